"""ConvNeXt: torchvision's parameter counts and state_dict names, the layer shapes the cost
models read against what the model computes, the logical names that make tp a column -> row
pair per block with the depthwise conv whole, stochastic depth, and bad configs."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import initialised
from flax import nnx

from jaxcnn.config import ModelConfig
from jaxcnn.errors import UserError
from jaxcnn.models import ConvNeXt, build_model, count_params, layer_shapes
from jaxcnn.models.convnext import drop_path, stochastic_depth_rates
from jaxcnn.models.torchvision_names import load_torchvision, torch_shape, torchvision_keys
from jaxcnn.sharding import axes as ax
from jaxcnn.sharding.partition import NAMES_KEY

TEST = ModelConfig(name="convnext_test")


def abstract(config: ModelConfig, image_shape) -> ConvNeXt:
    return nnx.eval_shape(lambda: build_model(config, image_shape, seed=0))


def flat_state(model) -> dict:
    return {"/".join(map(str, path)): v for path, v in nnx.to_flat_state(nnx.state(model))}


@pytest.mark.parametrize(
    ("name", "params"),
    [("convnext_tiny", 28_589_128), ("convnext_small", 50_223_688), ("convnext_base", 88_591_464),
     ("convnext_large", 197_767_336)],
)  # fmt: skip
def test_parameter_counts_equal_torchvisions(name, params):
    assert count_params(abstract(ModelConfig(name=name, num_classes=1000), (224, 224, 3))) == params


def test_every_torchvision_key_maps_to_one_parameter_of_its_shape():
    """convnext_tiny's state_dict: 182 keys (stem 4, 18 blocks x 9, 3 downsamples x 4, head 4),
    each onto one parameter, with torchvision's shapes."""
    config = ModelConfig(name="convnext_tiny", num_classes=1000)
    keys, state = torchvision_keys(config), flat_state(abstract(config, (224, 224, 3)))
    assert len(keys) == 182 and sorted(path for path, _ in keys.values()) == sorted(state)
    shapes = {key: torch_shape(how, state[path].shape) for key, (path, how) in keys.items()}
    assert shapes["features.0.0.weight"] == (96, 3, 4, 4)
    assert shapes["features.1.0.block.0.weight"] == (96, 1, 7, 7)  # depthwise: groups = channels
    assert shapes["features.1.0.block.3.weight"] == (384, 96) and shapes["features.1.0.block.5.weight"] == (96, 384)
    assert shapes["features.1.0.layer_scale"] == (96, 1, 1)
    assert shapes["features.2.1.weight"] == (192, 96, 2, 2) and shapes["features.6.0.weight"] == (384,)
    assert shapes["features.5.8.block.2.bias"] == (384,) and "features.5.9.layer_scale" not in shapes
    assert shapes["classifier.2.weight"] == (1000, 768)


def test_a_torchvision_state_dict_loads_and_computes_the_same_logits():
    """A state_dict written in torchvision's layout from one model, loaded into another."""
    source, target = initialised(TEST, (16, 16, 3), seed=0), initialised(TEST, (16, 16, 3), seed=1)
    state = flat_state(source)
    inverse = {"conv": (3, 2, 0, 1), "linear": (1, 0)}
    state_dict = {}
    for key, (path, how) in torchvision_keys(TEST).items():
        value = np.asarray(state[path].get_value())
        state_dict[key] = (
            value.transpose(inverse[how]) if how in inverse else value.reshape(torch_shape(how, value.shape))
        )
    state_dict["features.0.1.num_batches_tracked"] = np.zeros(())  # a key without counterpart is skipped
    load_torchvision(target, TEST, state_dict)
    images = np.random.default_rng(0).random((2, 16, 16, 3), np.float32)
    np.testing.assert_array_equal(source(images), target(images))
    with pytest.raises(UserError, match="does not fit"):
        load_torchvision(target, TEST, {k: v for k, v in state_dict.items() if "layer_scale" not in k})


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is None, reason="torchvision is not installed")
def test_torchvisions_own_state_dict_loads_and_gives_its_logits():  # pragma: no cover - needs torch
    import torch
    import torchvision

    config = ModelConfig(name="convnext_tiny", num_classes=1000, stem="imagenet")  # torchvision's stem at 64 pixels
    reference = torchvision.models.convnext_tiny().eval()
    model = build_model(config, (64, 64, 3), seed=0)
    load_torchvision(model, config, {k: v.numpy() for k, v in reference.state_dict().items()})
    images = np.random.default_rng(0).random((2, 64, 64, 3), np.float32)
    with torch.no_grad():
        want = reference(torch.from_numpy(images.transpose(0, 3, 1, 2))).numpy()
    np.testing.assert_allclose(model(images), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("name", "image_shape", "stem", "patch"),
    [("convnext_test", (28, 28, 1), "auto", 2), ("convnext_test", (17, 23, 3), "auto", 2),
     ("convnext_atto", (28, 28, 1), "auto", 2), ("convnext_tiny", (224, 224, 3), "auto", 4),
     ("convnext_test", (33, 33, 3), "imagenet", 4)],
)  # fmt: skip
def test_layer_shapes_follow_what_the_model_computes(name, image_shape, stem, patch):
    """Each unit's output height and width as the LayerShapes say, on odd sizes too; the
    small stem keeps a 28-pixel image at 1x1 after the last downsample."""
    config = ModelConfig(name=name, stem=stem, num_classes=7)
    model = abstract(config, image_shape)
    assert model.stem.conv.kernel_size == (patch, patch)
    layers = layer_shapes(config, image_shape)
    graphdef, state = nnx.split(model)
    x = jax.ShapeDtypeStruct((2, *image_shape), jnp.float32)
    for unit in range(layers[-1].unit):
        x = jax.eval_shape(lambda s, x, u=unit: nnx.merge(graphdef, s).pipeline_units()[u](x, False), state, x)
        last = [layer for layer in layers if layer.unit == unit][-1]
        assert x.shape[1:] == (*last.next_size, last.features), unit
    assert jax.eval_shape(
        lambda s, x: nnx.merge(graphdef, s)(x), state, jax.ShapeDtypeStruct((2, *image_shape), jnp.float32)
    ).shape == (2, 7)


def test_the_residual_stream_and_depthwise_conv_stay_whole_and_the_mlp_is_a_column_row_pair():
    block = abstract(ModelConfig(name="convnext_tiny"), (32, 32, 3)).blocks[0]

    def names(variable):
        return variable.get_metadata()[NAMES_KEY]

    assert names(block.dwconv.kernel) == (ax.KH, ax.KW, ax.GROUP_IN, ax.CONV_IN)
    assert block.dwconv.kernel.shape == (7, 7, 1, 96) and block.dwconv.feature_group_count == 96
    assert names(block.pwconv1.kernel) == (ax.CONV_IN, ax.CONV_OUT)
    assert names(block.pwconv2.kernel) == (ax.CONV_OUT, ax.CONV_IN)
    assert names(block.norm.scale) == (ax.NORM,) and names(block.layer_scale) == (ax.CONV_IN,)
    variables = jax.tree.leaves(nnx.state(block), is_leaf=lambda v: isinstance(v, nnx.Variable))
    assert all(len(v.get_metadata()[NAMES_KEY]) == v.get_value().ndim for v in variables)


def test_stochastic_depth_rates_rise_linearly_and_drop_whole_examples():
    config = ModelConfig(name="convnext_tiny", stochastic_depth=0.1)
    rates = stochastic_depth_rates(config)
    assert len(rates) == 18 and rates[0] == 0.0 and rates[-1] == pytest.approx(0.1)
    np.testing.assert_allclose(np.diff(rates), 0.1 / 17)
    y = jnp.ones((4000, 2, 2, 3))
    dropped = drop_path(y, 0.25, True, nnx.Rngs(dropout=0))
    per_example = np.asarray(dropped[:, 0, 0, 0])
    assert set(np.unique(per_example)) == {0.0, np.float32(1 / 0.75)}  # whole examples, the kept rescaled
    assert np.all(dropped == dropped[:, :1, :1, :1])
    assert abs((per_example == 0).mean() - 0.25) < 0.03
    assert drop_path(y, 0.25, False, None) is y  # evaluation: the identity


def test_stochastic_depth_changes_training_but_not_evaluation():
    model = initialised(ModelConfig(name="convnext_test", stochastic_depth=0.5), (16, 16, 1))
    for block in model.blocks:  # open the residual branches, which layer scale starts almost shut
        if hasattr(block, "layer_scale"):
            block.layer_scale[...] = jnp.ones_like(block.layer_scale[...])
    images = jnp.asarray(np.random.default_rng(0).random((8, 16, 16, 1)), jnp.float32)
    plain = model(images, train=True, rngs=nnx.Rngs(dropout=0))
    with pytest.raises(ValueError, match="needs rngs"):
        model(images, train=True)
    again = model(images, train=True, rngs=nnx.Rngs(dropout=0))
    other = model(images, train=True, rngs=nnx.Rngs(dropout=1))
    np.testing.assert_array_equal(plain, again)
    assert not np.allclose(plain, other)
    np.testing.assert_array_equal(model(images), model(images))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "convnext_tiny", "dense_features": (64,)}, "global average pooling"),
        ({"name": "convnext_tiny", "dropout": 0.5}, "drop --dense-features and --dropout"),
        ({"name": "convnext_tiny", "conv_features": (8, 16)}, "has 4 stages"),
        ({"name": "convnext_tiny", "norm": "group"}, "LayerNorm"),
        ({"name": "convnext_tiny", "conv1x1": "dot"}, "dense layers already"),
        ({"name": "convnext_tiny", "stochastic_depth": 1.0}, "stochastic-depth must be"),
        ({"name": "resnet18", "stochastic_depth": 0.1}, "stochastic-depth is ConvNeXt's"),
        ({"name": "resnet18", "norm": "layer"}, "unknown --norm"),
    ],
)
def test_bad_convnext_configs(kwargs, message):
    with pytest.raises(UserError, match=message):
        ModelConfig(**kwargs)


def test_the_norm_is_layer_norm_whatever_the_default_said():
    assert ModelConfig(name="convnext_tiny").norm == "layer" and ModelConfig(name="convnext_tiny").family == "convnext"
