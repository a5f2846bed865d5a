"""The HLO collective parser and the analytic model, on real compiled programs.

Hand-computed for TINY_PLAIN (conv 3x3x1x8 + bias, conv 3x3x8x16 + bias, dense 64x32 + bias,
dense 32x10 + bias: 80 + 1,168 + 2,080 + 330 = 3,658 parameters, 14,632 bytes) on 8x8x1
digits, batch 32.
"""

import pytest
from conftest import TINY_BN_DROPOUT, TINY_PLAIN, compiled_program
from flax import nnx

from jaxcnn.analysis.comm_model import comm_terms, summarise
from jaxcnn.analysis.cost import step_cost
from jaxcnn.analysis.hlo import collective_summary, collectives
from jaxcnn.config import ModelConfig
from jaxcnn.models import build_model, count_params
from jaxcnn.sharding import get_layout

PARAM_BYTES = 4 * count_params(nnx.eval_shape(lambda: build_model(TINY_PLAIN, (8, 8, 1), seed=0)))  # float32


def cost_of(layout, mesh, model=TINY_PLAIN, image_shape=None, batch_size=32):
    program = compiled_program(
        get_layout(layout), mesh, model, steps=10, batch_size=batch_size, image_shape=image_shape
    )
    return program, step_cost(program.train_step, program.abstract_state, program.mesh.size)


def test_dp_counts_and_bytes_match_hand_computation():
    _, cost = cost_of("dp", {"data": 8})
    summary = collective_summary(cost.collectives)
    assert summary["all-reduce"]["count"] == 1
    assert summary["all-reduce"]["buffer_bytes"] == PARAM_BYTES + 2 * 4  # gradients + loss, accuracy
    assert summary["all-reduce"]["wire_bytes"] == pytest.approx(2 * 7 / 8 * (PARAM_BYTES + 8))
    assert all(summary[k]["count"] == 0 for k in summary if k != "all-reduce")
    assert (
        cost.param_bytes == PARAM_BYTES and cost.optimizer_bytes == 2 * PARAM_BYTES + 8
    )  # Adam mu, nu + two int32 step counts
    # the backward pass costs about twice the forward: between 2x and 4x the forward's
    # multiply-adds (x2 flops) of the local batch of 4
    forward = 2 * 4 * (8 * 8 * 9 * 1 * 8 + 4 * 4 * 9 * 8 * 16 + 64 * 32 + 32 * 10)
    assert 2 * forward < cost.flops < 4 * forward and cost.temp_bytes > 0


def test_tp_partial_sums_match_hand_computation():
    _, cost = cost_of("tp", {"model": 2})
    reduces = sorted((c.shapes[0], c.buffer_bytes, c.group_size) for c in cost.collectives)
    assert reduces == [
        ((32, 4, 4, 16), 32 * 4 * 4 * 16 * 4, 2),  # row conv (block 1) output, forward
        ((32, 10), 32 * 10 * 4, 2),  # row dense (classifier) output, forward
        ((32, 64), 32 * 64 * 4, 2),  # column dense input gradient, backward
    ]


def test_fsdp_gathers_are_whole_tensors():
    _, cost = cost_of("fsdp", {"data": 8})
    gathers = sorted((c.shapes[0], c.buffer_bytes) for c in cost.collectives if c.kind == "all-gather")
    assert gathers == [((3, 3, 8, 16), 3 * 3 * 8 * 16 * 4), ((64, 32), 64 * 32 * 4)]


def test_spatial_halo_rows_match_hand_computation():
    _, cost = cost_of("spatial", {"data": 4, "spatial": 2})
    halos = sorted(c.buffer_bytes for c in cost.collectives if c.kind == "collective-permute")
    # local batch 8: conv 0's input row 8x1x8x1 (forward + weight gradient, each way),
    # conv 1's input row 8x1x4x8 likewise and its output-gradient row 8x1x4x16 (each way)
    assert halos == sorted([8 * 8 * 1 * 4] * 4 + [8 * 4 * 8 * 4] * 4 + [8 * 4 * 16 * 4] * 2)


GPU_HLO = """
  %ags = (f32[4,8]{1,0}, f32[32,8]{1,0}) all-gather-start(f32[4,8]{1,0} %p), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %agd = f32[32,8]{1,0} all-gather-done((f32[4,8]{1,0}, f32[32,8]{1,0}) %ags)
  %ars = f32[1024]{0} all-reduce-start(f32[1024]{0} %x), channel_id=2, replica_groups=[1,8]<=[8], to_apply=%add
  %ard = f32[1024]{0} all-reduce-done(f32[1024]{0} %ars)
  %cps = (bf16[2,8]{1,0}, bf16[2,8]{1,0}, u32[], u32[]) collective-permute-start(bf16[2,8]{1,0} %h), source_target_pairs={{0,1},{1,0}}
  %rs = f32[16]{0} reduce-scatter(f32[128]{0} %g), channel_id=3, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
"""


def test_gpu_async_forms_are_counted_once_with_their_outputs():
    found = collectives(GPU_HLO, 8)
    assert [(c.kind, c.group_size, c.buffer_bytes) for c in found] == [
        ("all-gather", 8, 32 * 8 * 4),  # the gathered output, not the shard
        ("all-reduce", 8, 1024 * 4),
        ("collective-permute", 2, 2 * 8 * 2),  # bf16, without the u32 contexts
        ("reduce-scatter", 4, 16 * 4 * 4),  # buffer = the unscattered input
    ]
    assert found[3].wire_bytes == pytest.approx(3 / 4 * 256)


MODEL_CASES = [
    ("dp", {"data": 8}, TINY_PLAIN),
    ("dp", {"data": 8}, TINY_BN_DROPOUT),
    ("fsdp", {"data": 8}, TINY_PLAIN),
    ("tp", {"model": 2}, TINY_PLAIN),
    ("hybrid", {"data": 4, "model": 2}, TINY_PLAIN),
    ("spatial", {"data": 4, "spatial": 2}, TINY_BN_DROPOUT),
]


@pytest.mark.parametrize(("layout", "mesh", "model"), MODEL_CASES, ids=[f"{c[0]}-{c[2].norm}" for c in MODEL_CASES])
def test_analytic_model_agrees_with_the_compiled_program(layout, mesh, model):
    program, cost = cost_of(layout, mesh, model)
    compute = {p.path: p.bytes_per_device for p in program.anatomy.compute_placements}
    modelled = summarise(comm_terms(model, (8, 8, 1), 32, program.layout, mesh, program.anatomy.placements, compute))
    # exact: every case measured byte for byte equal (so even the 8-byte loss-and-accuracy
    # all-reduce, 0.05% of dp's total, would show if the model dropped it)
    assert cost.comm_bytes() == modelled["total"]
    if layout == "spatial":
        assert cost.comm_bytes("collective-permute") == modelled["collective-permute"]


def test_spatial_halo_model_on_larger_images():
    model = ModelConfig(name="cnn2d_3layer_fullconnected_2layer", conv_features=(8, 16, 16), dense_features=(32,))
    program, cost = cost_of("spatial", {"data": 2, "spatial": 4}, model, image_shape=(32, 32, 3), batch_size=8)
    compute = {p.path: p.bytes_per_device for p in program.anatomy.compute_placements}
    modelled = summarise(
        comm_terms(
            model, (32, 32, 3), 8, program.layout, {"data": 2, "spatial": 4}, program.anatomy.placements, compute
        )
    )
    assert cost.comm_bytes("collective-permute") == modelled["collective-permute"]  # 34,816 bytes, exact
    assert cost.comm_bytes() == modelled["total"]  # 104,432 bytes, exact
