"""A run stopped under SLURM puts its own job back in the queue.

A preemption or `scancel --signal=TERM` (SLURM's default GraceTime=0) sends SIGTERM to the
batch shell as well as to the tasks, so a line after `srun` in the batch script -- the usual
`if [ $? -eq 75 ]; then scontrol requeue ...` -- dies with the shell and never runs. PyTorch
Lightning requeues from inside the training process for this reason
(`SLURMEnvironment(auto_requeue=True)`), and so does jaxcnn: once every process has saved at
the agreed stop, process 0 runs `scontrol requeue $SLURM_JOB_ID` and then all exit 75.

It asks only when the job allows it (`sbatch --requeue`, shown as Requeue=1), has not been
requeued since this run started (its Restarts still this run's SLURM_RESTART_COUNT: a job
that SLURM, an administrator's `scontrol requeue` or another process has requeued shows
COMPLETING like a preempted one, and is not requeued twice), and is in a state a requeue
brings back: RUNNING (a time limit's signal), COMPLETING (the batch shell was killed by the
same signal) or PREEMPTED. A job the user cancelled (CANCELLED) stays cancelled.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping

THIS_INSTANCE = ("RUNNING", "COMPLETING", "PREEMPTED")  # states in which a requeue brings the job back


def job_fields(text: str) -> dict[str, str]:
    """`scontrol show job`'s KEY=VALUE pairs (the first of each key)."""
    fields: dict[str, str] = {}
    for key, value in re.findall(r"(\w+)=(\S*)", text):
        fields.setdefault(key, value)
    return fields


def requeue_slurm_job(environ: Mapping[str, str] | None = None) -> str | None:
    """Requeue this process's SLURM batch job if it allows it; a line saying what was done
    (None outside a SLURM job)."""
    environ = os.environ if environ is None else environ
    job = environ.get("SLURM_JOB_ID")
    if not job:
        return None
    if shutil.which("scontrol") is None:
        return f"SLURM job {job}: no scontrol on PATH, so not requeued; run the same command again to continue"
    shown = _scontrol("show", "job", job)
    if shown.returncode != 0:
        return f"SLURM job {job}: scontrol show job failed ({_first_line(shown)}); not requeued"
    fields = job_fields(shown.stdout)
    state = fields.get("JobState", "?")
    if fields.get("BatchFlag") != "1":
        return f"SLURM job {job} is not a batch job (srun or salloc): nothing to requeue"
    if fields.get("Requeue") != "1":
        return f"SLURM job {job} does not allow requeueing (sbatch --requeue); not requeued"
    this_run = int(environ.get("SLURM_RESTART_COUNT") or 0)
    if int(fields.get("Restarts") or 0) > this_run:
        return f"SLURM job {job} has been requeued already; not requeued again"
    if state not in THIS_INSTANCE:
        return f"SLURM job {job} is {state}; not requeued"
    done = _scontrol("requeue", job)
    if done.returncode != 0:
        return f"SLURM job {job}: scontrol requeue failed ({_first_line(done)})"
    return f"requeued SLURM job {job}: it will run this command again and continue from the saved state"


def _scontrol(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60)


def _first_line(done: subprocess.CompletedProcess) -> str:
    text = (done.stderr or done.stdout).strip()
    return text.splitlines()[0] if text else f"exit {done.returncode}"


if __name__ == "__main__":  # docs/clusters/srun-restarting.sh, when its own shell is sent SIGTERM
    print(f"jaxcnn.requeue: {requeue_slurm_job() or 'not in a SLURM job: nothing to requeue'}", file=sys.stderr)
