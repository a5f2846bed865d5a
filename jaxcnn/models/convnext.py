"""ConvNeXt (Liu et al. 2022, "A ConvNet for the 2020s") in Flax NNX, as torchvision builds
it -- same blocks, same parameter shapes (jaxcnn.models.torchvision_names maps its
state_dict keys onto these modules) -- naming logical axes only.

A block: 7x7 depthwise conv -> LayerNorm over channels -> Linear C -> 4C -> GELU ->
Linear 4C -> C -> layer scale -> stochastic depth -> + input. Between stages a downsample:
LayerNorm -> 2x2 stride-2 conv. The stem is a 4x4 stride-4 patchify conv -> LayerNorm;
the head global average pooling -> LayerNorm -> the classifier.

Tensor parallelism comes from the names, as in the ResNets: the residual stream is a
`conv_in` space, whole under `tp`, so the depthwise conv, its LayerNorm (which needs every
channel of a pixel) and the layer scale are computed whole on every model device and move
nothing. The MLP is the Megatron pair: the first Linear splits its output channels
(`conv_out`), GELU runs on the split, the second splits its input channels and ends in
partial sums -- one all-reduce per block forward, one of the input gradient backward.
LayerNorm has no batch statistics, so `dp` moves nothing but gradients.

The 1x1 layers are `nnx.Linear` on the channels-last activation, as torchvision's are
(`nn.Linear` after a permute): a matrix product on every platform.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxcnn.config import CONVNEXTS, ModelConfig
from jaxcnn.models.parts import LayerShape, named, run_block
from jaxcnn.sharding import axes as ax
from jaxcnn.sharding.partition import constrain

MLP_RATIO = 4
LAYER_SCALE = 1e-6  # torchvision's layer_scale: the residual branch starts almost shut
NORM_EPS = 1e-6  # torchvision's LayerNorm / LayerNorm2d eps for ConvNeXt
# torchvision initialises every conv and linear kernel trunc_normal_(std=0.02) with its default
# cut at +-2 (absolute: 100 standard deviations, so in effect a normal), biases 0
KERNEL_INIT = jax.nn.initializers.normal(0.02)


def stochastic_depth_rates(config: ModelConfig) -> list[float]:
    """Each block's drop rate, linear from 0 at the first to `stochastic_depth` at the last
    (torchvision: p * block_id / (blocks - 1))."""
    total = sum(CONVNEXTS[config.name][0])
    return [config.stochastic_depth * i / max(total - 1, 1) for i in range(total)]


def convnext_layer_shapes(config: ModelConfig, image_shape: tuple[int, int, int]) -> list[LayerShape]:
    """Every conv and dense layer in order: the stem (unit 0); per stage its downsample (a
    unit of its own, from the second stage) and each block's depthwise conv and its two
    1x1 layers (one unit a block); the classifier (the last unit)."""
    height, width, channels = image_shape
    depths, _ = CONVNEXTS[config.name]
    imagenet = config.resnet_stem(image_shape) == "imagenet"
    patch = 4 if imagenet else 2
    widths = config.conv_features
    stem = LayerShape("conv", channels, widths[0], ax.CONV_IN, ax.CONV_IN, height, width, kernel=patch,
                      stride=patch, padding=0, path="stem/conv", norm_path="stem/norm", unit=0)  # fmt: skip
    layers, unit = [stem], 1
    (height, width), in_features = stem.next_size, widths[0]
    for stage, (blocks, stage_width) in enumerate(zip(depths, widths, strict=True)):
        if stage > 0:
            down = LayerShape("conv", in_features, stage_width, ax.CONV_IN, ax.CONV_IN, height, width, kernel=2,
                              stride=2, padding=0, path=f"blocks/{unit - 1}/conv",
                              norm_path=f"blocks/{unit - 1}/norm", unit=unit)  # fmt: skip
            layers.append(down)
            (height, width), in_features, unit = down.next_size, stage_width, unit + 1
        for _ in range(blocks):
            at = f"blocks/{unit - 1}"
            c, hidden = stage_width, MLP_RATIO * stage_width
            common = {"height": height, "width": width, "unit": unit}
            layers += [
                LayerShape("conv", c, c, ax.CONV_IN, ax.CONV_IN, kernel=7, groups=c, path=f"{at}/dwconv",
                           norm_path=f"{at}/norm", **common),
                LayerShape("conv", c, hidden, ax.CONV_IN, ax.CONV_OUT, kernel=1, path=f"{at}/pwconv1", **common),
                LayerShape("conv", hidden, c, ax.CONV_OUT, ax.CONV_IN, kernel=1, path=f"{at}/pwconv2",
                           other_paths=(at,), **common),  # the layer scale, a parameter of the block itself
            ]  # fmt: skip
            unit += 1
    layers.append(LayerShape("dense", in_features, config.num_classes, ax.EMBED, ax.CLASSES, path="head/fc",
                             norm_path="head/norm", unit=unit))  # fmt: skip
    return layers


def layer_norm(features: int, dtype, rngs: nnx.Rngs) -> nnx.LayerNorm:
    """LayerNorm over the last (channel) axis; variance as the mean of squared deviations
    (exact where a pixel's mean is large beside its spread, as jaxcnn.models.parts says)."""
    meta = named(ax.NORM)
    return nnx.LayerNorm(features, epsilon=NORM_EPS, use_fast_variance=False, dtype=dtype,
                         scale_metadata=meta, bias_metadata=meta, rngs=rngs)  # fmt: skip


def conv(layer: LayerShape, dtype, rngs: nnx.Rngs) -> nnx.Conv:
    pad = layer.pad
    names = ax.depthwise_kernel(layer.space_out) if layer.depthwise else (ax.KH, ax.KW, layer.space_in, layer.space_out)
    return nnx.Conv(
        layer.in_features,
        layer.features,
        kernel_size=(layer.kernel, layer.kernel),
        strides=(layer.stride, layer.stride),
        padding=((pad, pad), (pad, pad)),  # torch's padding
        feature_group_count=layer.groups,
        kernel_metadata=named(*names),
        bias_metadata=named(layer.space_out),
        kernel_init=KERNEL_INIT,
        dtype=dtype,
        rngs=rngs,
    )


def dense(layer: LayerShape, dtype, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(
        layer.in_features,
        layer.features,
        kernel_metadata=named(layer.space_in, layer.space_out),
        bias_metadata=named(layer.space_out),
        kernel_init=KERNEL_INIT,
        dtype=dtype,
        rngs=rngs,
    )


class Stem(nnx.Module):
    """Patchify conv -> LayerNorm."""

    def __init__(self, layer: LayerShape, config: ModelConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(config.dtype)
        self.conv, self.norm = conv(layer, dtype, rngs), layer_norm(layer.features, dtype, rngs)

    def __call__(self, x_BHWC: jax.Array, train: bool, rngs: nnx.Rngs | None = None) -> jax.Array:
        x = constrain(x_BHWC, ax.IMAGE_BHWC)
        return constrain(self.norm(self.conv(x)), ax.IMAGE_BHWC)


class Downsample(nnx.Module):
    """LayerNorm -> 2x2 stride-2 conv (torchvision's order: the norm first)."""

    def __init__(self, layer: LayerShape, config: ModelConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(config.dtype)
        self.norm, self.conv = layer_norm(layer.in_features, dtype, rngs), conv(layer, dtype, rngs)

    def __call__(self, x_BHWC: jax.Array, train: bool, rngs: nnx.Rngs | None = None) -> jax.Array:
        return constrain(self.conv(self.norm(x_BHWC)), ax.IMAGE_BHWC)


def drop_path(y_BHWC: jax.Array, rate: float, train: bool, rngs: nnx.Rngs | None) -> jax.Array:
    """torchvision's StochasticDepth(rate, "row"): in training each example's residual
    branch is dropped with probability `rate`, the kept ones scaled by 1 / (1 - rate)."""
    if not train or rate == 0.0:
        return y_BHWC
    if rngs is None:
        raise ValueError("stochastic depth in training needs rngs (the step's dropout stream)")
    keep = jax.random.bernoulli(rngs.dropout(), 1.0 - rate, (y_BHWC.shape[0], 1, 1, 1))
    return y_BHWC * (keep.astype(y_BHWC.dtype) / (1.0 - rate))


class Block(nnx.Module):
    """One ConvNeXt block (module docstring); `drop_rate` its stochastic depth."""

    def __init__(self, layers: list[LayerShape], config: ModelConfig, drop_rate: float, rngs: nnx.Rngs):
        dw, pw1, pw2 = layers
        dtype = jnp.dtype(config.dtype)
        self.remat, self.remat_names, self.drop_rate = config.remat, config.remat_names, drop_rate
        self.dwconv, self.norm = conv(dw, dtype, rngs), layer_norm(dw.features, dtype, rngs)
        self.pwconv1, self.pwconv2 = dense(pw1, dtype, rngs), dense(pw2, dtype, rngs)
        self.layer_scale = nnx.Param(jnp.full((dw.features,), LAYER_SCALE, jnp.float32), **named(ax.CONV_IN))

    def __call__(self, x_BHWC: jax.Array, train: bool, rngs: nnx.Rngs | None = None) -> jax.Array:
        y = run_block(self, x_BHWC, train)
        # the random draw stays outside remat: recomputing the branch must not draw again
        return constrain(x_BHWC + drop_path(y, self.drop_rate, train, rngs), ax.IMAGE_BHWC)

    def _forward(self, x_BHWC: jax.Array, train: bool) -> jax.Array:
        """The residual branch up to the layer scale."""
        y = checkpoint_name(self.dwconv(x_BHWC), "conv")
        y = checkpoint_name(self.norm(y), "norm")
        # torch's exact GELU; "relu" is remat's name for a block's activation (REMAT_NAMES)
        y = checkpoint_name(nnx.gelu(self.pwconv1(y), approximate=False), "relu")
        return self.pwconv2(y) * self.layer_scale[...].astype(y.dtype)


class Head(nnx.Module):
    """Global average pooling -> LayerNorm -> the classifier."""

    def __init__(self, layer: LayerShape, config: ModelConfig, rngs: nnx.Rngs):
        dtype = jnp.dtype(config.dtype)
        self.norm, self.fc = layer_norm(layer.in_features, dtype, rngs), dense(layer, dtype, rngs)

    def __call__(self, x_BHWC: jax.Array, train: bool, rngs: nnx.Rngs | None = None) -> jax.Array:
        pooled_BF = jnp.mean(x_BHWC.astype(jnp.float32), axis=(1, 2)).astype(x_BHWC.dtype)
        return self.fc(self.norm(constrain(pooled_BF, ax.FEATURES_BF)))


class ConvNeXt(nnx.Module):
    def __init__(self, config: ModelConfig, image_shape: tuple[int, int, int], *, rngs: nnx.Rngs):
        layers = convnext_layer_shapes(config, image_shape)
        units = [[layer for layer in layers if layer.unit == u] for u in range(layers[-1].unit + 1)]
        rates = iter(stochastic_depth_rates(config))
        self.stem = Stem(units[0][0], config, rngs)
        self.blocks = nnx.List(
            [Block(unit, config, next(rates), rngs) if len(unit) == 3 else Downsample(unit[0], config, rngs)
             for unit in units[1:-1]]
        )  # fmt: skip
        self.head = Head(units[-1][0], config, rngs)

    def pipeline_units(self) -> list[nnx.Module]:
        return [self.stem, *self.blocks, self.head]

    def __call__(self, x_BHWC: jax.Array, *, train: bool = False, rngs: nnx.Rngs | None = None) -> jax.Array:
        for unit in self.pipeline_units():
            x_BHWC = unit(x_BHWC, train, rngs)
        return x_BHWC
