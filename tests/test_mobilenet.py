"""MobileNetV2: torchvision's parameter counts, widths and state_dict names, the layer shapes
the cost models read against what the model computes, the logical names that put each
depthwise conv inside a column -> row pair (so tp splits it and it moves nothing), and bad
configs."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import initialised
from flax import nnx

from jaxcnn.config import ModelConfig
from jaxcnn.errors import UserError
from jaxcnn.models import MobileNetV2, build_model, count_params, layer_shapes
from jaxcnn.models.mobilenet import make_divisible, mobilenet_widths
from jaxcnn.models.torchvision_names import load_torchvision, torch_shape, torchvision_keys
from jaxcnn.sharding import axes as ax
from jaxcnn.sharding.partition import NAMES_KEY

TEST = ModelConfig(name="mobilenet_v2_test")


def abstract(config: ModelConfig, image_shape) -> MobileNetV2:
    return nnx.eval_shape(lambda: build_model(config, image_shape, seed=0))


def flat_state(model) -> dict:
    return {"/".join(map(str, path)): v for path, v in nnx.to_flat_state(nnx.state(model))}


def test_parameter_count_equals_torchvisions():
    model = abstract(ModelConfig(name="mobilenet_v2", num_classes=1000), (224, 224, 3))
    assert count_params(model) == 3_504_872
    assert len(model.blocks) == 17 and [b.residual for b in model.blocks].count(True) == 10


def test_width_multiplier_rounds_as_torchvision():
    """torchvision's _make_divisible: multiples of 8, never under 90% of the scaled width;
    the last conv keeps 1280 below multiplier 1."""
    assert [make_divisible(v) for v in (32 * 0.35, 16 * 0.35, 24 * 0.35, 320 * 0.5, 3.0)] == [16, 8, 8, 160, 8]
    stem, blocks, last = mobilenet_widths(ModelConfig(name="mobilenet_v2", width_multiplier=0.5))
    assert stem == 16 and [c for _, c, _ in blocks][::4] == [8, 16, 32, 48, 160] and last == 1280
    assert mobilenet_widths(ModelConfig(name="mobilenet_v2", width_multiplier=1.4))[2] == 1792


def test_every_torchvision_key_maps_to_one_parameter_of_its_shape():
    """mobilenet_v2's state_dict: 314 keys, of which 52 are batch norm's num_batches_tracked."""
    config = ModelConfig(name="mobilenet_v2", num_classes=1000)
    keys, state = torchvision_keys(config), flat_state(abstract(config, (224, 224, 3)))
    assert len(keys) == 314 - 52 and sorted(path for path, _ in keys.values()) == sorted(state)
    shapes = {key: torch_shape(how, state[path].shape) for key, (path, how) in keys.items()}
    assert shapes["features.0.0.weight"] == (32, 3, 3, 3)
    assert shapes["features.1.conv.0.0.weight"] == (32, 1, 3, 3)  # t = 1: depthwise first
    assert shapes["features.1.conv.1.weight"] == (16, 32, 1, 1) and shapes["features.1.conv.2.running_var"] == (16,)
    assert shapes["features.2.conv.0.0.weight"] == (96, 16, 1, 1) and shapes["features.2.conv.1.0.weight"] == (
        96,
        1,
        3,
        3,
    )
    assert shapes["features.2.conv.2.weight"] == (24, 96, 1, 1) and shapes["features.2.conv.3.weight"] == (24,)
    assert shapes["features.18.0.weight"] == (1280, 320, 1, 1) and shapes["classifier.1.weight"] == (1000, 1280)


def test_a_torchvision_state_dict_loads_and_computes_the_same_logits():
    source, target = initialised(TEST, (16, 16, 3), seed=0), initialised(TEST, (16, 16, 3), seed=1)
    state = flat_state(source)
    state_dict = {}
    for key, (path, how) in torchvision_keys(TEST).items():
        value = np.asarray(state[path].get_value())
        state_dict[key] = value.transpose(3, 2, 0, 1) if how == "conv" else value.T if how == "linear" else value
    load_torchvision(target, TEST, state_dict)
    images = np.random.default_rng(0).random((2, 16, 16, 3), np.float32)
    np.testing.assert_array_equal(source(images), target(images))
    with pytest.raises(UserError, match="batch norm"):
        torchvision_keys(ModelConfig(name="mobilenet_v2", norm="group"))


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is None, reason="torchvision is not installed")
def test_torchvisions_own_state_dict_loads_and_gives_its_logits():  # pragma: no cover - needs torch
    import torch
    import torchvision

    config = ModelConfig(name="mobilenet_v2", num_classes=1000, stem="imagenet")  # torchvision's stem at 64 pixels
    reference = torchvision.models.mobilenet_v2().eval()
    model = build_model(config, (64, 64, 3), seed=0)
    load_torchvision(model, config, {k: v.numpy() for k, v in reference.state_dict().items()})
    images = np.random.default_rng(0).random((2, 64, 64, 3), np.float32)
    with torch.no_grad():
        want = reference(torch.from_numpy(images.transpose(0, 3, 1, 2))).numpy()
    np.testing.assert_allclose(model(images), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("name", "image_shape", "stem", "stride"),
    [("mobilenet_v2_test", (28, 28, 1), "auto", 1), ("mobilenet_v2_test", (17, 23, 3), "imagenet", 2),
     ("mobilenet_v2", (28, 28, 1), "auto", 1), ("mobilenet_v2", (224, 224, 3), "auto", 2)],
)  # fmt: skip
def test_layer_shapes_follow_what_the_model_computes(name, image_shape, stem, stride):
    config = ModelConfig(name=name, stem=stem, num_classes=7)
    model = abstract(config, image_shape)
    assert model.stem.conv.strides == (stride, stride)
    layers = layer_shapes(config, image_shape)
    graphdef, state = nnx.split(model)
    x = jax.ShapeDtypeStruct((2, *image_shape), jnp.float32)
    for unit in range(layers[-1].unit):
        x = jax.eval_shape(lambda s, x, u=unit: nnx.merge(graphdef, s).pipeline_units()[u](x, False), state, x)
        last = [layer for layer in layers if layer.unit == unit][-1]
        assert x.shape[1:] == (*last.next_size, last.features), unit
    images = jax.ShapeDtypeStruct((2, *image_shape), jnp.float32)
    assert jax.eval_shape(lambda s, x: nnx.merge(graphdef, s)(x), state, images).shape == (2, 7)


def test_each_depthwise_conv_sits_between_a_column_and_a_row_layer():
    model = abstract(ModelConfig(name="mobilenet_v2"), (32, 32, 3))

    def names(conv):
        return conv.kernel.get_metadata()[NAMES_KEY][2:]

    assert names(model.stem.conv) == (ax.CONV_IN, ax.CONV_OUT)  # block 0 (t = 1) has no expand conv
    first = model.blocks[0]
    assert first.expand is None and names(first.depthwise.conv) == (ax.GROUP_IN, ax.CONV_OUT)
    assert names(first.project.conv) == (ax.CONV_OUT, ax.CONV_IN)
    block = model.blocks[3]
    assert names(block.expand.conv) == (ax.CONV_IN, ax.CONV_OUT)
    assert names(block.depthwise.conv) == (ax.GROUP_IN, ax.CONV_OUT) and block.depthwise.conv.kernel.shape == (
        3,
        3,
        1,
        144,
    )
    assert names(block.project.conv) == (ax.CONV_OUT, ax.CONV_IN)
    assert names(model.last.conv) == (ax.CONV_IN, ax.CONV_OUT)
    assert model.head.fc.kernel.get_metadata()[NAMES_KEY] == (ax.MLP, ax.CLASSES)  # the row layer after it
    variables = jax.tree.leaves(nnx.state(model), is_leaf=lambda v: isinstance(v, nnx.Variable))
    assert all(len(v.get_metadata()[NAMES_KEY]) == v.get_value().ndim for v in variables)


def test_flops_count_a_depthwise_conv_per_channel():
    """torchvision's 0.30 GMACs at 224: 2 x 0.30 GFLOPs, the depthwise convs 1/C of a full conv's."""
    layers = layer_shapes(ModelConfig(name="mobilenet_v2", num_classes=1000), (224, 224, 3))
    assert sum(layer.flops for layer in layers) == pytest.approx(0.601e9, rel=0.01)
    dw = next(layer for layer in layers if layer.depthwise)
    assert dw.flops == 2 * dw.out_height * dw.out_width * 9 * dw.features


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "mobilenet_v2", "dense_features": (64,)}, "drop --dense-features"),
        ({"name": "mobilenet_v2", "conv_features": (8, 16)}, "--width-multiplier instead"),
        ({"name": "mobilenet_v2", "width_multiplier": 0.0}, "must be positive"),
        ({"name": "mobilenet_v2", "norm": "layer"}, "unknown --norm"),
        ({"name": "resnet18", "width_multiplier": 0.5}, "MobileNetV2's"),
        ({"name": "mobilenet_v2", "max_pool": "select"}, "CNN family's"),
    ],
)
def test_bad_mobilenet_configs(kwargs, message):
    with pytest.raises(UserError, match=message):
        ModelConfig(**kwargs)


def test_classifier_dropout_is_seeded_and_off_in_evaluation():
    model = initialised(ModelConfig(name="mobilenet_v2_test", dropout=0.5), (16, 16, 1))
    images = jnp.asarray(np.random.default_rng(0).random((4, 16, 16, 1)), jnp.float32)
    graphdef, state = nnx.split(model)

    def logits(seed):
        return nnx.merge(graphdef, state, copy=True)(images, train=True, rngs=nnx.Rngs(dropout=seed))

    np.testing.assert_array_equal(logits(0), logits(0))
    assert not np.allclose(logits(0), logits(1))
