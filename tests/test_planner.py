"""The planner keeps what fits and ranks it; the scaling verdict says plainly when to stop."""

import dataclasses

import pytest
from conftest import TINY_PLAIN

from jaxcnn.analysis.cluster_clock import TREE_NET_HOP, collective_seconds, step_comm
from jaxcnn.analysis.hardware import RESNET50_IMAGES_PER_SECOND, RESNET50_TRAIN_FLOPS_PER_IMAGE, get_profile
from jaxcnn.analysis.hlo import Collective, kernel_count, spanned_axes
from jaxcnn.analysis.planner import (
    across_hosts_of,
    candidates_for,
    comm_seconds,
    explain,
    plan,
    price,
    rank,
)
from jaxcnn.analysis.verdicts import step_verdicts, verdict
from jaxcnn.config import ModelConfig, parse_bytes
from jaxcnn.errors import UserError

# dense-heavy, so parameters + Adam state (not activations) decide what fits
WIDE = ModelConfig(name="cnn2d_2layer_fullconnected_2layer", conv_features=(8, 16), dense_features=(2048,), norm="none")
LAYOUTS = ["dp", "fsdp", "tp", "hybrid"]


@pytest.fixture(scope="module")
def candidates():
    return plan(WIDE, (8, 8, 1), 32, 8, budget_bytes=1e12, profile=get_profile("h100"), layouts=LAYOUTS)


# h100's figures, its collectives costed as compiled (each its own ring, nothing hidden)
AS_COMPILED = dataclasses.replace(
    get_profile("h100"), combine_threshold_bytes=0, collective_algorithm="ring", overlap_fraction=0
)


def test_dp_wins_when_the_replicated_state_fits_comfortably(candidates):
    best = candidates[0]
    assert best.layout.name == "dp"  # on 8 devices or fewer: the fixed costs of a tiny model decide
    assert f"1. dp       {best.mesh}" in explain(candidates, 1e12)


def test_a_tiny_model_plans_one_device_and_names_the_redundant_compute():
    """Priced with kernel launches and collective hops, a model this small is fastest on one
    device; spatial on 8x8 images makes every device compute most of every image."""
    found = plan(TINY_PLAIN, (8, 8, 1), 32, 8, 1e12, get_profile("h100"), layouts=["single", "dp", "spatial"])
    assert found[0].layout.name in ("single", "dp") and found[0].devices < 8
    assert all(c.num_kernels > 0 for c in found)
    by_mesh = {(c.layout.name, c.mesh): c for c in found}
    assert by_mesh[("spatial", "data=1,spatial=8")].redundant and not by_mesh[("dp", "data=8")].redundant
    assert by_mesh[("single", "data=1")].redundancy == pytest.approx(1.0)
    assert "redundant compute" in explain(found, 1e12) and "spatial data=1,spatial=8" in explain(found, 1e12)


def test_a_sharded_layout_wins_when_replicated_state_exceeds_the_budget(candidates):
    dp = next(c for c in candidates if c.layout.name == "dp")
    budget = 0.8 * (dp.param_bytes + dp.optimizer_bytes)  # below replicated parameters + optimizer
    ranked = rank(list(candidates), budget)  # the same compiled candidates, a smaller budget
    best = ranked[0]
    assert best.layout.name in ("fsdp", "tp", "hybrid") and best.peak_bytes <= budget
    assert best.param_bytes + best.optimizer_bytes < dp.param_bytes + dp.optimizer_bytes
    text = explain(ranked, budget)
    assert f"1. {best.layout.name}" in text and "over budget" in text and "dp data=8" in text


def test_no_layout_fits_says_by_how_much(candidates):
    smallest = min(c.peak_bytes for c in candidates)
    text = explain(candidates, smallest / 2)
    assert text.startswith("no layout fits") and "2.00x" in text


def test_candidates_cover_every_factorisation():
    names = [(lay.name, tuple(m.items())) for lay, m in candidates_for(8)]
    assert ("hybrid", (("data", 2), ("model", 4))) in names and ("hybrid", (("data", 4), ("model", 2))) in names
    assert ("spatial", (("data", 1), ("spatial", 8))) in names and ("dp", (("data", 8),)) in names
    assert [lay.name for lay, _ in candidates_for(1)] == ["single"]
    fewer = [m for lay, m in candidates_for(8) if sum(m.values()) < 8 and lay.name in ("single", "dp")]
    assert fewer == [{"data": 1}, {"data": 2}, {"data": 4}]  # the same batch on fewer devices


# TINY_PLAIN's forward on a batch of 32 8x8x1 images: 2 FLOPs a multiply-add of each conv and dense
FORWARD_FLOPS = 2 * 32 * (8 * 8 * 9 * 1 * 8 + 4 * 4 * 9 * 8 * 16 + 64 * 32 + 32 * 10)


def test_pipeline_candidates_are_compiled_and_ranked():
    """On 4 devices the planner compiles the pipeline on each stage count the model's layers
    allow, under each schedule, and costs it like any layout: the busiest stage's figures from
    its compiled programs and the micro-batches its schedule holds, priced by the alpha-beta
    model with the bubble, ranked and explained."""
    profile = AS_COMPILED
    every = plan(TINY_PLAIN, (8, 8, 1), 32, 4, budget_bytes=1e12, profile=profile, layouts=["pipeline"])
    # interleaving on 4 stages takes micro-batches in groups of 4 (batch 32 gives M = 2 of 16)
    (refused,) = [c for c in every if c.error is not None]
    assert (refused.name, refused.mesh) == ("pipeline/1f1b x2", "data=1,stage=4") and "multiple of 4" in refused.error
    named = {(c.name, c.mesh): c for c in every if c.error is None}
    for mesh in ("data=2,stage=2", "data=1,stage=4"):  # the same programs, the same bubble
        gpipe, one_f_one_b = named[("pipeline/gpipe", mesh)], named[("pipeline/1f1b", mesh)]
        assert (gpipe.flops, gpipe.bubble_fraction) == (one_f_one_b.flops, one_f_one_b.bubble_fraction)
        # M = 2 <= S: 1F1B's warm-up forwards are all of them, as GPipe's; what it holds fewer of
        # at M > S: test_the_planners_1f1b_candidate_holds_what_a_1f1b_program_holds
        assert one_f_one_b.peak_bytes == gpipe.peak_bytes
    interleaved, gpipe = named[("pipeline/1f1b x2", "data=2,stage=2")], named[("pipeline/gpipe", "data=2,stage=2")]
    assert (interleaved.bubble_fraction, gpipe.bubble_fraction) == pytest.approx((1 / (2 * 2 + 1), 1 / 3))
    found = [c for c in every if c.schedule == ("gpipe", 1)]
    by_mesh = {c.mesh: c for c in found}
    assert set(by_mesh) == {"data=2,stage=2", "data=1,stage=4"}
    four, two = by_mesh["data=1,stage=4"], by_mesh["data=2,stage=2"]
    # by hand, TINY_PLAIN's layers hold 80, 1,168, 2,080 and 330 parameters: on 4 stages the
    # busiest holds dense 0; on 2 the FLOP-balanced split is conv 0 | the rest
    assert four.param_bytes == 4 * 2_080 and two.param_bytes == 4 * (1_168 + 2_080 + 330)
    # the largest boundary, after conv 0: each image's pooled 4x4x8 activation forward and its
    # gradient back, for the 32 images (16 a data shard)
    assert four.cost.transfer_bytes == 2 * 32 * (4 * 4 * 8) * 4 and two.cost.transfer_bytes == 2 * 16 * (4 * 4 * 8) * 4
    for c in found:
        data, stages = c.mesh_shape["data"], c.mesh_shape["stage"]
        assert c.error is None and c.layout.name == "pipeline"
        assert c.optimizer_bytes == 2 * c.param_bytes + 8  # Adam's mu and nu, two int32 step counts
        assert c.peak_bytes >= c.param_bytes + c.optimizer_bytes
        # the busiest stage: at least its share of a step (forward and backward: 2x to 4x the
        # forward's FLOPs), at most a whole step on its data shard
        assert 2 * FORWARD_FLOPS / (stages * data) <= c.flops <= 4 * FORWARD_FLOPS / data
        # the model's count (what is priced): 3x the forward of the busiest stage's layers
        assert 3 * FORWARD_FLOPS / (stages * data) <= c.compute_flops == c.model_flops <= 3 * FORWARD_FLOPS / data
        assert c.wire_bytes >= c.cost.transfer_bytes
        # priced: compute at the achieved FLOP/s (and each kernel's launch) stretched by the bubble
        # (S-1)/(M+S-1) (M = 2 micro-batches of 16); each hop of each collective the link's
        # latency, each byte its bandwidth
        assert c.bubble_fraction == pytest.approx((stages - 1) / (2 + stages - 1))
        launches = c.num_kernels * profile.kernel_seconds
        achieved = profile.flops_fp32 * profile.conv_fraction_fp32
        assert c.compute_seconds == pytest.approx((c.compute_flops / achieved + launches) / (1 - c.bubble_fraction))
        hops = sum(
            x.hops * x.repeats for x in max(c.cost.stage_collectives, key=lambda s: sum(x.step_wire_bytes for x in s))
        )
        assert c.comm_seconds == pytest.approx(
            hops * profile.hop_seconds + c.wire_bytes / profile.link_bytes_per_second
        )
    assert [c.step_seconds for c in found] == sorted(c.step_seconds for c in found)
    assert explain(every, 1e12).startswith(f"1. {every[0].name} {every[0].mesh} ")


def test_compute_is_priced_at_the_calibrated_fraction_of_the_peak(candidates):
    """A GPU profile's compute is FLOPs / (peak x the fraction a conv net's training step
    reaches) + each kernel's launch, in each precision; the fraction is the cited ResNet-50
    throughput's (FLOPs an image x images/s / peak) and well below 1; cpu-here's measured
    FLOP/s stand as they are."""
    h100 = get_profile("h100")
    for dtype, peak, fraction in (
        ("float32", h100.flops_fp32, h100.conv_fraction_fp32),
        ("bfloat16", h100.flops_bf16, h100.conv_fraction_bf16),
    ):
        for c in price(candidates, h100, 8, dtype):
            launches = c.num_kernels * h100.kernel_seconds
            assert c.compute_seconds == pytest.approx(c.compute_flops / (peak * fraction) + launches)
    for (name, dtype), (low, used, high) in RESNET50_IMAGES_PER_SECOND.items():
        profile = get_profile(name)
        assert low <= used <= high
        assert profile.achieved_flops(dtype) == pytest.approx(RESNET50_TRAIN_FLOPS_PER_IMAGE * used)
        assert 0.05 < profile.achieved_flops(dtype) / profile.flops(dtype) < 0.5
    assert get_profile("h200").achieved_flops() == h100.achieved_flops()  # the same die, H100's figures
    cpu = get_profile("cpu-here")
    assert [cpu.achieved_flops(dtype) for dtype in ("float32", "bfloat16")] == [cpu.flops_fp32, cpu.flops_bf16]


def test_budget_parsing():
    assert parse_bytes("16GiB") == 16 * 2**30 and parse_bytes("80GB") == 80e9 and parse_bytes("512") == 512
    with pytest.raises(UserError, match="cannot read 'lots' as a size"):
        parse_bytes("lots")


def _rows(*pairs, wait=0.0):
    return [{"num_devices": n, "speedup": s, "input_wait_fraction": wait} for n, s in pairs]


def test_verdicts():
    assert verdict(_rows((1, 1.0), (2, 1.9), (4, 3.6))).startswith("scaling pays: 3.60x on 4 devices")
    slow = verdict(_rows((1, 1.0), (2, 1.9), (4, 2.3)))
    assert slow == "under 1.5x for 2x devices (2 -> 4: 1.21x): don't scale out beyond 2 device(s)"
    assert verdict(_rows((1, 1.0), (2, 1.2), wait=0.4)).startswith("input-bound: fix the data pipeline first")
    assert step_verdicts(_rows((1, 1.0), (2, 1.9), (4, 2.3))) == [
        "baseline", "1.90x for 2x devices: pays", "1.21x for 2x devices: does not pay",
    ]  # fmt: skip


def test_collectives_across_hosts_are_priced_at_the_network_inside_at_the_link():
    """hybrid data=2,model=4 on 2 hosts of 4: `model` stays inside a host (the link), `data`
    crosses (the network); on one host every collective is on the link. (On a ring profile:
    the cluster clock's own tests follow.)"""
    profile = AS_COMPILED
    (hybrid,) = [
        c for c in plan(TINY_PLAIN, (8, 8, 1), 32, 8, 1e12, profile, layouts=["hybrid"]) if c.mesh == "data=2,model=4"
    ]
    mesh = hybrid.mesh_shape
    found = hybrid.cost.stage_collectives[0]
    spans = {spanned_axes(c, mesh) for c in found}
    assert ("model",) in spans and ("data",) in spans
    one = comm_seconds(hybrid.cost, profile, mesh)
    two = comm_seconds(hybrid.cost, profile, mesh, across={"data": 2, "model": 1})
    crossing = [c for c in found if "data" in spanned_axes(c, mesh)]
    extra = sum(
        c.repeats * (c.hops * (profile.network_hop_seconds - profile.hop_seconds)
                     + c.wire_bytes * (1 / profile.network_bytes_per_second - 1 / profile.link_bytes_per_second))
        for c in crossing
    )  # fmt: skip
    assert two - one == pytest.approx(extra) and extra > 0
    assert across_hosts_of(mesh, 8, 2) == {"data": 2, "model": 1} and across_hosts_of({"data": 4}, 8, 2) is None


KERNELS_HLO = """HloModule m

%fused_computation (p: f32[2]) -> f32[2] {
  %p = f32[2]{0} parameter(0)
  ROOT %n = f32[2]{0} negate(%p)
}

%body (a: (f32[2], s32[])) -> (f32[2], s32[]) {
  %a = (f32[2]{0}, s32[]) parameter(0)
  %g = f32[2]{0} get-tuple-element(%a), index=0
  %f = f32[2]{0} fusion(%g), kind=kLoop, calls=%fused_computation
  ROOT %t = (f32[2]{0}, s32[]) tuple(%f, %g)
}

ENTRY %main (x: f32[2]) -> f32[2] {
  %x = f32[2]{0} parameter(0)
  %m = (f32[2]{0}, f32[2]{0}, f32[2]{0}, f32[2]{0}, f32[2]{0}, /*index=5*/f32[2]{0}) fusion(%x), kind=kLoop, calls=%fused_computation
  %w = (f32[2]{0}, s32[]) while(%i), condition=%c, body=%body
  ROOT %r = f32[2]{0} negate(%x)
}
"""


def test_kernel_count_reads_the_entry_and_loop_bodies_not_fused_computations():
    # the entry's 6-output fusion and negate, the loop body's fusion; never a fusion's insides,
    # parameters, tuples or the while itself
    assert kernel_count(KERNELS_HLO) == 3


def test_the_planners_1f1b_candidate_holds_what_a_1f1b_program_holds():
    """The planner reorders the GPipe programs it compiled into 1F1B's timeline instead of
    compiling them again: at M = 4 > S = 2 (batch 64, micro-batches of 16) its 1F1B candidate
    has the peak of a pipeline built for 1F1B (its programs plus what its own timeline holds
    in flight), below GPipe's, at the same bubble."""
    from jaxcnn.analysis.planner import compile_candidate, compile_candidates
    from jaxcnn.sharding import get_layout

    found = compile_candidates(TINY_PLAIN, (8, 8, 1), 64, 2, layouts=["pipeline"])
    named = {c.name: c for c in found if c.mesh == "data=1,stage=2" and c.error is None}
    gpipe, planned = named["pipeline/gpipe"], named["pipeline/1f1b"]
    built, program = compile_candidate(
        TINY_PLAIN, (8, 8, 1), 64, get_layout("pipeline"), {"data": 1, "stage": 2}, ("1f1b", 1)
    )
    assert program.pipeline.microbatches == 4
    assert planned.peak_bytes == built.peak_bytes < gpipe.peak_bytes
    assert planned.bubble_fraction == built.bubble_fraction == gpipe.bubble_fraction


# --- the cluster clock (jaxcnn.analysis.cluster_clock) ------------------------------------------


def test_small_all_reduce_latency_grows_like_log_hosts_not_devices():
    """NCCL's tree: each doubling of the hosts adds one hop up and one down between hosts; a
    ring of 256 would pay 510 steps."""
    h100 = get_profile("h100")

    def small(hosts):
        return collective_seconds("all-reduce", 8 * hosts, 8, hosts, h100)

    steps = [small(2 * h) - small(h) for h in (8, 16)]  # (on fewer hosts the ring can be the cheaper)
    assert steps == pytest.approx([2 * TREE_NET_HOP] * 2)
    assert small(32) < 100e-6 < collective_seconds("all-reduce", 256, 8, 32, AS_COMPILED)
    # bandwidth across hosts: the host's NICs together, never above the link inside
    big = 2**30
    across = collective_seconds("all-reduce", 16, big, 2, h100) - small(2)
    assert across == pytest.approx(
        2 * 15 / 16 * big / min(h100.link_bytes_per_second, 8 * h100.network_bytes_per_second), rel=1e-3
    )


def _found(kind, role, buffer_bytes, line="", repeats=1, group=8):
    c = Collective(kind, group, buffer_bytes, "f32", ((buffer_bytes // 4,),), line)
    return dataclasses.replace(c, repeats=repeats), role


def test_parameter_collectives_combine_and_hide_behind_compute_statistics_stay_exposed():
    h100 = get_profile("h100")
    grads = [_found("all-reduce", "param", 4 * 2**20) for _ in range(20)]  # 80 MiB in 20 pieces
    forward = [_found("all-reduce", "statistics", 64, "jvp(batch_norm_statistics)") for _ in range(5)]
    backward = [_found("all-reduce", "statistics", 64, "transpose(jvp(batch_norm_statistics))") for _ in range(5)]
    found, roles = map(list, zip(*(grads + forward + backward), strict=True))
    one_grad = collective_seconds("all-reduce", 8, 80 * 2**20 / 3, 1, h100)  # combined into 3 of 30 MiB at most
    stats = collective_seconds("all-reduce", 8, 64, 1, h100)
    idle = step_comm(found, roles, h100, {"data": 8}, None, compute_seconds=0.0)
    assert idle.collectives == 3 + 10 and idle.hidden_seconds == 0
    assert idle.exposed_seconds == pytest.approx(3 * one_grad + 10 * stats)
    busy = step_comm(found, roles, h100, {"data": 8}, None, compute_seconds=1.0)  # ample compute to hide in
    assert busy.exposed_seconds == pytest.approx(one_grad + 5 * stats)  # the last bucket, the forward statistics
    assert busy.exposed_seconds + busy.hidden_seconds == pytest.approx(idle.exposed_seconds)
    as_compiled = step_comm(found, roles, AS_COMPILED, {"data": 8}, None, compute_seconds=1.0)
    assert as_compiled.collectives == 30 and as_compiled.hidden_seconds == 0


def test_batch_norms_backward_sums_hide_behind_half_the_backward_pass_at_most():
    """With too little compute to hide them all, batch norm's backward sums each hide behind
    an equal share of half the backward pass (the weight gradients', computed while they
    travel): together overlap_fraction x compute / 2, the rest of them exposed."""
    h100 = get_profile("h100")
    backward = [_found("all-reduce", "statistics", 64, "transpose(jvp(batch_norm_statistics))") for _ in range(5)]
    found, roles = map(list, zip(*backward, strict=True))
    one = collective_seconds("all-reduce", 8, 64, 1, h100)
    compute = 2 * one  # the sums take 5x that: most stay exposed
    clock = step_comm(found, roles, h100, {"data": 8}, None, compute_seconds=compute)
    assert h100.overlap_fraction > 0
    assert clock.hidden_seconds == pytest.approx(h100.overlap_fraction * compute / 2)
    assert clock.exposed_seconds == pytest.approx(5 * one - h100.overlap_fraction * compute / 2)
