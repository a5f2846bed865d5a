"""experiments/train.py end to end: result files as DESIGN specifies, and bad input as one line."""

import json
import subprocess
import sys

import pandas as pd
import pytest
from conftest import REPO, bundled_digits, load_train_module, write_digits_csv

from jaxcnn.commands import cli
from jaxcnn.results import EPOCH_COLUMNS
from jaxcnn.sharding import LAYOUTS

SCRIPT = REPO / "experiments/train.py"
SMALL = ["--conv-features", "8,16,16", "--dense-features", "32,16", "--batch-size", "32", "--quiet"]
JSON_KEYS = {
    "model", "layout", "mesh", "num_devices", "num_processes", "global_batch_size", "steps", "loss_history",
    "test_accuracy", "test_loss", "images_per_second", "compile_seconds", "wall_seconds", "input_wait_fraction",
}  # fmt: skip


def run_cli(*args, cwd=REPO):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=cwd, timeout=300)


@pytest.mark.slow
def test_cli_run_writes_both_result_files(tmp_path, capsys):
    """In-process (a real process: test_bad_input_in_a_real_process_..., tests/test_runs.py)."""
    load_train_module().main([*SMALL, "--epochs", "2", "--mesh", "data=8", "--results-dir", str(tmp_path),
                              "--run-name", "e2e"])  # fmt: skip
    stdout = capsys.readouterr().out
    record = json.loads((tmp_path / "e2e" / "e2e.json").read_text())
    assert set(record) >= JSON_KEYS
    assert record["layout"] == "dp" and record["mesh"] == {"data": 8} and record["num_devices"] == 8
    assert record["steps"] == 2 * (len(bundled_digits()) // 32) == len(record["loss_history"])
    assert 0.5 < record["test_accuracy"] <= 1.0 and record["images_per_second"] > 0
    epochs = pd.read_csv(tmp_path / "e2e" / "e2e.csv")
    assert list(epochs.columns) == EPOCH_COLUMNS and list(epochs["epoch"]) == [1, 2]
    assert epochs["step"].iloc[-1] == record["steps"]
    assert "test accuracy" in stdout and "images/s" in stdout


def test_label_free_test_file_gets_a_submission(tmp_path):
    test_csv = write_digits_csv(tmp_path / "unlabelled.csv", rows=21, labels=False)
    record = load_train_module().main(
        [*SMALL, "--max-steps", "3", "--host-devices", "8", "--mesh", "data=8", "--test-data", str(test_csv),
         "--results-dir", str(tmp_path), "--run-name", "sub"]
    )  # fmt: skip
    submission = pd.read_csv(tmp_path / "sub" / "submission.csv")
    assert list(submission.columns) == ["ImageId", "Label"]
    assert list(submission["ImageId"]) == list(range(1, 22))
    assert submission["Label"].between(0, 9).all()
    assert record["test_accuracy"] is None


def _ragged(tmp_path):
    path = tmp_path / "ragged.csv"
    path.write_text("label,pixel0,pixel1,pixel2,pixel3\n1,0,1,2,3\n2,0,1,2,3,4\n")
    return str(path)


BAD_INPUT = {
    "mesh too big": (["--mesh", "data=16", "--host-devices", "8"], "needs 16 devices but 8 exist"),
    "unknown axis": (["--mesh", "rows=8"], "unknown mesh axis 'rows'"),
    "unknown layout": (["--layout", "zero3"], "unknown layout 'zero3'"),
    "batch not divisible": (
        ["--batch-size", "100", "--mesh", "data=8"],
        "global batch of 100 is not divisible by mesh",
    ),
    "height not divisible": (
        ["--layout", "spatial", "--synthetic", "6x6x1", "--mesh", "data=2,spatial=4", "--batch-size", "8"],
        "image height 6 is not divisible by mesh axes spatial=4",
    ),
    "missing file": (["--data", "nowhere.csv"], "nowhere.csv not found"),
    "unknown dataset": (["--dataset", "cifar"], "unknown --dataset 'cifar'; use digits"),
    "dataset not found": (
        ["--dataset", "mnist", "--data-dir", lambda tmp: str(tmp / "empty")],
        "--dataset mnist: its files are in none of",
    ),
    "ragged file": (["--data", _ragged], "ragged rows"),
    "bad flag value": (["--epochs", "many"], "argument --epochs: invalid int value"),
    "layout axis missing": (["--layout", "dp", "--mesh", "model=8"], "splits over mesh axis 'data'"),
    "micro-batches not dividing": (
        ["--layout", "pipeline", "--mesh", "data=4,stage=2", "--microbatches", "3"],
        "--microbatches 3 must divide the global batch 64",
    ),
    "more stages than layers": (
        ["--layout", "pipeline", "--model", "cnn2d_1layer_fullconnected_1layer", "--mesh", "data=2,stage=4"],
        "a pipeline of 4 stages needs at least 4 layers",
    ),
    "micro-batches without pipeline": (["--microbatches", "4"], "apply to --layout pipeline only"),
    "channels not divisible": (
        ["--layout-rules", "batch=data,channels=model", "--mesh", "data=4,model=2"],
        "image channels 1 is not divisible by mesh axes model=2",
    ),
    "a later batch not divisible": (
        ["--batch-schedule", "0:64,1:100", "--epochs", "2"],
        "global batch of 100 is not divisible by mesh axes data=8",
    ),
    "bad flag before a missing file": (
        ["--input-workers", "-1", "--data", "nowhere.csv"],
        "--input-workers must be >= 0 and --prefetch >= 1, got -1 and 2",
    ),
    # training techniques
    "grad-accum zero": (["--grad-accum", "0"], "--grad-accum must be a positive integer"),
    "grad-accum not dividing": (["--grad-accum", "3"], "does not split into 8 data shards x 3 micro-batches"),
    "local sgd without replicas": (
        ["--layout", "fsdp", "--sync", "local-sgd"],
        "splits the batch but not the parameters",
    ),
    "staleness with local sgd": (["--sync", "local-sgd", "--staleness", "2"], "use it with --sync allreduce"),
    "negative staleness": (["--staleness", "-1"], "--staleness must be >= 0"),
    "sync-every without local sgd": (["--sync-every", "4"], "--sync-every applies to --sync local-sgd"),
    "batch schedule unreadable": (["--batch-schedule", "0:64,x"], "is not a list of EPOCH:BATCH pairs"),
    "batch schedule not from 0": (["--batch-schedule", "5:64"], "must start at epoch 0"),
    "linear scaling without base": (["--lr-scaling", "linear"], "needs --base-batch"),
    "auto-batch unreadable": (["--auto-batch", "lots"], "cannot read 'lots' as a size"),
    "auto-batch too small": (["--auto-batch", "1KiB"], "even a global batch of 8 needs"),
    "auto-batch with schedule": (["--auto-batch", "1GiB", "--batch-schedule", "0:64"], "drop it or --batch-schedule"),
    "remat unknown": (["--remat", "some"], "argument --remat: invalid choice"),
    "remat names unknown": (["--remat", "names", "--remat-names", "conv,attn"], "unknown --remat-names attn"),
    # checkpoints and multi-host
    "resume without a directory": (["--resume"], "nothing to resume: no run directory"),
    "checkpoint interval zero": (
        ["--checkpoint-dir", lambda t: str(t / "ck"), "--checkpoint-every", "0"],
        "--checkpoint-every must be a positive integer",
    ),
    "keep zero checkpoints": (
        ["--checkpoint-dir", lambda t: str(t / "ck"), "--keep-checkpoints", "0"],
        "--keep-checkpoints must be a positive integer",
    ),
    "checkpoint dir is a file": (["--checkpoint-dir", lambda t: str(t / "keep.json")], "is a file; give a directory"),
    "coordinator without port": (
        ["--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"],
        "must be HOST:PORT",
    ),
    "coordinator without process count": (["--coordinator", "localhost:1234"], "--coordinator needs --num-processes"),
    "process id out of range": (
        ["--coordinator", "localhost:1234", "--num-processes", "2", "--process-id", "2"],
        "--process-id must be in 0..1",
    ),
    "process count without coordinator": (["--num-processes", "2"], "need --coordinator HOST:PORT"),
    # out-of-range numbers
    "negative learning rate": (["--lr", "-1"], "--learning-rate must be positive"),
    "dropout of one": (["--dropout", "1"], "--dropout must be in [0, 1)"),
    "zero batch": (["--batch-size", "0"], "--batch-size must be a positive integer"),
    "zero max steps": (["--max-steps", "0"], "--max-steps must be a positive integer"),
    "one class": (["--num-classes", "1"], "--num-classes must be at least 2"),
    "pipeline with grad-accum": (
        ["--layout", "pipeline", "--mesh", "data=2,stage=4", "--grad-accum", "2"],
        "do not apply to --layout pipeline",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUT))
def test_bad_input_is_one_line_nonzero_and_leaves_results_alone(tmp_path, case, capsys):
    """In-process (the suite's 8 devices; each mesh here needs 8), through the same
    wrapper the script's __main__ uses; a real process is checked below."""
    flags, message = BAD_INPUT[case]
    flags = [f(tmp_path) if callable(f) else f for f in flags]
    earlier = tmp_path / "keep.json"
    earlier.write_text('{"earlier": "run"}\n')
    module = load_train_module()
    with pytest.raises(SystemExit) as exit_info:
        cli.run_main(
            "train.py", lambda: module.main([*flags, "--results-dir", str(tmp_path), "--run-name", "keep", "--quiet"])
        )
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
    assert earlier.read_text() == '{"earlier": "run"}\n'


def test_bad_input_in_a_real_process_exits_2_without_traceback(tmp_path):
    proc = run_cli("--layout", "zero3", "--results-dir", str(tmp_path))
    assert (
        proc.returncode == 2
        and proc.stderr.strip() == "jaxcnn train: error: unknown layout 'zero3'; use one of " + ", ".join(LAYOUTS)
    )


def test_unwritable_results_dir_is_refused_before_training(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    module = load_train_module()
    with pytest.raises(SystemExit) as exit_info:
        cli.run_main("train.py", lambda: module.main(["--results-dir", str(blocker / "sub"), "--quiet"]))
    stderr = capsys.readouterr().err
    assert exit_info.value.code != 0 and "cannot be written" in stderr and "Traceback" not in stderr


def test_environment_cluster_variables_are_checked(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("JAXCNN_COORDINATOR", "localhost:1234")
    monkeypatch.setenv("JAXCNN_NUM_PROCESSES", "two")
    module = load_train_module()
    with pytest.raises(SystemExit):
        cli.run_main("train.py", lambda: module.main(["--results-dir", str(tmp_path), "--quiet"]))
    assert "JAXCNN_NUM_PROCESSES='two' is not an integer" in capsys.readouterr().err


def test_existing_checkpoints_are_not_overwritten_without_resume(tmp_path, capsys):
    module = load_train_module()
    flags = [*SMALL, "--max-steps", "2", "--checkpoint-dir", str(tmp_path / "ck"), "--results-dir", str(tmp_path)]
    module.main([*flags, "--run-name", "first"])
    before = sorted(p.name for p in (tmp_path / "ck").iterdir())
    with pytest.raises(SystemExit):
        cli.run_main("train.py", lambda: module.main([*flags, "--run-name", "second"]))
    assert "already holds checkpoints (steps 2); pass --resume" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == before
    with pytest.raises(SystemExit):  # a checkpoint of another model: one line, nothing touched
        cli.run_main(
            "train.py", lambda: module.main([*flags, "--run-name", "third", "--resume", "--conv-features", "8,16,32"])
        )
    assert "holds a different model or training state" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "first"]  # no run directory for the refused runs
