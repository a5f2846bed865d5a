"""The scripts that measure on a lent GPU, run here on the CPU at toy sizes: the platform
choices experiment (cold compiles in their own processes, rows merged into its CSV) and the
GPU check's driver (steps under a budget, a step already done skipped, its summary)."""

import pandas as pd
import pytest
from conftest import load_script

from jaxcnn import compile_cache, platform_choices

TINY = ["--model", "cnn2d_1layer_fullconnected_1layer", "--image", "8x8x1", "--batch", "8"]


@pytest.mark.slow
def test_platform_choices_measures_every_variant_and_merges_its_rows(tmp_path):
    out = tmp_path / "choices.csv"
    script = load_script("platform_choices")
    common = [*TINY, "--steps", "2", "--rounds", "1", "--timeout", "120", "--out", str(out)]
    try:
        script.main(["--choices", "max_pool,cpu_convs", *common])
        first = pd.read_csv(out).set_index(["choice", "variant"])
        script.main(["--choices", "max_pool", *common])  # the same measurement again replaces its rows
    finally:
        compile_cache.enable(None)
    frame = pd.read_csv(out)
    assert sorted(zip(frame["choice"], frame["variant"], strict=True)) == [
        ("cpu_convs", "eigen"), ("cpu_convs", "ynnpack"), ("max_pool", "select"), ("max_pool", "window")
    ]  # fmt: skip
    assert (frame["cold_compile_seconds"] > 0).all() and (frame["warm_compile_seconds"] > 0).all()
    assert (frame["steps"] == 2).all() and not frame["timed_out"].any()
    for choice, rows in frame.groupby("choice"):
        measured = {r.variant: (r.median_step_seconds, r.cold_compile_seconds) for r in rows.itertuples()}
        assert (rows["picked"] == platform_choices.pick(measured)).all()
        assert (rows["chosen"] == platform_choices.variant(choice, "cpu")).all()
    # on a CPU max_pool=select and cpu_convs=eigen build one program (the platform's): measured once
    columns = ["cold_compile_seconds", "median_step_seconds"]
    assert first.loc[("max_pool", "select"), columns].equals(first.loc[("cpu_convs", "eigen"), columns])
    again = frame.set_index(["choice", "variant"])
    assert again.loc[("cpu_convs", "eigen"), columns].equals(first.loc[("cpu_convs", "eigen"), columns])  # kept
    assert not again.loc[("max_pool", "select"), columns].equals(first.loc[("max_pool", "select"), columns])


def test_platform_choices_refuses_a_choice_of_another_platform_and_unknown_variants(tmp_path):
    script = load_script("platform_choices")
    with pytest.raises(Exception, match="autotune is a gpu choice"):
        script.main(["--choices", "autotune", *TINY, "--out", str(tmp_path / "x.csv")])
    with pytest.raises(Exception, match="--variants dot: not a variant of max_pool"):
        script.main(["--choices", "max_pool", "--variants", "dot", *TINY, "--out", str(tmp_path / "x.csv")])


@pytest.mark.slow
def test_gpu_check_runs_its_steps_within_the_budget_and_skips_what_is_done(tmp_path, capsys):
    script = load_script("gpu_check")
    flags = ["--smoke", "--results", str(tmp_path), "--wheels", str(tmp_path / "no-wheels")]
    assert script.main([*flags, "--only", "env,train_cnn_cold,train_cnn_warm"]) == 0
    steps = pd.read_csv(tmp_path / "steps.csv")
    assert list(steps["step"]) == ["env", "train_cnn_cold", "train_cnn_warm"] and (steps["status"] == "ok").all()
    summary = pd.read_csv(tmp_path / "summary.csv")
    assert summary["jaxcnn_compile_cold_seconds"].iloc[0] > 2 * summary["jaxcnn_compile_warm_seconds"].iloc[1]
    capsys.readouterr()
    assert script.main([*flags, "--budget", "1"]) == 0  # nothing fits: every step not done yet is skipped
    steps = pd.read_csv(tmp_path / "steps.csv")
    assert set(steps["status"].iloc[3:]) == {"skipped"}
    assert "train_cnn_cold" not in set(steps["step"].iloc[3:])  # done already: not even tried
