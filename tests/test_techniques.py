"""Training techniques keep their promises under the layouts (issue: remat, gradient
accumulation, mixed precision, batch / learning-rate scaling, sync vs async updates).

Equivalences are checked under dp and hybrid (data=4, model=2) on the bundled digits:
per-step losses within rtol 1e-5 of the reference, final parameters allclose.
"""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_BN_DROPOUT, TINY_PLAIN, bundled_digits, compiled_program, train_losses
from flax import nnx

from jaxcnn.analysis.hlo import collectives
from jaxcnn.analysis.measure import measure_layout
from jaxcnn.autobatch import largest_batch
from jaxcnn.build import build_program
from jaxcnn.config import ModelConfig, OptimConfig, TrainConfig, UpdateConfig, epoch_steps
from jaxcnn.data import train_batches
from jaxcnn.errors import UserError
from jaxcnn.fit import fit
from jaxcnn.models import build_model
from jaxcnn.optim import make_schedule, optim_for_batch
from jaxcnn.sharding import build_mesh, get_layout
from jaxcnn.steps import StepContext, loss_and_grads, split_model

STEPS = 10
LAYOUTS = [("dp", {"data": 8}), ("hybrid", {"data": 4, "model": 2})]
IDS = ["dp", "hybrid"]
BN = dataclasses.replace(TINY_BN_DROPOUT, dropout=0.0)  # dropout masks depend on the batch's shape
SGD = OptimConfig(name="sgd", momentum=0.9, learning_rate=0.05, schedule="constant", warmup_steps=0)


def assert_same_training(a, b):
    (losses_a, state_a, _), (losses_b, state_b, _) = a, b
    np.testing.assert_allclose(losses_a, losses_b, rtol=1e-5)
    for x, y in zip(jax.tree.leaves(state_a.params), jax.tree.leaves(state_b.params), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-6)


# --- gradient accumulation ------------------------------------------------------------------


@pytest.mark.parametrize(("layout", "mesh"), LAYOUTS, ids=IDS)
def test_grad_accumulation_equals_one_big_step(layout, mesh):
    plain = train_losses(get_layout(layout), mesh, TINY_PLAIN, steps=STEPS)
    accumulated = train_losses(get_layout(layout), mesh, TINY_PLAIN, steps=STEPS, update=UpdateConfig(grad_accum=4))
    assert_same_training(accumulated, plain)


def test_grad_accumulation_with_batch_norm_sees_the_same_micro_batches_on_every_layout():
    """Batch-norm statistics are per micro-batch, so the micro-batches must be the same
    images whatever the data-axis size (UpdateRule.batch_order)."""
    update = UpdateConfig(grad_accum=2)
    reference = train_losses(get_layout("single"), {"data": 1}, BN, steps=STEPS, update=update)
    for layout, mesh in LAYOUTS:
        assert_same_training(train_losses(get_layout(layout), mesh, BN, steps=STEPS, update=update), reference)
    # and accumulation with batch norm is really per micro-batch, not the big batch
    assert not np.allclose(reference[0], train_losses(get_layout("single"), {"data": 1}, BN, steps=STEPS)[0])


@pytest.mark.parametrize(("layout", "mesh"), LAYOUTS, ids=IDS)
def test_grad_accumulation_reduces_gradients_once_per_step(layout, mesh):
    k = 4
    program = compiled_program(get_layout(layout), mesh, TINY_PLAIN, STEPS, update=UpdateConfig(grad_accum=k))
    found = collectives(program.train_step.as_text(), program.mesh.size)
    over_data = [c for c in found if c.kind == "all-reduce" and c.group_size == mesh["data"]]
    gradient_bytes = sum(p.bytes_per_device for p in program.anatomy.compute_placements)
    assert over_data and all(c.repeats == 1 for c in over_data), [(c.shapes, c.repeats) for c in over_data]
    # the gradients once (+ the loss and accuracy scalars), not K times
    assert gradient_bytes <= sum(c.step_bytes for c in over_data) <= gradient_bytes + 64
    if layout == "hybrid":  # tensor-parallel partial sums are per micro-batch: inside the loop
        over_model = [c for c in found if c.group_size == mesh["model"]]
        assert over_model and all(c.repeats == k for c in over_model)


def _loop_carried_shapes(hlo_text: str) -> list[tuple[int, ...]]:
    """Every array a compiled program's while loops carry from one iteration to the next."""
    shapes = []
    for line in hlo_text.splitlines():
        if re.search(r"= \(.*\) while\(", line):
            carried = line.split(" while(")[0]
            shapes += [tuple(int(d) for d in dims.split(",") if d) for dims in re.findall(r"f32\[([0-9,]*)\]", carried)]
    return shapes


def test_fsdp_accumulation_keeps_parameters_and_gradients_sharded():
    """FSDP under gradient accumulation: the micro-batch loop carries each split parameter
    and its gradient accumulator as 1/8 shards (never whole), gathers the parameter and
    reduce-scatters its gradient once a micro-batch, and trains as fsdp without accumulation."""
    k, mesh = 4, {"data": 8}
    program = compiled_program(get_layout("fsdp"), mesh, TINY_PLAIN, STEPS, update=UpdateConfig(grad_accum=k))
    text = program.train_step.as_text()
    split = [p for p in program.anatomy.placements if "data" in p.spec]
    assert split
    carried = _loop_carried_shapes(text)
    for p in split:
        dim = list(p.spec).index("data")
        shard = tuple(n // 8 if i == dim else n for i, n in enumerate(p.shape))
        assert p.shape not in carried, f"{p.path}: carried whole"
        assert carried.count(shard) >= 2, f"{p.path}: the parameter's and the accumulator's shards"
    split_bytes = sum(math.prod(p.shape) * 4 for p in split)
    found = collectives(text, program.mesh.size)
    scattered = [c for c in found if c.kind == "reduce-scatter"]
    assert scattered and all(c.repeats == k for c in scattered)
    assert sum(c.buffer_bytes for c in scattered) == split_bytes  # each split gradient, whole before the scatter
    assert not [
        c for c in found if c.kind == "all-reduce" and c.buffer_bytes >= min(math.prod(p.shape) * 4 for p in split)
    ]
    plain = train_losses(get_layout("fsdp"), mesh, TINY_PLAIN, steps=STEPS)
    assert_same_training(
        train_losses(get_layout("fsdp"), mesh, TINY_PLAIN, steps=STEPS, update=UpdateConfig(grad_accum=k)), plain
    )


# --- rematerialisation ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "mesh", "remat"), [("dp", {"data": 8}, "full"), ("dp", {"data": 8}, "dots"), ("hybrid", {"data": 4, "model": 2}, "names")]
)  # fmt: skip
def test_remat_leaves_training_unchanged(layout, mesh, remat):
    base = train_losses(get_layout(layout), mesh, TINY_BN_DROPOUT, steps=STEPS)
    rematted = train_losses(get_layout(layout), mesh, dataclasses.replace(TINY_BN_DROPOUT, remat=remat), steps=STEPS)
    assert_same_training(rematted, base)
    for a, b in zip(jax.tree.leaves(rematted[1].model_state), jax.tree.leaves(base[1].model_state), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_full_remat_trades_temp_memory_for_flops():
    """Widths growing 4x per block keep each block's activation bytes equal (the pool
    quarters the area), so what the blocks keep for the backward pass outweighs one
    block's backward working set -- the case remat is for. (Where widths only double, the
    first block's working set sets the peak and remat saves little: docs/training-techniques.md, Remat.)"""
    config = ModelConfig(name="cnn2d_3layer_fullconnected_2layer", conv_features=(8, 32, 128), dense_features=(32,))
    rows = {
        remat: measure_layout(
            dataclasses.replace(config, remat=remat), get_layout("single"), {"data": 1}, (64, 64, 3), 8
        )
        for remat in ("none", "full")
    }
    assert rows["full"]["temp_bytes_per_device"] < 0.8 * rows["none"]["temp_bytes_per_device"]
    assert rows["full"]["flops_per_device"] > 1.1 * rows["none"]["flops_per_device"]  # the forward, again


# --- mixed precision --------------------------------------------------------------------------


def test_bfloat16_computes_in_bf16_and_keeps_fp32_state():
    bf16 = dataclasses.replace(TINY_PLAIN, dtype="bfloat16")
    losses, state, program = train_losses(get_layout("dp"), {"data": 8}, bf16, steps=STEPS)
    reference = train_losses(get_layout("dp"), {"data": 8}, TINY_PLAIN, steps=STEPS)[0]
    assert {leaf.dtype for leaf in jax.tree.leaves((state.params, state.opt_state)) if leaf.ndim} == {
        jnp.dtype("float32")
    }
    hlo = program.train_step.as_text()
    assert any("bf16" in line and "convolution" in line for line in hlo.splitlines())
    np.testing.assert_allclose(losses, reference, rtol=3e-2)  # bf16 keeps ~3 significant digits
    assert not np.allclose(losses, reference, rtol=1e-6)


# --- synchronous vs asynchronous --------------------------------------------------------------


@pytest.mark.parametrize(("layout", "mesh"), LAYOUTS, ids=IDS)
def test_local_sgd_averaging_every_step_is_synchronous_sgd(layout, mesh):
    """SGD's update is linear in the gradient, so averaging the replicas' parameters after
    each step is averaging their gradients before it."""
    sync = train_losses(get_layout(layout), mesh, TINY_PLAIN, steps=STEPS, optim=SGD)
    local = train_losses(
        get_layout(layout), mesh, TINY_PLAIN, steps=STEPS, optim=SGD, update=UpdateConfig(sync="local-sgd")
    )
    replicas = mesh["data"]
    assert all(leaf.shape[0] == replicas for leaf in jax.tree.leaves(local[1].params))
    consensus = local[1]._replace(params=jax.tree.map(lambda x: x[0], local[1].params))
    assert_same_training((local[0], consensus, None), sync)


def test_local_sgd_communicates_only_when_replicas_meet():
    update = UpdateConfig(sync="local-sgd", sync_every=4)
    program = compiled_program(get_layout("dp"), {"data": 8}, TINY_PLAIN, STEPS, optim=SGD, update=update)
    param_bytes = sum(p.bytes_per_device for p in program.anatomy.placements)
    step = collectives(program.train_step.as_text(), 8)
    assert sum(c.step_bytes for c in step) <= 16  # the loss and accuracy scalars; no gradients
    average = collectives(program.averaging.average.as_text(), 8)
    assert sum(c.step_bytes for c in average if c.kind == "all-reduce") >= param_bytes
    # and the replicas really drift apart between meetings
    local = train_losses(get_layout("dp"), {"data": 8}, TINY_PLAIN, steps=STEPS, optim=SGD, update=update)[0]
    sync = train_losses(get_layout("dp"), {"data": 8}, TINY_PLAIN, steps=STEPS, optim=SGD)[0]
    assert not np.allclose(local[4:], sync[4:], rtol=1e-4)


@pytest.mark.parametrize("staleness", [0, 2])
@pytest.mark.parametrize(("layout", "mesh"), LAYOUTS, ids=IDS)
def test_stale_gradients_follow_the_delayed_update_rule(layout, mesh, staleness):
    """p[k+1] = p[k] - lr * grad(p[k-T]; batch k), against a loop written out by hand."""
    optim = OptimConfig(name="sgd", momentum=0.0, learning_rate=0.1, schedule="constant", warmup_steps=0)
    update = UpdateConfig(staleness=staleness)
    losses, state, _ = train_losses(get_layout(layout), mesh, TINY_PLAIN, steps=STEPS, optim=optim, update=update)

    single = compiled_program(get_layout("single"), {"data": 1}, TINY_PLAIN, STEPS, optim=optim)
    graphdef = split_model(nnx.eval_shape(lambda: build_model(TINY_PLAIN, bundled_digits().image_shape, 0)))[0]
    context = StepContext(graphdef, None, single.mesh, single.layout, None)
    grad = jax.jit(lambda p, ms, x, y: loss_and_grads(context, p, ms, jax.random.key(0), x, y))
    start = single.init()
    history, model_state, expected = [start.params], start.model_state, []
    for k, (x, y) in zip(range(STEPS), train_batches(bundled_digits(), 32, 0, 0), strict=False):
        loss, _, model_state, g = grad(history[max(k - staleness, 0)], model_state, x, y)
        history.append(jax.tree.map(lambda p, d: p - 0.1 * d, history[-1], g))
        expected.append(float(loss))
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(history[-1]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


def test_update_rules_that_do_not_fit_are_refused():
    with pytest.raises(UserError, match="splits the batch but not the parameters"):
        compiled_program(get_layout("fsdp"), {"data": 8}, TINY_PLAIN, STEPS, update=UpdateConfig(sync="local-sgd"))
    with pytest.raises(UserError, match="does not split into 8 data shards x 3 micro-batches"):
        compiled_program(get_layout("dp"), {"data": 8}, TINY_PLAIN, STEPS, update=UpdateConfig(grad_accum=3))
    with pytest.raises(UserError, match="use it with --sync allreduce"):
        UpdateConfig(sync="local-sgd", staleness=1)


# --- batch size and learning rate -------------------------------------------------------------


def test_linear_scaling_rule_and_its_warmup():
    base = OptimConfig(learning_rate=0.1, warmup_steps=10, schedule="constant")
    scaled = optim_for_batch(base, TrainConfig(batch_size=256, lr_scaling="linear", base_batch=64), 256)
    assert scaled.learning_rate == pytest.approx(0.4) and scaled.warmup_from == pytest.approx(0.1)
    schedule = make_schedule(scaled, 100)
    assert float(schedule(0)) == pytest.approx(0.1) and float(schedule(10)) == pytest.approx(0.4)
    assert float(schedule(5)) == pytest.approx(0.25)  # gradual: linear from the base rate
    assert optim_for_batch(base, TrainConfig(batch_size=64), 64) is base
    with pytest.raises(UserError, match="needs --base-batch"):
        TrainConfig(lr_scaling="linear")


def test_batch_schedule_grows_the_batch_with_one_program_per_size():
    config = TrainConfig(epochs=3, batch_schedule=((0, 32), (2, 64)))
    data = bundled_digits()
    assert config.batch_sizes == (32, 64) and config.batch_size == 32
    assert epoch_steps(len(data), config) == [len(data) // 32, len(data) // 32, len(data) // 64]
    programs = {
        b: compiled_program(get_layout("dp"), {"data": 8}, TINY_PLAIN, 100, batch_size=b, optim=optim_for_batch(SGD, config, b))
        for b in config.batch_sizes
    }  # fmt: skip
    assert optim_for_batch(SGD, config, 64).learning_rate == pytest.approx(2 * SGD.learning_rate)
    result = fit(programs, programs[32].init(), data, None, config, progress=False)
    assert [row["global_batch_size"] for row in result.epochs] == [32, 32, 64]
    assert result.steps == sum(epoch_steps(len(data), config)) and np.all(np.isfinite(result.loss_history))
    with pytest.raises(UserError, match="must start at epoch 0"):
        TrainConfig(batch_schedule=((1, 32),))


def test_largest_batch_search_brackets_and_bisects():
    calls = []

    def peak(batch):
        calls.append(batch)
        return 1000 + 10 * batch

    found = largest_batch(peak, 1000 + 10 * 200, multiple=8, limit=10_000)
    assert found.batch_size == 200 and found.peak_bytes == 3000
    assert len(calls) <= 2 * 11  # doubling then bisection, not a scan
    with pytest.raises(UserError, match="even a global batch of 8"):
        largest_batch(peak, 1000, multiple=8, limit=10_000)


def test_auto_batch_reads_compiled_memory():
    """The answer's compiled step fits; the next allowed batch's does not."""
    from jaxcnn.analysis.cost import auto_batch, step_cost

    layout, mesh = get_layout("dp"), build_mesh({"data": 8})

    def peak(batch):  # the train step alone, as the search compiles it (the compile cache shares it)
        program = build_program(TINY_PLAIN, OptimConfig(), layout, mesh, (8, 8, 1), batch, 1000, with_eval=False,
                                with_init=False)  # fmt: skip
        return step_cost(program.train_step, program.abstract_state, 8).peak_bytes

    budget = (peak(64) + peak(72)) // 2
    found = auto_batch(TINY_PLAIN, OptimConfig(), layout, mesh, (8, 8, 1), UpdateConfig(), budget, 1000)
    assert found.batch_size == 64 and found.peak_bytes <= budget
