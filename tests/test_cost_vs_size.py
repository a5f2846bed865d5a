"""experiments/cost_vs_size.py: the overhead fit, and a tiny sweep end to end."""

import math

import numpy as np
import pandas as pd
import pytest
from conftest import load_script

cost = load_script("cost_vs_size")


@pytest.mark.parametrize("relative", [True, False])
def test_fit_recovers_a_known_overhead_and_rate(relative):
    t0, rate = 4e-3, 50e9
    flops = np.array([1e8, 4e8, 1.6e9, 6.4e9, 2.5e10])
    fitted_t0, fitted_rate = cost.fit_overhead(flops, t0 + flops / rate, relative=relative)
    assert fitted_t0 == pytest.approx(t0, rel=1e-6)
    assert fitted_rate == pytest.approx(rate, rel=1e-6)


def test_fit_weighs_the_small_points_against_noise_on_the_large_ones():
    t0, rate = 2e-3, 100e9
    flops = np.geomspace(1e7, 1e11, 9)
    noisy = (t0 + flops / rate) * (1 + 0.03 * np.array([1, -1, 1, -1, 1, -1, 1, -1, 1]))
    fitted_t0, fitted_rate = cost.fit_overhead(flops, noisy)
    assert fitted_t0 == pytest.approx(t0, rel=0.1)
    assert fitted_rate == pytest.approx(rate, rel=0.1)


def test_fit_never_reports_a_negative_overhead_and_flat_times_are_all_overhead():
    flops = np.array([1e9, 2e9, 4e9])
    t0, rate = cost.fit_overhead(flops, flops / 1e10 - 1e-3)  # would extrapolate below zero
    assert t0 == 0 and rate > 0
    t0, rate = cost.fit_overhead(flops, [0.02, 0.02, 0.019])
    assert rate == math.inf and t0 == pytest.approx(0.02, rel=0.05)
    assert cost.overhead_verdict(t0, 0.02) == (pytest.approx(1.0, rel=0.05), "overhead-bound")
    assert all(math.isnan(v) for v in cost.fit_overhead([1e9], [0.1]))


def test_verdict_turns_compute_bound_when_the_overhead_is_under_half_the_step():
    assert cost.overhead_verdict(0.01, 0.015)[1] == "overhead-bound"
    share, verdict = cost.overhead_verdict(0.01, 0.03)
    assert share == pytest.approx(1 / 3) and verdict == "compute-bound"


def test_a_tiny_sweep_writes_a_row_per_point_and_a_plot(tmp_path):
    out, plot = tmp_path / "cost.csv", tmp_path / "cost.png"
    cost.main([
        "--models", "cnn2d_1layer_fullconnected_1layer", "--sizes", "8,16", "--batches", "4,8", "--batch-sweep-size",
        "8", "--size-sweep-batch", "4", "--steps", "2", "--out", str(out), "--plot", str(plot),
    ])  # fmt: skip
    frame = pd.read_csv(out)
    assert list(frame["sweep"]) == ["size", "size", "batch", "batch"]
    assert list(frame["image_size"]) == [8, 16, 8, 8] and list(frame["global_batch_size"]) == [4, 4, 4, 8]
    # FLOPs grow with the pixels and the images; the fit is per sweep and every point is judged
    assert frame["flops_per_step"].iloc[1] > frame["flops_per_step"].iloc[0]
    assert frame["flops_per_step"].iloc[3] == pytest.approx(2 * frame["flops_per_step"].iloc[2], rel=0.05)
    assert frame.groupby("sweep")["fit_t0_seconds"].nunique().eq(1).all()
    assert set(frame["verdict"]) <= {"overhead-bound", "compute-bound"}
    assert ((frame["mfu"] > 0) & frame["steps"].between(1, 2)).all()
    assert plot.stat().st_size > 0


def test_bad_sweeps_fail_before_any_compile(tmp_path):
    from jaxcnn.errors import UserError

    with pytest.raises(UserError, match="--sizes"):
        cost.main(["--sizes", "0,32", "--out", str(tmp_path / "c.csv")])
    with pytest.raises(UserError, match="nothing to measure"):
        cost.main(["--sizes", "", "--batches", "", "--out", str(tmp_path / "c.csv")])
    with pytest.raises(UserError, match="unknown model"):
        cost.main(["--models", "resnet7", "--out", str(tmp_path / "c.csv")])
