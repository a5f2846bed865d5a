"""GPipe: equal to one device step for step, gradients equal a sequential reference, each
stage holding only its own parameters, and bad pipeline settings refused."""

import dataclasses
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, TINY_PLAIN, bundled_digits, initialised, train_losses
from test_mesh import FakeGPU

from jaxcnn.analysis.measure import measure_layout
from jaxcnn.build import build_program
from jaxcnn.config import ModelConfig, OptimConfig, TrainConfig
from jaxcnn.data import load_csv
from jaxcnn.errors import UserError
from jaxcnn.fit import fit
from jaxcnn.models import count_params, cross_entropy
from jaxcnn.pipeline.split import balance, check_stages_within_processes, default_microbatches, stage_groups
from jaxcnn.sharding import build_mesh, get_layout
from jaxcnn.sharding.mesh import device_grid

STEPS = 10
PIPELINE = get_layout("pipeline")
_CACHE = {}


def pipeline_run(mesh, microbatches, model=TINY_PLAIN, steps=STEPS):
    key = (tuple(mesh.items()), microbatches, model, steps)
    if key not in _CACHE:
        data = bundled_digits()
        program = build_program(
            model, OptimConfig(learning_rate=1e-2, warmup_steps=2), PIPELINE, build_mesh(mesh), data.image_shape, 32,
            steps, microbatches=microbatches, with_eval=False,
        )  # fmt: skip
        result = fit(
            program, program.init(), data, None, TrainConfig(batch_size=32, epochs=1, max_steps=steps), progress=False
        )
        _CACHE[key] = (np.asarray(result.loss_history), result.state, program)
    return _CACHE[key]


@pytest.fixture(scope="module")
def single():
    return train_losses(get_layout("single"), {"data": 1}, TINY_PLAIN, steps=STEPS)


CASES = [(mesh, m) for s in (2, 4) for mesh in ({"stage": s}, {"data": 2, "stage": s}) for m in (1, 2, 4, 8)]


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
    assert "pipeline: 2 stages x 2 micro-batches of 16" in capsys.readouterr().out


def test_remat_and_bfloat16_reach_the_pipeline_stages():
    """The stages run the model's own conv blocks, so --remat and --dtype apply there too."""
    mesh = {"data": 2, "stage": 2}
    plain = pipeline_run(mesh, 2)
    rematted = pipeline_run(mesh, 2, dataclasses.replace(TINY_PLAIN, remat="full"))
    np.testing.assert_allclose(rematted[0], plain[0], rtol=1e-5)
    bf16 = pipeline_run(mesh, 2, dataclasses.replace(TINY_PLAIN, dtype="bfloat16"))
    hlo = "\n".join(part.compiled.as_text() for stage in bf16[2].anatomy.stages for part in stage)
    assert any("bf16" in line and "convolution" in line for line in hlo.splitlines())
    np.testing.assert_allclose(bf16[0], plain[0], rtol=3e-2)


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
