"""The cluster scripts of docs/clusters/, submitted as written to real launchers: a one-node
SLURM of real daemons (tests/slurm_cluster.py: munged, slurmctld, slurmd, stand-in GPUs) and
Open MPI's mpirun. Only the training flags are appended (and sbatch's sizes given on its command
line, which SLURM lets override the #SBATCH lines: one node of this machine's CPUs); CPU devices
stand in for the GPUs. Each job's outcome is read from `scontrol show job` and its files: the
final state, how often it was requeued, the losses of every step against one uninterrupted
process, and checkpoints that are whole.

SLURM holds a requeued batch job for a step credential's lifetime before it may start again
(cred_expire: 120 s by default, 10 s in the test cluster); a job released at once was refused
("Job credential revoked") and ended FAILED."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, TWO_EPOCHS_ON_4
from slurm_cluster import ClusterUnavailable, SlurmCluster

pytestmark = pytest.mark.slow

FLAGS = TWO_EPOCHS_ON_4  # the uninterrupted run's: a tiny CNN, 2 epochs of the digits on 4 devices
PERIODIC = ["--checkpoint-every", "20"]  # the scripts' own --checkpoint-every 500, as often as this run allows
JOB_LIMIT_S = 420  # a job, start to end, its requeues included (an instance takes under a minute unloaded)
RUN = "jaxcnn-run"  # the scripts' --run-name
CPUS = os.cpu_count() or 1


def unavailable(why: str) -> None:
    """Skip where the launcher cannot run; in CI (which installs it) fail instead."""
    if os.environ.get("CI"):
        pytest.fail(f"{why} (CI installs and runs these: see .ci/run)")
    pytest.skip(why)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    try:
        started = SlurmCluster.start(tmp_path_factory.mktemp("slurm"))
    except ClusterUnavailable as why:
        unavailable(str(why))
    yield started
    started.stop()


@pytest.fixture
def reference(uninterrupted) -> list[float]:
    """Every step's loss of one process of 4 devices, never stopped."""
    return uninterrupted["loss_history"]


def job_dir(tmp_path: Path) -> Path:
    """A directory to submit from, as the repository root would be: the scripts run
    experiments/train.py and docs/clusters/srun-restarting.sh by relative path, and leave
    runs/, checkpoints/ and their logs here."""
    (tmp_path / "experiments").symlink_to(REPO / "experiments")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/clusters").symlink_to(REPO / "docs/clusters")
    return tmp_path


def submit(cluster: SlurmCluster, where: Path, script: str, tasks: int, *sbatch_args: str, cpus: int = 1) -> str:
    """sbatch docs/clusters/SCRIPT as written, on one node with `tasks` tasks of `cpus` CPUs."""
    env = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # the scripts' `python`
    args = ["--nodes=1", f"--ntasks-per-node={tasks}", f"--cpus-per-task={cpus}", *sbatch_args,
            REPO / "docs/clusters" / script, *FLAGS, *PERIODIC]  # fmt: skip
    return cluster.sbatch(args, cwd=where, env=env)


class Watch:
    """A job's log and state, polled until something is seen; a job that ends first, or takes
    longer than JOB_LIMIT_S in all, fails the test with its log."""

    def __init__(self, cluster: SlurmCluster, job: str, where: Path):
        self.cluster, self.job, self.where = cluster, job, where
        self.deadline = time.monotonic() + JOB_LIMIT_S

    @property
    def log(self) -> str:
        path = self.where / f"jaxcnn-{self.job}.log"
        return path.read_text() if path.exists() else ""

    def fields(self) -> dict:
        return self.cluster.job(self.job)

    def until(self, what: str, seen) -> dict:
        while True:
            fields = self.fields()
            if seen(fields):
                return fields
            if fields["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                pytest.fail(f"job {self.job} ended {fields['JobState']} before {what}:\n{self.log[-3000:]}")
            if time.monotonic() > self.deadline:
                self.cluster.run("scancel", self.job, check=False)
                pytest.fail(f"job {self.job}: no {what} within {JOB_LIMIT_S} s:\n{self.log[-3000:]}")
            time.sleep(0.25)

    def line(self, pattern: str, count: int = 1) -> dict:
        """Until `pattern` has appeared in the log `count` times."""
        return self.until(f"{count} x {pattern!r}", lambda _: len(re.findall(pattern, self.log, re.M)) >= count)

    def end(self) -> dict:
        while (fields := self.fields())["JobState"] in ("PENDING", "RUNNING", "COMPLETING", "REQUEUED", "CONFIGURING"):
            if time.monotonic() > self.deadline:
                self.cluster.run("scancel", self.job, check=False)
                pytest.fail(f"job {self.job} still {fields['JobState']} after {JOB_LIMIT_S} s:\n{self.log[-3000:]}")
            time.sleep(0.5)
        return fields


def assert_finished_like_one_process(watch: Watch, reference: list, restarts: int, peer_killed: bool = False) -> dict:
    """The job ended COMPLETED after `restarts` requeues, with every step's loss of the
    uninterrupted run and only whole checkpoints left; its run record. No traceback, unless a
    peer was killed: the survivor's collective then fails (gloo: connection closed by peer)."""
    fields = watch.end()
    log = watch.log
    assert (fields["JobState"], fields["Restarts"], fields["ExitCode"]) == ("COMPLETED", str(restarts), "0:0"), log
    assert peer_killed or "Traceback" not in log, log
    assert "FAILED_PRECONDITION" not in log, log
    record = json.loads((watch.where / "runs" / RUN / f"{RUN}.json").read_text())
    np.testing.assert_allclose(record["loss_history"], reference, rtol=1e-5)
    saved = sorted((watch.where / "checkpoints" / RUN).iterdir())
    assert saved and all(path.name.isdigit() for path in saved), [path.name for path in saved]  # none half-written
    stops = re.findall(r"stopped \(\w+\) at step (\d+): state saved", log)
    assert len(stops) == len(set(stops)), stops  # each stop saved once
    return record


def test_one_task_per_node_runs_to_the_end_with_its_cpus(cluster, reference, tmp_path):
    """slurm-task-per-node.sbatch, its task given all the node's CPUs (--cpus-per-task; srun
    must be told on SLURM 22.05-23.02): the task's affinity holds them, and SLURM says so."""
    where = job_dir(tmp_path)
    watch = Watch(cluster, submit(cluster, where, "slurm-task-per-node.sbatch", 1, cpus=CPUS), where)
    record = assert_finished_like_one_process(watch, reference, restarts=0)
    assert record["launch"]["cpus"] == CPUS and record["launch"]["slurm_cpus_per_task"] == str(CPUS), record["launch"]


def test_time_limit_stops_saves_requeues_and_finishes(cluster, reference, tmp_path):
    """slurm-gpus-per-task.sbatch under a 1-minute limit, USR1 to the tasks 55 s before it:
    every task stops at one step and saves, process 0 requeues the job, and the job comes back
    and finishes. slurmctld sends the signal at its first time check after it is due; the job is
    submitted 8 to 20 s before one, so that the signal comes before training could have ended
    (one that comes while the tasks start stops the run at its first step). The second run is
    given a longer limit, so that it is not stopped again."""
    where = job_dir(tmp_path)
    if not 8 <= cluster.seconds_to_time_check() <= 20:
        time.sleep((cluster.seconds_to_time_check() - 20) % 30)
    watch = Watch(cluster, submit(cluster, where, "slurm-gpus-per-task.sbatch", 2, "--time=1", "--signal=USR1@55"),
                  where)  # fmt: skip
    watch.until("a requeue", lambda fields: fields["Restarts"] == "1")
    cluster.scontrol("update", f"JobId={watch.job}", "TimeLimit=10")
    assert_finished_like_one_process(watch, reference, restarts=1)
    log = watch.log
    assert len(re.findall(r"stopped \(SIGUSR1\) at step \d+: state saved", log)) == 1, log
    assert len(re.findall(r"^jaxcnn train: requeued SLURM job", log, re.M)) == 1, log  # process 0 did it
    assert "resuming from step" in log, log


def test_preemption_and_a_requeue_mid_run_come_back_and_finish(cluster, reference, tmp_path):
    """slurm-task-per-gpu.sbatch with periodic checkpoints: a preemption's SIGTERM to the batch
    shell and every task at once (`scancel --signal=TERM --full`, as GraceTime 0 sends it) mid-run,
    then an administrator's `scontrol requeue` mid-run of the job that came back. Each time the
    job comes back, exactly once (Restarts 2), and finishes with the uninterrupted run's losses."""
    where = job_dir(tmp_path)
    watch = Watch(cluster, submit(cluster, where, "slurm-task-per-gpu.sbatch", 2), where)
    watch.line(r"^epoch 1/2 ")
    cluster.run("scancel", "--signal=TERM", "--full", watch.job)
    watch.until("the preempted job requeued", lambda fields: fields["Restarts"] == "1")
    watch.line(r"resuming from step \d+[\s\S]*^epoch \d/2 ")  # the second run, past where it resumed
    cluster.scontrol("requeue", watch.job)
    watch.until("the job requeued again", lambda fields: fields["Restarts"] == "2")
    assert_finished_like_one_process(watch, reference, restarts=2)
    assert len(re.findall(r"resuming from step \d+", watch.log)) == 2, watch.log


def task_pid(job: str, process_id: int) -> int:
    """The pid of SLURM job `job`'s training task `process_id` (SLURM_PROCID)."""
    for proc in Path("/proc").iterdir():
        try:
            environ = dict(
                entry.split("=", 1) for entry in (proc / "environ").read_text().split("\0") if "=" in entry
            )
            command = (proc / "cmdline").read_text()
        except (OSError, ValueError):
            continue
        if environ.get("SLURM_JOB_ID") == job and environ.get("SLURM_PROCID") == str(process_id) and "train.py" in command:
            return int(proc.name)
    raise AssertionError(f"no training task {process_id} of job {job}")


def test_a_killed_task_restarts_from_the_last_checkpoint(cluster, reference, tmp_path):
    """slurm-task-per-gpu.sbatch: two processes on the node, one CPU each, joined by SLURM's
    variables; process 1 killed outright (SIGKILL) once a periodic checkpoint is saved; srun ends
    the step (--kill-on-bad-exit) and srun-restarting.sh starts both tasks again from the last
    checkpoint, within the same job (no requeue)."""
    where = job_dir(tmp_path)
    watch = Watch(cluster, submit(cluster, where, "slurm-task-per-gpu.sbatch", 2), where)
    saved = where / "checkpoints" / RUN
    watch.until("a periodic checkpoint", lambda _: saved.is_dir() and any(p.name == "40" for p in saved.iterdir()))
    os.kill(task_pid(watch.job, 1), signal.SIGKILL)
    record = assert_finished_like_one_process(watch, reference, restarts=0, peer_killed=True)
    assert (record["num_processes"], record["launch"]["launcher"], record["launch"]["cpus"]) == (2, "slurm", 1)
    log = watch.log
    assert "srun-restarting.sh: a task failed" in log and "restart 1 of 3" in log, log
    resumed = [int(step) for step in re.findall(r"resuming from step (\d+)", log)]
    assert len(resumed) == 1 and resumed[0] >= 40, log


def test_mpirun_script_two_ranks_train_like_one_process(reference, tmp_path):
    """docs/clusters/mpirun.sh, two ranks on this machine (NP, NPERNODE, HOSTFILE): JAX finds its
    coordinator from Open MPI's variables; the losses are one process's."""
    if shutil.which("mpirun") is None:
        unavailable("mpirun not found: apt-get install openmpi-bin")
    where = job_dir(tmp_path)
    (where / "hosts.txt").write_text(f"localhost slots={max(CPUS, 2)}\n")
    env = {**os.environ, "NP": "2", "NPERNODE": "2", "HOSTFILE": "hosts.txt",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}  # fmt: skip
    proc = subprocess.run(["bash", str(REPO / "docs/clusters/mpirun.sh"), *FLAGS, "--quiet"], cwd=where, env=env,
                          capture_output=True, text=True, timeout=JOB_LIMIT_S)  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    record = json.loads((where / "runs" / RUN / f"{RUN}.json").read_text())
    assert (record["num_processes"], record["launch"]["launcher"]) == (2, "openmpi"), record["launch"]
    np.testing.assert_allclose(record["loss_history"], reference, rtol=1e-5)
