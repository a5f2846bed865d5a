"""The planner keeps what fits and ranks it; the scaling verdict says plainly when to stop."""

import pytest
from conftest import TINY_PLAIN

from jaxcnn.analysis.hardware import get_profile
from jaxcnn.analysis.planner import candidates_for, explain, plan, rank
from jaxcnn.analysis.verdicts import step_verdicts, verdict
from jaxcnn.config import ModelConfig, parse_bytes
from jaxcnn.errors import UserError

# dense-heavy, so parameters + Adam state (not activations) decide what fits
WIDE = ModelConfig(name="cnn2d_2layer_fullconnected_2layer", conv_features=(8, 16), dense_features=(2048,), norm="none")
LAYOUTS = ["dp", "fsdp", "tp", "hybrid"]


@pytest.fixture(scope="module")
def candidates():
    return plan(WIDE, (8, 8, 1), 32, 8, budget_bytes=1e12, profile=get_profile("h100"), layouts=LAYOUTS)


def test_dp_wins_when_the_replicated_state_fits_comfortably(candidates):
    best = candidates[0]
    assert best.layout.name == "dp" and best.mesh_shape == {"data": 8}
    assert "1. dp" in explain(candidates, 1e12)


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


def test_pipeline_candidates_are_compiled_and_ranked():
    """On 4 devices the planner compiles the pipeline on each stage count the model's layers
    allow and costs it like any layout: a modelled step time and a peak, ranked and explained."""
    found = plan(TINY_PLAIN, (8, 8, 1), 32, 4, budget_bytes=1e12, profile=get_profile("h100"), layouts=["pipeline"])
    assert {c.mesh for c in found} == {"data=2,stage=2", "data=1,stage=4"}
    for c in found:
        assert c.error is None and c.layout.name == "pipeline"
        assert c.peak_bytes > 0 and c.param_bytes > 0 and c.flops > 0
        assert c.compute_seconds > 0 and c.step_seconds >= c.compute_seconds
        assert c.wire_bytes > 0  # the activations and gradients sent between stages
    assert [c.step_seconds for c in found] == sorted(c.step_seconds for c in found)
    assert "1. pipeline" in explain(found, 1e12)


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
