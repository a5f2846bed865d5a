"""The same CNN in jaxcnn and in PyTorch (eager), side by side on this machine.

python experiments/compare_backends.py                   # 28x28x1 batch 128 and 224x224x3 batch 8
python experiments/compare_backends.py --sizes 28 --steps 20 --no-ddp

Needs PyTorch (`pip install torch==2.13.0`, a CPU build). Both run the same architecture
(the default model: 3 conv blocks with batch norm, dense 256 -> 128 -> 10), the same
initial weights (copied from the jaxcnn model), the same batch and Adam (lr 1e-3,
constant). First it checks that the two compute the same thing -- logits and loss of one
training-mode forward from the same weights on the same batch, and each against the torch
twin in float64 (`max_logit_diff_vs_float64`: whose fp32 rounding a difference is) --
then times the median of warm steps: jaxcnn's `single` layout against torch eager on one
process, and jaxcnn `dp` on 2 devices against torch DistributedDataParallel over 2 local
processes (gloo).

Torch runs in spawned worker processes (jaxcnn.analysis.torch_twin) kept alive for the
whole run, and the timed rounds
alternate between backends, so both see the same machine. Torch gets glibc's default
malloc, as torch users run it, and once more with the settings jaxcnn applies to its own
process (`jaxcnn.host_memory`, `host_malloc=keep-freed`), which speed torch up too. Rows
share one schema; `ratio_vs_torch` is a row's images/s over torch's with the default malloc
(same variant), from this one run.
"""

from __future__ import annotations

import statistics

from jaxcnn import cli, results
from jaxcnn.analysis.measure import SIZES, interleaved, random_batch, timing_program, warm_stepper
from jaxcnn.analysis.torch_twin import TorchWorkers, check_agreement, torch_model
from jaxcnn.config import ModelConfig
from jaxcnn.errors import UserError
from jaxcnn.models import build_model
from jaxcnn.sharding import simulate_cpu_devices

PROG = "compare_backends.py"
KEEP, DEFAULT = "keep-freed", "glibc-default"  # host malloc: jaxcnn.host_memory's settings, or glibc's
BACKEND_SIZES = {size: SIZES[size] for size in ("28", "224")}
COLUMNS = [
    "backend", "variant", "host_malloc", "image_shape", "global_batch_size", "workers", "median_step_seconds", "images_per_second",
    "ratio_vs_torch", "max_logit_diff", "max_logit_diff_vs_float64", "loss_diff", "steps", "torch_threads",
]  # fmt: skip


def parse_flags(argv=None):
    parser = cli.experiment_parser(PROG, __doc__)
    parser.add_argument("--sizes", default="28,224", help=f"some of {', '.join(BACKEND_SIZES)}")
    parser.add_argument("--steps", type=int, default=20, help="warm steps timed per row (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds the steps are split into")
    parser.add_argument("--no-ddp", action="store_true", help="skip the 2-process rows")
    cli.add_output_flags(parser, out="runs/compare_backends.csv")
    return parser.parse_args(argv)


def _jaxcnn_stepper(config, image_shape, batch, images, labels, layout, mesh):
    return warm_stepper(timing_program(config, image_shape, batch, layout, mesh), images, labels)


def main(argv=None) -> list[dict]:
    args = parse_flags(argv)
    try:
        import torch
    except ImportError:
        raise UserError("PyTorch is not installed; pip install torch==2.13.0 (a CPU build) and run again") from None
    names = cli.some_of(args.sizes, BACKEND_SIZES, "--sizes")
    if args.steps < 1 or args.rounds < 1:
        raise UserError("--steps and --rounds must be positive integers")
    (out,) = cli.writable_outputs(args.out)
    simulate_cpu_devices(2, at_least=True)
    config = ModelConfig()
    rows = []
    for name in names:
        image_shape, batch = BACKEND_SIZES[name]
        images, labels = random_batch(image_shape, batch, config.num_classes)
        jax_model = build_model(config, image_shape, 0)
        twin = torch_model(jax_model, config)

        agreement = check_agreement(jax_model, twin, images, labels)
        print(f"{name}: same weights, same batch: max |logit diff| {agreement['max_logit_diff']:.2e} "
              f"(jaxcnn vs float64 {agreement['jaxcnn']:.2e}, torch vs float64 {agreement['torch']:.2e}), "
              f"|loss diff| {agreement['loss_diff']:.2e}")  # fmt: skip

        # (backend, variant, host malloc) -> a function timing n warm steps
        steppers = {
            ("jaxcnn", "single", KEEP): _jaxcnn_stepper(config, image_shape, batch, images, labels, "single", {"data": 1}),
            ("torch", "single", DEFAULT): TorchWorkers(image_shape, images, labels),
            ("torch", "single", KEEP): TorchWorkers(image_shape, images, labels, keep_host_memory=True),
        }  # fmt: skip
        if not args.no_ddp:
            steppers[("jaxcnn", "dp2", KEEP)] = _jaxcnn_stepper(
                config, image_shape, batch, images, labels, "dp", {"data": 2}
            )
            steppers[("torch", "dp2", DEFAULT)] = TorchWorkers(image_shape, images, labels, world=2)
        try:  # rounds interleave the backends, so drifts in the machine's speed hit all alike
            timings = interleaved(steppers, args.steps, args.rounds,
                                  lambda i, name=name: print(f"{name}: round {i + 1}/{args.rounds} timed", flush=True))  # fmt: skip
        finally:
            for stepper in steppers.values():
                if isinstance(stepper, TorchWorkers):
                    stepper.close()
        size_rows = []
        for (backend, variant, malloc), seconds in timings.items():
            median = statistics.median(seconds)
            size_rows.append({
                "backend": backend, "variant": variant, "host_malloc": malloc,
                "image_shape": "x".join(map(str, image_shape)), "global_batch_size": batch,
                "workers": 2 if variant == "dp2" else 1, "median_step_seconds": median,
                "images_per_second": batch / median, "ratio_vs_torch": None,
                "max_logit_diff": agreement["max_logit_diff"], "max_logit_diff_vs_float64": agreement[backend],
                "loss_diff": agreement["loss_diff"], "steps": len(seconds), "torch_threads": torch.get_num_threads(),
            })  # fmt: skip
        for row in size_rows:
            torch_row = next(
                r
                for r in size_rows
                if (r["backend"], r["variant"], r["host_malloc"]) == ("torch", row["variant"], DEFAULT)
            )
            row["ratio_vs_torch"] = row["images_per_second"] / torch_row["images_per_second"]
            print(f"{name:<4} {row['backend']:<7} {row['variant']:<7} {row['host_malloc']:<14} "
                  f"{row['images_per_second']:10,.1f} images/s  step {row['median_step_seconds'] * 1e3:8.2f} ms  "
                  f"vs torch (default malloc) {row['ratio_vs_torch']:5.2f}")  # fmt: skip
        rows += size_rows
    results.write_csv(out, rows, COLUMNS)
    print("wrote", out)
    return rows


if __name__ == "__main__":
    cli.run_main(PROG, main)
