"""Start N processes of experiments/train.py on this machine: one per GPU (torchrun-like),
or, on a CPU-only machine, as N hosts would run it.

python experiments/launch_local.py --num-processes 8 --devices-per-process 1 -- --mesh data=8   # 8 GPUs
python experiments/launch_local.py --num-processes 2 -- --mesh data=4 --epochs 2                # CPU
python experiments/launch_local.py --num-processes 2 --devices-per-process 2 -- --layout hybrid --mesh data=2,model=2

Process I gets --coordinator localhost:PORT --num-processes N --process-id I and
--local-devices I*D..I*D+D-1: its own GPUs, or on a CPU-only machine D simulated devices
(CPU collectives between them: gloo). Output lines are prefixed with the process id. When
a process fails, the others are stopped after a short grace period and the launcher exits
with its status. On a cluster run train.py itself on every host, e.g. with SLURM, one task
per GPU: `srun --nodes=2 --ntasks-per-node=8 --gpus-per-node=8 python experiments/train.py
--mesh data=2,model=8` (jax reads the SLURM variables and takes the task's GPU; no flags).
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "train.py"
GRACE_S = 15  # after one process fails, how long the others get to fail on their own


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def parse_flags(argv=None):
    parser = argparse.ArgumentParser(prog="launch_local.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument(
        "--devices-per-process", type=int, default=2, help="GPUs (or simulated CPU devices) each (default 2)"
    )
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then train.py's flags")
    args = parser.parse_args(argv)
    if args.num_processes < 1 or args.devices_per_process < 1:
        parser.exit(2, "launch_local.py: error: --num-processes and --devices-per-process must be >= 1\n")
    args.train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    return args


def _pump(stream, prefix: str, out) -> None:
    for line in stream:
        out.write(f"{prefix}{line}")
        out.flush()


def launch(num_processes: int, devices_per_process: int, train_args: list[str]) -> int:
    port = free_port()
    procs, pumps = [], []
    for i in range(num_processes):
        cmd = [
            sys.executable, str(SCRIPT), *train_args, "--coordinator", f"localhost:{port}",
            "--num-processes", str(num_processes), "--process-id", str(i),
            "--local-devices", ",".join(str(i * devices_per_process + k) for k in range(devices_per_process)),
        ]  # fmt: skip
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(proc)
        pump = threading.Thread(target=_pump, args=(proc.stdout, f"[p{i}] ", sys.stdout), daemon=True)
        pump.start()
        pumps.append(pump)
    status, failed_at = 0, None
    while any(p.poll() is None for p in procs):
        for p in procs:
            if p.poll() not in (None, 0) and failed_at is None:
                status, failed_at = p.returncode, time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.2)
    for pump in pumps:
        pump.join(timeout=5)
    codes = [p.returncode for p in procs]
    return status or next((c for c in codes if c), 0)


def main(argv=None) -> int:
    args = parse_flags(argv)
    return launch(args.num_processes, args.devices_per_process, args.train_args)


if __name__ == "__main__":
    sys.exit(main())
