"""Your own Flax NNX model under jaxcnn's layouts: a factory in, the same Program out.

    class Net(nnx.Module):
        def __init__(self, rngs):
            conv = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("kh", "kw", "conv_in", "conv_out"))
            self.conv = nnx.Conv(1, 32, (3, 3), kernel_init=conv, rngs=rngs)
            ...
        def __call__(self, x):           # or __call__(self, x, train): jaxcnn passes train= when asked for
            ...

    program = build_program(CustomModel(Net, name="net"), OptimConfig(), get_layout("fsdp"), mesh, (28, 28, 1), 64, 1000)

The layouts place each parameter by the logical names Flax keeps with it
(`nnx.with_partitioning`, or a layer's `*_metadata`): kernels `kh, kw, conv_in, conv_out`
and `embed, mlp` / `classes`, norms `norm` (jaxcnn.sharding.axes); a parameter without names
is replicated. jaxcnn builds the model under `jax.jit` with Flax's eager sharding off, so
creating it needs no mesh. Dropout and batch norm follow `train`: passed to a `__call__` that
takes it, else set by `model.train()` / `model.eval()`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import jax.numpy as jnp
from flax import nnx


@dataclass(frozen=True)
class CustomModel:
    factory: Callable[[nnx.Rngs], nnx.Module]  # rngs -> the model, its logits (B, num_classes) from (B, H, W, C)
    name: str = "custom"
    num_classes: int = 10  # what the loader's labels range over
    dtype: str = "float32"  # reported only: the model's own layers decide their dtype

    is_resnet = False  # read where jaxcnn's own families differ

    def build(self, seed: int) -> nnx.Module:
        with nnx.use_eager_sharding(False):  # placement comes from the layout, not from flax
            return self.factory(nnx.Rngs(seed))


def unit_pixels(images_BHWC):
    """uint8 pixels (0-255: an image folder's, sent to the devices as bytes) as float32 in
    [0, 1], inside the compiled step -- the same numbers as the host's x / 255 in float32.
    Float images pass unchanged."""
    if images_BHWC.dtype == jnp.uint8:
        return images_BHWC.astype(jnp.float32) / 255.0
    return images_BHWC


def call(model: nnx.Module, images, *, train: bool, rngs: nnx.Rngs | None = None):
    """The model's logits, however it takes `train`: jaxcnn's models and those whose __call__
    names it get it as an argument; any other is put in train or eval mode first. uint8
    images are scaled to [0, 1] first (`unit_pixels`)."""
    images = unit_pixels(images)
    if "train" in inspect.signature(type(model).__call__).parameters:
        extra = {"rngs": rngs} if "rngs" in inspect.signature(type(model).__call__).parameters else {}
        return model(images, train=train, **extra)
    if train:
        model.train()
    else:
        model.eval()
    return model(images)
