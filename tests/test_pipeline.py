"""The pipeline: equal to one device step for step under GPipe, 1F1B and interleaved 1F1B,
gradients equal a sequential reference, each stage holding only its own parameters and (1F1B)
at most S micro-batches whatever M, the schedules' timelines, and bad settings refused."""

import dataclasses
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, TINY_BN_DROPOUT, TINY_PLAIN, bundled_digits, initialised, train_losses
from test_mesh import FakeGPU

from jaxcnn.analysis.measure import measure_layout
from jaxcnn.build import build_program
from jaxcnn.config import ModelConfig, OptimConfig, TrainConfig
from jaxcnn.data import load_csv
from jaxcnn.errors import UserError
from jaxcnn.fit import fit
from jaxcnn.models import count_params, cross_entropy
from jaxcnn.pipeline.schedule import Action, bubble_fraction, stage_orders, ticks, timeline_bubble
from jaxcnn.pipeline.split import balance, check_stages_within_processes, default_microbatches, stage_groups
from jaxcnn.sharding import build_mesh, get_layout
from jaxcnn.sharding.mesh import device_grid

STEPS = 10
PIPELINE = get_layout("pipeline")
_CACHE = {}


def pipeline_run(mesh, microbatches, model=TINY_PLAIN, steps=STEPS, schedule="gpipe", virtual=1):
    key = (tuple(mesh.items()), microbatches, model, steps, schedule, virtual)
    if key not in _CACHE:
        data = bundled_digits()
        program = build_program(
            model, OptimConfig(learning_rate=1e-2, warmup_steps=2), PIPELINE, build_mesh(mesh), data.image_shape, 32,
            steps, microbatches=microbatches, with_eval=False, pipeline_schedule=schedule, virtual_stages=virtual,
        )  # fmt: skip
        result = fit(
            program, program.init(), data, None, TrainConfig(batch_size=32, epochs=1, max_steps=steps), progress=False
        )
        _CACHE[key] = (np.asarray(result.loss_history), result.state, program)
    return _CACHE[key]


@pytest.fixture(scope="module")
def single():
    return train_losses(get_layout("single"), {"data": 1}, TINY_PLAIN, steps=STEPS)


# M = 1 (no pipelining), fewer micro-batches than stages, more
CASES = [
    (mesh, m) for s, ms in ((2, (1, 4)), (4, (2, 8))) for mesh in ({"stage": s}, {"data": 2, "stage": s}) for m in ms
]


@pytest.mark.parametrize(
    ("mesh", "microbatches"), CASES, ids=[f"{','.join(f'{k}={v}' for k, v in c.items())}-M{m}" for c, m in CASES]
)
def test_pipeline_matches_single_device(single, mesh, microbatches):
    reference, ref_state, _ = single
    losses, state, program = pipeline_run(mesh, microbatches)
    assert program.anatomy.microbatches == microbatches and len(program.anatomy.stages) == mesh["stage"]
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    # final parameters: stage s holds exactly the single-device model's layers of group s
    reference_params = {_keys(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(ref_state.params)}
    for stage, group in zip(state.stages, program.anatomy.layer_groups, strict=True):
        for path, leaf in jax.tree_util.tree_leaves_with_path(stage.params):
            np.testing.assert_allclose(
                np.asarray(leaf), np.asarray(reference_params[_global(path, group)]), rtol=1e-4, atol=1e-6
            )


def _keys(path):
    return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)


def _global(path, group):
    """A stage's ('units', k, ...) as the whole model's path: a conv block's, or a dense
    layer's (its unit holds it as `layer`)."""
    num_blocks = len(TINY_PLAIN.conv_features)
    _, k, *rest = _keys(path)
    unit = group.start + k
    return ("blocks", unit, *rest) if unit < num_blocks else ("dense", unit - num_blocks, *rest[1:])


def test_accumulated_gradients_equal_a_sequential_reference():
    """One pipeline step's gradients (S=2, M=4) against jax.grad of the whole model."""
    data = bundled_digits()
    program = build_program(
        TINY_PLAIN, OptimConfig(name="sgd", learning_rate=1.0, schedule="constant", warmup_steps=0, momentum=0.0),
        PIPELINE, build_mesh({"stage": 2}), data.image_shape, 32, 1, microbatches=4, with_eval=False,
    )  # fmt: skip
    state = program.init()
    before = [jax.tree.map(np.asarray, stage.params) for stage in state.stages]  # the step donates them
    images, labels = data.images[:32], data.labels[:32]
    x, y = program.train_input.place(images, labels)
    new_state, _ = program.train_step(state, x, y)
    # plain SGD with lr 1: new = old - grad, so grad = old - new
    pipeline_grads = [
        jax.tree.map(lambda a, b: a - np.asarray(b), old, new.params)
        for old, new in zip(before, new_state.stages, strict=True)
    ]
    from flax import nnx

    model = initialised(TINY_PLAIN, data.image_shape)  # the program's init: its weights
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
        return cross_entropy(nnx.merge(graphdef, p, rest)(jnp.asarray(images), train=True), jnp.asarray(labels)).mean()

    reference = jax.jit(jax.grad(loss))(params)
    ref_flat = [np.asarray(v) for v in jax.tree.leaves(reference)]
    pipe_flat = [v for g in pipeline_grads for v in jax.tree.leaves(g)]
    assert len(ref_flat) == len(pipe_flat)
    for a, b in zip(
        sorted(pipe_flat, key=lambda v: (v.shape, float(v.sum()))),
        sorted(ref_flat, key=lambda v: (v.shape, float(v.sum()))),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_each_stage_holds_only_its_parameters():
    _, state, program = pipeline_run({"stage": 4}, 8)
    whole = sum(program.anatomy.stage_param_bytes)
    assert whole == 4 * count_params(initialised(TINY_PLAIN, (8, 8, 1)))  # every parameter, once
    for stage, bytes_ in zip(state.stages, program.anatomy.stage_param_bytes, strict=True):
        held = sum(leaf.nbytes for leaf in jax.tree.leaves(stage.params))
        assert held == bytes_ < whole
        devices = {d for leaf in jax.tree.leaves(stage.params) for d in leaf.sharding.device_set}
        assert len(devices) == 1  # stage=4 on 4 devices: one device each
    assert len({d for s in state.stages for leaf in jax.tree.leaves(s.params) for d in leaf.sharding.device_set}) == 4
    assert program.anatomy.bubble_fraction == pytest.approx(3 / 11)
    # activations 32/8 x (4x4x8, 2x2x16, 32), forward and gradient, per step
    assert program.record["bytes_between_stages_per_step"] == 2 * 8 * 4 * 4 * (128 + 64 + 32)


def test_balanced_split_and_user_split():
    assert balance([1, 1, 1, 1], 2) == (2,)
    assert balance([10, 1, 1, 1], 2) == (1,)
    assert balance([1, 2, 3, 4, 5, 6], 3) == (3, 5)
    groups = stage_groups(ModelConfig(), (28, 28, 1), 2, (2,))
    assert groups == [range(0, 2), range(2, 6)]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"microbatches": 3}, "--microbatches 3 must divide the global batch 32"),
        ({"mesh": {"stage": 8}}, "a pipeline of 8 stages needs at least 8 layers"),
        (
            {"mesh": {"data": 4, "stage": 2}, "microbatches": 16},
            "a micro-batch of 2 (32/16) does not split over data=4",
        ),
        ({"stage_split": (3, 1)}, "--stage-split 3,1 must give 1 increasing layer indices"),
        ({"virtual_stages": 3}, "2 stages x 3 virtual stages = 6 chunks needs at least 6 layers"),
        ({"virtual_stages": 2, "pipeline_schedule": "1f1b", "microbatches": 1}, "use --microbatches a multiple of 2"),
    ],
)
def test_bad_pipeline_settings_are_refused(kwargs, message):
    mesh = kwargs.pop("mesh", {"stage": 2})
    with pytest.raises(UserError, match=message.replace("(", "\\(").replace(")", "\\)")):
        build_program(TINY_PLAIN, OptimConfig(), PIPELINE, build_mesh(mesh), (8, 8, 1), 32, 10, **kwargs)


def test_default_microbatches_keep_batch_norm_statistics_meaningful():
    assert default_microbatches(64, 4) == 4  # 2S = 8 would leave 8 images per micro-batch
    assert default_microbatches(256, 4) == 8
    assert default_microbatches(30, 2) == 1  # no divisor keeps 16+: one micro-batch
    assert default_microbatches(48, 2) == 3


@pytest.mark.parametrize("mesh", [{"stage": 2}, {"data": 2, "stage": 2}])
def test_pipeline_compare_row_measures_what_the_layer_shapes_predict(mesh):
    row = measure_layout(TINY_PLAIN, PIPELINE, mesh, (8, 8, 1), 32, microbatches=4)
    # the cut after conv 0 carries each image's pooled 4x4x8 activation forward and its gradient
    # back: 32 images, 16 a data shard
    assert row["bytes_between_stages"] == 2 * (32 // mesh.get("data", 1)) * (4 * 4 * 8) * 4
    assert row["bubble_fraction"] == pytest.approx(1 / 5)
    # measured: equal on stage=2; on data=2,stage=2 32 bytes over (73,664 vs 73,632, 0.044%):
    # the loss and accuracy scalars (4 bytes each) all-reduced for each of the 4 micro-batches,
    # which the model leaves out. 0.1% holds that and catches anything a layer's bytes wrong.
    assert row["comm_bytes"] == pytest.approx(row["comm_bytes_model"], rel=1e-3)
    assert row["param_bytes_per_device"] < 4 * count_params(initialised(TINY_PLAIN, (8, 8, 1)))  # no stage holds all


def test_train_script_runs_the_pipeline_and_records_it(tmp_path, capsys):
    from conftest import load_train_module

    record = load_train_module().main(
        ["--model", "cnn2d_2layer_fullconnected_2layer", "--conv-features", "8,16", "--dense-features", "32",
         "--batch-size", "32", "--max-steps", "3", "--quiet", "--layout", "pipeline", "--mesh", "data=4,stage=2",
         "--host-devices", "8", "--microbatches", "2", "--results-dir", str(tmp_path)]
    )  # fmt: skip
    assert record["layout"] == "pipeline" and record["mesh"] == {"data": 4, "stage": 2}
    assert record["microbatches"] == 2 and record["bubble_fraction"] == pytest.approx(1 / 3)
    assert len(record["loss_history"]) == 3
    # evaluated on the bundled test set through the stages: a count of right answers out of its images
    accuracy, images = record["test_accuracy"], len(load_csv(REPO / "data/test.csv"))
    assert 0 <= accuracy <= 1 and accuracy * images == pytest.approx(round(accuracy * images), abs=1e-3)
    assert 0 < record["test_loss"] < float("inf")
    assert "pipeline (gpipe): 2 stages x 2 micro-batches of 16" in capsys.readouterr().out


def test_remat_and_bfloat16_reach_the_pipeline_stages():
    """The stages run the model's own conv blocks, so --remat and --dtype apply there too."""
    mesh = {"data": 2, "stage": 2}
    plain = pipeline_run(mesh, 4)
    rematted = pipeline_run(mesh, 4, dataclasses.replace(TINY_PLAIN, remat="full"))
    np.testing.assert_allclose(rematted[0], plain[0], rtol=1e-5)
    bf16 = pipeline_run(mesh, 4, dataclasses.replace(TINY_PLAIN, dtype="bfloat16"))
    hlo = "\n".join(part.compiled.as_text() for stage in bf16[2].anatomy.stages for part in stage)
    assert any("bf16" in line and "convolution" in line for line in hlo.splitlines())
    np.testing.assert_allclose(bf16[0], plain[0], rtol=3e-2)
    # activations cross the stage boundary in the compute dtype: half the bytes
    sent = lambda run: run[2].record["bytes_between_stages_per_step"]  # noqa: E731
    assert sent(bf16) * 2 == sent(plain)
    assert bf16[2].pipeline.programs[1]["x_sharding"] is not None
    assert "bf16" in bf16[2].pipeline.programs[1]["last"].as_text().split("ENTRY")[1].splitlines()[0]


SCHEDULE_CASES = [("1f1b", 1, {"stage": 2}, 4), ("1f1b", 1, {"data": 2, "stage": 2}, 4),
                  ("1f1b", 2, {"stage": 2}, 4), ("gpipe", 2, {"stage": 2}, 4)]  # fmt: skip


@pytest.mark.parametrize(
    ("schedule", "virtual", "mesh", "microbatches"), SCHEDULE_CASES, ids=[f"{c[0]}-V{c[1]}" for c in SCHEDULE_CASES]
)
def test_1f1b_and_interleaved_train_like_gpipe_and_one_device(single, schedule, virtual, mesh, microbatches):
    """The same micro-batches and gradients, summed in another order: per-step losses equal
    GPipe's and one device's (rtol 1e-5); V = 2 puts two non-neighbouring chunks on each stage."""
    losses, state, program = pipeline_run(mesh, microbatches, schedule=schedule, virtual=virtual)
    gpipe = pipeline_run(mesh, microbatches)[0]
    np.testing.assert_allclose(losses, gpipe, rtol=1e-5)
    np.testing.assert_allclose(losses, single[0], rtol=1e-5)
    assert len(state.stages) == mesh["stage"] * virtual == len(program.anatomy.layer_groups)
    stage_of = [{d for leaf in jax.tree.leaves(st.params) for d in leaf.sharding.device_set} for st in state.stages]
    for c, devices in enumerate(stage_of):  # chunk c on stage c mod S
        assert devices == stage_of[c % mesh["stage"]]
    stages, m = mesh["stage"], microbatches
    assert program.anatomy.bubble_fraction == pytest.approx(bubble_fraction(stages, m, virtual))


def test_batch_norm_and_dropout_train_alike_under_gpipe_and_1f1b():
    """Every schedule runs each chunk's micro-batches in the same order (the last chunk's
    backward, which updates its running statistics, too): the same losses and statistics."""
    gpipe, one_f_one_b = (pipeline_run({"stage": 2}, 4, TINY_BN_DROPOUT, schedule=s) for s in ("gpipe", "1f1b"))
    np.testing.assert_allclose(one_f_one_b[0], gpipe[0], rtol=1e-6)
    for a, b in zip(
        *(jax.tree.leaves([st.stats for st in run[1].stages]) for run in (gpipe, one_f_one_b)), strict=True
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("virtual", [1, 2])
def test_a_step_runs_compiled_programs_and_transfers_only(monkeypatch, virtual):
    """No eager op per step (the accumulators' zeros, the step's key, the step count and the
    metrics are inside compiled programs): nothing reaches JAX's eager evaluation."""
    _, state, program = pipeline_run({"stage": 2}, 4, schedule="1f1b", virtual=virtual, steps=2)
    x, y = program.train_input.place(*(a[:32] for a in (bundled_digits().images, bundled_digits().labels)))
    eager = []
    process = jax._src.core.EvalTrace.process_primitive
    monkeypatch.setattr(
        jax._src.core.EvalTrace, "process_primitive", lambda *a, **k: eager.append(a[1].name) or process(*a, **k)
    )
    state, metrics = program.train_step(state, x, y)
    jax.block_until_ready((state, metrics))
    assert eager == [] and set(metrics) == {"loss", "accuracy"} and int(state.step) == 3


def measured_in_flight(program, monkeypatch) -> list[int]:
    """Per stage, the most bytes a device held at once of the micro-batch inputs and output
    gradients handed between chunks during one train step -- counted from jax.live_arrays()
    between the step's programs and transfers: an array handed on still counts while anything
    keeps it alive."""
    import weakref

    import jaxcnn.pipeline.schedule as schedule

    runner, handed = program.pipeline, {}  # id -> (weak reference, stage, bytes a device holds)
    kinds = {id(p[k]): c for c, p in enumerate(runner.programs) for k in ("x_sharding", "y_sharding")}
    peak = [0] * runner.stages

    def sample():
        held = [0] * runner.stages
        for a in jax.live_arrays():
            ref, stage, size = handed.get(id(a), (None, 0, 0))
            if ref is not None and ref() is a:
                held[stage] += size
        peak[:] = map(max, peak, held)

    def to_stage(x, target):
        sample()
        out = transfer(x, target)
        if id(target) in kinds:  # (not the step's key)
            stage, size = kinds[id(target)] % runner.stages, out.addressable_shards[0].data.nbytes
            handed[id(out)] = (weakref.ref(out), stage, size)
        return out

    def run(compiled, *args):
        sample()
        return runner._done(compiled(*args))

    transfer = schedule.to_stage
    monkeypatch.setattr(schedule, "to_stage", to_stage)
    monkeypatch.setattr(runner, "_run", run)
    data = bundled_digits()
    x, y = program.train_input.place(data.images[:32], data.labels[:32])
    jax.block_until_ready(runner.train_step(program.init(), x, y))
    sample()
    monkeypatch.undo()
    return peak


@pytest.mark.parametrize(("schedule", "virtual"), [("gpipe", 1), ("1f1b", 1), ("1f1b", 2)])
def test_activations_held_in_flight_follow_the_schedule(monkeypatch, schedule, virtual):
    """What each stage holds between a micro-batch's forward and its backward (inputs,
    output gradients), measured from the live arrays as a step runs -- a buffer counts until
    nothing holds it -- equals what the runner and the planner read from the timeline, in
    micro-batches: GPipe's last stage holds all M; under 1F1B a stage holds the same whatever
    M, at most S micro-batches (interleaved over V chunks a stage: S x V chunks' worth)."""
    stages = 2

    def held(m):  # per stage: its measured peak bytes / one micro-batch's bytes there
        program = pipeline_run({"stage": stages}, m, schedule=schedule, virtual=virtual, steps=2)[2]
        runner = program.pipeline
        measured = measured_in_flight(program, monkeypatch)
        assert measured == runner.peak_held_bytes == program.anatomy.stage_held_bytes
        last = len(runner.programs) - 1
        one = [0] * stages
        for c, p in enumerate(runner.programs):
            one[c % stages] = max(one[c % stages], p["x_bytes"] + (p["y_bytes"] if c < last else 0))
        return [peak / size for peak, size in zip(measured, one, strict=True)]

    four, eight = held(4), held(8)
    if schedule == "gpipe":
        assert (four[-1], eight[-1]) == (4, 8)
    else:
        assert four == eight and all(0 < n <= stages * virtual for n in eight), (four, eight)


@pytest.mark.parametrize(("schedule", "stages", "virtual", "m"), [("gpipe", 4, 1, 8), ("1f1b", 4, 1, 8),
                         ("1f1b", 4, 2, 8), ("1f1b", 2, 3, 6), ("gpipe", 3, 2, 5), ("1f1b", 4, 1, 2)])  # fmt: skip
def test_each_schedule_runs_every_action_once_in_dependency_order_with_the_formulas_bubble(
    schedule, stages, virtual, m
):
    orders = stage_orders(schedule, stages, virtual, m)
    timeline = ticks(orders, stages * virtual)
    issued = [a for tick in timeline for a in tick if a is not None]
    chunks = stages * virtual
    assert sorted(issued) == sorted(Action(k, c, i) for k in "FB" for c in range(chunks) for i in range(m))
    when = {a: t for t, tick in enumerate(timeline) for a in tick if a is not None}
    for g, order in enumerate(orders):  # each stage runs its own chunks' actions, in its order, a tick each
        assert [tick[g] for tick in timeline if tick[g] is not None] == order
        assert all(a.chunk % stages == g for a in order)
    for a in issued:
        if a.kind == "F" and a.chunk:
            assert when[Action("F", a.chunk - 1, a.microbatch)] < when[a]
        if a.kind == "B":
            assert when[Action("F", a.chunk, a.microbatch)] < when[a]
            if a.chunk < chunks - 1:
                assert when[Action("B", a.chunk + 1, a.microbatch)] < when[a]
    assert timeline_bubble(timeline) == pytest.approx(bubble_fraction(stages, m, virtual))
    if schedule == "1f1b" and virtual == 1:  # stage s: S-s-1 warm-up forwards, then one forward, one backward
        for g, order in enumerate(orders):
            warm = min(stages - g - 1, m)
            first = ["F"] * (warm + 1) + ["B"] if warm < m else ["F"] * m + ["B"]
            assert [a.kind for a in order[: len(first)]] == first


@pytest.mark.parametrize(
    ("shape", "refused"),
    [({"data": 2, "stage": 2}, None), ({"data": 1, "stage": 4}, "use at most 2 stages, the devices of one process, "
                                        "e.g. --mesh data=2,stage=2")],
)  # fmt: skip
def test_a_stage_boundary_between_processes_is_refused_naming_a_mesh_that_works(shape, refused):
    """2 processes x 2 GPUs, laid out as a run lays them out (hosts across `data` first): stages
    inside each process run (tests/test_multihost.py trains one), a boundary between them is refused."""
    grid = device_grid(shape, [FakeGPU(i, i // 2) for i in range(4)])  # [data, stage]
    mesh = SimpleNamespace(devices=grid, shape=shape, size=grid.size)
    stages = [SimpleNamespace(devices=grid[:, s]) for s in range(shape["stage"])]
    if refused is None:
        check_stages_within_processes(stages, mesh, "stage")
    else:
        with pytest.raises(
            UserError, match=f"stages 1 and 2 would hand activations from process 0 to process 1.*{refused}"
        ):
            check_stages_within_processes(stages, mesh, "stage")
