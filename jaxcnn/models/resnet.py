"""ResNet-18/34/50 (He et al. 2016) in Flax NNX, as torchvision builds them (v1.5: a
bottleneck strides on its 3x3 conv), naming logical axes only.

Tensor parallelism comes from the names, as in the CNN family (jaxcnn.models.cnn): the
residual stream is a `conv_in` space, which `tp` keeps whole. Inside a block the convs
form a Megatron column -> row pair: the conv whose output is a `conv_out` space splits
its output channels, the block's last conv splits its input channels and ends in
partial sums, so each block all-reduces once, before its batch norm and the add; its
input gradient is all-reduced once in the backward pass. A basic block is exactly that
pair. A bottleneck's first 1x1 conv (conv_in -> conv_in) stays whole and computed on every
model device -- splitting it too would cost a second collective per block. The projection
shortcut maps conv_in -> conv_in: whole, computed beside the pair, no collective.

Spatial parallelism needs nothing here: convs are padded by kernel // 2 each side, XLA's
partitioner exchanges the halo rows a stride-2 or 7x7 window needs, and block outputs are
constrained so that heights that stop dividing are gathered (jaxcnn.sharding.partition).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxcnn.config import RESNETS, ModelConfig
from jaxcnn.layers import pointwise_conv
from jaxcnn.models.parts import LayerShape, named, norm_layer, normalise, run_block
from jaxcnn.sharding import axes as ax
from jaxcnn.sharding.partition import constrain

BOTTLENECK_EXPANSION = 4
# torchvision's initialisation: convs kaiming-normal over fan-out (ReLU gain), the
# classifier's kernel and bias uniform in +-1/sqrt(fan_in); norms scale 1, bias 0
CONV_INIT = jax.nn.initializers.variance_scaling(2.0, "fan_out", "normal")
DENSE_INIT = jax.nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform")


def uniform_bias(fan_in: int):
    bound = fan_in**-0.5
    return lambda key, shape, dtype=jnp.float32: jax.random.uniform(key, shape, dtype, -bound, bound)


def resnet_layer_shapes(config: ModelConfig, image_shape: tuple[int, int, int]) -> list[LayerShape]:
    """Every conv and the classifier in order: the stem (unit 0), each residual block's
    convs then its projection (units 1..N), the classifier after global pooling (N + 1)."""
    height, width, channels = image_shape
    block, stages = RESNETS[config.name]
    imagenet = config.resnet_stem(image_shape) == "imagenet"
    stem_width = config.conv_features[0]
    stem = LayerShape("conv", channels, stem_width, ax.CONV_IN, ax.CONV_IN, height, width,
                      kernel=7 if imagenet else 3, stride=2 if imagenet else 1, pool=3 if imagenet else 0,
                      path="stem/conv", norm_path="stem/norm", unit=0)  # fmt: skip
    layers = [stem]
    (height, width), in_features, unit = stem.next_size, stem_width, 1
    for stage, (blocks, stage_width) in enumerate(zip(stages, config.conv_features, strict=True)):
        for b in range(blocks):
            stride = 2 if stage > 0 and b == 0 else 1
            if block == "basic":
                out = stage_width
                convs = [(3, stride, stage_width, ax.CONV_IN, ax.CONV_OUT), (3, 1, out, ax.CONV_OUT, ax.CONV_IN)]
            else:
                out = stage_width * BOTTLENECK_EXPANSION
                convs = [(1, 1, stage_width, ax.CONV_IN, ax.CONV_IN), (3, stride, stage_width, ax.CONV_IN, ax.CONV_OUT),
                         (1, 1, out, ax.CONV_OUT, ax.CONV_IN)]  # fmt: skip
            h, w, cin = height, width, in_features
            for i, (kernel, s, features, space_in, space_out) in enumerate(convs, start=1):
                conv = LayerShape("conv", cin, features, space_in, space_out, h, w, kernel=kernel, stride=s,
                                  path=f"blocks/{unit - 1}/conv{i}", norm_path=f"blocks/{unit - 1}/norm{i}", unit=unit)  # fmt: skip
                layers.append(conv)
                (h, w), cin = conv.next_size, features
            if stride != 1 or in_features != out:
                layers.append(LayerShape("conv", in_features, out, ax.CONV_IN, ax.CONV_IN, height, width, kernel=1,
                                         stride=stride, path=f"blocks/{unit - 1}/shortcut/conv",
                                         norm_path=f"blocks/{unit - 1}/shortcut/norm", unit=unit, shortcut=True))  # fmt: skip
            (height, width), in_features, unit = (h, w), out, unit + 1
    layers.append(LayerShape("dense", in_features, config.num_classes, ax.EMBED, ax.CLASSES, path="head/fc", unit=unit))
    return layers


def _conv(layer: LayerShape, config: ModelConfig, rngs: nnx.Rngs) -> nnx.Conv:
    pad = layer.kernel // 2
    return nnx.Conv(
        layer.in_features,
        layer.features,
        kernel_size=(layer.kernel, layer.kernel),
        strides=(layer.stride, layer.stride),
        padding=((pad, pad), (pad, pad)),  # torch's padding (SAME would pad a stride-2 conv on one side only)
        kernel_metadata=named(ax.KH, ax.KW, layer.space_in, layer.space_out),
        bias_metadata=named(layer.space_out),
        use_bias=config.norm != "batch",  # batch norm's mean removes a bias (and its gradient)
        kernel_init=CONV_INIT,
        dtype=jnp.dtype(config.dtype),
        conv_general_dilated=pointwise_conv
        if layer.kernel == 1 and config.conv1x1 == "dot"
        else jax.lax.conv_general_dilated,
        rngs=rngs,
    )


def _norm(layer: LayerShape, config: ModelConfig, rngs: nnx.Rngs) -> nnx.Module | None:
    return norm_layer(config.norm, layer.features, jnp.dtype(config.dtype), rngs, config.norm_statistics)


class Stem(nnx.Module):
    """conv -> norm -> ReLU, then for ImageNet sizes a 3x3 stride-2 max-pool."""

    def __init__(self, layer: LayerShape, config: ModelConfig, rngs: nnx.Rngs):
        self.conv, self.norm, self.pool = _conv(layer, config, rngs), _norm(layer, config, rngs), layer.pool == 3

    def __call__(self, x_BHWC: jax.Array, train: bool, rngs: nnx.Rngs | None = None) -> jax.Array:
        x = constrain(x_BHWC, ax.IMAGE_BHWC)
        y = nnx.relu(normalise(self.norm, self.conv(x), train))
        if self.pool:  # lax.reduce_window: its gradient picks the winner inside each window (jaxcnn.layers)
            y = nnx.max_pool(y, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
        return constrain(y, ax.IMAGE_BHWC)


class Projection(nnx.Module):
    """The shortcut where a block changes width or stride: 1x1 conv -> norm."""

    def __init__(self, layer: LayerShape, config: ModelConfig, rngs: nnx.Rngs):
        self.conv, self.norm = _conv(layer, config, rngs), _norm(layer, config, rngs)

    def __call__(self, x_BHWC: jax.Array, train: bool) -> jax.Array:
        return normalise(self.norm, self.conv(x_BHWC), train)


class ResidualBlock(nnx.Module):
    """A basic block (two 3x3 convs) or a bottleneck (1x1, 3x3, 1x1): conv -> norm -> ReLU
    for all but the last conv, whose normalised output is added to the shortcut, then ReLU."""

    def __init__(self, layers: list[LayerShape], config: ModelConfig, rngs: nnx.Rngs):
        self.remat, self.remat_names = config.remat, config.remat_names
        convs = [layer for layer in layers if not layer.shortcut]
        self.depth = len(convs)
        for i, layer in enumerate(convs, start=1):  # conv1, norm1, ...: torchvision's names
            setattr(self, f"conv{i}", _conv(layer, config, rngs))
            setattr(self, f"norm{i}", _norm(layer, config, rngs))
        projection = [layer for layer in layers if layer.shortcut]
        self.shortcut = Projection(projection[0], config, rngs) if projection else None

    def __call__(self, x_BHWC: jax.Array, train: bool, rngs: nnx.Rngs | None = None) -> jax.Array:
        return run_block(self, x_BHWC, train)

    def _forward(self, x_BHWC: jax.Array, train: bool) -> jax.Array:
        y = x_BHWC
        for i in range(1, self.depth + 1):
            # the names are what remat="names" may save (jax.checkpoint_policies.save_only_these_names)
            y = checkpoint_name(getattr(self, f"conv{i}")(y), "conv")
            y = checkpoint_name(normalise(getattr(self, f"norm{i}"), y, train), "norm")
            if i < self.depth:
                y = checkpoint_name(nnx.relu(y), "relu")
        shortcut = x_BHWC if self.shortcut is None else self.shortcut(x_BHWC, train)
        return constrain(nnx.relu(y + shortcut), ax.IMAGE_BHWC)


class Head(nnx.Module):
    """Global average pooling -> the classifier."""

    def __init__(self, layer: LayerShape, config: ModelConfig, rngs: nnx.Rngs):
        self.fc = nnx.Linear(
            layer.in_features,
            layer.features,
            kernel_metadata=named(layer.space_in, layer.space_out),
            bias_metadata=named(layer.space_out),
            kernel_init=DENSE_INIT,
            bias_init=uniform_bias(layer.in_features),
            dtype=jnp.dtype(config.dtype),
            rngs=rngs,
        )

    def __call__(self, x_BHWC: jax.Array, train: bool, rngs: nnx.Rngs | None = None) -> jax.Array:
        pooled_BF = jnp.mean(x_BHWC.astype(jnp.float32), axis=(1, 2)).astype(x_BHWC.dtype)
        return self.fc(constrain(pooled_BF, ax.FEATURES_BF))


class ResNet(nnx.Module):
    def __init__(self, config: ModelConfig, image_shape: tuple[int, int, int], *, rngs: nnx.Rngs):
        layers = resnet_layer_shapes(config, image_shape)
        units = [[layer for layer in layers if layer.unit == u] for u in range(layers[-1].unit + 1)]
        self.stem = Stem(units[0][0], config, rngs)
        self.blocks = nnx.List([ResidualBlock(unit, config, rngs) for unit in units[1:-1]])
        self.head = Head(units[-1][0], config, rngs)

    def pipeline_units(self) -> list[nnx.Module]:
        return [self.stem, *self.blocks, self.head]

    def __call__(self, x_BHWC: jax.Array, *, train: bool = False, rngs: nnx.Rngs | None = None) -> jax.Array:
        for unit in self.pipeline_units():
            x_BHWC = unit(x_BHWC, train)
        return x_BHWC
