"""A stop every process agrees on (jaxcnn.stopping), as clusters stop jobs: real processes,
signals and restarts. SIGTERM to one of two processes stops both at one step, where both
save; the same command again continues (and stops again at --stop-signal); one process
continues it; a process killed outright is restarted with the others from the last
checkpoint (launch_local.py --max-restarts). Every run ends with the losses of one uninterrupted run."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, TWO_EPOCHS_ON_4, load_script

TRAIN, LAUNCH = REPO / "experiments/train.py", REPO / "experiments/launch_local.py"
RUN_LIMIT_S = 300  # a launch, start to end (they take well under a minute)
STEPS_PER_EPOCH = 89  # the bundled digits' 1,437 training images in batches of 16
FLAGS = TWO_EPOCHS_ON_4  # not --quiet: the tests time their signals by process 0's epoch lines


@pytest.fixture
def reference(uninterrupted) -> dict:
    """One process of 4 devices, never stopped."""
    return uninterrupted


def children(pid: int) -> dict[int, int]:
    """{process id (--process-id): pid} of the training processes a launcher started."""
    found = {}
    for child in map(int, Path(f"/proc/{pid}/task/{pid}/children").read_text().split()):
        args = Path(f"/proc/{child}/cmdline").read_text().split("\0")
        found[int(args[args.index("--process-id") + 1])] = child
    return found


def start(command: list, **kw) -> subprocess.Popen:
    """A process in a session of its own: a hung run's whole tree can be killed."""
    return subprocess.Popen([sys.executable, *map(str, command)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=REPO, start_new_session=True, **kw)  # fmt: skip


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL `proc` and what it started (a hung training process does not end at SIGTERM:
    JAX's preemption notifier holds it)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def signal_after(proc: subprocess.Popen, line_start: str, send) -> str:
    """Read `proc`'s output; once a line starts with `line_start`, call `send()`; its whole
    output. A run that has not ended within RUN_LIMIT_S fails the test (killed, not left hanging)."""
    seen, sent, hung = [], False, threading.Event()
    watchdog = threading.Timer(RUN_LIMIT_S, lambda: (hung.set(), kill_tree(proc)))
    watchdog.start()
    try:
        for line in proc.stdout:
            seen.append(line)
            if not sent and line.startswith(line_start):
                send()
                sent = True
        proc.wait(timeout=RUN_LIMIT_S)
    finally:
        watchdog.cancel()
        kill_tree(proc)  # a no-op once everything has ended
    assert not hung.is_set(), f"no end within {RUN_LIMIT_S} s:\n" + "".join(seen)[-3000:]
    assert sent, "".join(seen)[-3000:]
    return "".join(seen)


def stopped_steps(out: str) -> list[int]:
    """The step each process said it stopped (and saved) at."""
    return [int(s) for s in re.findall(r"stopped \(\w+\) at step (\d+)", out)]


def record(results, name) -> dict:
    return json.loads((results / name / f"{name}.json").read_text())


def assert_same_run(run: dict, reference: dict) -> None:
    assert len(run["loss_history"]) == len(reference["loss_history"]) == 2 * STEPS_PER_EPOCH
    np.testing.assert_allclose(run["loss_history"], reference["loss_history"], rtol=1e-5)
    np.testing.assert_allclose(run["test_accuracy"], reference["test_accuracy"], rtol=1e-6)


def test_sigterm_to_one_of_two_processes_stops_both_and_the_run_continues_on_any_process_count(tmp_path, reference):
    """SIGTERM to process 1 as training starts -> both stop at one step and save; the same
    command (as a requeued job runs it) resumes, and --stop-signal USR1 to process 0 as it
    resumes stops both again, mid-epoch; one process then runs to the end (Orbax reshards the
    state onto its devices). The processes agree on a step through JAX's coordinator, which
    took seconds on a loaded machine: the signals come with most of the run still ahead (a
    USR1 sent 42 steps before the end once came too late, and that run finished)."""
    common = [*FLAGS, "--run-name", "r", "--resume", "auto", "--stop-signal", "USR1", "--results-dir", tmp_path]
    command = [LAUNCH, "--num-processes", "2", "--", *common]
    launcher = start(command)
    out = signal_after(launcher, "[p0] jaxcnn train: training data on the devices",
                       lambda: os.kill(children(launcher.pid)[1], signal.SIGTERM))  # fmt: skip
    assert launcher.returncode == 75, out[-3000:]
    steps = stopped_steps(out)
    assert len(steps) == 2 and steps[0] == steps[1] and 0 < steps[0] < STEPS_PER_EPOCH, out[-3000:]
    stopped = record(tmp_path, "r")
    assert (stopped["interrupted_at_step"], stopped["stopped_by"]) == (steps[0], "SIGTERM")
    assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir()) == [str(steps[0])]
    again = start(command)  # the same command line
    out = signal_after(again, "[p0] jaxcnn train: resuming", lambda: os.kill(children(again.pid)[0], signal.SIGUSR1))
    assert again.returncode == 75, out[-3000:]
    second = stopped_steps(out)
    assert len(second) == 2 and steps[0] < second[0] == second[1] < 2 * STEPS_PER_EPOCH, out[-3000:]
    assert second[0] % STEPS_PER_EPOCH, out[-3000:]  # mid-epoch
    assert record(tmp_path, "r")["stopped_by"] == "SIGUSR1"  # process 0 was sent it; process 1 heard SIGTERM
    last = start([TRAIN, *common, "--host-devices", "4"])
    try:
        out = last.communicate(timeout=RUN_LIMIT_S)[0]
    finally:
        kill_tree(last)
    assert last.returncode == 0, out[-3000:]
    finished = record(tmp_path, "r")
    assert finished["resumed_from_step"] == second[0] and finished["num_processes"] == 1
    assert_same_run(finished, reference)


def test_a_killed_process_restarts_every_process_from_the_last_checkpoint(tmp_path, reference):
    every = 20
    command = [LAUNCH, "--num-processes", "2", "--max-restarts", "1", "--", *FLAGS, "--run-name", "r",
               "--resume", "auto", "--checkpoint-dir", tmp_path / "ckpt", "--checkpoint-every", str(every),
               "--results-dir", tmp_path]  # fmt: skip
    launcher = start(command)
    out = signal_after(launcher, "[p0] epoch 1/2", lambda: os.kill(children(launcher.pid)[1], signal.SIGKILL))
    assert launcher.returncode == 0, out[-3000:]
    assert "restarting all 2 (1 of 1)" in out
    finished = record(tmp_path, "r")
    # resumed from the newest checkpoint saved before the kill: at or after epoch 1's end (step 89)
    assert finished["resumed_from_step"] % every == 0 and finished["resumed_from_step"] >= 4 * every
    assert_same_run(finished, reference)


def test_a_resume_takes_its_launch_from_its_own_command_line_not_the_saved_run(tmp_path):
    """A requeued job gets new nodes and a new coordinator: a run directory's config (an older
    one's included, which saved its launch) gives a resume no coordinator, process count or
    devices -- and a run saves none."""
    from jaxcnn import runs
    from jaxcnn.commands import train as train_command
    from jaxcnn.run_config import ClusterConfig, ParallelConfig, RunConfig

    old = RunConfig(parallel=ParallelConfig(mesh="data=4", host_devices=4),
                    cluster=ClusterConfig(coordinator="node07:61234", num_processes=2, process_id=1,
                                          local_devices=(2, 3)))  # fmt: skip
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / runs.CONFIG).write_text(json.dumps(old.to_json()))  # as runs before this one saved it
    resumed = train_command.parse_flags(["--resume", "auto", "--run-name", "r", "--results-dir", str(tmp_path)])
    assert resumed.cluster == ClusterConfig() and resumed.parallel.host_devices is None
    assert resumed.parallel.mesh == "data=4"  # the run's own flags are restored
    runs.write_config(tmp_path / "r", old)
    assert "cluster" not in json.loads((tmp_path / "r" / runs.CONFIG).read_text())


def test_a_stop_during_after_or_before_a_periodic_save_never_hangs(tmp_path, reference):
    """Two processes with periodic checkpoints (every 10 steps): SIGTERM to process 1 while a save
    is written (a first run), right after one lands, and right before one is due (the runs that
    resume it). Each launch exits 75 within seconds, both processes at one step, the newest
    checkpoint that step's; the last run ends with the uninterrupted run's losses. Before the
    stop owned JAX's sync point alone, 2 of 4 such launches never ended (issue 48);
    experiments/stop_soak.py loops this chain (results/stop_soak.csv)."""
    soak = load_script("stop_soak")
    assert soak.FLAGS == FLAGS  # the module's uninterrupted run is this chain's reference
    rows = soak.chain(tmp_path, ["during", "after", "before"], reference["loss_history"])
    problems = [f"{row['moment']}: {row['problem']}\n{row['output_tail']}" for row in rows if row["problem"]]
    assert not problems and len(rows) == 4, problems or rows
    assert all(row["seconds_to_exit"] < soak.STOP_LIMIT_S for row in rows[:3]), rows


def catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (its SigCgt mask in /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return bool(int(re.search(r"^SigCgt:\s*([0-9a-f]+)", status, re.M).group(1), 16) >> (signum - 1) & 1)


def test_a_stop_signal_sent_while_the_process_starts_stops_it_at_its_first_step(tmp_path):
    """--stop-signal USR1 sent as soon as the process catches it -- its first act, before Python
    imports JAX (jaxcnn.stopping.keep_early_stops) -- is kept for the first step, not the signal's
    default end of the process: the run stops at step 1, saves and exits 75. Seen on the SLURM
    test cluster before: a time limit's USR1 that came while a loaded machine started the tasks
    killed both (exit 138)."""
    proc = start([TRAIN, *FLAGS, "--host-devices", "4", "--stop-signal", "USR1", "--results-dir", tmp_path,
                  "--run-name", "r", "--quiet"])  # fmt: skip
    try:
        deadline = time.monotonic() + RUN_LIMIT_S
        while not catches(proc.pid, signal.SIGUSR1) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "jax" not in Path(f"/proc/{proc.pid}/maps").read_text(), "JAX was loaded: not early"
        proc.send_signal(signal.SIGUSR1)
        out = proc.communicate(timeout=RUN_LIMIT_S)[0]
    finally:
        kill_tree(proc)
    assert proc.returncode == 75, out[-3000:]
    assert stopped_steps(out) == [1] and record(tmp_path, "r")["stopped_by"] == "SIGUSR1", out[-3000:]
