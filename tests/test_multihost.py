"""Several processes on this machine (CPU collectives over gloo) give one process's numbers,
and a dead peer ends the run instead of hanging (jaxcnn.distributed)."""

import json
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import REPO, write_folder

from jaxcnn.commands import main as jaxcnn_main

TRAIN, LAUNCH = REPO / "experiments/train.py", REPO / "experiments/launch_local.py"
TINY = ["--conv-features", "8,16,16", "--dense-features", "32,16", "--batch-size", "32", "--max-steps", "12",
        "--epochs", "1", "--quiet"]  # fmt: skip
# a survivor is told within the heartbeat timeout; the margin covers process start and teardown
HEARTBEAT_TIMEOUT_S = 10
DEAD_PEER_BOUND_S = HEARTBEAT_TIMEOUT_S + 20


def run(args, timeout=300):
    proc = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc


# --val-split 0.4: a test set of 48 of the 120 images, more than one process's 16 rows of a
# batch of 32, so that reading only its rows is a share of the set (process 0: 32 of 48)
FOLDER = ["--image-size", "12x10", "--num-classes", "3", "--augment-shift", "1", "--augment-flip", "--input-workers", "1",
          "--epochs", "3", "--val-split", "0.4"]  # fmt: skip
SHARDS = ["--image-size", "12x10", "--num-classes", "3", "--augment", "imagenet", "--input-workers", "1",
          "--epochs", "1", "--val-split", "0.4"]  # fmt: skip
# data across the two processes, the batch split over model first: each process holds every other block of rows
NOT_CONTIGUOUS = ["--layout-rules", "batch=model+data", "--mesh", "data=2,model=2"]
SLURM_SCRIPT = REPO / "docs/clusters/slurm-task-per-node.sbatch"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def slurm_task_env(node: int, nodes: int = 2) -> dict[str, str]:
    """What srun gives task 0 of node `node` under the script's --ntasks-per-node=1 (every
    "node" this machine; JAX_COORDINATOR_PORT: a free port instead of the job's)."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return env | {
        "SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "localhost", "SLURM_NTASKS": str(nodes),
        "SLURM_PROCID": str(node), "SLURM_LOCALID": "0", "SLURM_NODEID": str(node),
        "SLURM_STEP_TASKS_PER_NODE": f"1(x{nodes})", "JAX_COORDINATOR_PORT": str(free_port()),
    }  # fmt: skip


def run_slurm_script(flags: list[str]) -> str:
    """docs/clusters/slurm-task-per-node.sbatch's srun command, as 2 tasks on 2 "nodes": this
    machine's processes with the variables SLURM would give them (`flags` for its "$@")."""
    from test_launchers import srun_train_command

    command = srun_train_command(SLURM_SCRIPT, flags)
    envs = [slurm_task_env(node) for node in range(2)]
    envs[1]["JAX_COORDINATOR_PORT"] = envs[0]["JAX_COORDINATOR_PORT"]
    procs = [subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for env in envs]  # fmt: skip
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    return "\n".join(f"[p{i}] {line}" for i, out in enumerate(outs) for line in out.splitlines())


# the digits held in memory, launched as SLURM runs docs/clusters' one-task-per-node script, under
# a table whose batch rows are not one span per process; hybrid (data across the processes, model within each) on an image folder, each process's rows
# decoded and augmented in a grain worker of its own; dp on prepared shards (`jaxcnn prepare`),
# each process cutting random resized crops of its rows; the pipeline, its stages inside each
# process, `data` across them
@pytest.mark.parametrize(
    "layout_flags",
    [[*NOT_CONTIGUOUS, "slurm"], ["--layout", "hybrid", "--mesh", "data=2,model=2", *FOLDER],
     ["--mesh", "data=4", *SHARDS], ["--layout", "pipeline", "--mesh", "data=2,stage=2"]],
    ids=["slurm-rows-not-contiguous", "hybrid-image-folder", "dp-shards", "pipeline-stages-in-a-process"],
)  # fmt: skip
def test_two_processes_of_two_devices_equal_one_process_of_four(tmp_path, layout_flags):
    """The global batches do not depend on the process count: each process decodes and
    augments only its rows of each (image folder: in a grain worker process) -- and
    evaluates only its rows of the test set, to the same accuracy and loss."""
    slurm = "slurm" in layout_flags
    layout_flags = [f for f in layout_flags if f != "slurm"]
    if "--image-size" in layout_flags:
        layout_flags = ["--data", write_folder(tmp_path / "images", per_class=40), *layout_flags]
    if "--augment" in layout_flags:  # the folder's prepared shards instead
        jaxcnn_main(
            ["prepare", "--quiet", "--workers", "0", "--data", str(layout_flags[1]), "--out", str(tmp_path / "s")]
        )
        layout_flags[1] = tmp_path / "s"
    one = [TRAIN, *TINY, *layout_flags, "--host-devices", "4", "--results-dir", tmp_path / "one", "--run-name", "r"]
    two_flags = [*TINY, *layout_flags, "--results-dir", tmp_path / "two", "--run-name", "r"]
    with open(tmp_path / "one.log", "w") as log:  # beside the two processes: the cores overlap them
        one_run = subprocess.Popen([sys.executable, *map(str, one)], stdout=log, stderr=subprocess.STDOUT)
        try:
            if slurm:
                out = run_slurm_script([*map(str, two_flags), "--checkpoint-dir", str(tmp_path / "checkpoints")])
            else:
                out = run([LAUNCH, "--num-processes", "2", "--devices-per-process", "2", "--", *two_flags]).stdout
            assert one_run.wait(timeout=300) == 0, (tmp_path / "one.log").read_text()[-2000:]
        finally:
            one_run.kill()  # a no-op once it has ended
    one, two = (json.loads((tmp_path / d / "r" / "r.json").read_text()) for d in ("one", "two"))
    assert two["num_processes"] == 2 and two["num_devices"] == 4 and one["num_processes"] == 1
    assert two["launch"]["launcher"] == ("slurm" if slurm else "flags")
    assert (one["input_rows_per_process"], two["input_rows_per_process"]) == (32, 16)  # each builds only its rows
    np.testing.assert_allclose(two["loss_history"], one["loss_history"], rtol=1e-5)
    # each process reads only its rows of every test batch of 32: process 0 rows 0-15 (two blocks of 8)
    test_size = one["eval_examples_per_process"]  # one process reads them all
    held = [*range(8), *range(16, 24)] if layout_flags == NOT_CONTIGUOUS else range(16)
    assert two["eval_examples_per_process"] == sum(b + r < test_size for b in range(0, test_size, 32) for r in held)
    assert two["eval_examples_per_process"] < test_size  # a share: every case's test set outgrows one process's rows
    np.testing.assert_allclose(two["test_accuracy"], one["test_accuracy"], rtol=1e-6)
    np.testing.assert_allclose(two["test_loss"], one["test_loss"], rtol=1e-5)
    assert "[p0] wrote" in out and "[p1] wrote" not in out  # only process 0 writes results


def test_a_dead_peer_ends_the_run_within_the_bound(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    # not --quiet: process 0 prints a line at each epoch's end (its stdout is a pipe, not a terminal)
    common = [sys.executable, str(TRAIN), *TINY[:-5], "--epochs", "100000", "--mesh", "data=4",
              "--results-dir", str(tmp_path), "--coordinator", f"localhost:{port}", "--num-processes", "2",
              "--host-devices", "2", "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S)]  # fmt: skip
    procs = [
        subprocess.Popen([*common, "--process-id", str(i)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)
    ]
    connected, trained = threading.Event(), threading.Event()

    def watch(stream):
        for line in stream:
            if "connected" in line:  # the gloo ranks print once connected
                connected.set()
            if line.startswith("epoch 1/"):  # the step compiled and ran a whole epoch over both processes
                trained.set()

    threading.Thread(target=watch, args=(procs[0].stdout,), daemon=True).start()
    try:
        assert connected.wait(timeout=120), "the processes never connected"
        assert trained.wait(timeout=120), "the processes connected but never finished an epoch"
        assert all(p.poll() is None for p in procs), "a process ended before the peer was killed"
        procs[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        procs[0].wait(timeout=DEAD_PEER_BOUND_S + 30)
        elapsed = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert procs[0].returncode != 0
    assert elapsed < DEAD_PEER_BOUND_S, f"survivor took {elapsed:.1f} s"


# train.py in a process whose metrics fetches are, on process 0, always ready at once and, on
# process 1, never ready before they are due (its devices far behind); it says how many steps
# it had dispatched when a non-finite loss stopped it
NAN_DRIVER = """
import sys

import jaxcnn.fit.metrics as metrics
from jaxcnn.commands import cli
from jaxcnn.commands.train import PROG, main

process_id = int(sys.argv[sys.argv.index("--process-id") + 1])
metrics.Fetch.ready = lambda self: process_id == 0
read = metrics.MetricsReader._read


def recorded(self, values):
    try:
        read(self, values)
    except metrics.NonFiniteLoss:
        print(f"stopped with {self.dispatched} steps dispatched", flush=True)
        raise


metrics.MetricsReader._read = recorded
cli.run_main(PROG, lambda: main(sys.argv[1:]))
"""


def test_a_non_finite_loss_on_two_processes_stops_both_at_the_same_step(tmp_path):
    """Two processes, a NaN from step 2 (a learning rate of 1e30): though process 0's metrics
    arrive at once and process 1's only when due, both stop having dispatched the same steps
    (their collectives pair up: neither is left waiting in one) and both exit 2 with the
    same one-line error."""
    driver = tmp_path / "nan_driver.py"
    driver.write_text(NAN_DRIVER)
    flags = ["--model", "cnn2d_2layer_fullconnected_2layer", "--conv-features", "8,16", "--dense-features", "32",
             "--batch-size", "16", "--epochs", "1", "--quiet",
             "--optimizer", "sgd", "--momentum", "0", "--lr", "1e30", "--schedule", "constant", "--warmup-steps", "0",
             "--norm", "none", "--mesh", "data=2", "--host-devices", "1", "--results-dir", str(tmp_path),
             "--coordinator", f"localhost:{free_port()}", "--num-processes", "2", "--heartbeat-timeout", "10"]  # fmt: skip
    command = [sys.executable, str(driver), *flags, "--process-id"]
    procs = [
        subprocess.Popen([*command, str(i)], cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for i in range(2)
    ]
    try:
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            p.kill()  # a no-op once it has ended
    said = [f"[p{i}] {out}{err}" for i, (out, err) in enumerate(outs)]
    assert [p.returncode for p in procs] == [2, 2], "\n".join(s[-2000:] for s in said)
    for _, err in outs:
        assert "training loss is nan at step 2; stopped" in err.strip().splitlines()[-1], err[-2000:]
    stopped = [re.findall(r"stopped with (\d+) steps dispatched", out) for out, _ in outs]
    assert all(len(s) == 1 for s in stopped) and stopped[0] == stopped[1], stopped
