"""Start N processes of experiments/train.py on this machine: one per GPU (torchrun-like),
or, on a CPU-only machine, as N hosts would run it.

python experiments/launch_local.py --num-processes 8 --devices-per-process 1 -- --mesh data=8   # 8 GPUs
python experiments/launch_local.py --num-processes 2 -- --mesh data=4 --epochs 2                # CPU
python experiments/launch_local.py --num-processes 2 --devices-per-process 2 -- --layout hybrid --mesh data=2,model=2
python experiments/launch_local.py --num-processes 2 --max-restarts 3 -- --mesh data=4 --run-name r \\
    --resume auto --checkpoint-dir ckpt --checkpoint-every 50                     # restarted when one dies

Process I gets --coordinator localhost:PORT --num-processes N --process-id I and
--local-devices I*D..I*D+D-1: its own GPUs, or on a CPU-only machine D simulated devices
(CPU collectives between them: gloo). Output lines are prefixed with the process id.

When a process fails, the others are stopped -- after a short grace period, or at once with
--max-restarts, where every process is then started again (a new coordinator port) up to N
times, as torchrun does: with `--resume auto` and periodic checkpoints the run continues
from its last checkpoint. A SIGTERM to the launcher goes to every process (a Ctrl-C reaches
them from the terminal), which stop at one step, save and exit 75 (Ctrl-C: 130); that is no
failure: nothing restarts, and the launcher exits with their code. On a cluster run train.py itself on every host
(docs/clusters: SLURM, Open MPI, torchrun).
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "train.py"
GRACE_S = 15  # after one process fails, how long the others get to fail on their own
STOPPED = (75, 130)  # the training processes' exit codes after a requested stop, state saved (jaxcnn.stopping)


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
    parser.add_argument(
        "--max-restarts", type=int, default=0,
        help="when a process dies, start every process again, up to this many times (default 0: the run fails); "
        "the training flags need --resume auto and periodic checkpoints to continue where it was",
    )  # fmt: skip
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then train.py's flags")
    args = parser.parse_args(argv)
    if args.num_processes < 1 or args.devices_per_process < 1 or args.max_restarts < 0:
        parser.exit(2, "launch_local.py: error: --num-processes and --devices-per-process must be >= 1, "
                       "--max-restarts >= 0\n")  # fmt: skip
    args.train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    if args.max_restarts and not _resumes_automatically(args.train_args):
        parser.exit(2, "launch_local.py: error: --max-restarts starts the same command again: give train.py "
                       "--resume auto (and --checkpoint-dir, --checkpoint-every) so it continues the run\n")  # fmt: skip
    return args


def _resumes_automatically(train_args: list[str]) -> bool:
    pairs = zip(train_args, [*train_args[1:], ""], strict=True)
    return any(a == "--resume=auto" or (a == "--resume" and b == "auto") for a, b in pairs)


def _pump(stream, prefix: str, out) -> None:
    for line in stream:
        out.write(f"{prefix}{line}")
        out.flush()


class Processes:
    """One start of every training process; `wait()` returns how they ended."""

    def __init__(self, num_processes: int, devices_per_process: int, train_args: list[str]):
        port = free_port()
        self.procs, self.pumps = [], []
        for i in range(num_processes):
            cmd = [
                sys.executable, str(SCRIPT), *train_args, "--coordinator", f"localhost:{port}",
                "--num-processes", str(num_processes), "--process-id", str(i),
                "--local-devices", ",".join(str(i * devices_per_process + k) for k in range(devices_per_process)),
            ]  # fmt: skip
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            self.procs.append(proc)
            pump = threading.Thread(target=_pump, args=(proc.stdout, f"[p{i}] ", sys.stdout), daemon=True)
            pump.start()
            self.pumps.append(pump)

    def signal(self, signum: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signum)

    def wait(self, grace_s: float) -> tuple[int, bool]:
        """(exit status, whether a process failed): once one fails, the rest are killed after
        `grace_s` seconds (0: at once)."""
        failed_at = None
        while any(p.poll() is None for p in self.procs):
            for p in self.procs:
                if p.poll() not in (None, 0, *STOPPED) and failed_at is None:
                    failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at >= grace_s:
                for p in self.procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.2)
        for pump in self.pumps:
            pump.join(timeout=5)
        # a process killed by signal S ends as a shell reports it, 128 + S (sys.exit(-S) would give 256 - S)
        codes = [128 - p.returncode if p.returncode < 0 else p.returncode for p in self.procs]
        failure = next((c for c in codes if c not in (0, *STOPPED)), None)
        if failure is not None:
            return failure, True
        return next((c for c in codes if c), 0), False


def launch(num_processes: int, devices_per_process: int, train_args: list[str], max_restarts: int = 0) -> int:
    current: list[Processes] = []
    stopping = []  # a stop was sent: the processes' ends (a -15 before they handle it) are no failure

    def forward(signum, frame):  # a scheduler's stop: every process stops at one step and saves
        stopping.append(signum)
        if current:  # (none started yet: the loop below starts none)
            current[-1].signal(signum)

    # A Ctrl-C reaches every process of the terminal's group, the training processes too: they
    # stop and save by themselves (passed on, it would reach them twice: "exit at once").
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, forward),
                signal.SIGINT: signal.signal(signal.SIGINT, lambda signum, frame: None)}  # fmt: skip
    try:
        status = 0
        for attempt in range(max_restarts + 1):
            if stopping:  # stopped before (re)starting: as a process killed by that signal would end
                return 128 + stopping[0]
            current.append(Processes(num_processes, devices_per_process, train_args))
            if stopping:  # sent while they started
                current[-1].signal(stopping[0])
            status, failed = current[-1].wait(grace_s=0 if max_restarts else GRACE_S)
            if not failed or attempt == max_restarts or stopping:
                return status
            print(f"launch_local.py: a process failed (exit {status}); restarting all {num_processes} "
                  f"({attempt + 1} of {max_restarts})", file=sys.stderr, flush=True)  # fmt: skip
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return status


def main(argv=None) -> int:
    args = parse_flags(argv)
    return launch(args.num_processes, args.devices_per_process, args.train_args, args.max_restarts)


if __name__ == "__main__":
    sys.exit(main())
