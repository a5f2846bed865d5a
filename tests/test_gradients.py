"""Jitted float32 gradients against a float64 reference, at the sizes where bugs hide.

Every layer kind the models use, and whole models, over shapes that the tiny test models
never reach: 128 and 256 channels, odd heights and widths, batches of 3 and 48, each
`--norm`, with and without remat. The float32 gradient is taken under `jax.jit` (what
training runs, where XLA fuses and may recompute); the reference runs eagerly in float64
(one op at a time, nothing fused, rounding 1e-16; for whole models it is jitted too, eager
float64 being 4x slower there). The bar, per gradient leaf:
max |jit - reference| <= 1e-5 x max |reference|.

The reshape+max pool this project used to have failed this check at (48, 6, 6, 128)
after batch norm: a third of its windows got no gradient under jit (error 1.0).

A max-pool and a ReLU have kinks: where two inputs of a window are equal to within float32
rounding, float32 and float64 may rightly pick different winners, and the gradients then
differ at that window (one such window in 55,296 moves a whole model's kernel gradient by
~1e-3). The whole-model checks therefore compare at an input where both precisions take
the same branch at every window and every ReLU -- the next seed when one does not, and
the test says so if none of a few does.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import initialised, jit_initialised
from flax import nnx

from jaxcnn.config import ModelConfig
from jaxcnn.layers import _pool_with_choice, max_pool_2x2, pointwise_conv
from jaxcnn.models import ConvBlock, ResNet, cross_entropy
from jaxcnn.models.parts import normalise
from jaxcnn.sharding import axes as ax

RTOL = 1e-5  # of the largest entry of each reference gradient


def float64_twin(module: nnx.Module) -> nnx.Module:
    """The same module, its variables and compute dtype in float64 (call under x64)."""
    graphdef, state = nnx.split(module)
    twin = nnx.merge(graphdef, jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), state))
    for _, layer in nnx.iter_modules(twin):
        if hasattr(layer, "dtype"):
            layer.dtype = jnp.float64
    return twin


def grads_of(loss, module: nnx.Module, *inputs, jit: bool):
    """d loss / d (parameters, first input); `loss(module, *inputs)` returns a scalar."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def pure(params, x, *others):
        return loss(nnx.merge(graphdef, params, rest, copy=True), x, *others)

    grad = jax.grad(pure, argnums=(0, 1))
    return (jax.jit(grad) if jit else grad)(params, *inputs)


def assert_matches_float64(loss, module: nnx.Module, *inputs, jit_reference: bool = False) -> float:
    """Jitted float32 gradients of `loss` against the float64 ones (eager unless
    `jit_reference`); the worst error."""
    got = grads_of(loss, module, *inputs, jit=True)
    with jax.enable_x64(True):
        wide = [jnp.asarray(x, jnp.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in inputs]
        reference = grads_of(loss, float64_twin(module), *wide, jit=jit_reference)
        worst = 0.0
        for (path, g), r in zip(jax.tree.leaves_with_path(got), jax.tree.leaves(reference), strict=True):
            r = np.asarray(r)
            scale = np.abs(r).max()
            error = np.abs(np.asarray(g, np.float64) - r).max() / scale if scale else np.abs(g).max()
            assert error <= RTOL, f"{jax.tree_util.keystr(path)}: error {error:.2e} of the largest entry"
            worst = max(worst, float(error))
    return worst


def _block(cin: int, cout: int, norm: str, remat: str = "none") -> ConvBlock:
    config = ModelConfig(norm=norm, remat=remat)

    def make():
        with nnx.use_eager_sharding(False):
            return ConvBlock(cin, cout, ax.CONV_IN, ax.CONV_OUT, config, nnx.Rngs(params=0))

    return jit_initialised(make)


def _random(shape, seed: int, dtype=jnp.float32) -> jax.Array:
    """Standard normal values (NumPy's: an eager jax.random draw compiles per shape)."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


# (batch, height, width, in channels, out channels, norm): odd sides, 128-256 channels,
# batches 3-48; batch norm where the old pool failed, each norm at 256 channels
BLOCK_CASES = [
    (48, 6, 6, 64, 128, "batch"),
    (16, 6, 6, 128, 128, "batch"),
    (48, 9, 5, 32, 128, "batch"),
    (3, 7, 7, 128, 256, "batch"),
    (3, 7, 7, 128, 256, "group"),
    (3, 7, 7, 128, 256, "none"),
]


@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: "x".join(map(str, c[:5])) + f"-{c[5]}")
def test_conv_block_gradient_matches_float64(case):
    """conv -> norm -> ReLU -> pool, the unit where the old pool's gradient went wrong."""
    b, h, w, cin, cout, norm = case
    x = _random((b, h, w, cin), 0)
    dy = _random((b, -(-h // 2), -(-w // 2), cout), 1)
    assert_matches_float64(lambda block, x, dy: jnp.sum(block(x, train=True) * dy), _block(cin, cout, norm), x, dy)


def test_conv_block_gradient_under_remat_matches_float64():
    """Remat recomputes the forward (the pool's choice included) in the backward pass
    (`dots` here; `full` in the whole-model grid)."""
    x, dy = _random((48, 6, 6, 64), 0), _random((48, 3, 3, 128), 1)
    block = _block(64, 128, "batch", "dots")
    assert_matches_float64(lambda block, x, dy: jnp.sum(block(x, train=True) * dy), block, x, dy)


@pytest.mark.parametrize("shape", [(48, 6, 6, 128), (3, 7, 9, 256), (5, 1, 1, 3)], ids=str)
def test_pool_after_a_fused_producer_matches_float64(shape):
    """The pool alone behind an elementwise producer XLA fuses into it (the exact pattern
    of the bug), on odd sides (SAME padding) and a 1x1 image."""

    class ScaledPool(nnx.Module):
        def __init__(self):
            self.scale = nnx.Param(jnp.full((shape[-1],), 1.3))

        def __call__(self, x):
            return max_pool_2x2(nnx.relu((x - x.mean((0, 1, 2))) * self.scale + 0.1))

    b, h, w, c = shape
    dy = _random((b, -(-h // 2), -(-w // 2), c), 1)
    assert_matches_float64(lambda m, x, dy: jnp.sum(m(x) * dy), ScaledPool(), _random(shape, 0), dy)


def test_pool_sends_each_window_gradient_to_exactly_one_input():
    """With ties (a ReLU's zeros, equal values), the whole window's gradient goes to one
    input, the first maximum in row-major order (as torch's), and the values are flax's."""
    x = jnp.array([[1.0, 1.0, 0.0], [1.0, 0.5, 2.0], [3.0, 3.0, -1.0]]).reshape(1, 3, 3, 1)
    y, pullback = jax.vjp(max_pool_2x2, x)
    assert jnp.array_equal(y, nnx.max_pool(x, (2, 2), (2, 2), "SAME"))
    grad = pullback(jnp.array([10.0, 20.0, 30.0, 40.0]).reshape(1, 2, 2, 1))[0][0, :, :, 0]
    expected = jnp.array([[10.0, 0.0, 0.0], [0.0, 0.0, 20.0], [30.0, 0.0, 40.0]])
    assert jnp.array_equal(grad, expected)


def test_pool_passes_a_nan_through_from_any_corner():
    """A NaN must reach the loss (and the non-finite check), wherever it sits in its window."""
    for corner in range(4):
        window = jnp.arange(4.0).at[corner].set(jnp.nan).reshape(1, 2, 2, 1)
        assert jnp.isnan(max_pool_2x2(window)).all(), corner


def test_dense_and_loss_gradient_matches_float64():
    """The dense head at the default model's widths, through the cross-entropy."""

    class Head(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(1152, 256, rngs=rngs)
            self.out = nnx.Linear(256, 10, rngs=rngs)

        def __call__(self, x):
            return self.out(nnx.relu(self.hidden(x)))

    labels = jnp.arange(48) % 10
    loss = lambda m, x: cross_entropy(m(x), labels).mean()  # noqa: E731
    assert_matches_float64(loss, jit_initialised(lambda: Head(nnx.Rngs(0))), _random((48, 1152), 0))


MODELS = {
    # the default model (32/64/128 channels) at odd sides and batches; --norm none: the block grid
    "default-batch": (ModelConfig(norm="batch"), (48, 13, 13, 3)),
    "default-group": (ModelConfig(norm="group"), (3, 24, 24, 3)),
    "default-remat": (ModelConfig(norm="batch", remat="full"), (8, 16, 16, 1)),
    # 5 conv blocks up to 256 channels at an odd size: 40 -> 20 -> 10 -> 5 -> 3 -> 2
    "5-block": (ModelConfig(name="cnn2d_5layer_fullconnected_3layer", norm="batch"), (3, 40, 40, 3)),
    # residual blocks at 128 and 256 channels, a stride-2 projection, odd sides: 11 -> 6
    "resnet-basic": (ModelConfig(name="resnet_tiny", conv_features=(128, 256)), (3, 11, 11, 3)),
    # bottlenecks (64 -> 256 channels out) behind the 7x7 stride-2 stem and its 3x3 max-pool: 25 -> 13 -> 7 -> 4
    "resnet-bottleneck": (
        ModelConfig(name="resnet_tiny_bottleneck", conv_features=(16, 64), stem="imagenet", remat="full"),
        (2, 25, 25, 3),
    ),
}


def window_winners(y_BHWC: jax.Array) -> jax.Array:
    """Which of each 3x3 stride-2 window's (padded) inputs is largest: a ResNet stem's pool."""
    padded = jnp.pad(y_BHWC, ((0, 0), (1, 1), (1, 1), (0, 0)), constant_values=-jnp.inf)
    h, w = (y_BHWC.shape[1] - 1) // 2 + 1, (y_BHWC.shape[2] - 1) // 2 + 1
    windows = [padded[:, i : i + 2 * h - 1 : 2, j : j + 2 * w - 1 : 2] for i in range(3) for j in range(3)]
    return jnp.argmax(jnp.stack(windows), axis=0)


def resnet_branches(model: ResNet, images: jax.Array) -> list[jax.Array]:
    stem = model.stem
    y = nnx.relu(normalise(stem.norm, stem.conv(images), True))
    taken = [y > 0]
    if stem.pool:
        taken.append(window_winners(y))
        y = nnx.max_pool(y, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
    for block in model.blocks:
        x = y
        for i in range(1, block.depth + 1):
            y = normalise(getattr(block, f"norm{i}"), getattr(block, f"conv{i}")(y), True)
            if i < block.depth:
                taken.append(y > 0)
                y = nnx.relu(y)
        y = y + (x if block.shortcut is None else block.shortcut(x, True))
        taken.append(y > 0)
        y = nnx.relu(y)
    return taken


def branches(model: nnx.Module, images: jax.Array) -> list[jax.Array]:
    """Every ReLU's sign and every pool window's winner in a training forward pass."""
    if isinstance(model, ResNet):
        return resnet_branches(model, images)
    taken = []
    for block in model.blocks:
        y = block.conv(images)
        if isinstance(block.norm, nnx.BatchNorm):
            y = block.norm(y, use_running_average=False)
        elif block.norm is not None:
            y = block.norm(y)
        y = nnx.relu(y)
        taken += [y > 0, _pool_with_choice(y)[1]]
        images = max_pool_2x2(y)
    return taken


def images_off_the_kinks(model: nnx.Module, shape: tuple[int, ...], tries: int = 5) -> jax.Array:
    """Random images at which float32 and float64 take the same branch everywhere."""

    def branches_jit(model, images):
        graphdef, state = nnx.split(model)
        return jax.jit(lambda state, x: branches(nnx.merge(graphdef, state, copy=True), x))(state, images)

    for seed in range(tries):
        images = _random(shape, seed)
        with jax.enable_x64(True):
            wide = branches_jit(float64_twin(model), jnp.asarray(images, jnp.float64))
        narrow = branches_jit(model, images)
        if all(np.array_equal(a, b) for a, b in zip(narrow, wide, strict=True)):
            return images
    pytest.fail(f"float32 and float64 took different branches at all {tries} seeds")


@pytest.mark.parametrize("name", MODELS)
def test_whole_model_gradient_matches_float64(name):
    config, shape = MODELS[name]
    model = initialised(config, shape[1:])
    images, labels = images_off_the_kinks(model, shape), jnp.arange(shape[0]) % config.num_classes
    loss = lambda m, x: cross_entropy(m(x, train=True), labels).mean()  # noqa: E731
    assert_matches_float64(loss, model, images, jit_reference=True)


@pytest.mark.parametrize("stride", [1, 2])
def test_pointwise_conv_is_the_1x1_convolution_with_the_same_gradients(stride):
    """The ResNets' 1x1 convs as a matrix product: values and both gradients equal to
    lax's convolution in float64, at an odd size (9x7 -> 5x4 at stride 2), 128 -> 256 channels."""
    with jax.enable_x64(True):
        x, kernel = _random((3, 9, 7, 128), 0, jnp.float64), _random((1, 1, 128, 256), 1, jnp.float64)
        options = {
            "window_strides": (stride, stride),
            "padding": [(0, 0)] * 2,
            "dimension_numbers": ("NHWC", "HWIO", "NHWC"),
        }
        want, want_vjp = jax.vjp(partial(jax.lax.conv_general_dilated, **options), x, kernel)
        got, got_vjp = jax.vjp(partial(pointwise_conv, **options), x, kernel)
        assert got.shape == want.shape == (3, -(-9 // stride), -(-7 // stride), 256)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
        cotangent = _random(want.shape, 2, jnp.float64)
        for mine, theirs in zip(got_vjp(cotangent), want_vjp(cotangent), strict=True):
            np.testing.assert_allclose(mine, theirs, rtol=1e-12, atol=1e-11)
