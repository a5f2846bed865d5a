"""MobileNetV2 (Sandler et al. 2018) in Flax NNX, as torchvision builds it -- inverted
residuals of depthwise convolutions, batch norm, ReLU6, the width multiplier with its
rounding to 8 -- same parameter shapes (jaxcnn.models.torchvision_names maps its state_dict
keys onto these modules), naming logical axes only.

An inverted residual: 1x1 expand conv (C -> tC; absent for t = 1) -> BN -> ReLU6 -> 3x3
depthwise conv (stride 1 or 2) -> BN -> ReLU6 -> 1x1 project conv (tC -> C') -> BN, plus the
input where the stride is 1 and C == C'. Stem: 3x3 stride-2 conv -> BN -> ReLU6; after the
blocks a 1x1 conv to 1280 channels -> BN -> ReLU6, global average pooling, dropout, the
classifier.

Tensor parallelism comes from the names. The block's narrow stream is a `conv_in` space,
whole under `tp`; the expand conv is a column layer (its output channels `conv_out`), the
depthwise conv acts on that `conv_out` space -- each model device convolves its own
channels, normalises them (batch norm is per channel) and moves nothing -- and the project
conv is the row layer whose partial sums are all-reduced once. A t = 1 block has no
expand conv, so the stem before it is its column layer (where the block adds its input
back, that input must be whole: then the stem, the depthwise and the project convs stay
whole and move nothing). The last conv is a column layer
too (its 1280 channels are the model's largest layer) and the classifier the row layer
after it: its logits' partial sums are all-reduced.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxcnn.config import MOBILENETS, ModelConfig
from jaxcnn.layers import pointwise_conv
from jaxcnn.models.parts import LayerShape, named, norm_layer, normalise, run_block
from jaxcnn.sharding import axes as ax
from jaxcnn.sharding.partition import constrain

# torchvision's initialisation: convs kaiming-normal over fan-out, the classifier normal(0, 0.01),
# biases 0, norms scale 1 and bias 0
CONV_INIT = jax.nn.initializers.variance_scaling(2.0, "fan_out", "normal")
DENSE_INIT = jax.nn.initializers.normal(0.01)


def make_divisible(value: float, divisor: int = 8) -> int:
    """torchvision's _make_divisible: the nearest multiple of `divisor`, at least `divisor`,
    never below 90% of `value`."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


def mobilenet_widths(config: ModelConfig) -> tuple[int, list[tuple[int, int, int]], int]:
    """(stem width, every block's (expansion, output width, stride), last conv's width) at
    `config.width_multiplier`, as torchvision computes them."""
    stem, stages, last = MOBILENETS[config.name]
    m = config.width_multiplier
    blocks = [(t, make_divisible(c * m), s if i == 0 else 1) for t, c, n, s in stages for i in range(n)]
    return make_divisible(stem * m), blocks, make_divisible(last * max(1.0, m))


def mobilenet_layer_shapes(config: ModelConfig, image_shape: tuple[int, int, int]) -> list[LayerShape]:
    """Every conv and the classifier in order: the stem (unit 0), each inverted residual's
    convs (one unit a block), the last conv (a unit), the classifier (the last unit)."""
    height, width, channels = image_shape
    stem_width, blocks, last_width = mobilenet_widths(config)
    stride = 2 if config.resnet_stem(image_shape) == "imagenet" else 1
    (t, out, s) = blocks[0]
    # without an expand conv in the first block the stem is the column layer before its depthwise
    # conv -- unless the block adds its input back (stride 1, width kept), which must be whole
    stem_space = ax.CONV_OUT if t == 1 and not (s == 1 and stem_width == out) else ax.CONV_IN
    stem = LayerShape("conv", channels, stem_width, ax.CONV_IN, stem_space, height, width, stride=stride,
                      path="stem/conv", norm_path="stem/norm", unit=0)  # fmt: skip
    layers = [stem]
    (height, width), in_features, space = stem.next_size, stem_width, stem_space
    for unit, (t, out, s) in enumerate(blocks, start=1):
        at, common = f"blocks/{unit - 1}", {"unit": unit}
        hidden = round(in_features * t)
        h, w = height, width
        if t != 1:
            layers.append(LayerShape("conv", in_features, hidden, space, ax.CONV_OUT, h, w, kernel=1,
                                     path=f"{at}/expand/conv", norm_path=f"{at}/expand/norm", **common))  # fmt: skip
            space = ax.CONV_OUT
        dw = LayerShape("conv", hidden, hidden, space, space, h, w, stride=s, groups=hidden,
                        path=f"{at}/depthwise/conv", norm_path=f"{at}/depthwise/norm", **common)  # fmt: skip
        h, w = dw.next_size
        layers += [dw, LayerShape("conv", hidden, out, space, ax.CONV_IN, h, w, kernel=1,
                                  path=f"{at}/project/conv", norm_path=f"{at}/project/norm", **common)]  # fmt: skip
        (height, width), in_features, space = (h, w), out, ax.CONV_IN
    unit = len(blocks) + 1
    layers.append(LayerShape("conv", in_features, last_width, ax.CONV_IN, ax.CONV_OUT, height, width, kernel=1,
                             path="last/conv", norm_path="last/norm", unit=unit))  # fmt: skip
    layers.append(
        LayerShape("dense", last_width, config.num_classes, ax.MLP, ax.CLASSES, path="head/fc", unit=unit + 1)
    )
    return layers


class ConvNormAct(nnx.Module):
    """conv -> norm (-> ReLU6): torchvision's Conv2dNormActivation, or a project conv."""

    def __init__(self, layer: LayerShape, config: ModelConfig, rngs: nnx.Rngs, act: bool = True):
        pad = layer.pad
        names = (ax.depthwise_kernel(layer.space_out) if layer.depthwise
                 else (ax.KH, ax.KW, layer.space_in, layer.space_out))  # fmt: skip
        dot = layer.kernel == 1 and config.conv1x1 == "dot"
        self.conv = nnx.Conv(
            layer.in_features,
            layer.features,
            kernel_size=(layer.kernel, layer.kernel),
            strides=(layer.stride, layer.stride),
            padding=((pad, pad), (pad, pad)),  # torch's (SAME would pad a stride-2 conv on one side only)
            feature_group_count=layer.groups,
            kernel_metadata=named(*names),
            bias_metadata=named(layer.space_out),
            use_bias=config.norm != "batch",  # batch norm's mean removes a bias (and its gradient)
            kernel_init=CONV_INIT,
            dtype=jnp.dtype(config.dtype),
            conv_general_dilated=pointwise_conv if dot else jax.lax.conv_general_dilated,
            rngs=rngs,
        )
        self.norm = norm_layer(config.norm, layer.features, jnp.dtype(config.dtype), rngs, config.norm_statistics)
        self.act = act

    def __call__(self, x_BHWC: jax.Array, train: bool) -> jax.Array:
        y = checkpoint_name(self.conv(x_BHWC), "conv")
        y = checkpoint_name(normalise(self.norm, y, train), "norm")
        return checkpoint_name(jax.nn.relu6(y), "relu") if self.act else y


class Stem(ConvNormAct):
    """3x3 conv (stride 2, or 1 for small images) -> BN -> ReLU6."""

    def __call__(self, x_BHWC: jax.Array, train: bool, rngs: nnx.Rngs | None = None) -> jax.Array:
        return constrain(super().__call__(constrain(x_BHWC, ax.IMAGE_BHWC), train), ax.IMAGE_BHWC)


class InvertedResidual(nnx.Module):
    """expand (t != 1) -> depthwise -> project, plus the input where shapes allow."""

    def __init__(self, layers: list[LayerShape], config: ModelConfig, rngs: nnx.Rngs):
        self.remat, self.remat_names = config.remat, config.remat_names
        *expand, dw, project = layers
        self.expand = ConvNormAct(expand[0], config, rngs) if expand else None
        self.depthwise = ConvNormAct(dw, config, rngs)
        self.project = ConvNormAct(project, config, rngs, act=False)  # linear bottleneck: no ReLU6
        first = expand[0] if expand else dw
        self.residual = dw.stride == 1 and first.in_features == project.features

    def __call__(self, x_BHWC: jax.Array, train: bool, rngs: nnx.Rngs | None = None) -> jax.Array:
        return run_block(self, x_BHWC, train)

    def _forward(self, x_BHWC: jax.Array, train: bool) -> jax.Array:
        y = x_BHWC if self.expand is None else self.expand(x_BHWC, train)
        y = self.project(self.depthwise(y, train), train)
        return constrain(x_BHWC + y if self.residual else y, ax.IMAGE_BHWC)


class Last(ConvNormAct):
    """The 1x1 conv to the classifier's width -> BN -> ReLU6."""

    def __call__(self, x_BHWC: jax.Array, train: bool, rngs: nnx.Rngs | None = None) -> jax.Array:
        return constrain(super().__call__(x_BHWC, train), ax.IMAGE_BHWC)


class Head(nnx.Module):
    """Global average pooling -> dropout -> the classifier."""

    def __init__(self, layer: LayerShape, config: ModelConfig, rngs: nnx.Rngs):
        self.dropout = nnx.Dropout(config.dropout)
        self.fc = nnx.Linear(
            layer.in_features,
            layer.features,
            kernel_metadata=named(layer.space_in, layer.space_out),
            bias_metadata=named(layer.space_out),
            kernel_init=DENSE_INIT,
            dtype=jnp.dtype(config.dtype),
            rngs=rngs,
        )

    def __call__(self, x_BHWC: jax.Array, train: bool, rngs: nnx.Rngs | None = None) -> jax.Array:
        pooled_BF = jnp.mean(x_BHWC.astype(jnp.float32), axis=(1, 2)).astype(x_BHWC.dtype)
        pooled_BF = self.dropout(constrain(pooled_BF, ax.FEATURES_BF), deterministic=not train, rngs=rngs)
        return self.fc(pooled_BF)


class MobileNetV2(nnx.Module):
    def __init__(self, config: ModelConfig, image_shape: tuple[int, int, int], *, rngs: nnx.Rngs):
        layers = mobilenet_layer_shapes(config, image_shape)
        units = [[layer for layer in layers if layer.unit == u] for u in range(layers[-1].unit + 1)]
        self.stem = Stem(units[0][0], config, rngs)
        self.blocks = nnx.List([InvertedResidual(unit, config, rngs) for unit in units[1:-2]])
        self.last = Last(units[-2][0], config, rngs)
        self.head = Head(units[-1][0], config, rngs)

    def pipeline_units(self) -> list[nnx.Module]:
        return [self.stem, *self.blocks, self.last, self.head]

    def __call__(self, x_BHWC: jax.Array, *, train: bool = False, rngs: nnx.Rngs | None = None) -> jax.Array:
        for unit in self.pipeline_units():
            x_BHWC = unit(x_BHWC, train, rngs)
        return x_BHWC
