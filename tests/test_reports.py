"""The report scripts end to end (in-process, tiny model): compare, scaling, plan."""

import subprocess
import sys

import pandas as pd
import pytest
from conftest import REPO, load_script

from jaxcnn.analysis.measure import COMPARE_COLUMNS
from jaxcnn.analysis.verdicts import step_verdicts, verdict

TINY_FLAGS = [
    "--model",
    "cnn2d_2layer_fullconnected_2layer",
    "--conv-features",
    "8,16",
    "--dense-features",
    "32",
    "--norm",
    "none",
]


def test_compare_layouts_writes_the_design_csv_and_a_png(tmp_path, capsys):
    out, plot = tmp_path / "compare.csv", tmp_path / "compare.png"
    rows = load_script("compare_layouts").main(
        [
            *TINY_FLAGS,
            "--layouts",
            "dp,tp",
            "--steps",
            "2",
            "--batch-size",
            "32",
            "--out",
            str(out),
            "--plot",
            str(plot),
        ]
    )
    frame = pd.read_csv(out)
    assert list(frame.columns[: len(COMPARE_COLUMNS)]) == COMPARE_COLUMNS
    assert list(frame["layout"]) == ["single", "dp", "tp"]  # single always first: the baseline
    assert frame.loc[0, "speedup"] == pytest.approx(1.0)
    assert (frame["images_per_second"] > 0).all()
    # dp (14,640 bytes) and tp (42,240) measured equal to the byte: the model, exactly
    assert list(frame.loc[1:, "comm_bytes"]) == list(frame.loc[1:, "comm_bytes_model"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "ratio" in text and "simulated CPU devices" in text
    assert rows[2]["mesh"] == "model=8"


def test_scaling_reports_speedups_and_a_verdict(tmp_path, capsys):
    out, plot = tmp_path / "scaling.csv", tmp_path / "scaling.png"
    load_script("scaling").main(
        [*TINY_FLAGS, "--devices", "1,2", "--steps", "4", "--out", str(out), "--plot", str(plot)]
    )
    frame = pd.read_csv(out)
    assert list(frame["num_devices"]) == [1, 1, 2] and frame.loc[0, "layout"] == "single"
    baseline, rows = frame.iloc[0], frame.iloc[1:]
    # speed-up: images/s over the single-device baseline's; efficiency: speed-up per device
    assert (baseline["speedup"], baseline["efficiency"]) == (1.0, 1.0)
    assert list(rows["speedup"]) == pytest.approx(list(rows["images_per_second"] / baseline["images_per_second"]))
    assert list(rows["efficiency"]) == pytest.approx(list(rows["speedup"] / rows["num_devices"]))
    # the verdicts are the rules' (jaxcnn.analysis.verdicts, tested in test_planner) on these rows
    records = rows.to_dict("records")
    assert baseline["verdict"] == "single-device baseline" and list(rows["verdict"]) == step_verdicts(records)
    text = capsys.readouterr().out
    assert f"verdict: {verdict(records)}\n" in text and "simulated devices" in text
    # the modelled communication share: nothing to send on one device, some on two
    assert list(rows["comm_bytes"] > 0) == [False, True]
    assert rows["comm_fraction_model"].iloc[0] == 0 and 0 < rows["comm_fraction_model"].iloc[1] <= 1
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_compiles_for_more_devices_than_the_process_has_and_reads_each_program(tmp_path):
    """`scale --simulate 4,16` in its own process (the suite's has 8 devices): a row per layout
    and count, batch norm's statistics bytes flat in the count, the analytic model within 1%
    of the compiled bytes, every collective in the second CSV, and the plot."""
    out, plot = tmp_path / "simulate.csv", tmp_path / "simulate.png"
    flags = ["--model", "cnn2d_2layer_fullconnected_2layer", "--conv-features", "8,16", "--dense-features", "32"]
    done = subprocess.run(
        [sys.executable, "-m", "jaxcnn", "scale", "--simulate", "4,16", "--layouts", "dp,fsdp", *flags,
         "--batch-size", "2", "--weak", "--out", str(out), "--plot", str(plot)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    frame = pd.read_csv(out)
    assert list(zip(frame["layout"], frame["num_devices"], strict=True)) == [
        ("dp", 4),
        ("dp", 16),
        ("fsdp", 4),
        ("fsdp", 16),
    ]
    assert list(frame["global_batch_size"]) == [8, 32, 8, 32]
    for _, rows in frame.groupby("layout"):
        assert rows["forward_statistics_bytes_max"].nunique() == 1 and rows["forward_statistics_bytes_max"].iloc[0] > 0
    assert ((frame["model_over_compiled"] - 1).abs() < 0.01).all(), frame[
        ["layout", "num_devices", "model_over_compiled"]
    ]
    assert (frame["peak_bytes"] > 0).all() and (frame["flops_per_device"] > 0).all()
    found = pd.read_csv(tmp_path / "simulate_collectives.csv")
    fsdp16 = found[(found["layout"] == "fsdp") & (found["num_devices"] == 16)]
    assert "all-gather" in set(fsdp16["kind"]) and set(fsdp16["group_size"]) == {16}  # parameters gathered
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "nothing ran" in done.stdout


def test_simulate_prices_each_count_on_its_own_hosts():
    """Hosts of 4 devices: 4 devices are one host, 8 are two, and the 8-device step's
    collectives are priced across the network between them -- dearer than the same 8
    devices inside one host of 8 (hosts of 8: one host for both counts)."""
    from conftest import TINY_PLAIN

    from jaxcnn.analysis.hardware import get_profile
    from jaxcnn.analysis.simulate import simulate
    from jaxcnn.sharding import get_layout

    def rows(devices_per_host):
        found, _ = simulate(
            TINY_PLAIN, (8, 8, 1), [get_layout("dp")], [4, 8], lambda n: 4 * n, get_profile("h100"), devices_per_host
        )
        return found

    split, whole = rows(4), rows(8)
    assert [r["hosts"] for r in split] == [1, 2] and [r["hosts"] for r in whole] == [1, 1]
    assert split[0]["comm_seconds"] == whole[0]["comm_seconds"]
    assert split[1]["comm_seconds"] > whole[1]["comm_seconds"]


def test_plan_prints_ranked_choices_and_writes_every_candidate(tmp_path, capsys):
    out = tmp_path / "plan.csv"
    load_script("plan").main(
        [*TINY_FLAGS, "--devices", "4", "--budget", "64MiB", "--hardware", "a100,tpu-v5e", "--layouts", "dp,spatial",
         "--out", str(out)]
    )  # fmt: skip
    text = capsys.readouterr().out
    assert "1. " in text and "fits:" in text and "4 x a100" in text and "4 x tpu-v5e" in text
    assert text.count("compiling") == 4  # each candidate compiled once, then ranked on both profiles
    frame = pd.read_csv(out)
    # only the layouts asked for: dp on data=4 and on fewer (data=2), spatial on its two meshes
    assert frame["fits"].any() and set(frame["layout"]) == {"dp", "spatial"} and len(frame) == 8
    a100, v5e = (frame[frame["hardware"] == name].set_index(["layout", "mesh"]) for name in ("a100", "tpu-v5e"))
    assert (a100["flops_per_device"] == v5e.loc[a100.index, "flops_per_device"]).all()
    assert (a100["step_seconds_model"] != v5e.loc[a100.index, "step_seconds_model"]).all()


def test_pipeline_schedule_figure_and_micro_batches_in_flight(tmp_path):
    """The timeline figure draws from the schedules alone (nothing compiles); GPipe's middle
    and last stages hold all M micro-batches, 1F1B's at most S whatever M."""
    from jaxcnn import plots

    script = load_script("pipeline_schedules")
    held = {}
    for m in (4, 8):
        shown = script.timelines(["gpipe", "1f1b", "interleaved"], 4, 2, m)
        held[m] = [script.microbatches_in_flight(t, 4 * (2 if "V=" in name else 1)) for name, t in shown.items()]
    assert held[4][0] == [1, 4, 4, 4] and held[8][0] == [1, 8, 8, 8]  # stage 0 holds gradients only
    assert held[4][1] == held[8][1] and max(held[8][1]) <= 4
    png = plots.pipeline_timeline_plot(shown, tmp_path / "timeline.png", "4 stages, 8 micro-batches")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


BAD_INPUT = [
    ("plan.py", ["--budget", "lots"], "cannot read 'lots' as a size"),
    ("plan.py", ["--hardware", "abacus"], "unknown hardware profile 'abacus'"),
    ("plan.py", ["--layouts", "dp,zero3"], "unknown layout 'zero3'"),
    ("compare_layouts.py", ["--layouts", "dp,zero", "--steps", "0"], "unknown layout 'zero'"),
    ("scaling.py", ["--layout", "hybrid", "--devices", "1,2"], "cannot fill 1 devices"),
    ("pipeline_schedules.py", ["--models", "resnet18:32x32x3:8"], "needs at least 16 layers"),
]


@pytest.fixture(scope="module")
def bad_input_runs():
    """Each case in a process of its own, all started at once (the cores overlap them)."""
    procs = {
        (script, *flags): subprocess.Popen(
            [sys.executable, str(REPO / "experiments" / script), *flags],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        for script, flags, _ in BAD_INPUT
    }
    done = {}
    for case, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        done[case] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return done


@pytest.mark.parametrize(("script", "flags", "message"), BAD_INPUT)
def test_bad_input_to_report_scripts_is_one_line(bad_input_runs, script, flags, message):
    proc = bad_input_runs[(script, *flags)]
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
