"""ConvNeXt's and MobileNetV2's jitted float32 gradients against float64, as
tests/test_gradients.py does for the CNN and the ResNets (same bar: per gradient leaf,
max |jit - reference| <= 1e-5 x max |reference|): the layers they add -- depthwise convs
(7x7 with a bias, 3x3 stride 2 behind batch norm and ReLU6), LayerNorm over channels on a
stream whose mean is large beside its spread -- at 192-384 channels and odd sides, then
whole models.

ConvNeXt has no kinks (GELU, LayerNorm, no pool), so any input will do. MobileNetV2's ReLU6
has two: its whole-model check picks an input where float32 and float64 take the same side
at every ReLU6 (test_gradients.py's reasoning).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import initialised, jit_initialised
from flax import nnx
from test_gradients import RTOL, _random, assert_matches_float64, float64_twin, grads_of

from jaxcnn.config import ModelConfig
from jaxcnn.models import cross_entropy
from jaxcnn.models.convnext import Block, conv, layer_norm
from jaxcnn.models.mobilenet import ConvNormAct
from jaxcnn.models.parts import LayerShape
from jaxcnn.sharding import axes as ax


def _made(make):
    def build():
        with nnx.use_eager_sharding(False):
            return make()

    return jit_initialised(build)


@pytest.mark.parametrize(
    ("shape", "kernel", "stride"), [((3, 9, 7, 384), 7, 1), ((16, 13, 11, 192), 3, 2)], ids=["7x7", "3x3-stride2"]
)
def test_depthwise_conv_gradient_matches_float64(shape, kernel, stride):
    b, h, w, c = shape
    layer = LayerShape("conv", c, c, ax.CONV_IN, ax.CONV_IN, h, w, kernel=kernel, stride=stride, groups=c)
    module = _made(lambda: conv(layer, jnp.float32, nnx.Rngs(params=0)))
    x, dy = _random(shape, 0), _random((b, layer.out_height, layer.out_width, c), 1)
    assert_matches_float64(lambda m, x, dy: jnp.sum(m(x) * dy), module, x, dy)


def test_depthwise_conv_behind_batch_norm_and_relu6_matches_float64():
    """MobileNetV2's unit: depthwise 3x3 stride 2 -> batch norm -> ReLU6, 192 channels, 13x11."""
    layer = LayerShape("conv", 192, 192, ax.CONV_OUT, ax.CONV_OUT, 13, 11, kernel=3, stride=2, groups=192)
    module = _made(lambda: ConvNormAct(layer, ModelConfig(name="mobilenet_v2_test"), nnx.Rngs(params=0)))
    x = _random((16, 13, 11, 192), 0) * 3.0  # reaches both of ReLU6's kinks
    dy = _random((16, 7, 6, 192), 1)
    assert_matches_float64(lambda m, x, dy: jnp.sum(m(x, train=True) * dy), module, x, dy)


def test_layer_norm_over_channels_matches_float64_where_the_mean_dwarfs_the_spread():
    """Mean 10x the spread: E[x^2] - E[x]^2 (flax's fast variance) cancels two digits there.
    (At 300x float32 itself is the limit: the mean of 384 values of 30 is rounded by ~1e-5 of
    the spread, whatever the formula.)"""
    module = _made(lambda: layer_norm(384, jnp.float32, nnx.Rngs(params=0)))
    x = _random((8, 7, 5, 384), 0) * 0.5 + 5.0
    dy = _random((8, 7, 5, 384), 1)
    assert_matches_float64(lambda m, x, dy: jnp.sum(m(x) * dy), module, x, dy)


def test_convnext_block_gradient_matches_float64():
    """A ConvNeXt-T stage-1 block (96 channels, MLP 384) on an odd 9x7 map, its layer scale
    opened to 1 so the branch counts as much as the stream."""
    c = 96
    common = {"height": 9, "width": 7}
    layers = [
        LayerShape("conv", c, c, ax.CONV_IN, ax.CONV_IN, kernel=7, groups=c, **common),
        LayerShape("conv", c, 4 * c, ax.CONV_IN, ax.CONV_OUT, kernel=1, **common),
        LayerShape("conv", 4 * c, c, ax.CONV_OUT, ax.CONV_IN, kernel=1, **common),
    ]
    block = _made(lambda: Block(layers, ModelConfig(name="convnext_tiny"), 0.0, nnx.Rngs(params=0)))
    block.layer_scale[...] = jnp.ones((c,))
    x, dy = _random((4, 9, 7, c), 0), _random((4, 9, 7, c), 1)
    assert_matches_float64(lambda m, x, dy: jnp.sum(m(x, True) * dy), block, x, dy)


def relu6_sides(model, images: jax.Array) -> list[jax.Array]:
    """Which side of each of ReLU6's two kinks every activation of a training pass is on."""
    sides = []

    def unit(layer, y):
        y = layer.norm(layer.conv(y), use_running_average=False)
        if layer.act:
            sides.append(jnp.sign(y) + jnp.sign(y - 6.0))
            y = jax.nn.relu6(y)
        return y

    y = unit(model.stem, images)
    for block in model.blocks:
        x = y
        y = y if block.expand is None else unit(block.expand, y)
        y = unit(block.project, unit(block.depthwise, y))
        y = x + y if block.residual else y
    unit(model.last, y)
    return sides


def images_off_the_kinks(model, shape, tries: int = 5) -> jax.Array:
    def sides(model, images):
        graphdef, state = nnx.split(model)
        return jax.jit(lambda state, x: relu6_sides(nnx.merge(graphdef, state, copy=True), x))(state, images)

    for seed in range(tries):
        images = _random(shape, seed)
        with jax.enable_x64(True):
            wide = sides(float64_twin(model), jnp.asarray(images, jnp.float64))
        if all(np.array_equal(a, b) for a, b in zip(sides(model, images), wide, strict=True)):
            return images
    pytest.fail(f"float32 and float64 took different sides of a ReLU6 at all {tries} seeds")


MODELS = {
    # two stages at 64 and 128 channels (MLPs 256, 512), the small stem, an odd 14x10 image,
    # the blocks recomputed in the backward pass (remat)
    "convnext": (ModelConfig(name="convnext_test", conv_features=(64, 128), remat="full"), (3, 14, 10, 3)),
    # MobileNetV2 blocks at width 2 (depthwise on 64, 192, 288 channels), batch norm, the imagenet stem: 17 -> 9 -> 5
    "mobilenet": (ModelConfig(name="mobilenet_v2_test", width_multiplier=2.0, stem="imagenet"), (4, 17, 17, 3)),
}


def assert_gradients_match_float64(loss, model, images) -> float:
    """assert_matches_float64 (jitted float32 against jitted float64), each leaf's error
    measured against its largest entry or, if larger, 1e-2 of the model's largest gradient
    entry. MobileNetV2 has leaves whose true gradient (nearly) cancels, where float32 rounding
    is all a leaf holds and no bar relative to the leaf can hold:
    - a project conv's batch-norm bias: zero -- the next conv passes a constant shift per
      channel on to a batch norm, which subtracts it (float64 gives ~1e-17 of the largest);
    - the batch-norm scale before each depthwise conv (the stem's, each expand conv's): BN ->
      ReLU6 -> depthwise -> BN is per channel and scale-invariant wherever ReLU6 is linear, so
      the gradient is 4e-5..1.2e-4 of the largest (measured at this size), float32's error on
      it 3e-5..3e-4 of itself, 1.3e-8 of the largest entry."""
    got = grads_of(loss, model, images, jit=True)
    with jax.enable_x64(True):
        reference = grads_of(loss, float64_twin(model), jnp.asarray(images, jnp.float64), jit=True)
        largest = max(float(np.abs(np.asarray(r)).max()) for r in jax.tree.leaves(reference))
        worst = 0.0
        for (path, g), r in zip(jax.tree.leaves_with_path(got), jax.tree.leaves(reference), strict=True):
            r, g = np.asarray(r), np.asarray(g, np.float64)
            error = float(np.abs(g - r).max()) / max(float(np.abs(r).max()), 1e-2 * largest)
            assert error <= RTOL, f"{jax.tree_util.keystr(path)}: error {error:.2e} of the largest entry"
            worst = max(worst, error)
    return worst


@pytest.mark.parametrize("name", MODELS)
def test_whole_model_gradient_matches_float64(name):
    config, shape = MODELS[name]
    model = initialised(config, shape[1:])
    if config.family == "convnext":
        for block in model.blocks:  # open the residual branches: gradients through every block count
            if isinstance(block, Block):
                block.layer_scale[...] = jnp.full_like(block.layer_scale[...], 0.5)
        images = _random(shape, 0)
    else:
        images = images_off_the_kinks(model, shape)
    labels = jnp.arange(shape[0]) % config.num_classes
    loss = lambda m, x: cross_entropy(m(x, train=True), labels).mean()  # noqa: E731
    assert_gradients_match_float64(loss, model, images)
