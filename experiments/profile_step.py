"""Where one train step's time goes: per-op thread time from a jax.profiler trace, joined
with the compiled HLO, and the host page faults per step.

python experiments/profile_step.py                   # default model, 28x28x1, batch 128
python experiments/profile_step.py --size 224 --top 15
python experiments/profile_step.py --model resnet50 --size 224 --steps 2   # runs/profile_resnet50_224.*

Writes runs/profile_<size>.csv (one row per op, slowest first) and profile_<size>.json
(the step's summary: traced step time, thread time in ops and outside them -- XLA:CPU's
Eigen convolutions run as untraced tasks -- page faults per step, temp buffer bytes). The
trace itself goes to --trace-dir, for TensorBoard's or Perfetto's trace viewer.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from jaxcnn import results
from jaxcnn.analysis.measure import SIZES, random_batch, timing_program
from jaxcnn.analysis.profiling import profile_step
from jaxcnn.commands import cli
from jaxcnn.config import DEFAULT_MODEL, DTYPES, ModelConfig
from jaxcnn.errors import UserError
from jaxcnn.sharding import simulate_cpu_devices

PROG = "profile_step.py"
COLUMNS = ["op", "thread_ms_per_step", "share_of_traced", "kind", "shape", "source"]


def parse_flags(argv=None):
    parser = cli.experiment_parser(PROG, __doc__)
    parser.add_argument("--size", default="28", help=f"one of {', '.join(SIZES)} (image side; batch 64/128/8)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the CNN (default) or a ResNet, e.g. resnet50")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--steps", type=int, default=5, help="steps traced (default %(default)s)")
    parser.add_argument("--top", type=int, default=12, help="ops printed (all are written)")
    parser.add_argument("--out-dir", default="runs")
    parser.add_argument("--trace-dir", default=None, help="where the trace goes (default: a temporary folder)")
    return parser.parse_args(argv)


def main(argv=None) -> tuple[list[dict], dict]:
    args = parse_flags(argv)
    if args.size not in SIZES:
        raise UserError(f"--size must be one of {', '.join(SIZES)}, got {args.size!r}")
    if args.steps < 1:
        raise UserError("--steps must be a positive integer")
    out_dir = results.ensure_writable_dir(args.out_dir)
    simulate_cpu_devices(1, at_least=True)
    image_shape, batch = SIZES[args.size]
    config = ModelConfig(name=args.model, dtype=args.dtype)
    program = timing_program(config, image_shape, batch)
    images, labels = random_batch(image_shape, batch, config.num_classes)
    trace_dir = Path(args.trace_dir or tempfile.mkdtemp(prefix="jaxcnn-trace-"))
    rows, summary = profile_step(program, program.init(), images, labels, args.steps, trace_dir)
    summary.update(model=args.model, size=args.size, batch=batch, dtype=args.dtype, steps=args.steps)

    busy = summary["worker_threads"] * summary["step_seconds_traced"]
    print(
        f"{args.size}x{args.size} batch {batch}: step {summary['step_seconds_traced'] * 1e3:.1f} ms traced on "
        f"{summary['worker_threads']} threads; ops {summary['traced_thread_seconds'] * 1e3:.1f} thread-ms, "
        f"outside ops (Eigen convolutions, waits) {summary['untraced_thread_seconds'] * 1e3:.1f} of "
        f"{busy * 1e3:.1f}; {summary['minor_page_faults_per_step']:,.0f} page faults in the median step "
        f"(the heap grew in {summary['heap_growth_steps']} of {summary['fault_steps']}, after "
        f"{summary['warmup_steps']} warm-up steps); "
        f"temp buffer {summary['temp_bytes'] / 2**20:.1f} MiB"
    )
    for row in rows[: args.top]:
        print(f"{row['thread_ms_per_step']:8.2f} ms {row['share_of_traced']:6.1%}  {row['op']:<28} "
              f"{row['kind']:<6} {row['shape']:<26} {row['source'][-50:]}")  # fmt: skip
    name = f"profile_{args.size}" if args.model == DEFAULT_MODEL else f"profile_{args.model}_{args.size}"
    csv = results.write_csv(out_dir / f"{name}.csv", rows, COLUMNS)
    results.write_json(out_dir / f"{name}.json", summary)
    print("wrote", csv, "and the trace under", trace_dir)
    return rows, summary


if __name__ == "__main__":
    cli.run_main(PROG, main)
