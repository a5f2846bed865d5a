"""A one-node SLURM cluster of real daemons for the tests: munged, slurmctld and slurmd (Debian's
`slurm-wlm`), started as root in a directory of their own with free ports, the node's real CPUs
and eight stand-in GPUs (GRES files), and stopped by the PIDs it started.

    cluster = SlurmCluster.start(tmp_path)      # raises ClusterUnavailable(why) where it cannot run
    job = cluster.sbatch(["--ntasks=2", "script.sbatch", ...], cwd=job_dir)
    cluster.job(job)["JobState"]                # scontrol show job's fields
    cluster.stop()
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from jaxcnn.requeue import job_fields

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "scancel", "sinfo", "squeue")
START_S = 60  # daemons up and the node idle
GPUS = 8
# SLURM holds a requeued batch job for a step credential's lifetime (cred_expire, 120 s by
# default) before it may start again on the node that revoked the old one's
CREDENTIAL_S = 10
TIME_CHECK_S = 30  # slurmctld tests time limits (and sends --signal's warnings) every 30 s from its start


class ClusterUnavailable(Exception):
    """Why no cluster can start here (not root, slurm-wlm not installed, a daemon that failed)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(root: Path, host: str, cpus: int) -> str:
    return f"""\
ClusterName=jaxcnn-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.socket,cred_expire={CREDENTIAL_S}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
MpiDefault=none
ReturnToService=2
MinJobAge=3600
JobCompType=jobcomp/filetxt
JobCompLoc={root}/jobcomp.txt
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} Gres=gpu:{GPUS} State=UNKNOWN
PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


@dataclass
class SlurmCluster:
    root: Path
    env: dict  # the environment its clients (and the jobs) need: SLURM_CONF
    processes: list = field(default_factory=list)  # the daemons this cluster started, in start order
    controller_started: float = 0.0  # time.time() when slurmctld started: its time checks follow from it

    @classmethod
    def start(cls, root: Path) -> SlurmCluster:
        if os.geteuid() != 0:
            raise ClusterUnavailable("the SLURM tests start slurmctld and slurmd, which needs root")
        missing = [name for name in DAEMONS + CLIENTS if shutil.which(name) is None]
        if missing:
            raise ClusterUnavailable(f"{', '.join(missing)} not found: apt-get install slurm-wlm")
        root.mkdir(parents=True, exist_ok=True)
        root.chmod(0o700)  # munged refuses a socket directory others can write
        for sub in ("state", "spool"):
            (root / sub).mkdir(exist_ok=True)
        key = root / "munge.key"  # the cluster's own key: nothing of the machine's munge is used
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        for i in range(GPUS):  # stand-in GPU device files: SLURM counts them and sets SLURM_GPUS_ON_NODE
            (root / f"gpu{i}").touch()
        host = socket.gethostname()
        (root / "slurm.conf").write_text(_config(root, host, os.cpu_count() or 1))
        (root / "gres.conf").write_text(f"Name=gpu File={root}/gpu[0-{GPUS - 1}]\n")
        cluster = cls(root, {**os.environ, "SLURM_CONF": str(root / "slurm.conf")})
        try:
            cluster._daemon("munged", "-F", "-f", f"--socket={root}/munge.socket", f"--key-file={key}",
                            f"--pid-file={root}/munged.pid", f"--seed-file={root}/munged.seed",
                            f"--log-file={root}/munged.log")  # fmt: skip
            cluster._wait(lambda: (root / "munge.socket").exists(), "munged's socket")
            cluster.controller_started = time.time()
            cluster._daemon("slurmctld", "-D", "-i", "-f", str(root / "slurm.conf"))
            cluster._daemon("slurmd", "-D", "-f", str(root / "slurm.conf"))
            cluster._wait(lambda: cluster.node_state() == "idle", "the node to be idle")
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _daemon(self, name: str, *args: str) -> None:
        log = open(self.root / f"{name}.out", "w")  # noqa: SIM115 (kept open for the daemon's life)
        self.processes.append(
            subprocess.Popen([name, *args], stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        )

    def _wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + START_S
        while not ready():
            dead = [p for p in self.processes if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                name = Path(dead[0].args[0]).name if dead else "the cluster"
                out = (self.root / f"{name}.out").read_text()[-1500:] if dead else ""
                raise ClusterUnavailable(f"waiting for {what}: {name} {'exited' if dead else 'timed out'}\n{out}")
            time.sleep(0.2)

    def seconds_to_time_check(self) -> float:
        """Until slurmctld's next test of time limits, when a job's --signal=SIG@N is sent once
        it is due (its first test runs as it starts, then one every TIME_CHECK_S)."""
        return TIME_CHECK_S - (time.time() - self.controller_started) % TIME_CHECK_S

    def stop(self) -> None:
        """Stop exactly the daemons this cluster started (by PID), newest first; the jobs'
        processes go with slurmd's end of them."""
        for job in self.jobs_running():
            self.run("scancel", job, check=False)
        for process in reversed(self.processes):
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        self.processes.clear()

    def run(self, *command: str, check: bool = True, cwd=None) -> subprocess.CompletedProcess:
        done = subprocess.run(command, capture_output=True, text=True, env=self.env, cwd=cwd, timeout=60)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(command)}: exit {done.returncode}\n{done.stdout}{done.stderr}")
        return done

    def scontrol(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.run("scontrol", *args, check=check)

    def node_state(self) -> str:
        done = self.run("sinfo", "-h", "-o", "%t", check=False)
        return done.stdout.strip() if done.returncode == 0 else ""

    def jobs_running(self) -> list[str]:
        if not self.processes:
            return []
        done = self.run("squeue", "-h", "-o", "%i", check=False)
        return done.stdout.split() if done.returncode == 0 else []

    def sbatch(self, args: list, cwd: Path, env: dict | None = None) -> str:
        """Submit; the job's id."""
        done = subprocess.run(["sbatch", "--parsable", *map(str, args)], capture_output=True, text=True,
                              env={**self.env, **(env or {})}, cwd=cwd, timeout=60)  # fmt: skip
        if done.returncode != 0:
            raise AssertionError(f"sbatch {' '.join(map(str, args))}: {done.stderr}")
        return done.stdout.strip().split(";")[0]

    def job(self, job: str) -> dict[str, str]:
        """`scontrol show job`'s fields (JobState, Restarts, ExitCode, Reason, ...)."""
        return job_fields(self.scontrol("show", "job", job).stdout)
