"""Benchmark one train step: median time over warm steps, images/s, compile time, FLOPs and MFU.

jaxcnn bench                                 # default config and 224x224x3, every variant
jaxcnn bench --configs 224 --dtype bfloat16 --steps 5

For each config (`default`: the default model on 8x8x1 digits-shaped images, batch 64;
`224`: 224x224x3, batch 8) three variants of the same training step on one device:
`jaxcnn-single` (the `single` layout), `jaxcnn-dp1` (the `dp` layout on data=1: what the
sharding machinery costs) and `plain-jit` (a plain Flax NNX + optax step under `jax.jit`,
no shardings, as a user would write it; on CPU also `plain-jit-cpu-options`, the same step
compiled with jaxcnn's XLA:CPU options, the like-for-like baseline). Timed steps are
split into --rounds rounds that alternate between variants. FLOPs per step come from
XLA's `cost_analysis`; MFU divides achieved FLOP/s by a peak measured in the same run
(the best of repeated large matmuls in the same dtype), so it is honest about this machine.
(`python experiments/bench.py` is the same command.)
"""

from __future__ import annotations

import statistics

from jaxcnn import cli
from jaxcnn.config import DTYPES, ModelConfig
from jaxcnn.errors import UserError

PROG = "jaxcnn bench"
CONFIGS = {"default": "8", "224": "224"}  # -> jaxcnn.analysis.measure.SIZES: (image shape, batch)
COLUMNS = [
    "config", "variant", "image_shape", "global_batch_size", "dtype", "median_step_seconds", "images_per_second",
    "compile_seconds", "flops_per_step", "achieved_flops_per_second", "peak_flops_per_second", "mfu", "steps",
    "platform", "device_kind",
]  # fmt: skip


def parse_flags(argv=None):
    parser = cli.experiment_parser(PROG, __doc__)
    parser.add_argument("--configs", default="default,224", help=f"some of {', '.join(CONFIGS)}")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--steps", type=int, default=40, help="warm steps timed per variant (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds the steps are split into")
    parser.add_argument("--batch-224", type=int, help="batch of the 224 config (default: measure.SIZES', 8)")
    cli.add_output_flags(parser, out="runs/bench.csv")
    return parser.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_flags(argv)
    import jax  # after the flags: --help and bad flags answer at once

    from jaxcnn import results
    from jaxcnn.analysis.baselines import jaxcnn_stepper, peak_flops, plain_jit_stepper
    from jaxcnn.analysis.measure import SIZES, interleaved, random_batch
    from jaxcnn.compiling import CPU_STEP_OPTIONS
    from jaxcnn.sharding import simulate_cpu_devices

    names = cli.some_of(args.configs, CONFIGS, "--configs")
    if args.batch_224 is None:
        args.batch_224 = SIZES["224"][1]
    if min(args.steps, args.rounds, args.batch_224) < 1:
        raise UserError("--steps, --rounds and --batch-224 must be positive integers")
    (out,) = cli.writable_outputs(args.out)
    simulate_cpu_devices(1, at_least=True)
    device = jax.devices()[0]
    peak = peak_flops(args.dtype)
    print(f"peak {peak / 1e9:.1f} GFLOP/s ({args.dtype} matmul on {device.device_kind})")
    rows = []
    for name in names:
        image_shape, batch = SIZES[CONFIGS[name]]
        batch = args.batch_224 if name == "224" else batch
        config = ModelConfig(dtype=args.dtype)
        images, labels = random_batch(image_shape, batch, config.num_classes)
        variants = {
            "jaxcnn-single": jaxcnn_stepper(config, "single", device, image_shape, batch, images, labels),
            "jaxcnn-dp1": jaxcnn_stepper(config, "dp", device, image_shape, batch, images, labels),
            "plain-jit": plain_jit_stepper(config, image_shape, images, labels),
        }
        if device.platform == "cpu":  # the same plain step with jaxcnn's XLA:CPU options: a like-for-like baseline
            variants["plain-jit-cpu-options"] = plain_jit_stepper(config, image_shape, images, labels, CPU_STEP_OPTIONS)
        timed = interleaved({variant: steps for variant, (steps, _, _) in variants.items()}, args.steps, args.rounds)
        for variant, (_, compile_seconds, flops) in variants.items():
            seconds = timed[variant]
            median = statistics.median(seconds)
            rows.append(
                {
                    "config": name,
                    "variant": variant,
                    "image_shape": "x".join(map(str, image_shape)),
                    "global_batch_size": batch,
                    "dtype": args.dtype,
                    "median_step_seconds": median,
                    "images_per_second": batch / median,
                    "compile_seconds": compile_seconds,
                    "flops_per_step": flops,
                    "achieved_flops_per_second": flops / median,
                    "peak_flops_per_second": peak,
                    "mfu": flops / median / peak,
                    "steps": len(seconds),
                    "platform": device.platform,
                    "device_kind": device.device_kind,
                }
            )
            r = rows[-1]
            print(f"{name:<8} {variant:<22} {r['images_per_second']:10,.1f} images/s  step {median * 1e3:8.2f} ms  "
                  f"compile {compile_seconds:5.2f} s  {flops / 1e9:8.3f} GFLOP  MFU {r['mfu']:6.1%}")  # fmt: skip
        speed = {r["variant"]: r["images_per_second"] for r in rows if r["config"] == name}
        baseline = "plain-jit-cpu-options" if "plain-jit-cpu-options" in speed else "plain-jit"
        print(f"{name:<8} sharding machinery: dp on data=1 at {speed['jaxcnn-dp1'] / speed[baseline] - 1:+.1%} "
              f"of {baseline}")  # fmt: skip
    results.write_csv(out, rows, COLUMNS)
    print("wrote", out)
    return rows
