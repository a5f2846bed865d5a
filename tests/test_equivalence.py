"""Every layout computes what one device computes.

The matrix: each layout x (a plain model, a batch-norm + dropout model) x two mesh
shapes, 10 training steps on the bundled digits against `single`: per-step losses within
rtol 1e-5 (fp32), final parameters allclose, batch-norm running statistics allclose.
Same seed -> same dropout masks on every layout (jax_threefry_partitionable makes random
bits independent of how the array is split).
"""

import functools

import jax
import numpy as np
import pytest
from conftest import TINY_BN_DROPOUT, TINY_PLAIN, load_script, train_losses

from jaxcnn.sharding import get_layout, parse_rules

STEPS = 10
MODELS = {"plain": TINY_PLAIN, "bn_dropout": TINY_BN_DROPOUT}
# fsdp and tp together on a 3-axis mesh: only a rules table, no new code
FSDP_TP_RULES = "batch=data+fsdp,params=fsdp,conv_out=model,mlp=model"

MESHES = [
    ("dp", {"data": 8}),
    ("dp", {"data": 2}),
    ("fsdp", {"data": 8}),
    ("fsdp", {"data": 4}),
    ("tp", {"model": 2}),
    ("tp", {"model": 4}),
    ("hybrid", {"data": 4, "model": 2}),
    ("hybrid", {"data": 2, "model": 4}),
    ("spatial", {"data": 4, "spatial": 2}),
    ("spatial", {"data": 2, "spatial": 4}),
    (FSDP_TP_RULES, {"data": 2, "fsdp": 2, "model": 2}),
]


def layout_named(name):
    return parse_rules(name, "fsdp+tp") if "=" in name else get_layout(name)


@functools.cache
def single_run(model_name):
    return train_losses(get_layout("single"), {"data": 1}, MODELS[model_name], steps=STEPS)


def _mesh_id(mesh):
    return ",".join(f"{k}={v}" for k, v in mesh.items())


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize(("layout_name", "mesh"), MESHES, ids=[f"{n.split(',')[0]}-{_mesh_id(m)}" for n, m in MESHES])
def test_layout_matches_single_device(layout_name, mesh, model_name):
    reference, ref_state, _ = single_run(model_name)
    losses, state, program = train_losses(layout_named(layout_name), mesh, MODELS[model_name], steps=STEPS)

    assert program.mesh.size == int(np.prod(list(mesh.values())))
    assert len(losses) == STEPS and np.all(np.isfinite(losses))
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    stats, ref_stats = jax.tree.leaves(state.model_state), jax.tree.leaves(ref_state.model_state)
    blocks = len(MODELS[model_name].conv_features)
    assert len(stats) == (2 * blocks if model_name == "bn_dropout" else 0)  # mean, var per BN layer
    for a, b in zip(stats, ref_stats, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_the_layouts_really_split_something():
    """Guards the matrix against passing because nothing was sharded."""
    _, state, _ = train_losses(get_layout("tp"), {"model": 2}, TINY_PLAIN, steps=STEPS)
    specs = {tuple(leaf.sharding.spec) for leaf in jax.tree.leaves(state.params)}
    assert any("model" in spec for spec in specs)
    _, state, _ = train_losses(get_layout("fsdp"), {"data": 8}, TINY_PLAIN, steps=STEPS)
    adam_mu = jax.tree.leaves(state.opt_state)
    assert any("data" in tuple(leaf.sharding.spec) for leaf in adam_mu if leaf.ndim >= 2)


def test_dropout_is_active_and_seeded():
    """The bn_dropout rows would prove little if dropout did nothing."""
    from dataclasses import replace

    without = train_losses(get_layout("single"), {"data": 1}, replace(TINY_BN_DROPOUT, dropout=0.0), steps=STEPS)[0]
    assert not np.allclose(without, single_run("bn_dropout")[0])


# The default model (32/64/128 channels) at 24x24x3, batch 48, on odd device counts: a
# part of experiments/check_layouts.py's realistic set (all of it: results/).
REALISTIC_MESHES = [("dp", "data=3"), ("fsdp", "data=3"), ("tp", "model=2"), ("hybrid", "data=3,model=2"),
                    ("spatial", "data=3,spatial=2")]  # fmt: skip


@pytest.fixture(scope="module")
def realistic_rows():
    script = load_script("check_layouts")
    table = [("cnn2d_3layer_fullconnected_3layer", "24x24x3", 48, layout, mesh) for layout, mesh in REALISTIC_MESHES]
    cases = script.realistic_cases([get_layout(name) for name, _ in REALISTIC_MESHES], table)
    return {row["layout"]: row for row in script.check(cases, steps=4, lr=1e-2, seed=0, free_running=False)}


@pytest.mark.parametrize(("layout_name", "mesh"), REALISTIC_MESHES, ids=[f"{n}-{m}" for n, m in REALISTIC_MESHES])
def test_layout_matches_single_step_by_step_at_a_realistic_size(realistic_rows, layout_name, mesh):
    """From single's exact state at every step, on the same batch: the layout's loss within
    rtol 1e-5, and its gradient within 1e-5 of the largest entry in all steps but at most
    one. A step may differ by ~1e-3 where a pool window's two largest inputs tie to within
    float32 rounding and the layout's summation order picks the other (both are right; see
    experiments/check_layouts.py). A wrong gradient -- the old pool's -- differs by ~1 at
    every step."""
    row = realistic_rows[layout_name]
    assert row["mesh"] == mesh and row["steps"] == 4
    assert row["step_rel_loss_diff"] <= 1e-5
    assert row["kink_steps"] <= 1 and row["step_rel_grad_diff"] < 1e-2
    assert row["count_all_reduce"] > 0  # the layout really split the work: gradients or partial sums reduced
