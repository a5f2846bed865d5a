"""Each launcher's environment -> the devices every process takes (jaxcnn.distributed), beside
what JAX's own detection would have given it; and the cluster scripts in docs/clusters read
as the launchers would run them.

The environments are what SLURM, Open MPI and torchrun set for each task. For each, what
jaxcnn passes to `jax.distributed.initialize` is captured (nothing joins) on a pretend GPU
machine. tests/test_multihost.py runs the SLURM script's command as real processes."""

import re
import shlex
import sys
from pathlib import Path

import pytest
from conftest import REPO

from jaxcnn import distributed
from jaxcnn.commands import train as train_command
from jaxcnn.distributed import choose_local_devices, launch_from
from jaxcnn.errors import UserError
from jaxcnn.run_config import ClusterConfig

CLUSTERS = REPO / "docs" / "clusters"


def sbatch_options(script: Path) -> dict[str, str]:
    """The #SBATCH options of a script, {"nodes": "2", ...}."""
    options = {}
    for line in script.read_text().splitlines():
        if line.startswith("#SBATCH --"):
            name, _, value = line.removeprefix("#SBATCH --").split()[0].partition("=")
            options[name] = value
    return options


def slurm_task_env(options: dict[str, str], node: int, local: int, job_id: int = 4242) -> dict[str, str]:
    """The variables SLURM gives task `local` of node `node` in an srun step of the script's
    allocation (CUDA_VISIBLE_DEVICES as SLURM's GPU plugin sets it: every GPU of the node for
    --gpus-per-node; under --gpus-per-task, bound with device cgroups, the task's own,
    renumbered from 0)."""
    nodes, per_node = int(options["nodes"]), int(options["ntasks-per-node"])
    env = {
        "SLURM_JOB_ID": str(job_id), "SLURM_STEP_NODELIST": f"gpu[001-{nodes:03d}]", "SLURM_NTASKS": str(nodes * per_node),
        "SLURM_PROCID": str(node * per_node + local), "SLURM_LOCALID": str(local), "SLURM_NODEID": str(node),
        "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{nodes})", "SLURM_STEP_NUM_NODES": str(nodes),
    }  # fmt: skip
    if "gpus-per-task" in options:
        per_task = int(options["gpus-per-task"])
        env |= {"SLURM_GPUS_PER_TASK": str(per_task), "SLURM_GPUS_ON_NODE": str(per_task * per_node),
                "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(per_task)))}  # fmt: skip
    else:
        gpus = int(options["gpus-per-node"])
        env |= {"SLURM_GPUS_ON_NODE": str(gpus), "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(gpus)))}
    return env


def mpirun_env(rank: int, size: int = 16, per_host: int = 8) -> dict[str, str]:
    return {
        "OMPI_COMM_WORLD_SIZE": str(size), "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % per_host), "OMPI_COMM_WORLD_LOCAL_SIZE": str(per_host),
        "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.0.0.1,10.1.0.1:34911",
    }  # fmt: skip


def torchrun_env(rank: int, size: int = 16, per_host: int = 8) -> dict[str, str]:
    return {
        "RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank % per_host),
        "LOCAL_WORLD_SIZE": str(per_host), "MASTER_ADDR": "host0", "MASTER_PORT": "29500",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }  # fmt: skip


LAUNCHER_VARIABLES = re.compile(r"^(SLURM_|OMPI_|PMI|PMIX_|CUDA_VISIBLE|JAX_|JAXCNN_)|^(RANK|WORLD_SIZE|LOCAL_RANK|"
                                r"LOCAL_WORLD_SIZE|MASTER_ADDR|MASTER_PORT|TORCHELASTIC_USE_AGENT_STORE)$")  # fmt: skip


@pytest.fixture
def launcher_env(monkeypatch):
    """Set a launcher's variables (and only those: the machine's own are cleared)."""
    import os

    for name in list(os.environ):
        if LAUNCHER_VARIABLES.search(name):
            monkeypatch.delenv(name)

    def set_env(env: dict[str, str]):
        for name, value in env.items():
            monkeypatch.setenv(name, value)

    return set_env


def captured_initialize(monkeypatch, launch) -> dict:
    """What jaxcnn passes to jax.distributed.initialize on a GPU machine (nothing joins)."""
    calls = []
    monkeypatch.setattr(distributed, "computes_on_cpu", lambda: False)
    monkeypatch.setattr(distributed.jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
    distributed.initialize(launch)
    (args, kwargs), = calls  # fmt: skip
    return {"coordinator": args[0], "num_processes": args[1], "process_id": args[2], **kwargs}


def jax_would_choose() -> list[int] | None:
    """The devices JAX's own detection picks for this environment (jax.distributed.initialize
    with no local_device_ids and detection on)."""
    from jax._src import clusters

    return clusters.ClusterEnv.auto_detect_unset_distributed_params(None, None, None, None, None, 10)[3]


# (script, node, local rank) -> the devices jaxcnn chooses, and JAX's
SLURM_TABLE = [
    ("slurm-task-per-node.sbatch", 0, 0, None, [0]),  # JAX: GPU 0 alone, 1 of the node's 8
    ("slurm-task-per-node.sbatch", 1, 0, None, [0]),
    ("slurm-task-per-gpu.sbatch", 0, 0, (0,), [0]),
    ("slurm-task-per-gpu.sbatch", 1, 5, (5,), [5]),  # the same: each sees 8, takes its local rank's
    ("slurm-gpus-per-task.sbatch", 0, 0, None, [0]),
    ("slurm-gpus-per-task.sbatch", 1, 5, None, [5]),  # JAX: GPU 5, where the task sees one, number 0
]


@pytest.mark.parametrize(("script", "node", "local", "ours", "jaxs"), SLURM_TABLE)
def test_slurm_scripts_give_each_task_its_devices(launcher_env, monkeypatch, script, node, local, ours, jaxs):
    options = sbatch_options(CLUSTERS / script)
    env = slurm_task_env(options, node, local)
    launcher_env(env)
    launch = launch_from(ClusterConfig())
    per_node = int(options["ntasks-per-node"])
    assert (launch.launcher, launch.num_processes, launch.process_id) == (
        "slurm",
        2 * per_node,
        node * per_node + local,
    )
    assert launch.coordinator == f"gpu001:{4242 % 4096 + 65535 - 4095}"  # JAX's reading of the node list and job
    assert launch.local_devices == ours, launch.devices_reason
    assert jax_would_choose() == jaxs  # what jaxcnn used to get by leaving the choice to JAX
    call = captured_initialize(monkeypatch, launch)
    assert call["local_device_ids"] == ours and call["cluster_detection_method"] == "deactivate"
    assert (call["num_processes"], call["process_id"]) == (launch.num_processes, launch.process_id)


@pytest.mark.parametrize(("node", "tasks"), [(0, 8), (1, 8), (2, 4)])
def test_an_uneven_slurm_task_list_gives_each_node_its_own_count(launcher_env, node, tasks):
    """SLURM writes 20 tasks on 3 nodes as "8(x2),4": 8 on each of the first two, 4 on the
    last. One task per GPU share of a node's 8 GPUs: a task of the last node takes 2 of them
    (its local rank's pair), one of the others 1."""
    assert distributed.slurm_tasks_on_node({"SLURM_STEP_TASKS_PER_NODE": "8(x2),4", "SLURM_NODEID": str(node)}) == tasks
    local = 1
    launcher_env({
        "SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "gpu[001-003]", "SLURM_NTASKS": "20",
        "SLURM_PROCID": str(8 * node + local), "SLURM_LOCALID": str(local), "SLURM_NODEID": str(node),
        "SLURM_STEP_TASKS_PER_NODE": "8(x2),4", "SLURM_STEP_NUM_NODES": "3", "SLURM_GPUS_ON_NODE": "8",
        "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
    })  # fmt: skip
    launch = launch_from(ClusterConfig())
    assert (launch.launcher, launch.num_processes, launch.process_id) == ("slurm", 20, 8 * node + local)
    assert launch.local_devices == ((2, 3) if tasks == 4 else (1,)), launch.devices_reason


@pytest.mark.parametrize(
    ("env", "launcher", "coordinator", "devices", "jaxs"),
    [
        (mpirun_env(11), "openmpi", "10.0.0.1:", (3,), [3]),
        (mpirun_env(11) | {"CUDA_VISIBLE_DEVICES": "3"}, "openmpi", "10.0.0.1:", None, [3]),  # a wrapper bound it
        (mpirun_env(3, size=4, per_host=2) | {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, "openmpi", "10.0.0.1:", (2, 3),
         [1]),  # 2 ranks on a host of 4 GPUs: two each
        (torchrun_env(9), "torchrun", "host0:29501", (1,), None),  # JAX does not read torchrun's variables
        (torchrun_env(9) | {"TORCHELASTIC_USE_AGENT_STORE": "False"}, "torchrun", "host0:29500", (1,), None),
        (torchrun_env(1, size=2, per_host=1), "torchrun", "host0:29501", None, None),
    ],
    ids=["mpirun", "mpirun-bound", "mpirun-2-each", "torchrun", "torchrun-own-store", "torchrun-one-per-host"],
)  # fmt: skip
def test_mpirun_and_torchrun_give_each_process_its_devices(launcher_env, monkeypatch, env, launcher, coordinator,
                                                           devices, jaxs):  # fmt: skip
    launcher_env(env)
    launch = launch_from(ClusterConfig())
    assert launch.launcher == launcher and launch.coordinator.startswith(coordinator)
    assert launch.local_devices == devices, launch.devices_reason
    assert jax_would_choose() == jaxs
    assert captured_initialize(monkeypatch, launch)["local_device_ids"] == devices


@pytest.mark.parametrize(
    ("inner", "launcher", "rank", "devices"),
    [
        (torchrun_env(13), "torchrun", 13, (5,)),  # srun, one task per node, starting torchrun
        (mpirun_env(13), "openmpi", 13, (5,)),  # mpirun inside the sbatch script
    ],
    ids=["torchrun-under-srun", "mpirun-inside-sbatch"],
)
def test_a_launcher_inside_slurm_is_the_one_that_counts(launcher_env, inner, launcher, rank, devices):
    """torchrun under srun and mpirun in a batch script also see SLURM's variables, which
    describe 2 tasks (one per node), not the 16 processes: the innermost launcher decides."""
    options = sbatch_options(CLUSTERS / "slurm-task-per-node.sbatch")
    launcher_env(slurm_task_env(options, 1, 0) | inner)
    launch = launch_from(ClusterConfig())
    assert (launch.launcher, launch.num_processes, launch.process_id) == (launcher, 16, rank)
    assert launch.local_devices == devices, launch.devices_reason


@pytest.mark.parametrize(
    ("args", "devices"),
    [
        ((2, 1, 4, None, 8), None),  # 2 tasks, each bound to 4 of the node's 8: each takes its 4
        ((2, 1, 8, None, 8), (4, 5, 6, 7)),  # unbound: local rank 1's half
        ((None, 3, 8), (3,)),  # processes on the host unknown: JAX's rule, GPU of the local rank
        ((None, 3, 2), None),  # ... unless that GPU cannot be seen: bound to its own
    ],
    ids=["bound-4-of-8", "shared-8", "unknown-count", "unknown-count-bound"],
)
def test_bound_and_shared_gpus_are_told_apart(args, devices):
    assert choose_local_devices(*args)[0] == devices


def test_flags_and_jax_local_device_ids_override_the_launchers_choice(launcher_env, monkeypatch):
    options = sbatch_options(CLUSTERS / "slurm-task-per-gpu.sbatch")
    launcher_env(slurm_task_env(options, 0, 5))
    assert launch_from(ClusterConfig(local_devices=(2, 3))).local_devices == (2, 3)
    monkeypatch.setenv("JAX_LOCAL_DEVICE_IDS", "6,7")
    launch = launch_from(ClusterConfig())
    assert launch.local_devices == (6, 7) and launch.devices_reason == "JAX_LOCAL_DEVICE_IDS"
    monkeypatch.delenv("JAX_LOCAL_DEVICE_IDS")
    flags = launch_from(ClusterConfig(coordinator="10.0.0.9:1234", num_processes=4, process_id=1))
    assert (flags.launcher, flags.coordinator, flags.local_devices) == ("flags", "10.0.0.9:1234", None)


def test_a_launch_of_one_task_or_none_is_one_process(launcher_env):
    assert launch_from(ClusterConfig()).launcher == "single"
    launcher_env(slurm_task_env({"nodes": "1", "ntasks-per-node": "1", "gpus-per-node": "8"}, 0, 0))
    assert not launch_from(ClusterConfig()).multi_process  # srun -n1: one process, all 8 GPUs


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((4, 3, 6), "4 processes on this host see 6 GPUs each, which do not split evenly"),
        ((8, 3, 16, 1), "sees 16 GPUs but the launcher gave each of the node's 8 tasks 1"),
    ],
)
def test_devices_that_cannot_be_shared_out_are_refused_in_one_line(args, message):
    with pytest.raises(UserError, match=message):
        choose_local_devices(*args)


@pytest.mark.parametrize("script", sorted(p.name for p in CLUSTERS.iterdir() if "experiments/train.py" in p.read_text()))
def test_every_cluster_script_runs_train_with_flags_it_accepts(script):
    """The training command of each script in docs/clusters parses (extra flags through "$@")."""
    command = launch_command(CLUSTERS / script)
    train_args = command[command.index("experiments/train.py") + 1 :]
    config = train_command.parse_flags([a for a in train_args if a != "$@"] + ["--quiet"])
    assert config.parallel.mesh == "data=16" and config.checkpoint.resume == "auto"
    if script.endswith(".sbatch"):
        assert config.checkpoint.stop_signal == "USR1" and sbatch_options(CLUSTERS / script)["signal"].startswith(
            "USR1"
        )


def launch_command(script: Path) -> list[str]:
    """The launcher's command line in a cluster script (its continuation lines joined); the
    sbatch scripts' srun is docs/clusters/srun-restarting.sh's, given the command."""
    text = script.read_text().replace("\\\n", " ")
    launchers = (["srun"], ["mpirun"], ["torchrun"], ["exec", "bash"])
    line = next(line for line in text.splitlines() if line.split()[:1] in launchers or line.split()[:2] in launchers)
    return shlex.split(line)


def srun_train_command(script: Path, extra: list[str]) -> list[str]:
    """The srun line's training command, as this machine runs it: this Python, `extra` for "$@"."""
    command = launch_command(script)
    command = command[command.index("python") :]
    return [sys.executable if a == "python" else a for a in command[: command.index("$@")]] + extra
