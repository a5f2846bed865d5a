"""How a train step's cost grows with image size and batch, and where it stops being overhead-bound.

python experiments/cost_vs_size.py              # default CNN and resnet18: sizes 32..224 at batch 8, batches 8..256 at 32
python experiments/cost_vs_size.py --models resnet18 --sizes 32,64 --batches 8,32 --steps 2

For each model two sweeps on one device (the `single` layout, Adam): square images of
--channels channels at each of --sizes with batch --size-sweep-batch, and each of
--batches at --batch-sweep-size pixels a side (an empty list skips its sweep). Each point
gets its FLOPs per step from XLA's cost_analysis of the compiled step and the median of a
few warm steps: the points of a sweep take turns, one step each per round (so a drift in
the machine's speed hits each alike), and a point stops once its timed steps add up to
--seconds-per-point (at least one). Achieved FLOP/s and MFU are against a matmul peak
measured in the same run (at its start and its end, the better of the two). A ResNet's stem
follows --stem: `auto` switches to the ImageNet stem (7x7 stride 2 + max-pool: a quarter of
the pixels each side, about 1/16 of the work after it) from 128 pixels, which the FLOPs show.

Per model and sweep a least-squares fit of step_seconds = t0 + flops / rate (residuals
relative to the step, so the small points, where the overhead shows, weigh as much as the
large ones) gives t0, what a step costs beyond its arithmetic, and rate, the FLOP/s its
arithmetic runs at. Each point gets overhead_share = t0 / step_seconds (at most 1) and a
verdict: overhead-bound while t0 is more than half the step, else compute-bound. Printed:
the first size and the first batch where compute dominates. Rows -> --out (CSV); per model
and sweep, step time against FLOPs per step, log-log, with the fitted line -> --plot (PNG).
The default run takes 3-5 minutes on 2 CPU cores (a resnet18 step at batch 256 is
~750 GFLOP).
"""

from __future__ import annotations

import math
import statistics
import time

import numpy as np

from jaxcnn import plots, results
from jaxcnn.commands import cli
from jaxcnn.config import DEFAULT_MODEL, DTYPES, RESNETS, STEMS, ModelConfig
from jaxcnn.errors import UserError

PROG = "cost_vs_size.py"
SWEEPS = ("size", "batch")
OVERHEAD_BOUND = 0.5  # a point is overhead-bound while t0 is more than this share of its step
COLUMNS = [
    "model", "sweep", "image_size", "image_shape", "global_batch_size", "dtype", "stem", "flops_per_step",
    "flops_per_image", "median_step_seconds", "images_per_second", "achieved_flops_per_second",
    "peak_flops_per_second", "mfu", "steps", "compile_seconds", "fit_t0_seconds", "fit_flops_per_second",
    "fitted_step_seconds", "overhead_share", "verdict", "platform", "device_kind",
]  # fmt: skip


def parse_flags(argv=None):
    parser = cli.experiment_parser(PROG, __doc__)
    g = parser.add_argument_group("experiment")
    g.add_argument("--models", type=cli.name_list, default=(DEFAULT_MODEL, "resnet18"), help="model names")
    g.add_argument("--sizes", type=cli.int_list, default=(32, 64, 96, 128, 160, 224), help="the size sweep's sides")
    g.add_argument("--size-sweep-batch", type=int, default=8, help="global batch of the size sweep")
    g.add_argument("--batches", type=cli.int_list, default=(8, 16, 32, 64, 128, 256), help="the batch sweep's batches")
    g.add_argument("--batch-sweep-size", type=int, default=32, help="image side of the batch sweep")
    g.add_argument("--channels", type=int, default=3, help="channels per pixel")
    g.add_argument("--dtype", choices=DTYPES, default="float32")
    g.add_argument("--stem", choices=STEMS, default="auto", help="the ResNets' stem")
    g.add_argument("--steps", type=int, default=3, help="warm steps timed per point, at most")
    g.add_argument(
        "--seconds-per-point", type=float, default=3.0, help="stop timing a point once its steps add up to this"
    )
    cli.add_output_flags(g, out="runs/cost_vs_size.csv", plot="runs/cost_vs_size.png")
    return parser.parse_args(argv)


def fit_overhead(flops, seconds, relative: bool = True) -> tuple[float, float]:
    """(t0, rate) of the least-squares fit seconds = t0 + flops / rate, t0 >= 0. `relative`
    weighs each residual by 1 / seconds. A sweep whose time does not grow with its FLOPs is
    all overhead: (its weighted mean time, inf). Fewer than two distinct FLOP counts: (nan, nan)."""
    x, y = np.asarray(flops, float), np.asarray(seconds, float)
    if len(np.unique(x)) < 2:
        return math.nan, math.nan
    w = 1 / y**2 if relative else np.ones_like(y)
    design = np.stack([np.ones_like(x), x], axis=1) * np.sqrt(w)[:, None]
    (t0, slope), *_ = np.linalg.lstsq(design, y * np.sqrt(w), rcond=None)
    if slope <= 0:
        return float(np.sum(w * y) / np.sum(w)), math.inf
    if t0 < 0:  # a negative fixed cost means none: refit through the origin
        t0, slope = 0.0, float(np.sum(w * x * y) / np.sum(w * x * x))
    return float(t0), float(1 / slope)


def overhead_verdict(t0: float, step_seconds: float) -> tuple[float, str]:
    """(overhead_share, verdict) of one point under its sweep's fit."""
    if math.isnan(t0):
        return math.nan, "no fit"
    share = min(t0 / step_seconds, 1.0)
    return share, "overhead-bound" if share > OVERHEAD_BOUND else "compute-bound"


def check_flags(args) -> list[ModelConfig]:
    """The models' configs; bad flags fail here, before any compile."""
    for flag in ("size_sweep_batch", "batch_sweep_size", "channels", "steps"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be a positive integer, got {getattr(args, flag)}")
    if min(args.sizes + args.batches, default=1) < 1:
        raise UserError("--sizes and --batches must be positive integers, e.g. 32,64,128 (or empty to skip a sweep)")
    if not args.models or not (args.sizes or args.batches):
        raise UserError("nothing to measure: give --models and at least one of --sizes, --batches")
    if args.seconds_per_point <= 0:
        raise UserError(f"--seconds-per-point must be positive, got {args.seconds_per_point}")
    return [
        ModelConfig(name=name, dtype=args.dtype, **({"stem": args.stem} if name in RESNETS else {}))
        for name in args.models
    ]


def sweep_points(args) -> list[tuple[str, int, int]]:
    """(sweep, image side, batch) of every point, in order."""
    return [("size", s, args.size_sweep_batch) for s in args.sizes] + [
        ("batch", args.batch_sweep_size, b) for b in args.batches
    ]


def step_timer(program, images, labels):
    """One warm-up step now; then each call times one more step (state carried along)."""
    import jax

    x, y = program.train_input.place(images, labels)
    state = [program.init()]
    state[0], metrics = program.train_step(state[0], x, y)
    jax.block_until_ready(metrics)

    def step() -> float:
        start = time.perf_counter()
        state[0], metrics = program.train_step(state[0], x, y)
        jax.block_until_ready(metrics)
        return time.perf_counter() - start

    return step


def time_points(timers: dict, steps: int, seconds_per_point: float) -> dict:
    """{key: seconds of each timed step}: up to `steps` rounds of one step per point; a point
    sits out once its steps add up to `seconds_per_point`."""
    timed = {key: [] for key in timers}
    for _ in range(steps):
        for key, step in timers.items():
            if sum(timed[key]) < seconds_per_point:
                timed[key].append(step())
    return timed


def measure_sweep(config, sweep, points, args, device, peak, counter) -> list[dict]:
    """Compile every point of one model's sweep, time them in turns, fit and judge them."""
    from jaxcnn.analysis.baselines import flops_of
    from jaxcnn.analysis.measure import random_batch, timing_program

    rows, timers = [], {}
    for side, batch in points:
        shape = (side, side, args.channels)
        counter[0] += 1
        print(f"[{counter[0]}/{counter[1]}] {config.name} {sweep} sweep: {side}x{side} batch {batch}: compiling ...",
              flush=True)  # fmt: skip
        program = timing_program(config, shape, batch, "single", devices=[device])
        timers[len(timers)] = step_timer(program, *random_batch(shape, batch, config.num_classes))
        flops = flops_of(program.train_step)
        rows.append({
            "model": config.name, "sweep": sweep, "image_size": side, "image_shape": "x".join(map(str, shape)),
            "global_batch_size": batch, "dtype": config.dtype,
            "stem": config.resnet_stem(shape) if config.is_resnet else "", "flops_per_step": flops,
            "flops_per_image": flops / batch, "peak_flops_per_second": peak, "compile_seconds": program.compile_seconds,
            "platform": device.platform, "device_kind": device.device_kind,
        })  # fmt: skip
    timed = time_points(timers, args.steps, args.seconds_per_point)
    for row, seconds in zip(rows, timed.values(), strict=True):
        median = statistics.median(seconds)
        row.update(
            median_step_seconds=median, images_per_second=row["global_batch_size"] / median,
            achieved_flops_per_second=row["flops_per_step"] / median,
            mfu=row["flops_per_step"] / median / row["peak_flops_per_second"], steps=len(seconds),
        )  # fmt: skip
    t0, rate = fit_overhead([r["flops_per_step"] for r in rows], [r["median_step_seconds"] for r in rows])
    for r in rows:
        share, verdict = overhead_verdict(t0, r["median_step_seconds"])
        fitted = t0 + r["flops_per_step"] / rate if not math.isnan(t0) else math.nan
        r.update(fit_t0_seconds=t0, fit_flops_per_second=rate, fitted_step_seconds=fitted, overhead_share=share,
                 verdict=verdict)  # fmt: skip
        print(f"    {r['image_shape']:>11} batch {r['global_batch_size']:4d}  {r['flops_per_step'] / 1e9:9.3f} GFLOP  "
              f"step {r['median_step_seconds'] * 1e3:9.2f} ms ({r['steps']})  MFU {r['mfu']:6.1%}  "
              f"overhead {share:6.1%}  {verdict}")  # fmt: skip
    print(f"    {summary(rows)}", flush=True)
    return rows


def summary(rows: list[dict]) -> str:
    """One line: the sweep's fit and the first point where compute dominates."""
    r0 = rows[0]
    what = f"{r0['model']}, sizes at batch {r0['global_batch_size']}" if r0["sweep"] == "size" else (
        f"{r0['model']}, batches at {r0['image_size']}x{r0['image_size']}")  # fmt: skip
    t0, rate = r0["fit_t0_seconds"], r0["fit_flops_per_second"]
    if math.isnan(t0):
        return f"{what}: too few points to fit t0 + flops / rate"
    fit = plots.overhead_fit_text(t0, rate)
    first = next((r for r in rows if r["verdict"] == "compute-bound"), None)
    if first is None:
        return f"{what}: overhead-bound at every point ({fit})"
    where = f"{first['image_size']}x{first['image_size']}" if first["sweep"] == "size" else (
        f"batch {first['global_batch_size']}")  # fmt: skip
    return f"{what}: compute dominates first at {where} ({fit})"


def main(argv=None) -> list[dict]:
    args = parse_flags(argv)
    configs = check_flags(args)
    out, plot = cli.writable_outputs(args.out, args.plot)
    import jax  # after the flags: --help and bad flags answer at once

    from jaxcnn.analysis.baselines import peak_flops
    from jaxcnn.sharding import simulate_cpu_devices

    simulate_cpu_devices(1, at_least=True)
    device = jax.devices()[0]
    peak = peak_flops(args.dtype)
    print(f"peak {peak / 1e9:.1f} GFLOP/s ({args.dtype} matmul on {device.device_kind})", flush=True)
    points = sweep_points(args)
    counter = [0, len(points) * len(configs)]
    rows, lines = [], []
    for config in configs:
        for sweep in SWEEPS:
            chosen = [(side, batch) for s, side, batch in points if s == sweep]
            if chosen:
                rows += measure_sweep(config, sweep, chosen, args, device, peak, counter)
                lines.append(summary(rows[-len(chosen) :]))
    peak = max(peak, peak_flops(args.dtype))  # again at the end: the run is long and the host's speed drifts
    for row in rows:
        row["peak_flops_per_second"] = peak
        row["mfu"] = row["flops_per_step"] / row["median_step_seconds"] / peak
    print(f"peak {peak / 1e9:.1f} GFLOP/s, the better of the start's and the end's", flush=True)
    results.write_csv(out, rows, COLUMNS)
    written = [out]
    if plot:
        title = f"train step cost on {device.device_kind} ({args.dtype}, peak {peak / 1e9:.0f} GFLOP/s)"
        written.append(plots.cost_vs_size_plot(rows, plot, title))
    print("\n".join(lines))
    print("wrote", ", ".join(map(str, written)))
    return rows


if __name__ == "__main__":
    cli.run_main(PROG, main)
