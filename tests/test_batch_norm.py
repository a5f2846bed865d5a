"""Batch norm with one collective each way (jaxcnn.models.batch_norm): the same numbers as
flax's two-pass batch norm over the whole batch, however the batch is cut over devices, and
one all-reduce of 2 x C values forward and one backward per layer in the compiled step."""

from __future__ import annotations

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import compiled_program
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcnn.analysis.hlo import collectives
from jaxcnn.analysis.lint import classify
from jaxcnn.config import ModelConfig
from jaxcnn.models import layer_shapes
from jaxcnn.models.batch_norm import BatchNorm
from jaxcnn.sharding import build_mesh, get_layout
from jaxcnn.sharding.partition import activation_layout

SHAPE = (16, 8, 8, 6)  # batch 16: two images a device on data=8


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def _pair(local=False):
    """Ours and flax's, same float64 parameters (scale and bias not 1 and 0)."""
    rng = np.random.default_rng(1)
    kwargs = {"momentum": 0.9, "use_fast_variance": False, "dtype": jnp.float64, "param_dtype": jnp.float64}
    ours, flax = BatchNorm(6, local=local, rngs=nnx.Rngs(0), **kwargs), nnx.BatchNorm(6, rngs=nnx.Rngs(0), **kwargs)
    scale, bias = jnp.asarray(rng.normal(1, 0.2, 6)), jnp.asarray(rng.normal(0, 0.2, 6))
    for bn in (ours, flax):
        bn.scale[...], bn.bias[...] = scale, bias
    return ours, flax


def _batch():
    rng = np.random.default_rng(0)  # a mean 6x the spread: where E[x^2] - E[x]^2 would cancel
    return jnp.asarray(rng.normal(3.0, 0.5, SHAPE)), jnp.asarray(rng.normal(size=SHAPE))


def _loss(bn, x, weights):
    return jnp.sum(jnp.sin(bn(x, use_running_average=False)) * weights)


def _grads(bn, x, weights, layout=None, mesh=None):
    """d loss / d (scale, bias, x) and the running statistics after the step, under jit with
    the batch split as `layout` says on `mesh` (None: one device)."""
    graphdef, state = nnx.split(bn)

    def step(state, x):
        def loss(params, x):
            module = nnx.merge(graphdef, params, copy=True)
            if layout is None:
                return _loss(module, x, weights), nnx.state(module)
            with activation_layout(layout, mesh):
                return _loss(module, x, weights), nnx.state(module)

        (_, after), (d_state, dx) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(state, x)
        return d_state["scale"][...], d_state["bias"][...], dx, after["mean"][...], after["var"][...]

    if mesh is not None:
        x = jax.device_put(x, NamedSharding(mesh, P(*layout_entries(layout, mesh))))
    return [np.asarray(a) for a in jax.jit(step)(state, x)]


def layout_entries(layout, mesh):
    return [tuple(a for a in layout.axes_for(name) or () if a in mesh.shape) or None for name in ("batch", "height")]


@pytest.mark.parametrize(
    ("layout", "mesh"),
    [(None, None), ("dp", {"data": 8}), ("spatial", {"data": 2, "spatial": 4}), ("hybrid", {"data": 4, "model": 2})],
    ids=["one-device", "dp-8", "spatial-2x4", "hybrid-4x2"],
)
def test_statistics_and_gradients_equal_flax_two_pass_over_the_whole_batch(x64, layout, mesh):
    ours, flax = _pair()
    x, weights = _batch()
    expected = _grads(flax, x, weights)
    found = _grads(ours, x, weights, layout and get_layout(layout), mesh and build_mesh(mesh))
    for name, a, b in zip(("d_scale", "d_bias", "dx", "running mean", "running var"), found, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13, err_msg=name)


def test_inside_a_shard_map_the_statistics_run_over_its_axis(x64):
    """Gradient accumulation's path: per-device shards, `axis_name` the batch's axis; the
    local scale and bias gradients are this device's share (their mean is the batch's)."""
    ours, flax = _pair()
    x, weights = _batch()
    expected = _grads(flax, x, weights)
    mesh = build_mesh({"data": 4})
    graphdef, state = nnx.split(ours)

    def per_device(state, x, weights):
        def loss(params, x):
            module = nnx.merge(graphdef, params, copy=True)
            module.axis_name = ("data",)
            return _loss(module, x, weights), nnx.state(module)

        (_, after), (d_state, dx) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(state, x)
        d_affine = jax.lax.pmean((d_state["scale"][...], d_state["bias"][...]), "data")
        return d_affine, dx, (after["mean"][...], after["var"][...])

    mapped = jax.shard_map(
        per_device, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=(P(), P("data"), P()), check_vma=False
    )
    (d_scale, d_bias), dx, running = jax.jit(mapped)(state, x, weights)
    np.testing.assert_allclose(np.asarray(dx), expected[2], rtol=1e-12, atol=1e-13)
    # 4 devices' mean x 4: the sum
    np.testing.assert_allclose(np.asarray(d_scale) * 4, expected[0], rtol=1e-12, err_msg="d_scale")
    np.testing.assert_allclose(np.asarray(d_bias) * 4, expected[1], rtol=1e-12, err_msg="d_bias")
    for name, a, b in zip(("running mean", "running var"), running, expected[3:], strict=True):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-12, atol=1e-13, err_msg=name)


def test_float32_statistics_of_activations_with_a_large_mean_stay_exact():
    """Where E[x^2] - E[x]^2 cancels: float32 activations of mean 30 and spread 1 split over
    8 devices. The batch's mean and variance (read from the running averages, momentum 0)
    equal float64's two-pass ones to float32 rounding, where the one-pass form is off by
    more than 1e-5 (asserted, so the case stays a hard one). The running mean is a previous
    batch's, as after a few steps: the shifted sums are taken about it."""
    rng = np.random.default_rng(4)
    x, weights = rng.normal(30.0, 1.0, SHAPE).astype(np.float32), rng.normal(size=SHAPE).astype(np.float32)
    axes = (0, 1, 2)
    exact_mean, exact_var = x.astype(np.float64).mean(axes), x.astype(np.float64).var(axes)
    one_pass = np.square(x).mean(axes) - np.square(x.mean(axes))
    assert np.abs(one_pass / exact_var - 1).max() > 1e-5
    bn = BatchNorm(6, momentum=0.0, rngs=nnx.Rngs(0))
    bn.mean[...] = jnp.asarray(rng.normal(30.0, 1.0, SHAPE).astype(np.float32).mean(axes))
    for layout, mesh in ((None, None), ("dp", {"data": 8})):
        found = _grads(
            bn, jnp.asarray(x), jnp.asarray(weights), layout and get_layout(layout), mesh and build_mesh(mesh)
        )
        np.testing.assert_allclose(found[3], exact_mean, rtol=1e-7, err_msg=f"mean, {layout}")
        np.testing.assert_allclose(found[4], exact_var, rtol=2e-6, err_msg=f"variance, {layout}")


def test_per_device_statistics_normalise_each_piece_on_its_own(x64):
    ours, _ = _pair(local=True)
    x, weights = _batch()
    found = _grads(ours, x, weights, get_layout("dp"), build_mesh({"data": 4}))
    quarters = [_grads(_pair()[1], x[i : i + 4], weights[i : i + 4]) for i in range(0, 16, 4)]
    np.testing.assert_allclose(found[2], np.concatenate([q[2] for q in quarters]), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(found[0], sum(q[0] for q in quarters), rtol=1e-12)  # scale: summed over the pieces
    np.testing.assert_allclose(found[3], np.mean([q[3] for q in quarters], axis=0), rtol=1e-12)  # running: averaged


RESNET18 = ModelConfig(name="resnet18", conv_features=(8, 8, 16, 16))  # ResNet-18's 20 batch norms, narrow
CNN = ModelConfig(name="cnn2d_2layer_fullconnected_1layer", conv_features=(8, 16))


@pytest.mark.parametrize(
    ("model", "layout", "mesh", "image"),
    [
        (CNN, "dp", {"data": 8}, (8, 8, 1)),
        (CNN, "fsdp", {"data": 8}, (8, 8, 1)),
        (CNN, "spatial", {"data": 2, "spatial": 4}, (8, 8, 1)),
        (RESNET18, "dp", {"data": 8}, (16, 16, 3)),
        (RESNET18, "fsdp", {"data": 8}, (16, 16, 3)),
        (RESNET18, "spatial", {"data": 4, "spatial": 2}, (16, 16, 3)),
    ],
    ids=["cnn-dp", "cnn-fsdp", "cnn-spatial", "resnet18-dp", "resnet18-fsdp", "resnet18-spatial"],
)
def test_one_collective_each_way_per_batch_norm_layer(model, layout, mesh, image):
    program = compiled_program(get_layout(layout), mesh, model, steps=4, batch_size=32, image_shape=image)
    found = collectives(program.train_step.as_text(), program.mesh.size)
    roles = classify(found, program.anatomy.placements, program.mesh)
    norms = sum(1 for layer in layer_shapes(model, image) if layer.norm_path)
    widths = {layer.features for layer in layer_shapes(model, image) if layer.norm_path}
    assert not [c for c, role in zip(found, roles, strict=True) if role == "statistics" and c.kind != "all-reduce"]
    # forward: each layer's (2, C) shifted sums; backward: its (2, C) sums of dy and dy x_hat.
    # All-reduced once each (XLA may fuse several layers' into one collective)
    summed = [c for c in found if c.kind == "all-reduce" for shape in c.shapes if shape in {(2, w) for w in widths}]
    assert len(summed) == 2 * norms
    # over all the devices holding different pieces at once, not once per axis (under spatial,
    # where a layer's rows are whole on every device: over data only)
    data = mesh.get("data", 1)
    assert all(c.group_size in (data, program.mesh.size) for c in summed)
    assert any(c.group_size == program.mesh.size for c in summed)
    if layout != "spatial":  # the rest: the gradients' fused reduction, the loss and the accuracy
        assert Counter(c.kind for c in found)["all-reduce"] <= 2 * norms + 4


def test_statistics_bytes_do_not_grow_with_the_device_count():
    """The forward's statistics are 2 x C floats a layer on 2 devices and on 8: an
    all-reduce, not a gather of every piece's moments."""
    per_layer = {}
    for n in (2, 8):
        program = compiled_program(get_layout("dp"), {"data": n}, CNN, steps=4, batch_size=32, image_shape=(8, 8, 1))
        found = collectives(program.train_step.as_text(), program.mesh.size)
        roles = classify(found, program.anatomy.placements, program.mesh)
        per_layer[n] = sorted(c.buffer_bytes for c, role in zip(found, roles, strict=True) if role == "statistics")
    assert per_layer[2] == per_layer[8]
    assert max(per_layer[8]) <= 2 * max(CNN.conv_features) * 4 * len(CNN.conv_features)  # fused at most


def test_per_device_statistics_gather_nothing():
    model = ModelConfig(name=CNN.name, conv_features=CNN.conv_features, norm_statistics="per-device")
    program = compiled_program(get_layout("dp"), {"data": 8}, model, steps=4, batch_size=32, image_shape=(8, 8, 1))
    found = collectives(program.train_step.as_text(), program.mesh.size)
    assert not [c for c in found if c.kind == "all-gather"]
    # forward: the running averages; backward: scale's and bias's gradients (with the others)
    assert Counter(c.kind for c in found)["all-reduce"] <= 2 + 3


def test_evaluation_mode_set_on_the_module_normalises_by_the_running_statistics():
    ours, flax = _pair()
    x, _ = _batch()
    for bn in (ours, flax):
        bn.mean[...], bn.var[...] = jnp.full(6, 2.5), jnp.full(6, 0.3)
        bn.use_running_average = True  # as model.eval() sets it: calls without the argument evaluate
    np.testing.assert_allclose(ours(x), flax(x), rtol=1e-6)
    assert float(ours.mean[...][0]) == 2.5  # the running statistics untouched


def test_bfloat16_compute_matches_flax():
    kwargs = {"momentum": 0.9, "use_fast_variance": False, "dtype": jnp.bfloat16}
    ours, flax = BatchNorm(6, rngs=nnx.Rngs(0), **kwargs), nnx.BatchNorm(6, rngs=nnx.Rngs(0), **kwargs)
    scale = jnp.asarray(np.random.default_rng(2).normal(1, 0.2, 6), jnp.float32)
    ours.scale[...], flax.scale[...] = scale, scale
    x = jnp.asarray(np.random.default_rng(3).normal(3.0, 0.5, SHAPE), jnp.float32)
    y_ours, y_flax = ours(x, use_running_average=False), flax(x, use_running_average=False)
    assert y_ours.dtype == y_flax.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y_ours, np.float32), np.asarray(y_flax, np.float32), atol=1e-2, rtol=1e-2)
    np.testing.assert_allclose(ours.var[...], flax.var[...], rtol=1e-5)


def test_a_whole_models_gradient_under_spatial_equals_one_devices():
    """The default model under spatial data=4,spatial=2: its last block's 2 rows are whole on
    every device while its batch norm still cuts them into pieces. A sharding constraint
    that pinned the pieces to their owners once made XLA compute blocks 0 and 1's
    gradients 4x too large here -- invisible to Adam's per-step losses, which scaling leaves
    unchanged."""
    from jaxcnn.models import build_model, call, cross_entropy

    model = build_model(ModelConfig(), (8, 8, 1), seed=0)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    rng = np.random.default_rng(0)
    x, y = jnp.asarray(rng.normal(size=(64, 8, 8, 1)), jnp.float32), jnp.asarray(rng.integers(0, 10, 64))

    def grads(layout=None, mesh=None):
        def loss(params, x):
            merged = nnx.merge(graphdef, params, rest, copy=True)
            if layout is None:
                return cross_entropy(call(merged, x, train=True), y).mean()
            with activation_layout(layout, mesh):
                return cross_entropy(call(merged, x, train=True), y).mean()

        placed = x if mesh is None else jax.device_put(x, NamedSharding(mesh, P("data", "spatial")))
        return jax.jit(jax.grad(loss))(params, placed)

    expected = grads()
    found = grads(get_layout("spatial"), build_mesh({"data": 4, "spatial": 2}))
    for a, b in zip(jax.tree.leaves(found), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(jnp.abs(b).max()))
