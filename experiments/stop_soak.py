"""A stop near a periodic checkpoint, looped: two real processes (launch_local.py, dp over 4
CPU devices, periodic checkpoints every 10 steps), SIGTERM to process 1 at a moment read from
the checkpoint directory -- `during` a save (its temporary directory appears), `after` one (a
finished step appears), `before` one (three steps before the next save is due, timed from the
last two) -- in a first run and in the runs that resume it, then a last run to the end. The
moment is when the signal is sent; the stop lands where the processes agree on it, some steps
later (JAX's sync protocol goes through the coordinator), and the CSV gives that step too. Each stopped launch must exit 75
within STOP_LIMIT_S of its signal, every process at the same step, the newest checkpoint that
step's; the last run's losses must equal an uninterrupted run's (rtol 1e-5). A launch that does
not end is killed and counted as hung.

python experiments/stop_soak.py --rounds 20 --out results/stop_soak.csv

Each round runs one chain of launches (a fresh directory): the moments in rotation, so that each
comes first (a first run) and later (a resumed run) across rounds. tests/test_stopping.py runs
one chain.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
LAUNCH, TRAIN = REPO / "experiments/launch_local.py", REPO / "experiments/train.py"
MOMENTS = ("during", "after", "before")
EVERY = 10  # steps between periodic checkpoints
STOP_LIMIT_S = 30  # from the signal to the launcher's exit
RUN_LIMIT_S = 300  # a launch, start to end
FLAGS = ["--conv-features", "8,16,16", "--dense-features", "32,16", "--batch-size", "16", "--epochs", "2",
         "--mesh", "data=4"]  # fmt: skip


def reference_losses(workdir: Path) -> list[float]:
    """One process of 4 devices, never stopped."""
    subprocess.run([sys.executable, str(TRAIN), *FLAGS, "--host-devices", "4", "--results-dir", str(workdir),
                    "--run-name", "reference", "--quiet"], check=True, capture_output=True, timeout=RUN_LIMIT_S)  # fmt: skip
    return json.loads((workdir / "reference" / "reference.json").read_text())["loss_history"]


def training_processes(launcher: int) -> dict[int, int]:
    """{process id: pid} of the training processes a launcher started (none yet: {})."""
    found = {}
    with contextlib.suppress(OSError):
        for child in map(int, Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()):
            with contextlib.suppress(OSError, ValueError):
                args = Path(f"/proc/{child}/cmdline").read_text().split("\0")
                found[int(args[args.index("--process-id") + 1])] = child
    return found


def moment_reached(moment: str, checkpoints: Path, seen: set, saves_started: list) -> bool:
    """Whether `moment` has come, judged from the checkpoint directory: `seen` holds the entries
    of its last look (those present at the launch's start are not new), `saves_started` when each
    save's temporary directory appeared (at its step: finishing takes longer, and varies).
    `before`: two saves give the time a step takes; the signal goes three steps before the next
    save is due (about two steps pass before the processes agree)."""
    entries = set(os.listdir(checkpoints)) if checkpoints.is_dir() else set()
    new = entries - seen
    seen |= entries
    if any("tmp" in name for name in new):
        saves_started.append(time.monotonic())
    if moment == "during":
        return any("tmp" in name for name in new)
    if moment == "after":
        return any(name.isdigit() for name in new)
    if len(saves_started) < 2:
        return False
    seconds_a_step = (saves_started[-1] - saves_started[-2]) / EVERY
    return time.monotonic() - saves_started[-1] >= (EVERY - 3) * seconds_a_step


def stop_once(workdir: Path, moment: str | None) -> dict:
    """One launch of the run in `workdir`: with a `moment`, SIGTERM to process 1 then; without,
    to the end. What happened."""
    checkpoints = workdir / "checkpoints"
    command = [sys.executable, str(LAUNCH), "--num-processes", "2", "--", *FLAGS, "--run-name", "r",
               "--results-dir", str(workdir), "--resume", "auto", "--checkpoint-dir", str(checkpoints),
               "--checkpoint-every", str(EVERY)]  # fmt: skip
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(launcher.stdout), daemon=True)
    reader.start()
    started, signalled = time.monotonic(), None
    seen = set(os.listdir(checkpoints)) if checkpoints.is_dir() else set()
    saves_started: list[float] = []
    try:
        while launcher.poll() is None and time.monotonic() - started < RUN_LIMIT_S:
            if moment and signalled is None and moment_reached(moment, checkpoints, seen, saves_started):
                pid = training_processes(launcher.pid).get(1)
                if pid is not None:
                    os.kill(pid, signal.SIGTERM)
                    signalled = time.monotonic()
            if signalled is not None and time.monotonic() - signalled > STOP_LIMIT_S:
                break
            time.sleep(0.005)
    finally:
        hung = launcher.poll() is None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)  # a no-op once everything has ended
        launcher.wait()
        reader.join(timeout=10)
    out = "".join(lines)
    stops = [int(step) for step in re.findall(r"stopped \(\w+\) at step (\d+)", out)]
    saved = sorted(int(name) for name in os.listdir(checkpoints) if name.isdigit()) if checkpoints.is_dir() else []
    resumed = re.search(r"resuming from step (\d+)", out)
    return {
        "moment": moment or "none",
        "resumed_from": int(resumed.group(1)) if resumed else 0,
        "exit_code": launcher.returncode if not hung else None,
        "hung": hung,
        "signalled": signalled is not None,
        "seconds_to_exit": round(time.monotonic() - signalled, 2) if signalled and not hung else None,
        "stop_steps": ",".join(map(str, stops)),
        "stop_step_mod_every": stops[0] % EVERY if stops else None,
        "newest_checkpoint": saved[-1] if saved else None,
        "output_tail": out[-2000:],
    }


def check(row: dict) -> str | None:
    """What is wrong with a stopped launch (None: nothing)."""
    if row["hung"]:
        return f"no end within {STOP_LIMIT_S} s of the signal"
    if not row["signalled"]:
        return "the run ended before its moment came"
    stops = row["stop_steps"].split(",") if row["stop_steps"] else []
    if row["exit_code"] != 75 or len(stops) != 2 or stops[0] != stops[1]:
        return f"exit {row['exit_code']}, stops {stops}"
    if row["newest_checkpoint"] != int(stops[0]):
        return f"stopped at {stops[0]} but the newest checkpoint is {row['newest_checkpoint']}"
    return None


def chain(workdir: Path, moments: list[str], reference: list[float]) -> list[dict]:
    """A first run stopped at moments[0], resumed runs stopped at the others, a last run to the
    end; a row per launch with `problem` (None when right)."""
    rows = []
    for moment in moments:
        row = stop_once(workdir, moment)
        row["problem"] = check(row)
        rows.append(row)
        if row["problem"]:
            return rows
    last = stop_once(workdir, None)
    last["problem"] = None if last["exit_code"] == 0 else f"the last run exited {last['exit_code']}"
    if last["problem"] is None:
        losses = json.loads((workdir / "r" / "r.json").read_text())["loss_history"]
        if len(losses) != len(reference) or not np.allclose(losses, reference, rtol=1e-5, atol=0):
            last["problem"] = "the losses differ from the uninterrupted run's"
    rows.append(last)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("results/stop_soak.csv"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="stop-soak-") as tmp:
        reference = reference_losses(Path(tmp))
        rows = []
        for round_ in range(args.rounds):
            moments = list(MOMENTS[round_ % 3 :] + MOMENTS[: round_ % 3])
            workdir = Path(tmp) / f"round{round_}"
            workdir.mkdir()
            for position, row in enumerate(chain(workdir, moments, reference)):
                rows.append({"round": round_, "launch": position, **{k: v for k, v in row.items() if k != "output_tail"}})
                said = row["problem"] or "ok"
                print(f"round {round_} launch {position} {row['moment']:>6}: exit {row['exit_code']} stops "
                      f"{row['stop_steps'] or '-'} in {row['seconds_to_exit']} s -- {said}", flush=True)  # fmt: skip
                if row["problem"]:
                    print(row["output_tail"], file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    stopped = [r for r in rows if r["moment"] != "none"]
    bad = [r for r in rows if r["problem"]]
    worst = max((r["seconds_to_exit"] for r in stopped if r["seconds_to_exit"] is not None), default=None)
    print(f"{len(stopped) - sum(1 for r in stopped if r['problem'])} of {len(stopped)} stops right, "
          f"{sum(r['hung'] for r in rows)} hung, slowest exit {worst} s after its signal; "
          f"{sum(1 for r in rows if r['moment'] == 'none' and not r['problem'])} of {args.rounds} rounds ended with "
          f"the uninterrupted run's losses; wrote {args.out}")  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
