#!/bin/bash
# srun COMMAND... for every task of the job, started again from the last checkpoint when a task
# dies, up to MAX_RESTARTS times (default 3), as torchrun --max-restarts does on one machine; and
# the job requeued when it is preempted. The sbatch scripts beside this file call it; the command
# must resume by itself (--resume auto).
#
# - SLURM 22.05 to 23.02: srun does not inherit the job's --cpus-per-task (restored in 23.11), so
#   every task would get one CPU: passed on here through SRUN_CPUS_PER_TASK.
# - --kill-on-bad-exit: a task that dies ends the step at once; the others would otherwise wait in a
#   collective until JAX's heartbeat timeout.
# - A stop the tasks agree on (the time limit's --signal, a SIGTERM that reaches them) saves at one
#   step; process 0 requeues the job (jaxcnn.requeue) and every task exits 75.
# - A preemption or `scancel --signal=TERM --full` (GraceTime 0) sends SIGTERM to this shell and to
#   srun as well, and srun answers a SIGTERM by killing its tasks: they may die before they save.
#   This shell traps the signal, lives on, and requeues the job itself -- the same rule as
#   process 0's, so a job already requeued is not requeued twice -- to continue from the last
#   periodic checkpoint.
# - 0 is done, 75 a saved stop, 130 a Ctrl-C, 2 bad input (the same command would fail again):
#   none is restarted.
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"; fi
terminated=
trap 'terminated=1' TERM
restarts="${MAX_RESTARTS:-3}"
for attempt in $(seq 0 "$restarts"); do
    srun --kill-on-bad-exit=1 "$@"
    status=$?
    if [ -n "$terminated" ]; then
        python -m jaxcnn.requeue
        break
    fi
    case "$status" in 0 | 2 | 75 | 130) break ;; esac
    if [ "$attempt" -lt "$restarts" ]; then
        echo "srun-restarting.sh: a task failed (exit $status); restart $((attempt + 1)) of $restarts from the last checkpoint" >&2
    fi
done
exit "$status"
