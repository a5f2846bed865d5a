"""Benchmark one train step: median time over warm steps, images/s, compile time, FLOPs and MFU.

jaxcnn bench                                 # the default CNN at 8x8, 28 and 224; resnet18 at 32
jaxcnn bench --configs 224 --dtype bfloat16 --steps 5
jaxcnn bench --configs resnet50-224 --batch 32
jaxcnn bench --configs 224,resnet50-224 --batch fill     # on a GPU/TPU: the batch that fills it

Configs (model, image shape, batch; warm steps and rounds unless --steps/--rounds):
  default        the default CNN, 8x8x1 (the digits' shape), batch 64      40 steps, 10 rounds
  28             the default CNN, 28x28x1, batch 128                       40 steps, 10 rounds
  224            the default CNN, 224x224x3, batch 8                       40 steps, 10 rounds
  resnet18-32    resnet18 (3x3 stem), 32x32x3, batch 128                   8 steps, 2 rounds
  resnet50-224   resnet50 (ImageNet stem), 224x224x3, batch 8 (opt-in)     6 steps, 2 rounds
The ResNets take fewer steps: a resnet18-32 step is 377 GFLOP, 2-4 s on a 2-core CPU.

For each config three variants of the same training step on one device (--variants):
`jaxcnn-single` (the `single` layout), `jaxcnn-dp1` (the `dp` layout on data=1: what the
sharding machinery costs) and `plain-jit` (a plain Flax NNX + optax step under `jax.jit`, no
shardings, as a user would write it; on CPU also `plain-jit-cpu-options`, the same step
compiled with jaxcnn's XLA:CPU options, the like-for-like baseline). Each variant's time to
its first step is printed as it is built -- lowering, compiling (or reading the compile
cache), the first step -- and kept in the CSV. Timed steps are split into rounds that
alternate between variants. FLOPs per step come from XLA's
`cost_analysis`; MFU divides achieved FLOP/s by a peak measured in the same run (the best
of repeated large matmuls in the same dtype), so it is honest about this machine.

--batch N replaces every chosen config's batch. --batch fill searches compiled steps for
the largest batch (a multiple of 32, at most 4096) whose memory fits --fill-memory, by
default 70% of what the device reports (jaxcnn.autobatch; about 2 log2(4096/32) compiles
per config, before any timing); a CPU reports no memory, so there give --fill-memory.
(`python experiments/bench.py` is the same command.)
"""

from __future__ import annotations

import statistics
from typing import NamedTuple

from jaxcnn.commands import cli
from jaxcnn.config import DEFAULT_MODEL, DTYPES, ModelConfig, parse_bytes
from jaxcnn.errors import UserError

PROG = "jaxcnn bench"


class BenchConfig(NamedTuple):
    model: str
    image_shape: tuple[int, int, int]
    batch: int
    steps: int  # warm steps timed per variant, unless --steps
    rounds: int  # the interleaved rounds they are split into, unless --rounds


CONFIGS = {
    "default": BenchConfig(DEFAULT_MODEL, (8, 8, 1), 64, 40, 10),
    "28": BenchConfig(DEFAULT_MODEL, (28, 28, 1), 128, 40, 10),
    "224": BenchConfig(DEFAULT_MODEL, (224, 224, 3), 8, 40, 10),
    "resnet18-32": BenchConfig("resnet18", (32, 32, 3), 128, 8, 2),
    "resnet50-224": BenchConfig("resnet50", (224, 224, 3), 8, 6, 2),
}
DEFAULT_CONFIGS = "default,28,224,resnet18-32"
COLUMNS = [
    "config", "model", "variant", "image_shape", "global_batch_size", "dtype", "median_step_seconds",
    "images_per_second", "compile_seconds", "lower_seconds", "cached", "first_step_seconds",
    "time_to_first_step_seconds", "compiled_peak_bytes", "flops_per_step",
    "achieved_flops_per_second", "peak_flops_per_second", "mfu", "steps", "platform", "device_kind", "compile_cache",
]  # fmt: skip
VARIANTS = ("jaxcnn-single", "jaxcnn-dp1", "plain-jit", "plain-jit-cpu-options")


def parse_flags(argv=None):
    parser = cli.experiment_parser(PROG, __doc__)
    parser.add_argument(
        "--configs", default=DEFAULT_CONFIGS, help=f"some of {', '.join(CONFIGS)} (default: %(default)s)"
    )
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--steps", type=int, help="warm steps timed per variant (default: the config's)")
    parser.add_argument(
        "--rounds", type=int, help="interleaved rounds the steps are split into (default: the config's)"
    )
    parser.add_argument(
        "--batch", type=cli.positive_int_or("fill"), help="every config's batch: N, or fill (the largest that fits the device); "
        "default: the config's"
    )  # fmt: skip
    parser.add_argument(
        "--fill-memory", metavar="BYTES", help="with --batch fill: memory a step may use, e.g. 64GiB "
        "(default: 70%% of the device's)"
    )  # fmt: skip
    parser.add_argument(
        "--variants", help="some of the variants above, each compiling its own step (default: every one; "
        "plain-jit-cpu-options on a CPU only)",
    )  # fmt: skip
    cli.add_output_flags(parser, out="runs/bench.csv")
    return parser.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_flags(argv)
    import jax  # after the flags: --help and bad flags answer at once

    from jaxcnn import compile_cache, results
    from jaxcnn.analysis.baselines import (
        FILL_FRACTION,
        device_memory_bytes,
        fill_batch,
        peak_flops,
    )
    from jaxcnn.analysis.measure import interleaved, random_batch
    from jaxcnn.sharding import simulate_cpu_devices

    names = cli.some_of(args.configs, CONFIGS, "--configs")
    chosen = cli.some_of(args.variants, VARIANTS, "--variants") if args.variants else None
    width = max(map(len, names))
    if any(n is not None and n < 1 for n in (args.steps, args.rounds)):
        raise UserError("--steps and --rounds must be positive integers")
    if args.fill_memory and args.batch != "fill":
        raise UserError("--fill-memory is for --batch fill; drop it or add --batch fill")
    fill_budget = parse_bytes(args.fill_memory) if args.fill_memory else None
    (out,) = cli.writable_outputs(args.out)
    simulate_cpu_devices(1, at_least=True)
    device = jax.devices()[0]
    if chosen is None:
        chosen = [v for v in VARIANTS if v != "plain-jit-cpu-options" or device.platform == "cpu"]
    elif "plain-jit-cpu-options" in chosen and device.platform != "cpu":
        raise UserError(
            f"--variants plain-jit-cpu-options runs on a CPU only; this machine computes on {device.platform}"
        )
    if args.batch == "fill" and fill_budget is None:
        limit = device_memory_bytes(device)
        if limit is None:
            raise UserError(f"--batch fill: the {device.platform} device reports no memory; give --fill-memory BYTES")
        fill_budget = FILL_FRACTION * limit
    peak = peak_flops(args.dtype)
    print(f"peak {peak / 1e9:.1f} GFLOP/s ({args.dtype} matmul on {device.device_kind})")
    rows = []
    for name in names:
        bench = CONFIGS[name]
        config = ModelConfig(name=bench.model, dtype=args.dtype)
        batch = args.batch or bench.batch
        if batch == "fill":
            search = fill_batch(config, bench.image_shape, device, fill_budget)
            batch = search.batch_size
            print(f"{name:<{width}} --batch fill: {batch} ({search.peak_bytes / 2**20:,.0f} of "
                  f"{fill_budget / 2**20:,.0f} MiB a step; {len(search.probes)} compiles)")  # fmt: skip
        steps = args.steps or bench.steps
        rounds = min(args.rounds or bench.rounds, steps)
        images, labels = random_batch(bench.image_shape, batch, config.num_classes)
        variants = {}
        for variant in chosen:
            variants[variant] = _stepper(variant, config, device, bench.image_shape, batch, images, labels)
            startup = variants[variant].startup
            print(f"{name:<{width}} {variant:<22} first step {startup.seconds:7.2f} s after the start: lowering "
                  f"{startup.lower_seconds:.2f} s, compile {startup.compile_seconds:.2f} s"
                  f"{' (cached)' if startup.cached else ''}, first step {startup.first_step_seconds:.2f} s",
                  flush=True)  # fmt: skip
        timed = interleaved({variant: stepper.steps for variant, stepper in variants.items()}, steps, rounds)
        for variant, stepper in variants.items():
            seconds, startup, flops = timed[variant], stepper.startup, stepper.flops
            median = statistics.median(seconds)
            rows.append(
                {
                    "config": name,
                    "model": bench.model,
                    "variant": variant,
                    "image_shape": "x".join(map(str, bench.image_shape)),
                    "global_batch_size": batch,
                    "dtype": args.dtype,
                    "median_step_seconds": median,
                    "images_per_second": batch / median,
                    "compile_seconds": startup.compile_seconds,
                    "lower_seconds": startup.lower_seconds,
                    "cached": startup.cached,
                    "first_step_seconds": startup.first_step_seconds,
                    "time_to_first_step_seconds": startup.seconds,
                    "compiled_peak_bytes": stepper.peak_bytes,
                    "flops_per_step": flops,
                    "achieved_flops_per_second": flops / median,
                    "peak_flops_per_second": peak,
                    "mfu": flops / median / peak,
                    "steps": len(seconds),
                    "platform": device.platform,
                    "device_kind": device.device_kind,
                    "compile_cache": compile_cache.in_use(),
                }
            )
            r = rows[-1]
            print(f"{name:<{width}} {variant:<22} {r['images_per_second']:10,.1f} images/s  step {median * 1e3:8.2f} ms  "
                  f"{flops / 1e9:8.3f} GFLOP  MFU {r['mfu']:6.1%}")  # fmt: skip
        speed = {r["variant"]: r["images_per_second"] for r in rows if r["config"] == name}
        baseline = next((b for b in ("plain-jit-cpu-options", "plain-jit") if b in speed), None)
        if baseline and "jaxcnn-dp1" in speed:
            print(f"{name:<{width}} sharding machinery: dp on data=1 at "
                  f"{speed['jaxcnn-dp1'] / speed[baseline] - 1:+.1%} of {baseline}")  # fmt: skip
        results.write_csv(out, rows, COLUMNS)  # after every config: a run cut short keeps what it measured
    print("wrote", out)
    return rows


def _stepper(variant: str, config, device, image_shape, batch: int, images, labels):
    from jaxcnn.analysis.baselines import jaxcnn_stepper, plain_jit_stepper
    from jaxcnn.platform_choices import CPU_WITHOUT_YNN_CONVS

    if variant.startswith("jaxcnn-"):
        layout = "single" if variant == "jaxcnn-single" else "dp"
        return jaxcnn_stepper(config, layout, device, image_shape, batch, images, labels)
    # plain-jit-cpu-options: the plain step with jaxcnn's XLA:CPU options, a like-for-like baseline on a CPU
    options = CPU_WITHOUT_YNN_CONVS if variant == "plain-jit-cpu-options" else None
    return plain_jit_stepper(config, image_shape, images, labels, options)
