"""Multi-host runs: `jax.distributed` from flags, environment variables or the cluster.

The same script runs on every host. Where the cluster is given by
`--coordinator HOST:PORT --num-processes N --process-id I` (or JAXCNN_COORDINATOR,
JAXCNN_NUM_PROCESSES, JAXCNN_PROCESS_ID), those are used; otherwise, inside a SLURM job
step or an Open MPI launch of 2+ tasks, jax detects the cluster itself; otherwise the run
is one process. It must happen before JAX touches a device.

A dead peer: every process sends the coordinator heartbeats; when one stops (killed,
machine lost) the coordination service fails the others after `HEARTBEAT_TIMEOUT_S`, and a
collective already waiting on the dead peer fails as soon as its connection drops. Either
way the survivors exit non-zero instead of hanging (tests/test_multihost.py measures it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import jax

from jaxcnn.errors import UserError

HEARTBEAT_TIMEOUT_S = 10  # jax's default is 100 s; a training step here is far shorter
INIT_TIMEOUT_S = 120  # how long process 0 waits for the others to join

ENV = {"coordinator": "JAXCNN_COORDINATOR", "num_processes": "JAXCNN_NUM_PROCESSES", "process_id": "JAXCNN_PROCESS_ID"}


@dataclass(frozen=True)
class Cluster:
    coordinator: str | None = None
    num_processes: int = 1
    process_id: int = 0
    auto: bool = False  # SLURM / Open MPI: let jax read the cluster

    @property
    def multi_process(self) -> bool:
        return self.auto or self.num_processes > 1


def _env_int(name: str) -> int | None:
    text = os.environ.get(name)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise UserError(f"environment variable {name}={text!r} is not an integer") from None


def cluster_from(coordinator: str | None, num_processes: int | None, process_id: int | None) -> Cluster:
    """The cluster from flags, else environment variables, else SLURM / Open MPI, else one process."""
    coordinator = coordinator or os.environ.get(ENV["coordinator"])
    num_processes = num_processes if num_processes is not None else _env_int(ENV["num_processes"])
    process_id = process_id if process_id is not None else _env_int(ENV["process_id"])
    if coordinator is None:
        if num_processes not in (None, 1) or process_id not in (None, 0):
            raise UserError("--num-processes / --process-id need --coordinator HOST:PORT (process 0's address)")
        slurm = _env_int("SLURM_NTASKS") or 1
        mpi = _env_int("OMPI_COMM_WORLD_SIZE") or 1
        return Cluster(auto=max(slurm, mpi) > 1)
    host, sep, port = coordinator.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"--coordinator {coordinator!r} must be HOST:PORT, e.g. 10.0.0.1:1234")
    if num_processes is None or num_processes < 1:
        raise UserError("--coordinator needs --num-processes N (N >= 1)")
    if process_id is None or not 0 <= process_id < num_processes:
        raise UserError(f"--process-id must be in 0..{num_processes - 1} for --num-processes {num_processes}")
    return Cluster(coordinator, num_processes, process_id)


def initialize(cluster: Cluster) -> None:
    """Join the cluster (no-op for one process). Call before any JAX computation."""
    if not cluster.multi_process:
        return
    try:
        if cluster.auto:
            jax.distributed.initialize(
                initialization_timeout=INIT_TIMEOUT_S, heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S
            )
        else:
            jax.distributed.initialize(
                cluster.coordinator,
                cluster.num_processes,
                cluster.process_id,
                initialization_timeout=INIT_TIMEOUT_S,
                heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
            )
    except Exception as err:  # jax raises RuntimeError / XlaRuntimeError with a long text
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise UserError(f"could not join the cluster at {cluster.coordinator or 'auto-detected'}: {first}") from None
