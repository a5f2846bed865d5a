"""The CNN family: output shapes for each member and input size, logical names on every parameter."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import initialised
from flax import nnx

from jaxcnn.config import ModelConfig
from jaxcnn.errors import UserError
from jaxcnn.layers import max_pool_2x2
from jaxcnn.models import build_model, conv_channel_spaces
from jaxcnn.sharding import axes as ax
from jaxcnn.sharding.partition import NAMES_KEY

FAMILY = [f"cnn2d_{c}layer_fullconnected_{d}layer" for c in (2, 3) for d in (2, 3)]
SIZES = [(8, 8, 1), (28, 28, 1), (224, 224, 3)]


@pytest.mark.parametrize("name", FAMILY)
@pytest.mark.parametrize("image_shape", SIZES)
def test_logits_shape_for_every_member_and_size(name, image_shape):
    config = ModelConfig(name=name, norm="batch", dropout=0.1, num_classes=7)
    model = nnx.eval_shape(lambda: build_model(config, image_shape, seed=0))  # shapes only: no 25M-param init
    graphdef, state = nnx.split(model)
    images = jax.ShapeDtypeStruct((2, *image_shape), jnp.float32)
    logits = jax.eval_shape(lambda s, x: nnx.merge(graphdef, s)(x, train=False), state, images)
    assert logits.shape == (2, 7)
    assert len(model.blocks) == int(name[6]) and len(model.dense) == int(name[-6])


@pytest.mark.parametrize("shape", [(2, 8, 8, 3), (2, 7, 5, 3), (1, 1, 1, 2)])
def test_max_pool_matches_flax_in_values_and_in_gradient_without_ties(shape):
    """jaxcnn's pool equals reduce_window's (odd sides: SAME padding); on tie-free data
    the gradients are equal too, and with ties each window's gradient still sums to its
    output's (given to one of the tied maxima)."""
    reference = lambda x: nnx.max_pool(x, (2, 2), (2, 2), "SAME")  # noqa: E731
    rng = np.random.default_rng(0)  # NumPy's draws: an eager jax.random draw compiles per shape
    random = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    for x in (random, jnp.round(random)):
        y, pullback = jax.vjp(max_pool_2x2, x)
        y_ref = reference(x)
        dy = jnp.asarray(rng.uniform(size=y.shape), jnp.float32) + 0.5
        assert jnp.array_equal(y, y_ref)
        assert jnp.allclose(pullback(dy)[0].sum(), dy.sum())
    assert jnp.allclose(jax.vjp(max_pool_2x2, random)[1](dy)[0], jax.vjp(reference, random)[1](dy)[0])


def _reference_logits(model, x_BHWC: np.ndarray) -> np.ndarray:
    """The CNN's evaluation forward in NumPy, float64, from the model's own variables:
    each block a 3x3 SAME conv, batch norm on the running statistics, ReLU, 2x2 max-pool
    (even sides here: no padding); then flatten, dense + ReLU, classifier -- no dropout."""
    value = lambda v: np.asarray(v.get_value(), np.float64)  # noqa: E731
    h = np.asarray(x_BHWC, np.float64)
    for block in model.blocks:
        kernel, (height, width) = value(block.conv.kernel), h.shape[1:3]
        padded = np.pad(h, ((0, 0), (1, 1), (1, 1), (0, 0)))
        h = sum(padded[:, i : i + height, j : j + width] @ kernel[i, j] for i in range(3) for j in range(3))
        norm = block.norm
        h = (h - value(norm.mean)) / np.sqrt(value(norm.var) + norm.epsilon) * value(norm.scale) + value(norm.bias)
        h = np.maximum(h, 0)
        b, height, width, c = h.shape
        h = h.reshape(b, height // 2, 2, width // 2, 2, c).max(axis=(2, 4))
    h = h.reshape(h.shape[0], -1)
    *hidden, classifier = model.dense
    for layer in hidden:
        h = np.maximum(h @ value(layer.kernel) + value(layer.bias), 0)
    return h @ value(classifier.kernel) + value(classifier.bias)


def test_small_model_runs_and_dropout_only_in_training():
    """Evaluation computes the forward written out in NumPy (no dropout: at rate 0.5 it
    would zero half the hidden units); training draws a dropout mask per key."""
    config = ModelConfig(
        name="cnn2d_2layer_fullconnected_2layer", conv_features=(4, 8), dense_features=(16,), dropout=0.5
    )
    model = initialised(config, (8, 8, 1))
    rng = np.random.default_rng(0)
    for block in model.blocks:  # running statistics away from init's 0 and 1, so they count
        block.norm.mean.set_value(jnp.asarray(rng.normal(size=block.norm.mean.get_value().shape), jnp.float32))
        block.norm.var.set_value(jnp.asarray(rng.uniform(0.5, 2, size=block.norm.var.get_value().shape), jnp.float32))
    x = jnp.asarray(rng.normal(size=(3, 8, 8, 1)), jnp.float32)
    np.testing.assert_allclose(model(x), _reference_logits(model, np.asarray(x)), rtol=1e-5, atol=1e-5)
    a = model(x, train=True, rngs=nnx.Rngs(dropout=0))
    b = model(x, train=True, rngs=nnx.Rngs(dropout=1))
    assert not jnp.allclose(a, b)


@pytest.mark.parametrize("norm", ["none", "batch", "group"])
def test_every_parameter_and_statistic_has_logical_names(norm):
    model = nnx.eval_shape(lambda: build_model(ModelConfig(norm=norm), (8, 8, 1), seed=0))
    variables = jax.tree.leaves(nnx.state(model), is_leaf=lambda v: isinstance(v, nnx.Variable))
    assert variables
    for variable in variables:
        names = variable.get_metadata().get(NAMES_KEY)
        assert names is not None and len(names) == variable.get_value().ndim
        assert set(names) <= set(ax.PARAM_AXES)


def test_channel_spaces_alternate_back_from_the_flatten():
    assert conv_channel_spaces(3) == [ax.CONV_IN, ax.CONV_OUT, ax.CONV_IN]
    assert conv_channel_spaces(2) == [ax.CONV_OUT, ax.CONV_IN]
    model = nnx.eval_shape(lambda: build_model(ModelConfig(), (8, 8, 1), seed=0))
    kernels = [d.kernel.get_metadata()[NAMES_KEY] for d in model.dense]
    assert kernels == [(ax.EMBED, ax.MLP), (ax.MLP, ax.EMBED), (ax.EMBED, ax.CLASSES)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "resnet101"}, "unknown model"),
        ({"name": "cnn2d_9layer_fullconnected_2layer"}, "use 1..6 conv"),
        ({"conv_features": (8,)}, "has 3 conv blocks"),
        ({"dense_features": (8,)}, "has 2 hidden dense"),
        ({"norm": "layer"}, "unknown --norm"),
        ({"dropout": 1.0}, "--dropout"),
    ],
)
def test_bad_model_configs(kwargs, message):
    with pytest.raises(UserError, match=message):
        ModelConfig(**kwargs)
