"""What made the train step fast on this machine, and what did not: an ablation.

python experiments/speedups.py                  # 28x28x1 batch 128 and 224x224x3 batch 8
python experiments/speedups.py --sizes 28 --rounds 3

Each variant runs in its own process (the host-malloc settings only take effect before
JAX starts), and the processes alternate over --rounds rounds, so a drift in the machine's
speed hits every variant alike. The first three are cumulative, from JAX's defaults to
what jaxcnn does; the rest are tried on top of jaxcnn's settings and were not adopted.
Writes results/speedups.csv: per size and variant the median warm step, images/s and the
speed-up over JAX's defaults.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from jaxcnn import cli, results
from jaxcnn.errors import UserError

PROG = "speedups.py"
SIZES = {"28": ((28, 28, 1), 128), "224": ((224, 224, 3), 8)}
ONEDNN = {"xla_cpu_use_onednn": True, "xla_cpu_experimental_onednn_custom_call": True}
YNN_ELTWISE = ",LIBRARY_FUSION_TYPE_ELTWISE"
# name -> (adopted, keep freed host memory, Eigen convolutions, extra)
VARIANTS = {
    "jax defaults": (False, False, False, None),
    "+ keep freed host memory": (True, True, False, None),
    "+ Eigen convolutions (jaxcnn)": (True, True, True, None),
    "jaxcnn + oneDNN convolutions": (False, True, True, "onednn"),
    "jaxcnn + YNNPACK elementwise fusions": (False, True, True, "eltwise"),
    "jaxcnn in bfloat16": (False, True, True, "bfloat16"),
}
COLUMNS = ["size", "variant", "adopted", "median_step_seconds", "images_per_second", "speedup_vs_jax_defaults", "steps"]


def parse_flags(argv=None):
    parser = cli.FlagParser(prog=PROG, description=__doc__, formatter_class=cli.argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="28,224", help=f"some of {', '.join(SIZES)}")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", default="15,5", help="warm steps per process, per size (default %(default)s)")
    parser.add_argument("--out", default="results/speedups.csv")
    parser.add_argument("--child", default=None, help=cli.argparse.SUPPRESS)
    return parser.parse_args(argv)


def child(variant: str, size: str, steps: int) -> None:
    """Time one variant in this fresh process; print its step seconds as JSON."""
    import warnings

    import jaxcnn.train
    import numpy as np

    from jaxcnn.analysis.measure import time_steps
    from jaxcnn.compiling import CPU_STEP_OPTIONS, YNN_FUSION_TYPES
    from jaxcnn.config import ModelConfig, OptimConfig
    from jaxcnn.sharding import build_mesh, get_layout

    _, _, eigen, extra = VARIANTS[variant]
    options = None
    if eigen:
        options = dict(CPU_STEP_OPTIONS)
        if extra == "onednn":
            options.update(ONEDNN)
        if extra == "eltwise":
            options[YNN_FUSION_TYPES] += YNN_ELTWISE
    jaxcnn.train.cpu_step_options = lambda mesh: options  # the switch under test, for this process only
    image_shape, batch = SIZES[size]
    config = ModelConfig(dtype="bfloat16" if extra == "bfloat16" else "float32")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = jaxcnn.train.build_program(
            config, OptimConfig(learning_rate=1e-3, schedule="constant", warmup_steps=0),
            get_layout("single"), build_mesh({"data": 1}), image_shape, batch, 1000, with_eval=False,
        )  # fmt: skip
    rng = np.random.default_rng(0)
    images = rng.random((batch, *image_shape), dtype=np.float32)
    labels = rng.integers(0, 10, batch).astype(np.int32)
    seconds, _ = time_steps(program, program.init(), images, labels, steps)
    print(json.dumps(seconds))


def main(argv=None) -> list[dict]:
    args = parse_flags(argv)
    if args.child:
        variant, size, steps = args.child.split("|")
        return child(variant, size, int(steps))
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    steps = cli.int_list(args.steps)
    if not sizes or any(s not in SIZES for s in sizes):
        raise UserError(f"--sizes must be some of {', '.join(SIZES)}")
    if len(steps) != 2 or min(steps) < 1 or args.rounds < 1:
        raise UserError("--steps takes two positive counts (28, 224) and --rounds a positive integer")
    out = Path(args.out)
    results.ensure_writable_dir(out.parent)
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
