"""Multi-host runs: `jax.distributed` from flags, environment variables or the cluster.

The same script runs on every host. Where the cluster is given by
`--coordinator HOST:PORT --num-processes N --process-id I` (or JAXCNN_COORDINATOR,
JAXCNN_NUM_PROCESSES, JAXCNN_PROCESS_ID), those are used; otherwise, inside a SLURM job
step or an Open MPI launch of 2+ tasks, jax detects the cluster itself; otherwise the run
is one process. It must happen before JAX touches a device.

One process per GPU: `--local-devices 3` gives this process GPU 3 alone (jax.distributed's
`local_device_ids`); under SLURM with a task per GPU, jax takes the task's from SLURM_LOCALID
itself. On a CPU-only machine `--local-devices` counts the devices to simulate, so the same
launch line (experiments/launch_local.py) runs there.

A dead peer: every process sends the coordinator heartbeats; when one stops (killed,
machine lost) the coordination service fails the others after `--heartbeat-timeout`, and a
collective already waiting on the dead peer fails as soon as its connection drops. Either
way the survivors exit non-zero instead of hanging (tests/test_multihost.py measures it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import jax

from jaxcnn.errors import UserError
from jaxcnn.host_memory import computes_on_cpu
from jaxcnn.run_config import ClusterConfig

ENV = {"coordinator": "JAXCNN_COORDINATOR", "num_processes": "JAXCNN_NUM_PROCESSES", "process_id": "JAXCNN_PROCESS_ID"}


@dataclass(frozen=True)
class Cluster:
    coordinator: str | None = None
    num_processes: int = 1
    process_id: int = 0
    auto: bool = False  # SLURM / Open MPI: let jax read the cluster
    local_devices: tuple[int, ...] | None = None  # None: every device of the host (or SLURM's task GPU)
    heartbeat_timeout: int = 100
    join_timeout: int = 300

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


def cluster_from(config: ClusterConfig) -> Cluster:
    """The cluster from flags, else environment variables, else SLURM / Open MPI, else one process."""
    coordinator = config.coordinator or os.environ.get(ENV["coordinator"])
    num_processes = config.num_processes if config.num_processes is not None else _env_int(ENV["num_processes"])
    process_id = config.process_id if config.process_id is not None else _env_int(ENV["process_id"])
    timing = {"heartbeat_timeout": config.heartbeat_timeout, "join_timeout": config.join_timeout}
    local = {"local_devices": config.local_devices, **timing}
    if coordinator is None:
        if num_processes not in (None, 1) or process_id not in (None, 0):
            raise UserError("--num-processes / --process-id need --coordinator HOST:PORT (process 0's address)")
        slurm = _env_int("SLURM_NTASKS") or 1
        mpi = _env_int("OMPI_COMM_WORLD_SIZE") or 1
        return Cluster(auto=max(slurm, mpi) > 1, **local)
    host, sep, port = coordinator.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"--coordinator {coordinator!r} must be HOST:PORT, e.g. 10.0.0.1:1234")
    if num_processes is None or num_processes < 1:
        raise UserError("--coordinator needs --num-processes N (N >= 1)")
    if process_id is None or not 0 <= process_id < num_processes:
        raise UserError(f"--process-id must be in 0..{num_processes - 1} for --num-processes {num_processes}")
    return Cluster(coordinator, num_processes, process_id, **local)


def initialize(cluster: Cluster) -> None:
    """Join the cluster (one process: only `--local-devices`). Call before any JAX computation."""
    if not cluster.multi_process:
        if cluster.local_devices and not computes_on_cpu():  # one process on some of the host's GPUs
            jax.config.update("jax_cuda_visible_devices", ",".join(map(str, cluster.local_devices)))
        return
    try:
        jax.distributed.initialize(
            cluster.coordinator,  # None (auto): jax reads SLURM's or Open MPI's variables
            None if cluster.auto else cluster.num_processes,
            None if cluster.auto else cluster.process_id,
            local_device_ids=None if computes_on_cpu() else cluster.local_devices,  # CPU: counted, not chosen
            initialization_timeout=cluster.join_timeout,
            heartbeat_timeout_seconds=cluster.heartbeat_timeout,
        )
    except Exception as err:  # jax raises RuntimeError / XlaRuntimeError with a long text
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise UserError(f"could not join the cluster at {cluster.coordinator or 'auto-detected'}: {first}") from None
