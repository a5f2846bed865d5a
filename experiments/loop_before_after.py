"""End to end, before and after the loop work: `jaxcnn train` (or `jaxcnn bench-loop`) from an
earlier commit and from this checkout, the same jobs on the same machine, alternating run by run.

python experiments/loop_before_after.py --before e1424f6 --rounds 3 --out results/loop_before_after.csv
python experiments/loop_before_after.py --before ae9435b --jobs bench-tiny,bench-dp8 --rounds 6

The earlier commit is checked out into a temporary git worktree and run with the same
virtual environment (its package ahead on PYTHONPATH); each tree keeps its own compile
cache, warmed by a first round that is recorded as `cold`. Jobs: `default` (the README's
first command: `jaxcnn train`, the bundled digits) and `fashion` (`--dataset fashion-mnist`,
--fashion-epochs epochs). The CSV has a row per (round, job, tree): the process's wall
seconds from start to exit, the run's own training seconds, steady images/s, compile
seconds and final test accuracy, and what the loop chose (data on device, steps a call).
The bench jobs run `jaxcnn bench-loop` on the digits held on the devices (modes device and
device-K; `tiny`: one device, `dp8`: dp over 8 simulated devices), --bench-rounds rounds of
--bench-steps steps inside each process: a row per (round, job, tree, mode) with fit's and the
bare loop's ms per step (the bare loop: the same compiled calls without fit, a control for
the machine's speed at that moment) and the 1-minute load average when the process started.
"""

from __future__ import annotations

import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from jaxcnn import results
from jaxcnn.commands import cli
from jaxcnn.errors import UserError

PROG = "loop_before_after.py"
REPO = Path(__file__).resolve().parents[1]
JOBS = {"default": [], "fashion": ["--dataset", "fashion-mnist"], "bench-tiny": ["tiny"], "bench-dp8": ["dp8"]}
COLUMNS = ["round", "warm", "job", "tree", "commit", "wall_seconds", "train_seconds", "images_per_second",
           "compile_seconds", "test_accuracy", "epochs", "steps", "data_on_device", "steps_per_call", "mode",
           "fit_ms_per_step", "bare_ms_per_step", "fit_over_bare", "load_1min", "machine"]  # fmt: skip


def parse_flags(argv=None):
    parser = cli.experiment_parser(PROG, __doc__)
    parser.add_argument("--before", default="e1424f6", help="the earlier commit (default %(default)s: before issue 37)")
    parser.add_argument("--after", help="a later commit, checked out apart too (default: this checkout as it is)")
    parser.add_argument("--rounds", type=int, default=3, help="warm rounds after the cold one (default %(default)s)")
    parser.add_argument("--jobs", type=cli.name_list, default=tuple(JOBS), help=", ".join(JOBS))
    parser.add_argument("--fashion-epochs", type=int, default=2, help="(default %(default)s)")
    parser.add_argument("--bench-rounds", type=int, default=5, help="bench-loop's --rounds (default %(default)s)")
    parser.add_argument("--bench-steps", type=int, default=500, help="bench-loop's --steps (default %(default)s)")
    cli.add_output_flags(parser, out="runs/loop_before_after.csv")
    return parser.parse_args(argv)


def _commit(ref: str, cwd: Path) -> str:
    done = subprocess.run(["git", "rev-parse", "--short", ref], cwd=cwd, capture_output=True, text=True)
    if done.returncode:
        raise UserError(f"--before {ref!r}: not a commit of this repository ({done.stderr.strip()})")
    return done.stdout.strip()


def _run(tree: Path, job: str, flags: list[str], work: Path, name: str, cache: Path) -> dict:
    """One `jaxcnn train` process from `tree`: its wall seconds and its result record."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [sys.executable, "-c", "import sys; from jaxcnn.commands import main; sys.argv[0] = 'jaxcnn'; main()",
               "train", *JOBS[job], *flags, "--results-dir", str(work), "--run-name", name,
               "--compile-cache", str(cache), "--quiet"]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"{name} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    record = json.loads((work / name / f"{name}.json").read_text())
    return {"wall_seconds": wall, "train_seconds": record["train_seconds"],
            "images_per_second": record["images_per_second"], "compile_seconds": record["compile_seconds"],
            "test_accuracy": record["test_accuracy"], "epochs": record["epochs"], "steps": record["steps"],
            "data_on_device": record.get("data_on_device", "off (not built)"),
            "steps_per_call": record.get("steps_per_call", 1)}  # fmt: skip


def _bench(tree: Path, job: str, args, work: Path, name: str, cache: Path) -> list[dict]:
    """One `jaxcnn bench-loop` process from `tree`: a row per mode."""
    env = {**os.environ, "PYTHONPATH": str(tree), "JAXCNN_CACHE": str(cache)}
    out = work / f"{name}.csv"
    command = [sys.executable, "-c", "import sys; from jaxcnn.commands import main; sys.argv[0] = 'jaxcnn'; main()",
               "bench-loop", "--cases", *JOBS[job], "--data", "digits", "--modes", "device,device-K",
               "--rounds", str(args.bench_rounds), "--steps", str(args.bench_steps), "--out", str(out)]  # fmt: skip
    load = os.getloadavg()[0]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"{name} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    with open(out) as f:
        modes = list(csv.DictReader(f))
    return [{"wall_seconds": wall, "mode": m["mode"], "steps_per_call": int(m["steps_per_call"]),
             "fit_ms_per_step": float(m["fit_ms_per_step"]), "bare_ms_per_step": float(m["bare_ms_per_step"]),
             "fit_over_bare": float(m["fit_over_bare"]), "data_on_device": "on", "load_1min": load}
            for m in modes]  # fmt: skip


def main(argv=None) -> list[dict]:
    args = parse_flags(argv)
    bad = [j for j in args.jobs if j not in JOBS]
    if bad or min(args.rounds, args.fashion_epochs, args.bench_rounds, args.bench_steps) < 1:
        raise UserError(f"--jobs from {', '.join(JOBS)}; --rounds, --fashion-epochs, --bench-* >= 1")
    (out,) = cli.writable_outputs(args.out)
    before = _commit(args.before, REPO)
    edited = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=REPO).returncode != 0
    after = _commit("HEAD", REPO) + ("+" if edited else "")  # "+": the checkout has changes not committed
    if args.after:
        after = _commit(args.after, REPO)
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    rows = []
    with tempfile.TemporaryDirectory(prefix="jaxcnn-before-after-") as tmp:
        tmp = Path(tmp)
        subprocess.run(["git", "worktree", "add", "--detach", str(tmp / "before"), before], cwd=REPO, check=True,
                       capture_output=True)  # fmt: skip
        if args.after:
            subprocess.run(["git", "worktree", "add", "--detach", str(tmp / "after"), after], cwd=REPO, check=True,
                           capture_output=True)  # fmt: skip
        trees = {"before": (tmp / "before", before), "after": (tmp / "after" if args.after else REPO, after)}
        try:
            for round_ in range(args.rounds + 1):
                for job in args.jobs:
                    flags = ["--epochs", str(args.fashion_epochs)] if job == "fashion" else []
                    order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
                    for tree in order:
                        path, commit = trees[tree]
                        name = f"{job}-{tree}-{round_}"
                        if job.startswith("bench"):
                            for row in _bench(path, job, args, tmp, name, tmp / f"cache-{tree}"):
                                rows.append({"round": round_, "warm": round_ > 0, "job": job, "tree": tree,
                                             "commit": commit, **row, "machine": machine})  # fmt: skip
                                print(f"{PROG}: round {round_} {job:<10} {tree:<6} {row['mode']:<9} fit "
                                      f"{row['fit_ms_per_step']:.3f} ms/step, bare {row['bare_ms_per_step']:.3f} "
                                      f"(load {row['load_1min']:.1f})", flush=True)  # fmt: skip
                        else:
                            row = _run(path, job, flags, tmp, name, tmp / f"cache-{tree}")
                            rows.append({"round": round_, "warm": round_ > 0, "job": job, "tree": tree,
                                         "commit": commit, **row, "machine": machine})  # fmt: skip
                            print(f"{PROG}: round {round_} {job:<8} {tree:<6} {row['wall_seconds']:6.1f} s wall, "
                                  f"{row['train_seconds']:6.1f} s training, {row['images_per_second']:8,.0f} "
                                  f"images/s, test accuracy {row['test_accuracy']:.4f}", flush=True)  # fmt: skip
                        if out:
                            results.write_csv(out, rows, COLUMNS)
        finally:
            for tree in ("before", "after"):
                if (tmp / tree).exists():
                    subprocess.run(["git", "worktree", "remove", "--force", str(tmp / tree)], cwd=REPO,
                                   capture_output=True)  # fmt: skip
    for job in args.jobs:
        if job.startswith("bench"):
            for mode in ("device", "device-K"):
                fit = {t: [r["fit_ms_per_step"] for r in rows if (r["job"], r["tree"], r["mode"]) == (job, t, mode)]
                       for t in trees}  # fmt: skip
                b, a = statistics.median(fit["before"]), statistics.median(fit["after"])
                print(f"{PROG}: {job} {mode}: median fit {b:.3f} ms/step before ({before}), {a:.3f} after "
                      f"({after}): {a / b - 1:+.1%}")  # fmt: skip
            continue
        warm = {t: [r["wall_seconds"] for r in rows if r["job"] == job and r["tree"] == t and r["warm"]] for t in trees}
        b, a = statistics.median(warm["before"]), statistics.median(warm["after"])
        print(f"{PROG}: {job}: median wall {b:.1f} s before ({before}), {a:.1f} s after ({after}): {b / a:.2f}x")
    if out:
        print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    cli.run_main(PROG, main)
