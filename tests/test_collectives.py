"""What each layout makes XLA emit, read from the compiled train step's HLO.

The programs are the ones the equivalence matrix trains (shared through conftest), so
these are the collectives of the runs proven equal to one device. Model: TINY_PLAIN on
8x8x1 digits, batch 32 (so conv 0 is 3x3x1x8, conv 1 3x3x8x16, dense 64x32 and 32x10).
"""

import numpy as np
import pytest
from conftest import TINY_BN_DROPOUT, TINY_PLAIN, compiled_program
from jax.sharding import NamedSharding

from jaxcnn.analysis.hlo import collectives, kinds_seen
from jaxcnn.analysis.lint import classify, lint_program
from jaxcnn.sharding import get_layout

BATCH = 32


def compiled(layout, mesh, model=TINY_PLAIN):
    program = compiled_program(get_layout(layout), mesh, model, steps=10)
    return program, collectives(program.train_step.as_text(), program.mesh.size)


def param_bytes(program):
    return sum(int(np.prod(p.shape)) * 4 for p in program.anatomy.placements)


def test_single_device_has_no_collectives():
    _, found = compiled("single", {"data": 1})
    assert found == []


def test_dp_one_fused_gradient_all_reduce_and_no_all_gather():
    program, found = compiled("dp", {"data": 8})
    assert kinds_seen(found) == {"all-reduce": 1}
    (grads,) = found
    assert grads.group_size == 8
    # every gradient travels in that one all-reduce, plus the loss and accuracy scalars
    assert grads.buffer_bytes == param_bytes(program) + 2 * 4
    assert len([s for s in grads.shapes if s]) == len(program.anatomy.placements)


def test_fsdp_gathers_parameters_and_reduces_gradients_to_their_owners():
    program, found = compiled("fsdp", {"data": 8})
    kinds = kinds_seen(found)
    sharded = [p for p in program.anatomy.placements if "data" in tuple(p.spec)]
    assert {p.path for p in sharded} == {"blocks/1/conv/kernel", "dense/0/kernel"}  # >= 4 KiB: FSDP threshold
    gathered = {c.shapes[0] for c in found if c.kind == "all-gather"}
    for p in sharded:
        assert p.shape in gathered, f"{p.path} is never all-gathered"
    # Gradients: a reduce-scatter on GPU/TPU; XLA:CPU emits all-reduce of the full
    # gradient + dynamic-slice instead (no ReduceScatterCreator pass) -- accept exactly one.
    if kinds["reduce-scatter"]:
        scattered = {tuple(sorted(s)) for c in found if c.kind == "reduce-scatter" for s in c.shapes}
        shards = [NamedSharding(program.mesh, p.spec).shard_shape(p.shape) for p in sharded]
        assert all(tuple(sorted(shard)) in scattered for shard in shards)
    else:
        reduced = {tuple(sorted(s)) for c in found if c.kind == "all-reduce" for s in c.shapes}
        assert all(tuple(sorted(p.shape)) in reduced for p in sharded)
    assert kinds["collective-permute"] == 0 and kinds["all-to-all"] == 0
    # the point of FSDP: parameter bytes per device fall by the sharded tensors' (N-1)/N
    dp_program, _ = compiled("dp", {"data": 8})
    saved = sum(int(np.prod(p.shape)) * 4 * 7 // 8 for p in sharded)
    assert (
        sum(p.bytes_per_device for p in dp_program.anatomy.placements)
        - sum(p.bytes_per_device for p in program.anatomy.placements)
        == saved
    )


@pytest.mark.parametrize(("layout", "mesh"), [("tp", {"model": 2}), ("hybrid", {"data": 4, "model": 2})])
def test_tp_column_row_pairs_all_reduce_partial_sums_never_all_gather_activations(layout, mesh):
    _, found = compiled(layout, mesh)
    local_batch = BATCH // mesh.get("data", 1)
    assert kinds_seen(found)["all-gather"] == 0
    # the row conv (block 1) ends in an all-reduce of its output over `model`
    row_outputs = [c for c in found if c.kind == "all-reduce" and (local_batch, 4, 4, 16) in c.shapes]
    assert row_outputs and all(c.group_size == mesh["model"] for c in row_outputs)
    # with batch norm, the only gathers are of the replicated `norm` vectors; (when the
    # batch is split) its statistics are all-reduced, never gathered
    bn_program, bn_found = compiled(layout, mesh, TINY_BN_DROPOUT)
    roles = classify(bn_found, bn_program.anatomy.placements, bn_program.mesh)
    gathers = [(c, r) for c, r in zip(bn_found, roles, strict=True) if c.kind == "all-gather"]
    assert gathers and all(role != "statistics" and len(c.shapes[0]) == 1 for c, role in gathers)
    statistics = [c for c, role in zip(bn_found, roles, strict=True) if role == "statistics"]
    assert all(c.kind == "all-reduce" for c in statistics)
    assert bool(statistics) == ("data" in mesh)


def test_spatial_exchanges_one_halo_row_with_neighbours():
    _, found = compiled("spatial", {"data": 4, "spatial": 2})
    halos = [c for c in found if c.kind == "collective-permute"]
    assert halos
    for c in halos:
        (shape,) = c.shapes
        assert shape[0] == BATCH // 4 and shape[1] == 1  # local batch, one row of height
        assert c.group_size == 2


@pytest.mark.parametrize(
    ("layout", "mesh"),
    [
        ("single", {"data": 1}),
        ("dp", {"data": 8}),
        ("fsdp", {"data": 8}),
        ("tp", {"model": 2}),
        ("hybrid", {"data": 4, "model": 2}),
        ("spatial", {"data": 4, "spatial": 2}),
    ],
)
@pytest.mark.parametrize("model", [TINY_PLAIN, TINY_BN_DROPOUT], ids=["plain", "bn_dropout"])
def test_lint_finds_no_unexpected_collective(layout, mesh, model):
    program = compiled_program(get_layout(layout), mesh, model, steps=10)
    report = lint_program(program)
    assert bool(report.collectives) == (layout != "single")  # it read the step's collectives: none is vacuous
    assert not [w for w in report.warnings if "did not expect" in w], report.warnings
