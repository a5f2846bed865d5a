"""How this process joins a run: the launcher that started it, the devices it takes, and
`jax.distributed` started from them.

One command line for every launcher. `launch_from(config)` reads, in this order (the
innermost launcher first: torchrun under srun also sees SLURM's variables):

  flags       --coordinator HOST:PORT --num-processes N --process-id I (or JAXCNN_COORDINATOR,
              JAXCNN_NUM_PROCESSES, JAXCNN_PROCESS_ID): what experiments/launch_local.py passes
  torchrun    torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...)
  openmpi     an mpirun rank of 2+ (OMPI_COMM_WORLD_RANK, ...)
  slurm       an srun task of a step with 2+ tasks (SLURM_PROCID, SLURM_NTASKS, ...)
  single      none of these: one process

For SLURM and Open MPI the coordinator, process count and id come from JAX's own cluster
detection. The devices do not: left to JAX, every task of a launcher that numbers its
tasks on a node takes the GPU of its local rank alone -- right for one task per GPU, but a
task per node would see 1 of its 8 GPUs, and a task that SLURM has bound to its GPU
(`--gpus-per-task`, where it sees that GPU as number 0) would name a GPU it cannot see.
jaxcnn decides from the processes on the host and the GPUs each can see
(`choose_local_devices`), passes the choice to `jax.distributed.initialize` with JAX's
detection off, and says what it chose and why in the run's header and record.

On a CPU-only machine `--local-devices` counts the devices to simulate, so the same launch
line (experiments/launch_local.py) runs there.

A dead peer: every process sends the coordinator heartbeats; when one stops (killed,
machine lost) the coordination service fails the others after `--heartbeat-timeout`, and a
collective already waiting on the dead peer fails as soon as its connection drops. Either
way the survivors exit non-zero instead of hanging (tests/test_multihost.py measures it).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

import jax

from jaxcnn.errors import UserError
from jaxcnn.host_memory import computes_on_cpu
from jaxcnn.run_config import ClusterConfig

ENV = {"coordinator": "JAXCNN_COORDINATOR", "num_processes": "JAXCNN_NUM_PROCESSES", "process_id": "JAXCNN_PROCESS_ID"}
TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Launch:
    """This process's place in the run, as its launcher (or the flags) gave it."""

    launcher: str  # "single", "flags", "slurm", "openmpi" or "torchrun"
    coordinator: str | None = None  # process 0's HOST:PORT
    num_processes: int = 1
    process_id: int = 0
    local_devices: tuple[int, ...] | None = None  # the accelerators this process takes (None: all it sees)
    devices_reason: str = "every device this process sees"
    heartbeat_timeout: int = 100
    join_timeout: int = 300

    @property
    def multi_process(self) -> bool:
        return self.num_processes > 1

    def describe(self) -> str:
        """One line for the run's header."""
        devices = "all it sees" if self.local_devices is None else ",".join(map(str, self.local_devices))
        where = f"process {self.process_id} of {self.num_processes}" if self.multi_process else "one process"
        return f"launch: {self.launcher}, {where}; devices {devices} ({self.devices_reason})"

    def as_record(self) -> dict:
        return {
            "launcher": self.launcher, "coordinator": self.coordinator, "num_processes": self.num_processes,
            "process_id": self.process_id, "local_devices": list(self.local_devices) if self.local_devices else None,
            "devices_reason": self.devices_reason,
            # the CPUs this process may run on, and what SLURM gave the task (srun must be told on 22.05-23.02)
            "cpus": len(os.sched_getaffinity(0)), "slurm_cpus_per_task": os.environ.get("SLURM_CPUS_PER_TASK"),
        }  # fmt: skip


def _int(environ: Mapping[str, str], name: str) -> int | None:
    text = environ.get(name)
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise UserError(f"environment variable {name}={text!r} is not an integer") from None


def _id_list(text: str | None) -> tuple[int, ...] | None:
    try:
        return tuple(int(part) for part in text.split(",")) if text else None
    except ValueError:
        raise UserError(
            f"environment variable JAX_LOCAL_DEVICE_IDS={text!r} must be device numbers, e.g. 0,1"
        ) from None


def visible_gpus(environ: Mapping[str, str]) -> int | None:
    """How many GPUs this process can see, told without starting JAX: CUDA_VISIBLE_DEVICES's
    entries (numbers or UUIDs), else SLURM's count for the node; None when nothing says."""
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None and listed.strip() not in ("", "all"):
        return len([entry for entry in listed.split(",") if entry.strip()])
    return _int(environ, "SLURM_GPUS_ON_NODE")


def slurm_tasks_on_node(environ: Mapping[str, str]) -> int | None:
    """The tasks of this step on this task's node, from SLURM_STEP_TASKS_PER_NODE ("8(x2),4":
    8 on each of the first two nodes, 4 on the third) and SLURM_NODEID."""
    spec = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    node = _int(environ, "SLURM_NODEID") or 0
    if spec:
        counts = []
        for part in spec.split(","):
            match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
            if not match:
                break
            counts += [int(match[1])] * int(match[2] or 1)
        else:
            if node < len(counts):
                return counts[node]
    return _int(environ, "SLURM_NTASKS_PER_NODE")


def choose_local_devices(
    local_processes: int | None,
    local_rank: int,
    visible: int | None,
    per_task: int | None = None,
    node_gpus: int | None = None,
) -> tuple[tuple[int, ...] | None, str]:
    """(the accelerators this process takes, why): `local_processes` on this host (None:
    unknown), this one's `local_rank` among them, the GPUs it can see (`visible`, None:
    unknown), the GPUs the launcher gave each task (`per_task`, SLURM's --gpus-per-task) and
    the host's GPUs (`node_gpus`, SLURM's count). Ids count the GPUs the process sees
    (CUDA's numbering under CUDA_VISIBLE_DEVICES)."""
    seen = f"{visible} visible" if visible is not None else "count unknown"
    if local_processes == 1:
        return None, f"one process on this host: all its GPUs ({seen})"
    if visible is not None and node_gpus is not None and visible < node_gpus:
        return None, f"bound: the process sees {visible} of the host's {node_gpus} GPUs, its own"
    if local_processes is None:  # JAX's own rule, unless it would name a GPU the process cannot see
        if visible is not None and local_rank >= visible:
            return None, f"bound: local rank {local_rank} but only {visible} GPUs visible, its own"
        return (local_rank,), f"processes on this host unknown: one GPU by local rank {local_rank}"
    if per_task is not None:
        if visible is None or visible == per_task:
            return None, f"bound by the launcher (--gpus-per-task={per_task}): the task sees only its own"
        if visible == per_task * local_processes:
            first = local_rank * per_task
            ids = tuple(range(first, first + per_task))
            return ids, f"--gpus-per-task={per_task} unbound: local rank {local_rank}'s share of the node's {visible}"
        raise UserError(
            f"this task sees {visible} GPUs but the launcher gave each of the node's {local_processes} tasks "
            f"{per_task}; bind them (--gpu-bind=per_task:{per_task}) or pass --local-devices"
        )
    if visible is None:
        return (local_rank,), f"one GPU per process by local rank ({local_processes} processes on this host)"
    if visible < local_processes:  # the launcher (or a wrapper) gave each process its own GPUs
        return None, f"bound: the process sees only its own {visible} of the host's GPUs"
    if visible % local_processes == 0:
        share = visible // local_processes
        ids = tuple(range(local_rank * share, (local_rank + 1) * share))
        return ids, f"{local_processes} processes share the host's {visible} GPUs: {share} each by local rank"
    raise UserError(
        f"{local_processes} processes on this host see {visible} GPUs each, which do not split evenly; bind each "
        "process's GPUs (CUDA_VISIBLE_DEVICES, --gpus-per-task) or pass --local-devices"
    )


def _jax_detected(method: str, timeout: int) -> tuple[str, int, int]:
    """(coordinator, process count, process id) as JAX's own cluster detection reads them
    (a placeholder device list keeps it from choosing devices: that is ours to do)."""
    from jax._src import clusters  # the detection jax.distributed.initialize runs

    try:
        coordinator, count, pid, _ = clusters.ClusterEnv.auto_detect_unset_distributed_params(
            os.environ.get("JAX_COORDINATOR_ADDRESS"), None, None, [0], method, timeout
        )
    except (RuntimeError, KeyError, ValueError) as err:
        raise UserError(f"cannot read the {method} job's processes: {err}") from None
    return coordinator, count, pid


def launch_from(config: ClusterConfig, environ: Mapping[str, str] | None = None) -> Launch:
    """This process's launch: the flags, else the environment's launcher, else one process
    (see the module's docstring). Reads no device: call it before JAX starts."""
    environ = os.environ if environ is None else environ
    timing = {"heartbeat_timeout": config.heartbeat_timeout, "join_timeout": config.join_timeout}
    given = config.local_devices or _id_list(environ.get("JAX_LOCAL_DEVICE_IDS"))
    coordinator = config.coordinator or environ.get(ENV["coordinator"])
    num_processes = config.num_processes if config.num_processes is not None else _int(environ, ENV["num_processes"])
    process_id = config.process_id if config.process_id is not None else _int(environ, ENV["process_id"])
    if coordinator is not None:
        return _from_flags(coordinator, num_processes, process_id, given, timing)
    if num_processes not in (None, 1) or process_id not in (None, 0):
        raise UserError("--num-processes / --process-id need --coordinator HOST:PORT (process 0's address)")
    found = _launcher(environ)
    if found is None:
        reason = "--local-devices" if given else "every device this process sees"
        return Launch("single", local_devices=given, devices_reason=reason, **timing)
    name, local_processes, local_rank, per_task = found
    if name == "torchrun":
        port = _int(environ, "JAX_COORDINATOR_PORT") or _int(environ, "MASTER_PORT")
        if port is None:
            raise UserError("torchrun's MASTER_PORT is empty: set it (or JAX_COORDINATOR_PORT) to a free port")
        if environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and not environ.get("JAX_COORDINATOR_PORT"):
            port += 1  # torchrun's agent holds MASTER_PORT itself
        coordinator = environ.get("JAX_COORDINATOR_ADDRESS") or f"{environ['MASTER_ADDR']}:{port}"
        count, pid = _int(environ, "WORLD_SIZE"), _int(environ, "RANK")
    else:
        coordinator, count, pid = _jax_detected({"slurm": "slurm", "openmpi": "ompi"}[name], config.join_timeout)
    if given:
        devices, reason = given, "--local-devices" if config.local_devices else "JAX_LOCAL_DEVICE_IDS"
    else:
        node_gpus = _int(environ, "SLURM_GPUS_ON_NODE") if name == "slurm" else None
        devices, reason = choose_local_devices(local_processes, local_rank, visible_gpus(environ), per_task, node_gpus)
    return Launch(name, coordinator, count, pid, devices, reason, **timing)


def _from_flags(coordinator: str, num_processes, process_id, given, timing) -> Launch:
    host, sep, port = coordinator.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"--coordinator {coordinator!r} must be HOST:PORT, e.g. 10.0.0.1:1234")
    if num_processes is None or num_processes < 1:
        raise UserError("--coordinator needs --num-processes N (N >= 1)")
    if process_id is None or not 0 <= process_id < num_processes:
        raise UserError(f"--process-id must be in 0..{num_processes - 1} for --num-processes {num_processes}")
    reason = "--local-devices" if given else "every device this process sees"
    return Launch("flags", coordinator, num_processes, process_id, given, reason, **timing)


def _launcher(environ: Mapping[str, str]) -> tuple[str, int | None, int, int | None] | None:
    """(launcher, processes on this host, local rank, GPUs per task) of a launch of 2+
    processes found in the environment; None when there is none. The innermost launcher
    wins: torchrun under srun, or mpirun inside an sbatch script, also sees SLURM's
    variables, which describe the allocation, not these processes."""
    if all(name in environ for name in TORCHRUN) and (_int(environ, "WORLD_SIZE") or 1) > 1:
        return "torchrun", _int(environ, "LOCAL_WORLD_SIZE"), _int(environ, "LOCAL_RANK") or 0, None
    if (_int(environ, "OMPI_COMM_WORLD_SIZE") or 1) > 1:
        local = _int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE")
        return "openmpi", local, _int(environ, "OMPI_COMM_WORLD_LOCAL_RANK") or 0, None
    if (_int(environ, "SLURM_NTASKS") or 1) > 1 and "SLURM_STEP_NODELIST" in environ and "SLURM_PROCID" in environ:
        per_task = environ.get("SLURM_GPUS_PER_TASK")  # "2", or "a100:2" with a type
        try:
            per_task = int(per_task.rpartition(":")[2]) if per_task else None
        except ValueError:
            raise UserError(f"environment variable SLURM_GPUS_PER_TASK={per_task!r} is not a GPU count") from None
        return "slurm", slurm_tasks_on_node(environ), _int(environ, "SLURM_LOCALID") or 0, per_task
    return None


def initialize(launch: Launch) -> None:
    """Join the run (one process: only its devices). Call before any JAX computation."""
    on_cpu = computes_on_cpu()
    if not launch.multi_process:
        if launch.local_devices and not on_cpu:  # one process on some of the host's GPUs
            jax.config.update("jax_cuda_visible_devices", ",".join(map(str, launch.local_devices)))
        return
    try:
        jax.distributed.initialize(
            launch.coordinator, launch.num_processes, launch.process_id,
            local_device_ids=None if on_cpu else launch.local_devices,  # CPU: counted, not chosen
            cluster_detection_method="deactivate",  # the launch is decided: JAX must not pick devices again
            initialization_timeout=launch.join_timeout, heartbeat_timeout_seconds=launch.heartbeat_timeout,
        )  # fmt: skip
    except Exception as err:  # jax raises RuntimeError / XlaRuntimeError with a long text
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise UserError(f"could not join the run at {launch.coordinator} ({launch.launcher}): {first}") from None
