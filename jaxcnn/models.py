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

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxcnn.config import ModelConfig
from jaxcnn.layers import max_pool_2x2
from jaxcnn.sharding import axes as ax
from jaxcnn.sharding.partition import NAMES_KEY, constrain


def _named(*names: str) -> dict:
    return {NAMES_KEY: names}


def _norm_layer(kind: str, features: int, dtype, rngs: nnx.Rngs) -> nnx.Module | None:
    meta = _named(ax.NORM)
    if kind == "none":
        return None
    if kind == "batch":  # flax computes the statistics in float32 even for a bfloat16 dtype
        norm = nnx.BatchNorm(features, momentum=0.9, dtype=dtype, scale_metadata=meta, bias_metadata=meta, rngs=rngs)
        for stat in (norm.mean, norm.var):  # running statistics: same placement as scale/bias
            stat.set_metadata(**meta)
        return norm
    groups = math.gcd(features, 8)
    return nnx.GroupNorm(features, num_groups=groups, dtype=dtype, scale_metadata=meta, bias_metadata=meta, rngs=rngs)


def conv_channel_spaces(num_blocks: int) -> list[str]:
    """Logical name of the channel space *after* each conv block (see module docstring)."""
    return [ax.CONV_OUT if (num_blocks - 1 - i) % 2 else ax.CONV_IN for i in range(num_blocks)]


def remat_policy(remat: str, names: tuple[str, ...]):
    """The jax.checkpoint policy for `--remat` (None: save nothing but the block's input)."""
    if remat == "dots":
        return jax.checkpoint_policies.dots_saveable  # matmuls and convolutions
    if remat == "names":
        return jax.checkpoint_policies.save_only_these_names(*names)
    return None


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
        self.conv = nnx.Conv(
            in_features,
            features,
            kernel_size=(3, 3),
            padding="SAME",
            kernel_metadata=_named(ax.KH, ax.KW, space_in, space_out),
            bias_metadata=_named(space_out),
            # BatchNorm subtracts the per-channel mean, so a conv bias before it has zero
            # gradient up to rounding -- which Adam would amplify into layout-dependent drift.
            use_bias=norm != "batch",
            dtype=dtype,
            rngs=rngs,
        )
        self.norm = _norm_layer(norm, features, dtype, rngs)

    def __call__(self, x_BHWC: jax.Array, train: bool) -> jax.Array:
        if self.remat == "none":
            return self._forward(x_BHWC, train)
        # jax.checkpoint: the backward pass recomputes what the policy does not save
        policy = remat_policy(self.remat, self.remat_names)
        return nnx.remat(lambda block, x: block._forward(x, train), policy=policy)(self, x_BHWC)

    def _forward(self, x_BHWC: jax.Array, train: bool) -> jax.Array:
        # the names are what remat="names" may save (jax.checkpoint_policies.save_only_these_names)
        y = checkpoint_name(self.conv(x_BHWC), "conv")
        if isinstance(self.norm, nnx.BatchNorm):
            y = self.norm(y, use_running_average=not train)
        elif self.norm is not None:
            y = self.norm(y)
        y = checkpoint_name(y, "norm")
        y = checkpoint_name(nnx.relu(y), "relu")
        y = max_pool_2x2(y)
        return constrain(y, ax.IMAGE_BHWC)


@dataclass(frozen=True)
class LayerShape:
    """One layer's geometry and the logical names of its channel spaces."""

    kind: str  # "conv" | "dense"
    in_features: int
    features: int
    space_in: str
    space_out: str
    height: int = 1  # conv: input height and width (SAME conv keeps them; the pool halves)
    width: int = 1


def layer_shapes(config: ModelConfig, image_shape: tuple[int, int, int]) -> list[LayerShape]:
    """Every layer of the model in order: the one description both the model and the
    analytic cost model (jaxcnn.analysis.comm_model) are built from."""
    height, width, in_features = image_shape
    layers, space_in = [], ax.CONV_IN
    for features, space_out in zip(config.conv_features, conv_channel_spaces(len(config.conv_features)), strict=True):
        layers.append(LayerShape("conv", in_features, features, space_in, space_out, height, width))
        space_in, in_features = space_out, features
        height, width = -(-height // 2), -(-width // 2)  # SAME pooling rounds up
    in_features, space_in = height * width * in_features, ax.EMBED
    widths = (*config.dense_features, config.num_classes)
    for j, features in enumerate(widths):
        space_out = ax.CLASSES if j == len(widths) - 1 else (ax.MLP if space_in == ax.EMBED else ax.EMBED)
        layers.append(LayerShape("dense", in_features, features, space_in, space_out))
        in_features, space_in = features, space_out
    return layers


class CNN(nnx.Module):
    def __init__(self, config: ModelConfig, image_shape: tuple[int, int, int], *, rngs: nnx.Rngs):
        layers = layer_shapes(config, image_shape)
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
                    kernel_metadata=_named(layer.space_in, layer.space_out),
                    bias_metadata=_named(layer.space_out),
                    dtype=dtype,
                    rngs=rngs,
                )
                for layer in layers
                if layer.kind == "dense"
            ]
        )
        self.dropout = nnx.Dropout(config.dropout)

    def __call__(self, x_BHWC: jax.Array, *, train: bool = False, rngs: nnx.Rngs | None = None) -> jax.Array:
        x = constrain(x_BHWC, ax.IMAGE_BHWC)
        for block in self.blocks:
            x = block(x, train)
        x_BF = constrain(x.reshape(x.shape[0], -1), ax.FEATURES_BF)
        for layer in self.dense[:-1]:
            x_BF = nnx.relu(layer(x_BF))
            x_BF = constrain(self.dropout(x_BF, deterministic=not train, rngs=rngs), ax.FEATURES_BF)
        return self.dense[-1](x_BF)


def build_model(config: ModelConfig, image_shape: tuple[int, int, int], seed: int) -> CNN:
    """A CNN with initial weights from `seed`. Call it under `jax.jit`/`nnx.eval_shape` to
    create state where it will live: jaxcnn never builds the model on one device and then
    scatters it (`jaxcnn.spmd` jits `init` with out_shardings)."""
    with nnx.use_eager_sharding(False):  # placement comes from the layout, not from flax
        return CNN(config, image_shape, rngs=nnx.Rngs(params=seed))


def count_params(model: nnx.Module) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def cross_entropy(logits_BK: jax.Array, labels_B: jax.Array) -> jax.Array:
    """Per-example softmax cross-entropy, computed in fp32."""
    logits_BK = logits_BK.astype(jnp.float32)
    return -jnp.take_along_axis(jax.nn.log_softmax(logits_BK), labels_B[:, None], axis=-1)[:, 0]
