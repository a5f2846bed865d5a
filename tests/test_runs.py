"""After the run: the run directory (config, results, model, curves, TensorBoard), never
clobbered; `jaxcnn predict` / `jaxcnn evaluate` from it; Ctrl-C saves and `--resume`
continues; `--help` before JAX."""

import importlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time

import numpy as np
import pandas as pd
import pytest
from conftest import REPO, load_train_module, write_digits_csv, write_folder
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from jaxcnn.commands import COMMANDS, cli, evaluate, module_name, predict
from jaxcnn.config import LAYOUT_NAMES, ModelConfig
from jaxcnn.run_config import RunConfig
from jaxcnn.saved_model import flat_variables, model_template, restore_model
from jaxcnn.sharding import LAYOUTS, build_mesh, get_layout

TINY = ["--conv-features", "8,16,16", "--dense-features", "32,16", "--batch-size", "32", "--host-devices", "8"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A two-epoch run on the bundled digits under dp on data=8 (the suite's devices)."""
    results_dir = tmp_path_factory.mktemp("runs")
    record = load_train_module().main([*TINY, "--epochs", "2", "--results-dir", str(results_dir), "--run-name", "r"])
    return results_dir / "r", record


def test_a_run_leaves_config_results_model_curves_and_tensorboard(finished_run):
    run_dir, record = finished_run
    names = {p.name for p in run_dir.iterdir()}
    assert names == {"config.json", "r.json", "r.csv", "model", "curves.png", "tensorboard"}  # no checkpoints left
    config = json.loads((run_dir / "config.json").read_text())
    assert RunConfig.from_json(config) == RunConfig.from_json(record["config"])  # the whole RunConfig, by part
    assert config["model"]["conv_features"] == [8, 16, 16] and config["train"]["epochs"] == 2
    assert json.loads((run_dir / "r.json").read_text())["test_accuracy"] == record["test_accuracy"]
    assert (run_dir / "curves.png").read_bytes()[:4] == b"\x89PNG"
    for path in run_dir.rglob("*"):  # results, plot, model and event files alike: 0644 under umask 022
        if path.is_file():
            assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~_umask(), path


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_tensorboard_event_files_load_with_every_figure(finished_run):
    run_dir, record = finished_run
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert tags >= {"train/loss", "train/learning_rate", "train/accuracy", "test/accuracy", "test/loss",
                    "speed/images_per_second", "speed/input_wait_fraction"}  # fmt: skip
    losses = events.Scalars("train/loss")
    assert [e.step for e in losses] == list(range(1, record["steps"] + 1))
    np.testing.assert_allclose([e.value for e in losses], record["loss_history"], rtol=1e-6)
    assert events.Scalars("test/accuracy")[-1].value == pytest.approx(record["test_accuracy"])
    rates = [e.value for e in events.Scalars("train/learning_rate")]
    peak = json.loads((run_dir / "config.json").read_text())["optim"]["learning_rate"]
    assert max(rates) == pytest.approx(peak) and rates[0] < peak and rates[-1] < rates[len(rates) // 2]  # warm, cosine


def test_evaluate_and_predict_reproduce_the_runs_test_accuracy(finished_run, tmp_path):
    run_dir, record = finished_run
    summary = evaluate.main(["--run", str(run_dir), "--out", str(tmp_path / "eval")])
    assert summary["accuracy"] == record["test_accuracy"]  # exactly: the same model, layout and batches
    assert summary["loss"] == pytest.approx(record["test_loss"], rel=1e-5)
    per_class = pd.read_csv(tmp_path / "eval" / "per_class.csv")
    confusion = pd.read_csv(tmp_path / "eval" / "confusion.csv", index_col="true")
    assert confusion.to_numpy().sum() == summary["examples"] == per_class["examples"].sum()
    assert np.trace(confusion.to_numpy()) == per_class["correct"].sum() == round(record["test_accuracy"] * 360)
    assert (tmp_path / "eval" / "confusion.png").exists()
    frame = predict.main(["--run", str(run_dir), "--out", str(tmp_path / "p.csv")])
    labels = pd.read_csv(REPO / "data/test.csv")["label"].to_numpy()
    assert list(frame.columns) == ["ImageId", "Label"] and len(frame) == len(labels)
    assert np.mean(frame["Label"].to_numpy() == labels) == record["test_accuracy"]


def test_the_kept_model_restores_under_another_layout_with_the_same_values(finished_run):
    run_dir, _ = finished_run
    config = ModelConfig(conv_features=(8, 16, 16), dense_features=(32, 16))
    dp = restore_model(run_dir / "model", model_template(config, (8, 8, 1), get_layout("dp"), build_mesh({"data": 8})))
    tp = restore_model(run_dir / "model", model_template(config, (8, 8, 1), get_layout("tp"), build_mesh({"model": 2})))
    for a, b in zip(dp, tp, strict=True):
        a, b = flat_variables(a), flat_variables(b)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert any("model" in str(v.sharding.spec) for v in flat_variables(tp[0]).values())


def test_a_run_directory_is_never_overwritten_without_overwrite(finished_run, tmp_path, capsys):
    run_dir, _ = finished_run
    copy = tmp_path / "r"
    shutil.copytree(run_dir, copy)
    before = {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()}
    module = load_train_module()
    flags = [*TINY, "--max-steps", "2", "--results-dir", str(tmp_path), "--run-name", "r", "--quiet"]
    with pytest.raises(SystemExit) as exit_info:
        cli.run_main("jaxcnn train", lambda: module.main(flags))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already exists; pass another --run-name, --overwrite" in err[0]
    assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()} == before
    (tmp_path / "notarun").mkdir()
    with pytest.raises(SystemExit):  # --overwrite never deletes what jaxcnn did not write
        cli.run_main("jaxcnn train", lambda: module.main([*flags[:-3], "--run-name", "notarun", "--overwrite"]))
    assert "is not a run directory" in capsys.readouterr().err
    diverges = ["--optimizer", "sgd", "--momentum", "0", "--lr", "1e30", "--schedule", "constant", "--warmup-steps",
                "0", "--norm", "none", "--max-steps", "12", "--overwrite"]  # fmt: skip
    with pytest.raises(SystemExit):  # the new run fails: the run it was to replace is put back untouched
        cli.run_main("jaxcnn train", lambda: module.main([*flags, *diverges]))
    assert "training loss is nan" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in copy.rglob("*") if p.is_file()} == before
    record = module.main([*flags, "--overwrite"])
    assert record["steps"] == 2 and json.loads((copy / "r.json").read_text())["steps"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notarun", "r"]  # the old run is gone once replaced


def test_predict_on_a_folder_names_each_file_with_its_class_and_probability(tmp_path):
    train = write_folder(tmp_path / "train", per_class=8, size=(12, 10))
    load_train_module().main(
        ["--data", str(train), "--val-split", "0.25", "--channels", "3", "--num-classes", "3",
         "--model", "cnn2d_2layer_fullconnected_2layer", "--conv-features", "4,8", "--dense-features", "16",
         "--batch-size", "8", "--max-steps", "4", "--host-devices", "8", "--quiet", "--results-dir", str(tmp_path),
         "--run-name", "f"]
    )  # fmt: skip
    flat = tmp_path / "photos"  # the images to label: no class subfolders, another size (resized to the model's)
    write_folder(tmp_path / "other", per_class=2, size=(20, 16), classes=("x",))
    shutil.move(tmp_path / "other" / "x", flat)
    frame = predict.main(["--run", str(tmp_path / "f"), "--data", str(flat), "--layout", "single"])
    assert list(frame.columns) == ["path", "label", "probability"]
    assert sorted(frame["path"]) == sorted(str(p) for p in flat.iterdir())
    assert set(frame["label"]) <= {"cat", "dog", "owl"} and frame["probability"].between(1 / 3, 1).all()
    assert (tmp_path / "f" / "predictions-photos.csv").exists()
    summary = evaluate.main(["--run", str(tmp_path / "f"), "--data", str(train)])  # class subfolders: labelled
    assert summary["examples"] == 24 and (tmp_path / "f" / "evaluation-train" / "per_class.csv").exists()
    assert list(pd.read_csv(tmp_path / "f" / "evaluation-train" / "per_class.csv")["class"]) == ["cat", "dog", "owl"]


def _bad_cases(tmp_path, run_dir):
    other = tmp_path / "other"  # a run directory whose model is of another size than its config says
    shutil.copytree(run_dir, other, ignore=shutil.ignore_patterns("model"))
    config = json.loads((other / "config.json").read_text())
    config["model"]["conv_features"] = [8, 16, 32]
    (other / "config.json").write_text(json.dumps(config))
    shutil.copytree(run_dir / "model", other / "model")
    (other / "r.json").rename(other / "other.json")
    unfinished = tmp_path / "unfinished"
    shutil.copytree(run_dir, unfinished, ignore=shutil.ignore_patterns("model"))
    garbage = tmp_path / "garbage.csv"
    garbage.write_text("label,pixel0\n1,2,3\n")
    wide = write_digits_csv(tmp_path / "wide.csv", rows=8, side=6)
    return {
        "missing run": (["--run", str(tmp_path / "nowhere")], "not found; pass --run"),
        "not a run": (["--run", str(tmp_path)], "is not a run directory (no config.json)"),
        "unfinished run": (["--run", str(unfinished)], "has no trained model: it stopped before finishing"),
        "another model": (["--run", str(other)], "is not this model: "),
        "missing data": (["--run", str(run_dir), "--data", str(tmp_path / "none.csv")], "not found"),
        "unreadable data": (["--run", str(run_dir), "--data", str(garbage)], "garbage.csv"),
        "other image size": (
            ["--run", str(run_dir), "--data", str(wide)],
            "are 6x6x1, but the run's model takes 8x8x1",
        ),
        "pipeline": (["--run", str(run_dir), "--layout", "pipeline"], "use --layout dp"),
        "negative batch": (["--run", str(run_dir), "--batch-size", "-2"], "--batch-size must be a positive integer"),
    }


@pytest.mark.parametrize("command", [predict, evaluate], ids=["predict", "evaluate"])
def test_bad_input_to_predict_and_evaluate_is_one_line_exit_2(finished_run, tmp_path, capsys, command):
    run_dir, _ = finished_run
    for case, (flags, message) in _bad_cases(tmp_path, run_dir).items():
        with pytest.raises(SystemExit) as exit_info:
            cli.run_main(command.PROG, lambda flags=flags: command.main([*flags, "--out", str(tmp_path / "out")]))
        lines = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2 and len(lines) == 1 and message in lines[0], (case, lines)
        assert not (tmp_path / "out").exists(), case
    wrong_kind = tmp_path / ("a_dir" if command is predict else "a_file")  # --out must be a file / a directory
    wrong_kind.mkdir() if command is predict else wrong_kind.write_text("kept")
    with pytest.raises(SystemExit):
        cli.run_main(
            command.PROG, lambda: command.main(["--run", str(run_dir), "--out", str(wrong_kind), "--overwrite"])
        )
    assert f"--out {wrong_kind} is a" in capsys.readouterr().err


def test_evaluate_on_class_folders_uses_the_runs_class_names(finished_run, tmp_path):
    """A CSV-trained run's classes are the labels' names: folder "7" is label 7, not the
    second folder in sorted order."""
    from PIL import Image

    test = pd.read_csv(REPO / "data/test.csv")
    for label in (3, 7):
        (tmp_path / "digits" / str(label)).mkdir(parents=True)
        for i, row in enumerate(test[test["label"] == label].drop(columns="label").to_numpy()[:5]):
            Image.fromarray((row.reshape(8, 8) * 16).clip(0, 255).astype(np.uint8)).save(
                tmp_path / "digits" / str(label) / f"{i}.png"
            )
    run_dir, _ = finished_run
    evaluate.main(["--run", str(run_dir), "--data", str(tmp_path / "digits"), "--out", str(tmp_path / "eval")])
    per_class = pd.read_csv(tmp_path / "eval" / "per_class.csv").set_index("class")
    assert per_class.loc[[3, 7], "examples"].tolist() == [5, 5] and per_class["examples"].sum() == 10


def test_resume_refuses_flags_that_change_the_saved_steps(tmp_path, capsys):
    module = load_train_module()
    flags = [*TINY, "--quiet", "--results-dir", str(tmp_path)]
    saved = ["--checkpoint-dir", str(tmp_path / "ck"), "--max-steps", "20"]
    module.main([*flags, *saved, "--checkpoint-every", "10", "--run-name", "a"])
    refused = "other steps per epoch, batch or seed"
    cases = {
        "another batch": ([*saved, "--run-name", "b", "--resume", "--batch-size", "64"], refused),
        "another seed": ([*saved, "--run-name", "b", "--resume", "--seed", "3"], refused),
        "fewer steps": ([*saved[:2], "--max-steps", "10", "--run-name", "b", "--resume"], refused),
        "no run named": (["--resume"], "--resume needs --run-name NAME"),
        "checkpoints in the run": (["--run-name", "c", "--checkpoint-dir", str(tmp_path / "c" / "ck")], "is inside"),
        "resume and overwrite": ([*saved, "--run-name", "a", "--resume", "--overwrite"], "give one"),
    }
    for case, (extra, message) in cases.items():
        with pytest.raises(SystemExit) as exit_info:
            cli.run_main("jaxcnn train", lambda extra=extra: module.main([*flags, *extra]))
        lines = capsys.readouterr().err.strip().splitlines()
        assert exit_info.value.code == 2 and len(lines) == 1 and message in lines[0], (case, lines)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "ck"]  # nothing made for the refused runs
    longer = module.main([*flags, *saved[:2], "--max-steps", "30", "--run-name", "d", "--resume"])  # more is fine
    assert longer["resumed_from_step"] == 20 and len(longer["loss_history"]) == 30


def _train_process(*flags):
    return subprocess.Popen(
        [sys.executable, str(REPO / "experiments/train.py"), *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, cwd=REPO,
    )  # fmt: skip


def test_ctrl_c_saves_and_resume_matches_an_uninterrupted_run(tmp_path):
    """Under the pipeline, whose state lives per stage (saved as the whole model's: the
    SPMD layouts' stops are test_stopping's)."""
    flags = ["--conv-features", "8,16,16", "--dense-features", "32,16", "--batch-size", "32", "--epochs", "5",
             "--host-devices", "2", "--layout", "pipeline", "--mesh", "stage=2", "--results-dir", str(tmp_path)]  # fmt: skip
    reference = _train_process(*flags, "--run-name", "ref")  # beside the run to stop: the cores overlap them
    run = _train_process(*flags, "--run-name", "run")
    seen = []
    for line in run.stdout:  # stdout is a pipe: one line per epoch, not a progress bar
        seen.append(line)
        if line.startswith("epoch 2/5"):
            run.send_signal(signal.SIGINT)
            break
    _, err = run.communicate(timeout=120)
    assert run.returncode == 130, err
    out, reference_err = reference.communicate(timeout=300)
    assert reference.returncode == 0, reference_err
    assert [line.split()[1] for line in out.splitlines() if line.startswith("epoch ")] == [
        f"{e}/5" for e in range(1, 6)
    ]
    assert "state saved in" in err and "continue with: jaxcnn train --resume --run-name run" in err, err
    partial = json.loads((tmp_path / "run" / "run.json").read_text())
    assert partial["interrupted_at_step"] == len(partial["loss_history"]) >= 2 * 44
    assert partial["test_accuracy"] is None and not (tmp_path / "run" / "model").exists()
    assert list(pd.read_csv(tmp_path / "run" / "run.csv")["epoch"])[:2] == [1, 2]
    resumed = subprocess.run(
        [sys.executable, str(REPO / "experiments/train.py"), "--resume", "--run-name", "run", "--results-dir",
         str(tmp_path), "--quiet"], capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from step {partial['interrupted_at_step']} " in resumed.stdout
    ref, done = (json.loads((tmp_path / n / f"{n}.json").read_text()) for n in ("ref", "run"))
    assert done["loss_history"] == ref["loss_history"] and done["test_accuracy"] == ref["test_accuracy"]
    pd.testing.assert_frame_equal(
        *(
            pd.read_csv(tmp_path / n / f"{n}.csv")[["epoch", "step", "train_loss", "test_accuracy"]]
            for n in ("ref", "run")
        )
    )
    assert (tmp_path / "run" / "model").is_dir() and not (tmp_path / "run" / "checkpoints").exists()
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))  # both parts' event files
    events.Reload()
    assert sorted({e.step for e in events.Scalars("train/loss")}) == list(range(1, len(ref["loss_history"]) + 1))
    epoch_ends = list(pd.read_csv(tmp_path / "ref" / "ref.csv")["step"])
    assert sorted({e.step for e in events.Scalars("test/accuracy")}) == epoch_ends and len(epoch_ends) == 5


def test_a_second_ctrl_c_exits_at_once():
    code = textwrap.dedent("""
        import os, signal, time
        from jaxcnn.stopping import stop_requests
        with stop_requests(multi_process=False) as stop:
            os.kill(os.getpid(), signal.SIGINT)
            print("first: stop requested", stop.check(), flush=True)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)
            print("still running")
    """)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 130 and time.monotonic() - start < 25
    assert proc.stdout.splitlines() == ["first: stop requested True"] and "exiting now" in proc.stderr


def _parser_of(command: str, monkeypatch) -> cli.FlagParser:
    """The parser `jaxcnn <command>` builds, caught as it is asked to parse."""
    module = importlib.import_module(f"jaxcnn.commands.{module_name(command)}")
    caught = []

    def catch(self, args=None, namespace=None):
        caught.append(self)
        raise SystemExit(0)

    with monkeypatch.context() as patch:
        patch.setattr(cli.FlagParser, "parse_args", catch)
        with pytest.raises(SystemExit):
            module.parse_flags([])
    return caught[0]


def test_help_answers_before_jax_is_imported_and_shows_every_default(monkeypatch):
    """Every command in `jaxcnn.commands.COMMANDS`: `--help` prints its usage without
    importing JAX, and each flag's help ends in its default (or says it is required)."""
    code = textwrap.dedent("""
        import sys
        from jaxcnn.commands import COMMANDS, main
        for name in COMMANDS:
            try:
                main([name, "--help"])
            except SystemExit as stop:
                print("exit", name, stop.code)
        print("JAX IMPORTED" if "jax" in sys.modules else "no jax")
    """)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    seconds = time.perf_counter() - start
    assert proc.returncode == 0 and proc.stdout.strip().endswith("no jax"), (proc.stdout[-40:], proc.stderr[-300:])
    assert seconds < 1.0, f"every jaxcnn COMMAND --help took {seconds:.2f} s"
    for name in COMMANDS:
        assert f"usage: jaxcnn {name} " in proc.stdout and f"exit {name} 0" in proc.stdout, name
    for name in COMMANDS:
        parser = _parser_of(name, monkeypatch)
        formatter = parser._get_formatter()
        flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
        assert flags, name
        for action in flags:
            text = formatter._get_help_string(action)
            assert "default" in text.lower() or text.endswith("(required)"), (name, action.option_strings, text)


def test_the_layout_names_flags_list_are_the_layouts():
    assert tuple(LAYOUTS) == LAYOUT_NAMES
