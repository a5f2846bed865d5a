"""The CNN family `cnn2d_<N>layer_fullconnected_<M>layer`, in Flax NNX.

N blocks of conv 3x3 (SAME) -> norm -> ReLU -> 2x2 max-pool (SAME, so any input size
works, down to 1x1), then M dense layers (ReLU + dropout between them).

Every parameter carries logical axis names (see `jaxcnn.sharding.axes`); activations are
constrained by logical names at block boundaries. Which names a kernel gets is chosen so
that one rule, `conv_out=model` / `mlp=model`, gives tensor parallelism in column -> row
pairs:

- Channel *spaces* alternate between `conv_out` (a space tp splits) and `conv_in` (one it
  keeps whole), counted back from the flatten, which always sees a `conv_in` space. So
  for 3 blocks: block 0 is (conv_in -> conv_in) and stays replicated (Cin is the image's
  1-3 channels, the cheapest conv), block 1 (conv_in -> conv_out) is a column layer,
  block 2 (conv_out -> conv_in) the row layer that ends with an all-reduce of partial
  sums; the flatten then needs no all-gather.
- Dense layers alternate forward from the flatten: dense 0 (embed -> mlp) column,
  dense 1 (mlp -> embed) row, ..., the classifier's output is `classes`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxcnn.config import ModelConfig
from jaxcnn.layers import max_pool_2x2, max_pool_window
from jaxcnn.models.parts import LayerShape, named, norm_layer, normalise, run_block
from jaxcnn.sharding import axes as ax
from jaxcnn.sharding.partition import constrain


def conv_channel_spaces(num_blocks: int) -> list[str]:
    """Logical name of the channel space *after* each conv block (see module docstring)."""
    return [ax.CONV_OUT if (num_blocks - 1 - i) % 2 else ax.CONV_IN for i in range(num_blocks)]


class ConvBlock(nnx.Module):
    def __init__(
        self,
        in_features: int,
        features: int,
        space_in: str,
        space_out: str,
        config: ModelConfig,
        rngs: nnx.Rngs,
    ):
        dtype = jnp.dtype(config.dtype)
        norm = config.norm
        self.remat, self.remat_names = config.remat, config.remat_names
        self.pool = config.max_pool  # jaxcnn.platform_choices: same numbers, a platform's faster kernel
        self.conv = nnx.Conv(
            in_features,
            features,
            kernel_size=(3, 3),
            padding="SAME",
            kernel_metadata=named(ax.KH, ax.KW, space_in, space_out),
            bias_metadata=named(space_out),
            # BatchNorm subtracts the per-channel mean, so a conv bias before it has zero
            # gradient up to rounding -- which Adam would amplify into layout-dependent drift.
            use_bias=norm != "batch",
            dtype=dtype,
            rngs=rngs,
        )
        self.norm = norm_layer(norm, features, dtype, rngs, config.norm_statistics)

    def __call__(self, x_BHWC: jax.Array, train: bool, rngs: nnx.Rngs | None = None) -> jax.Array:
        return run_block(self, x_BHWC, train)

    def _forward(self, x_BHWC: jax.Array, train: bool) -> jax.Array:
        # the names are what remat="names" may save (jax.checkpoint_policies.save_only_these_names)
        y = checkpoint_name(self.conv(x_BHWC), "conv")
        y = checkpoint_name(normalise(self.norm, y, train), "norm")
        y = checkpoint_name(nnx.relu(y), "relu")
        y = max_pool_2x2(y) if self.pool == "select" else max_pool_window(y)
        return constrain(y, ax.IMAGE_BHWC)


def cnn_layer_shapes(config: ModelConfig, image_shape: tuple[int, int, int]) -> list[LayerShape]:
    """Every layer of the model in order: the one description both the model and the
    analytic cost model (jaxcnn.analysis.comm_model) are built from."""
    height, width, in_features = image_shape
    layers, space_in = [], ax.CONV_IN
    spaces = conv_channel_spaces(len(config.conv_features))
    for i, (features, space_out) in enumerate(zip(config.conv_features, spaces, strict=True)):
        conv = LayerShape("conv", in_features, features, space_in, space_out, height, width, pool=2,
                          path=f"blocks/{i}/conv", norm_path=f"blocks/{i}/norm", unit=i)  # fmt: skip
        layers.append(conv)
        space_in, in_features = space_out, features
        height, width = conv.next_size
    in_features, space_in = height * width * in_features, ax.EMBED
    widths = (*config.dense_features, config.num_classes)
    for j, features in enumerate(widths):
        space_out = ax.CLASSES if j == len(widths) - 1 else (ax.MLP if space_in == ax.EMBED else ax.EMBED)
        layers.append(
            LayerShape("dense", in_features, features, space_in, space_out, path=f"dense/{j}", unit=len(layers))
        )
        in_features, space_in = features, space_out
    return layers


class DenseUnit(nnx.Module):
    """Dense layer `layer` of a CNN as a pipeline unit: the first flattens its input, all
    but the classifier apply ReLU and dropout after."""

    def __init__(self, layer: nnx.Linear, dropout: nnx.Dropout, first: bool, hidden: bool):
        self.layer, self.dropout, self.first, self.hidden = layer, dropout, first, hidden

    def __call__(self, x: jax.Array, train: bool, rngs: nnx.Rngs | None = None) -> jax.Array:
        if self.first:
            x = constrain(x.reshape(x.shape[0], -1), ax.FEATURES_BF)
        x = self.layer(x)
        if self.hidden:
            x = constrain(self.dropout(nnx.relu(x), deterministic=not train, rngs=rngs), ax.FEATURES_BF)
        return x


class CNN(nnx.Module):
    def __init__(self, config: ModelConfig, image_shape: tuple[int, int, int], *, rngs: nnx.Rngs):
        layers = cnn_layer_shapes(config, image_shape)
        dtype = jnp.dtype(config.dtype)
        self.blocks = nnx.List(
            [
                ConvBlock(layer.in_features, layer.features, layer.space_in, layer.space_out, config, rngs)
                for layer in layers
                if layer.kind == "conv"
            ]
        )
        self.dense = nnx.List(
            [
                nnx.Linear(
                    layer.in_features,
                    layer.features,
                    kernel_metadata=named(layer.space_in, layer.space_out),
                    bias_metadata=named(layer.space_out),
                    dtype=dtype,
                    rngs=rngs,
                )
                for layer in layers
                if layer.kind == "dense"
            ]
        )
        self.dropout = nnx.Dropout(config.dropout)

    def pipeline_units(self) -> list[nnx.Module]:
        """The layers in order as modules `unit(x, train, rngs)`: what a pipeline cuts between."""
        last = len(self.dense) - 1
        dense = [DenseUnit(layer, self.dropout, j == 0, j < last) for j, layer in enumerate(self.dense)]
        return [*self.blocks, *dense]

    def __call__(self, x_BHWC: jax.Array, *, train: bool = False, rngs: nnx.Rngs | None = None) -> jax.Array:
        x = constrain(x_BHWC, ax.IMAGE_BHWC)
        for unit in self.pipeline_units():
            x = unit(x, train, rngs)
        return x
