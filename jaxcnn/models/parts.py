"""What the model families share: logical-name metadata, the norm layer, remat, and the
`LayerShape` description both a model and the analytic models (jaxcnn.analysis, the
pipeline's split) are built from."""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
from flax import nnx

from jaxcnn.models.batch_norm import BatchNorm
from jaxcnn.sharding import axes as ax
from jaxcnn.sharding.partition import NAMES_KEY


def named(*names: str) -> dict:
    """Metadata giving a parameter's dimensions their logical names."""
    return {NAMES_KEY: names}


def norm_layer(kind: str, features: int, dtype, rngs: nnx.Rngs, statistics: str = "global") -> nnx.Module | None:
    meta = named(ax.NORM)
    if kind == "none":
        return None
    # Variance as the mean of squared deviations, not E[x^2] - E[x]^2 (flax's fast default):
    # the difference cancels where a channel's mean is large beside its spread, as after a
    # ReLU -- on a 2-block ResNet at 32x32 that moved the float32 gradient 5e-5 (relative
    # to its largest entry) from the float64 one, against 3e-6 computed this way.
    stable = {"use_fast_variance": False, "scale_metadata": meta, "bias_metadata": meta, "dtype": dtype, "rngs": rngs}
    if kind == "batch":  # flax computes the statistics in float32 even for a bfloat16 dtype
        # momentum 0.9 and epsilon 1e-5 are torch's BatchNorm2d defaults (its momentum=0.1)
        norm = BatchNorm(features, momentum=0.9, local=statistics == "per-device", **stable)
        for stat in (norm.mean, norm.var):  # running statistics: same placement as scale/bias
            stat.set_metadata(**meta)
        return norm
    return nnx.GroupNorm(features, num_groups=math.gcd(features, 8), **stable)


def normalise(norm: nnx.Module | None, y: jax.Array, train: bool) -> jax.Array:
    if isinstance(norm, nnx.BatchNorm):
        return norm(y, use_running_average=not train)
    return y if norm is None else norm(y)


def remat_policy(remat: str, names: tuple[str, ...]):
    """The jax.checkpoint policy for `--remat` (None: save nothing but the block's input)."""
    if remat == "dots":
        return jax.checkpoint_policies.dots_saveable  # matmuls and convolutions
    if remat == "names":
        return jax.checkpoint_policies.save_only_these_names(*names)
    return None


def run_block(block: nnx.Module, x: jax.Array, train: bool) -> jax.Array:
    """`block._forward(x, train)`, recomputed in the backward pass under `--remat`
    (jax.checkpoint saves what the policy names, the block's input always)."""
    if block.remat == "none":
        return block._forward(x, train)
    policy = remat_policy(block.remat, block.remat_names)
    return nnx.remat(lambda b, x: b._forward(x, train), policy=policy)(block, x)


@dataclass(frozen=True)
class LayerShape:
    """One conv or dense layer: its geometry, the logical names of its channel spaces,
    where its parameters are, and which pipeline unit holds it."""

    kind: str  # "conv" | "dense"
    in_features: int
    features: int
    space_in: str
    space_out: str
    height: int = 1  # conv: input height and width
    width: int = 1
    kernel: int = 3  # conv: kernel x kernel, padded by `padding` (default kernel // 2) each side
    stride: int = 1
    groups: int = 1  # conv: feature groups; groups == in_features == features is a depthwise conv
    padding: int | None = None  # None: kernel // 2 (ConvNeXt's patchify convs: 0)
    pool: int = 0  # conv: followed by 2 (the CNN's 2x2 pool), 3 (a ResNet stem's 3x3/2 pool) or 0
    path: str = ""  # the layer's module in the model's state, e.g. "blocks/1/conv"
    norm_path: str = ""  # its norm's, if any
    unit: int = 0  # the pipeline unit (a CNN layer, a ResNet stem / block / head) it belongs to
    shortcut: bool = False  # a ResNet block's projection: listed after the block's convs, with their output shape
    # modules holding parameters that act on this layer's output, beside its norm (ConvNeXt's
    # layer scale sits on its block): where the comm model looks up how their gradients reduce
    other_paths: tuple[str, ...] = ()

    @property
    def pad(self) -> int:
        return self.kernel // 2 if self.padding is None else self.padding

    @property
    def depthwise(self) -> bool:
        return self.groups > 1 and self.groups == self.in_features == self.features

    @property
    def out_height(self) -> int:
        return (self.height + 2 * self.pad - self.kernel) // self.stride + 1

    @property
    def out_width(self) -> int:
        return (self.width + 2 * self.pad - self.kernel) // self.stride + 1

    @property
    def next_size(self) -> tuple[int, int]:
        """Height and width of the activation after the layer's pool (what comes next sees)."""
        h, w = self.out_height, self.out_width
        if self.pool == 2:
            return -(-h // 2), -(-w // 2)  # SAME pooling rounds up
        if self.pool == 3:
            return (h - 1) // 2 + 1, (w - 1) // 2 + 1
        return h, w

    @property
    def flops(self) -> float:
        """Forward FLOPs per image (x3 with the backward pass, alike for every layer)."""
        if self.kind == "conv":
            per_group = self.in_features // self.groups  # each output channel sees its group's inputs only
            return 2.0 * self.out_height * self.out_width * self.kernel**2 * per_group * self.features
        return 2.0 * self.in_features * self.features
