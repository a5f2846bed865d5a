"""What made the train step fast on this machine, and what did not: an ablation.

python experiments/speedups.py                  # 28x28x1 batch 128 and 224x224x3 batch 8
python experiments/speedups.py --sizes 28 --rounds 3

Each variant runs in its own process (the host-malloc settings only take effect before
JAX starts), and the processes alternate over --rounds rounds, so a drift in the machine's
speed hits every variant alike. The first three are cumulative, from JAX's defaults to
what jaxcnn does; the rest are tried on top of jaxcnn's settings and were not adopted.
Writes runs/speedups.csv (--out): per size and variant the median warm step, images/s and the
speed-up over JAX's defaults.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from jaxcnn import results
from jaxcnn.analysis.measure import SIZES as ALL_SIZES
from jaxcnn.analysis.measure import random_batch, time_steps, timing_program
from jaxcnn.commands import cli
from jaxcnn.config import ModelConfig
from jaxcnn.errors import UserError
from jaxcnn.platform_choices import CPU_WITHOUT_YNN_CONVS, YNN_FUSION_TYPES

PROG = "speedups.py"
SIZES = {size: ALL_SIZES[size] for size in ("28", "224")}
# XLA:CPU options tried on top of jaxcnn's (CPU_WITHOUT_YNN_CONVS)
EXTRA_OPTIONS = {
    "onednn": {"xla_cpu_use_onednn": True, "xla_cpu_experimental_onednn_custom_call": True},
    "eltwise": {YNN_FUSION_TYPES: CPU_WITHOUT_YNN_CONVS[YNN_FUSION_TYPES] + ",LIBRARY_FUSION_TYPE_ELTWISE"},
    "xnn-graph": {"xla_cpu_experimental_xnn_graph_fusion_mode": "XNN_GRAPH_FUSION_MODE_GREEDY"},
}
# name -> (adopted, keep freed host memory, Eigen convolutions, extra: a key of EXTRA_OPTIONS or "bfloat16")
VARIANTS = {
    "jax defaults": (False, False, False, None),
    "+ keep freed host memory": (True, True, False, None),
    "+ Eigen convolutions (jaxcnn)": (True, True, True, None),
    "jaxcnn + oneDNN convolutions": (False, True, True, "onednn"),
    "jaxcnn + YNNPACK elementwise fusions": (False, True, True, "eltwise"),
    "jaxcnn + XNNPACK graph fusion": (False, True, True, "xnn-graph"),
    "jaxcnn in bfloat16": (False, True, True, "bfloat16"),
}
COLUMNS = ["size", "variant", "adopted", "median_step_seconds", "images_per_second", "speedup_vs_jax_defaults", "steps"]


def parse_flags(argv=None):
    parser = cli.experiment_parser(PROG, __doc__)
    parser.add_argument("--sizes", default="28,224", help=f"some of {', '.join(SIZES)}")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", default="15,5", help="warm steps per process, per size (default %(default)s)")
    cli.add_output_flags(parser, out="runs/speedups.csv")
    parser.add_argument("--child", default=None, help=cli.argparse.SUPPRESS)
    return parser.parse_args(argv)


def child(variant: str, size: str, steps: int) -> None:
    """Time one variant in this fresh process; print its step seconds as JSON."""
    _, _, eigen, extra = VARIANTS[variant]
    options = {}  # XLA's defaults
    if eigen:
        options = {**CPU_WITHOUT_YNN_CONVS, **EXTRA_OPTIONS.get(extra, {})}
    image_shape, batch = SIZES[size]
    config = ModelConfig(dtype="bfloat16" if extra == "bfloat16" else "float32")
    program = timing_program(config, image_shape, batch, compiler_options=options)  # the switch under test
    seconds, _ = time_steps(program, program.init(), *random_batch(image_shape, batch), steps)
    print(json.dumps(seconds))


def main(argv=None) -> list[dict]:
    args = parse_flags(argv)
    if args.child:
        variant, size, steps = args.child.split("|")
        return child(variant, size, int(steps))
    sizes = cli.some_of(args.sizes, SIZES, "--sizes")
    steps = cli.int_list(args.steps)
    if len(steps) != 2 or min(steps) < 1 or args.rounds < 1:
        raise UserError("--steps takes two positive counts (28, 224) and --rounds a positive integer")
    (out,) = cli.writable_outputs(args.out)
    rows = []
    for size in sizes:
        n = steps[0] if size == "28" else steps[1]
        seconds = {v: [] for v in VARIANTS}
        for round_ in range(args.rounds):
            for variant, (_, keep_memory, *_rest) in VARIANTS.items():
                env = {**os.environ, "JAXCNN_KEEP_HOST_MEMORY": "1" if keep_memory else "0"}
                done = subprocess.run(
                    [sys.executable, __file__, "--child", f"{variant}|{size}|{n}"],
                    env=env, capture_output=True, text=True, check=False,
                )  # fmt: skip
                if done.returncode:
                    raise UserError(f"variant {variant!r} failed: {done.stderr.strip().splitlines()[-1:]}")
                seconds[variant] += json.loads(done.stdout.strip().splitlines()[-1])
                print(f"{size}: round {round_ + 1}/{args.rounds} {variant}: "
                      f"{statistics.median(seconds[variant]) * 1e3:.1f} ms so far", flush=True)  # fmt: skip
        base = statistics.median(seconds["jax defaults"])
        for variant, (adopted, *_rest) in VARIANTS.items():
            median = statistics.median(seconds[variant])
            rows.append({
                "size": size, "variant": variant, "adopted": adopted, "median_step_seconds": median,
                "images_per_second": SIZES[size][1] / median, "speedup_vs_jax_defaults": base / median,
                "steps": len(seconds[variant]),
            })  # fmt: skip
    for row in rows:
        print(f"{row['size']:>4} {row['variant']:<40} {row['median_step_seconds'] * 1e3:8.1f} ms  "
              f"{row['speedup_vs_jax_defaults']:5.2f}x  {'adopted' if row['adopted'] else ''}")  # fmt: skip
    results.write_csv(out, rows, COLUMNS)
    print("wrote", out)
    return rows


if __name__ == "__main__":
    cli.run_main(PROG, main)
