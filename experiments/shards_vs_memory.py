"""Does training on prepared shards keep up with training on images already in memory?

python experiments/shards_vs_memory.py --shards DIR --out results/shards_vs_memory.csv

Trains --model for --steps steps at --batch-size twice per round, alternating: on the prepared
shards in DIR (`jaxcnn prepare`; --augment imagenet: a random resized crop to --image-size per
example, decoded in --input-workers grain workers) and on --synthetic random images of the
same size held in memory; same layout, mesh and seed. Each run is `jaxcnn train` in a process
of its own; its images/s (steps after the first: compilation is not counted) and
input_wait_fraction come from the run's JSON. The ratio is shards / memory, per round and the
median (the issue's target: >= 0.95).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from jaxcnn import results
from jaxcnn.commands import cli
from jaxcnn.errors import UserError

PROG = "shards_vs_memory.py"
TRAIN = Path(__file__).resolve().parent / "train.py"
COLUMNS = [
    "round", "source", "images_per_second", "ratio_to_memory", "input_wait_fraction", "train_seconds", "steps",
    "batch_size", "image_size", "model", "input_workers", "shards",
]  # fmt: skip


def parse_flags(argv=None):
    parser = cli.experiment_parser(PROG, __doc__)
    g = parser.add_argument_group("shards vs memory")
    g.add_argument("--shards", required=True, help="a prepared directory (jaxcnn prepare)")
    g.add_argument("--model", default="resnet18")
    g.add_argument("--image-size", default="64x64", help="HxW trained at (default %(default)s)")
    g.add_argument("--batch-size", type=int, default=32)
    g.add_argument("--steps", type=int, default=20, help="steps per run (default %(default)s)")
    g.add_argument("--input-workers", type=int, default=1)
    g.add_argument("--rounds", type=int, default=1, help="rounds, each training on both (default %(default)s)")
    cli.add_output_flags(g, out_help="write the rows to this CSV (default: print only)")
    return parser.parse_args(argv)


def train(flags: list[str], results_dir: Path) -> dict:
    """One `jaxcnn train` run in its own process: its JSON record."""
    command = [sys.executable, str(TRAIN), *flags, "--results-dir", str(results_dir), "--run-name", "r", "--quiet"]
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"train failed ({' '.join(flags)}): {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads((results_dir / "r" / "r.json").read_text())


def main(argv=None) -> list[dict]:
    args = parse_flags(argv)
    (out,) = cli.writable_outputs(args.out)
    manifest = json.loads((Path(args.shards) / "manifest.json").read_text())
    height, width = args.image_size.split("x")
    common = ["--model", args.model, "--batch-size", str(args.batch_size), "--max-steps", str(args.steps),
              "--epochs", "1000", "--input-workers", str(args.input_workers), "--seed", "0"]  # fmt: skip
    sources = {
        "shards": ["--data", args.shards, "--augment", "imagenet", "--image-size", args.image_size],
        "memory": ["--synthetic", f"{height}x{width}x{manifest['channels']}", "--num-classes",
                   str(len(manifest["classes"])), "--synthetic-size", str(args.batch_size * args.steps)],
    }  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for r in range(args.rounds):
            for source, flags in sources.items():
                record = train([*common, *flags], Path(scratch) / f"{source}-{r}")
                rows.append({
                    "round": r + 1, "source": source, "images_per_second": record["images_per_second"],
                    "input_wait_fraction": record.get("input_wait_fraction"), "train_seconds": record["train_seconds"],
                    "steps": record["steps"], "batch_size": args.batch_size, "image_size": args.image_size,
                    "model": args.model, "input_workers": args.input_workers, "shards": args.shards,
                })  # fmt: skip
                print(f"round {r + 1} {source:>7}: {record['images_per_second']:7.1f} images/s "
                      f"(input wait {record.get('input_wait_fraction', 0):.1%})")  # fmt: skip
    for row in rows:
        memory = next(m for m in rows if m["round"] == row["round"] and m["source"] == "memory")
        row["ratio_to_memory"] = row["images_per_second"] / memory["images_per_second"]
    ratio = statistics.median(row["ratio_to_memory"] for row in rows if row["source"] == "shards")
    print(f"{PROG}: shards / memory = {ratio:.3f} (median over {args.rounds} round(s); target >= 0.95)")
    if out:
        print("wrote", results.write_csv(out, rows, COLUMNS))
    return rows


if __name__ == "__main__":
    cli.run_main(PROG, main)
