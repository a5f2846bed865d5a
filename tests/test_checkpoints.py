"""Checkpoints survive a kill; resuming is exact, also onto another layout; damaged
checkpoints are skipped; a non-finite loss stops the run without saving it."""

import contextlib
import functools
import json
import random
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import jax
import numpy as np
import pandas as pd
import pytest
from conftest import REPO, bundled_digits, load_train_module, write_folder

from jaxcnn.build import build_program
from jaxcnn.checkpoint import Checkpointer, arrays_equal
from jaxcnn.commands import cli
from jaxcnn.config import ModelConfig, OptimConfig
from jaxcnn.sharding import build_mesh, get_layout

TINY = ["--conv-features", "8,16,16", "--dense-features", "32,16", "--batch-size", "32", "--quiet"]


def train(tmp_path, name, *flags):
    """experiments/train.py in-process (the suite's 8 devices); its JSON record."""
    module = load_train_module()
    return module.main([*TINY, "--results-dir", str(tmp_path), "--run-name", name, *flags])


TINY_CONFIG = ModelConfig(conv_features=(8, 16, 16), dense_features=(32, 16))


@functools.cache
def restoring_program(layout, mesh_items, config, image_shape, steps):
    """The run's own train program (`steps` of the default optimiser: the compile cache holds it)."""
    return build_program(
        config, OptimConfig(), get_layout(layout), build_mesh(dict(mesh_items)), image_shape, 32, steps,
        with_eval=False, with_init=False,
    )  # fmt: skip


def final_state(directory, layout="dp", mesh=None, config=TINY_CONFIG, image_shape=(8, 8, 1), steps=30):
    program = restoring_program(layout, tuple((mesh or {"data": 8}).items()), config, image_shape, steps)
    checkpointer = Checkpointer(directory, every=1)
    restored = checkpointer.restore_latest(program.abstract_state)
    checkpointer.close()
    return restored


def test_a_save_on_cpu_devices_writes_replicated_arrays_whole_compiling_nothing(tmp_path, caplog):
    """Orbax by default splits a replicated array's copy to the host among its replicas, a
    slice op compiled per shape and slice (seconds for a small model); on CPU devices the
    first replica is written whole: saving compiles nothing, and reads back equal."""
    import logging

    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxcnn.saved_model import ModelVariables, save_model

    replicated = NamedSharding(build_mesh({"data": 8}), P())
    params = {f"w{n}": jax.device_put(np.arange(8 * n, dtype=np.float32).reshape(8, n), replicated) for n in (13, 29)}
    with caplog.at_level(logging.WARNING, logger="jax"), jax.log_compiles():
        save_model(tmp_path / "model", ModelVariables(params, {}))
    assert not [r.getMessage() for r in caplog.records if "ompil" in r.getMessage()]
    back = ocp.StandardCheckpointer().restore(tmp_path / "model")["params"]
    assert all(np.array_equal(back[k], params[k]) for k in params)


def test_resume_continues_exactly_and_onto_another_layout(tmp_path):
    full = train(
        tmp_path, "full", "--max-steps", "30", "--checkpoint-dir", str(tmp_path / "a"), "--checkpoint-every", "10"
    )
    # drop the last checkpoint: the resumed runs restart from step 20
    for copy in ("b", "c"):
        subprocess.run(["cp", "-r", str(tmp_path / "a"), str(tmp_path / copy)], check=True)
        subprocess.run(["rm", "-rf", str(tmp_path / copy / "30")], check=True)
    same = train(tmp_path, "same", "--max-steps", "30", "--checkpoint-dir", str(tmp_path / "b"), "--resume")
    other = train(
        tmp_path, "other", "--max-steps", "30", "--checkpoint-dir", str(tmp_path / "c"), "--resume",
        "--layout", "hybrid", "--mesh", "data=4,model=2",
    )  # fmt: skip
    assert same["resumed_from_step"] == 20 and len(same["loss_history"]) == 30
    assert same["loss_history"] == full["loss_history"]  # bit for bit: same program, same data position
    np.testing.assert_allclose(other["loss_history"], full["loss_history"], rtol=1e-5)
    a, b = final_state(tmp_path / "a"), final_state(tmp_path / "b")
    assert a.step == b.step == 30 and arrays_equal(a.state, b.state)
    # saved under dp on data=8, restored under hybrid data=4,model=2: the same values
    resharded = final_state(tmp_path / "a", "hybrid", {"data": 4, "model": 2})
    assert arrays_equal(resharded.state.params, a.state.params)
    assert any("model" in str(leaf.sharding.spec) for leaf in jax.tree.leaves(resharded.state.params))


def test_a_pipeline_resumes_exactly_and_onto_dp_and_back(tmp_path):
    """Its checkpoints hold the whole model's TrainState, the tree dp saves: dp continues a
    pipeline run, and the pipeline continues dp (no batch norm, whose
    statistics the pipeline takes per micro-batch: the layouts then train alike)."""
    pipeline, dp = ["--layout", "pipeline", "--mesh", "data=2,stage=2"], ["--mesh", "data=4"]

    def run(name, layout, directory, *flags):
        return train(tmp_path, name, "--max-steps", "30", "--norm", "none", *layout,
                     "--checkpoint-dir", str(tmp_path / directory), "--checkpoint-every", "10", *flags)  # fmt: skip

    def copy_until(source, target, step):
        subprocess.run(["cp", "-r", str(tmp_path / source), str(tmp_path / target)], check=True)
        for later in range(step + 10, 31, 10):
            subprocess.run(["rm", "-rf", str(tmp_path / target / str(later))], check=True)

    full = run("full", pipeline, "a")  # (its bit-for-bit resume: the kill test below, and test_runs' Ctrl-C)
    copy_until("a", "c", 10)
    onto_dp = run("onto-dp", dp, "c", "--resume")  # steps 11-30 under dp, saving 20 and 30 as dp
    copy_until("c", "d", 20)
    # steps 21-30 under the pipeline again, from dp's state: interleaved, two chunks a stage
    back = run("back", [*pipeline, "--pipeline-schedule", "1f1b", "--virtual-stages", "2"], "d", "--resume")
    assert (onto_dp["resumed_from_step"], back["resumed_from_step"]) == (10, 20)
    np.testing.assert_allclose(onto_dp["loss_history"], full["loss_history"], rtol=1e-5)
    np.testing.assert_allclose(back["loss_history"], full["loss_history"], rtol=1e-5)
    config = replace(TINY_CONFIG, norm="none")
    a, d = final_state(tmp_path / "a", config=config), final_state(tmp_path / "d", config=config)
    assert a.step == d.step == 30
    for x, y in zip(jax.tree.leaves(a.state), jax.tree.leaves(d.state), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-6)


def test_a_resumed_run_holds_every_epoch_and_reports_no_throughput_when_nothing_was_left(tmp_path, capsys):
    # a checkpoint every epoch's steps (the bundled digits at batch 256): both fall on an epoch's end
    per_epoch = len(bundled_digits()) // 256
    flags = ["--batch-size", "256", "--epochs", "2", "--checkpoint-every", str(per_epoch)]
    full = train(tmp_path, "full", *flags, "--checkpoint-dir", str(tmp_path / "a"))
    assert sorted(int(p.name) for p in (tmp_path / "a").iterdir() if p.name.isdigit()) == [per_epoch, 2 * per_epoch]
    subprocess.run(["cp", "-r", str(tmp_path / "a"), str(tmp_path / "b")], check=True)
    subprocess.run(["rm", "-rf", str(tmp_path / "b" / str(2 * per_epoch))], check=True)
    capsys.readouterr()
    done = train(tmp_path, "done", *flags, "--checkpoint-dir", str(tmp_path / "a"), "--resume")  # at the last step
    summary = capsys.readouterr().out
    later = train(tmp_path, "later", *flags, "--checkpoint-dir", str(tmp_path / "b"), "--resume")  # after epoch 1
    columns = ["epoch", "step", "train_loss", "train_accuracy", "test_loss", "test_accuracy"]
    reference = pd.read_csv(tmp_path / "full" / "full.csv")[columns]
    assert list(reference["epoch"]) == [1, 2] and full["epochs"] == 2
    for name, record in (("done", done), ("later", later)):
        rows = pd.read_csv(tmp_path / name / f"{name}.csv")[columns]
        pd.testing.assert_frame_equal(rows, reference, rtol=1e-6)  # the restored epochs included
        assert record["epochs"] == 2 and record["loss_history"] == full["loss_history"]
    # nothing was trained: no throughput (it read 1,000,000,000 images/s), and the summary says why
    on_disk = json.loads((tmp_path / "done" / "done.json").read_text())
    assert done["images_per_second"] is None and on_disk["images_per_second"] is None
    assert on_disk["input_wait_fraction"] is None and on_disk["resumed_from_step"] == 2 * per_epoch
    assert later["resumed_from_step"] == per_epoch
    assert "nothing left to train" in summary and "images/s" not in summary
    assert later["images_per_second"] > 0 and 0 <= later["input_wait_fraction"] < 1


def test_damaged_latest_checkpoint_falls_back_with_a_warning(tmp_path, recwarn):
    train(tmp_path, "a", "--max-steps", "20", "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "10")
    for blob in (tmp_path / "ck" / "20" / "state").rglob("d/*"):
        if blob.is_file():
            blob.write_bytes(blob.read_bytes()[:16])  # truncated array data
    restored = final_state(tmp_path / "ck", steps=20)
    assert restored.step == 10
    assert any("checkpoint step 20" in str(w.message) and "damaged" in str(w.message) for w in recwarn.list)


def test_non_finite_loss_stops_naming_the_step_and_saves_nothing_after_it(tmp_path, capsys):
    flags = ["--optimizer", "sgd", "--momentum", "0", "--lr", "1e30", "--schedule", "constant", "--warmup-steps", "0",
             "--norm", "none", "--max-steps", "12"]  # fmt: skip
    with pytest.raises(SystemExit) as exit_info:
        cli.run_main(
            "train.py",
            lambda: train(tmp_path, "nan", *flags, "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "1"),
        )
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "training loss is nan at step 2; stopped" in error[0], error
    assert "last good checkpoint is step 1" in error[0]
    steps = Checkpointer(tmp_path / "ck", every=1).steps()
    assert steps == [1]
    assert not (tmp_path / "nan" / "nan.json").exists()
    skipped = train(tmp_path, "skip", *flags, "--skip-nonfinite")
    assert skipped["skipped_steps"] == 11  # every step after the first overflows the parameters


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():  # each thread's children
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's parent here need not reap it)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in status and "State:\tX" not in status


KILL_SEED = 0  # draws step 20


def test_kill_at_a_random_step_and_resume_equals_an_uninterrupted_run(tmp_path):
    """SIGKILL mid-training, then --resume: on an image folder decoded and augmented by two
    grain workers, epochs of 3 steps and checkpoints every 5, so the run stops mid-epoch
    and the loader must continue at the exact example (its position is in the checkpoint).
    Under the pipeline, whose state lives per stage: its checkpoints hold the whole model's
    state, which dp's program restores below (dp's kill and restart: test_stopping)."""
    folder = write_folder(tmp_path / "images", per_class=40, size=(12, 10))
    flags = [*TINY, "--max-steps", "30", "--checkpoint-every", "5", "--results-dir", str(tmp_path / "runs"),
             "--layout", "pipeline", "--host-devices", "2", "--mesh", "stage=2",
             "--data", str(folder), "--num-classes", "3", "--channels", "3",
             "--augment-shift", "1", "--augment-flip", "--input-workers", "2"]  # fmt: skip
    script = [sys.executable, str(REPO / "experiments/train.py")]
    # the uninterrupted run beside the one to kill (two processes of their own; the machine's cores overlap them)
    with open(tmp_path / "ref.err", "w") as err:
        reference = subprocess.Popen(
            [*script, *flags, "--checkpoint-dir", str(tmp_path / "ref"), "--run-name", "ref"],
            stdout=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip
    # the checkpoint to kill after: one mid-epoch (epochs of 3 steps: 108 of the 120 images
    # train, 12 are held out), drawn from a fixed seed so that a failure reruns the same kill
    kill_after = random.Random(KILL_SEED).choice([step for step in range(10, 25, 5) if step % 3])
    victim = subprocess.Popen([*script, *flags, "--checkpoint-dir", str(tmp_path / "ck"), "--run-name", "run"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 240
    while not (tmp_path / "ck" / str(kill_after)).exists() and victim.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    workers = _children(victim.pid)  # the grain worker processes (and multiprocessing's resource tracker)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert victim.returncode == -signal.SIGKILL, f"the run ended before step {kill_after}"
    assert len(workers) >= 2
    deadline = time.monotonic() + 10
    while any(map(_running, workers)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_running, workers)), "the killed run's input workers outlived it"
    assert not (tmp_path / "runs" / "run" / "run.json").exists()
    assert reference.wait(timeout=300) == 0, (tmp_path / "ref.err").read_text()
    resumed = subprocess.run(
        [*script, *flags, "--checkpoint-dir", str(tmp_path / "ck"), "--run-name", "run", "--resume"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    ref, run = (json.loads((tmp_path / "runs" / n / f"{n}.json").read_text()) for n in ("ref", "run"))
    assert run["resumed_from_step"] % 5 == 0 and kill_after - 5 <= run["resumed_from_step"] < 30
    assert f"resuming from step {run['resumed_from_step']} " in resumed.stdout
    assert run["loss_history"] == ref["loss_history"]
    config = replace(TINY_CONFIG, num_classes=3)
    a, b = (final_state(tmp_path / d, config=config, image_shape=(12, 10, 3)) for d in ("ref", "ck"))
    assert a.step == b.step == 30 and arrays_equal(a.state, b.state)
    assert a.record["loader"]["next_step"] == b.record["loader"]["next_step"] == 30
