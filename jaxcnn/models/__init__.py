"""The model families, in Flax NNX, naming logical axes only: the VGG-like
`cnn2d_<N>layer_fullconnected_<M>layer` (jaxcnn.models.cnn), ResNet-18/34/50
(jaxcnn.models.resnet), ConvNeXt (jaxcnn.models.convnext) and MobileNetV2
(jaxcnn.models.mobilenet). Each describes itself as `LayerShape`s (`layer_shapes`), the
one description the analytic cost and communication models and the pipeline's split
read, and each runs as a sequence of `pipeline_units()`."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxcnn import platform_choices
from jaxcnn.config import ModelConfig
from jaxcnn.models.cnn import CNN, ConvBlock, cnn_layer_shapes, conv_channel_spaces
from jaxcnn.models.convnext import ConvNeXt, convnext_layer_shapes
from jaxcnn.models.custom import CustomModel, call, unit_pixels
from jaxcnn.models.mobilenet import MobileNetV2, mobilenet_layer_shapes
from jaxcnn.models.parts import LayerShape, remat_policy
from jaxcnn.models.resnet import ResNet, resnet_layer_shapes

# family (ModelConfig.family) -> (module, its layer shapes)
FAMILIES = {
    "cnn": (CNN, cnn_layer_shapes),
    "resnet": (ResNet, resnet_layer_shapes),
    "convnext": (ConvNeXt, convnext_layer_shapes),
    "mobilenet": (MobileNetV2, mobilenet_layer_shapes),
}

__all__ = [
    "CNN",
    "ConvBlock",
    "ConvNeXt",
    "CustomModel",
    "LayerShape",
    "MobileNetV2",
    "ResNet",
    "build_model",
    "call",
    "conv_channel_spaces",
    "count_params",
    "cross_entropy",
    "layer_shapes",
    "remat_policy",
    "resolve_kernels",
    "unit_pixels",
]


def layer_shapes(config: ModelConfig, image_shape: tuple[int, int, int]) -> list[LayerShape]:
    """Every conv and dense layer of the model on images of `image_shape`, in order."""
    return FAMILIES[config.family][1](config, image_shape)


def resolve_kernels(config: ModelConfig | CustomModel, platform: str) -> ModelConfig | CustomModel:
    """`config` with its family's kernel choice, if "auto", made for `platform`
    (jaxcnn.platform_choices): the ResNets' and MobileNetV2's 1x1 convolutions, the CNN's
    max-pool; ConvNeXt has none."""
    if isinstance(config, CustomModel):
        return config  # its kernels are its own
    own = config.kernel_choice  # the model family's kernel choice
    if own is None or getattr(config, own) != "auto":
        return config
    return dataclasses.replace(config, **{own: platform_choices.variant(own, platform)})


def build_model(config: ModelConfig | CustomModel, image_shape: tuple[int, int, int], seed: int) -> nnx.Module:
    """The model with initial weights from `seed`. Call it under `jax.jit`/`nnx.eval_shape`
    to create state where it will live: jaxcnn never builds the model on one device and then
    scatters it (`jaxcnn.spmd` jits `init` with out_shardings). Kernel choices left "auto"
    are the default backend's (program builders resolve them for their mesh first)."""
    if isinstance(config, CustomModel):
        return config.build(seed)
    config = resolve_kernels(config, jax.default_backend())
    family = FAMILIES[config.family][0]
    with nnx.use_eager_sharding(False):  # placement comes from the layout, not from flax
        return family(config, image_shape, rngs=nnx.Rngs(params=seed))


def count_params(model: nnx.Module) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def cross_entropy(logits_BK: jax.Array, labels_B: jax.Array) -> jax.Array:
    """Per-example softmax cross-entropy, computed in fp32."""
    logits_BK = logits_BK.astype(jnp.float32)
    return -jnp.take_along_axis(jax.nn.log_softmax(logits_BK), labels_B[:, None], axis=-1)[:, 0]
