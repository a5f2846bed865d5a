"""The same models in jaxcnn and in PyTorch (eager), side by side on this machine.

python experiments/compare_backends.py                   # every config below
python experiments/compare_backends.py --configs cnn-28 --steps 20 --no-ddp

Needs PyTorch and torchvision (`pip install -e '.[torch]'`; measured with torch 2.14.1,
torchvision 0.29.1, run on the CPU). The configs (--configs, default all):

  cnn-28        the default CNN (3 conv blocks with batch norm, dense 256 -> 128 -> 10), 28x28x1, batch 128
  cnn-224       the default CNN, 224x224x3, batch 8
  resnet18-32   ResNet-18 with the small stem (3x3 stride-1 conv, no pool), 32x32x3, batch 128
  resnet50-224  ResNet-50 with the ImageNet stem (7x7/2 conv, 3x3/2 max-pool), 224x224x3, batch 8

In torch the CNN is written out (jaxcnn.analysis.torch_twin) and the ResNets are
torchvision's (`torchvision.models.resnet18/50`, the small stem swapped in as CIFAR code
does), fed NCHW contiguous batches as torch users feed them. Both backends run the same
architecture, the same initial weights (copied from the jaxcnn model), the same batch and
Adam (lr 1e-3, constant). First it checks that the two compute the same thing -- logits and
loss of one training-mode forward from the same weights on the same batch, and each against
the torch twin in float64 (`max_logit_diff_vs_float64`: whose fp32 rounding a difference
is) -- then times the median of warm steps: jaxcnn's `single` layout against torch eager on
one process and, for the CNN configs, jaxcnn `dp` on 2 devices against torch
DistributedDataParallel over 2 local processes (gloo; a ResNet's 2-process rows would take
too long here). A ResNet's step takes seconds on a CPU, so the ResNets default to 4 steps
in 2 rounds, the CNN to 20 in 5 (--steps, --rounds set every config's), so that the
default run takes about 10 minutes on 2 cores (a ResNet-18 step at 32x32, batch 128, ~8 s).

Torch runs in spawned worker processes (jaxcnn.analysis.torch_twin) kept alive for the
whole config, and the timed rounds alternate between backends, so both see the same
machine. Torch gets glibc's default malloc, as torch users run it, and once more with the
settings jaxcnn applies to its own process (`jaxcnn.host_memory`, `host_malloc=keep-freed`),
which speed torch up too. Rows share one schema; `ratio_vs_torch` is a row's images/s over
torch's with the default malloc (same variant), from this one run. `flops_per_step` is
XLA's count for jaxcnn's compiled `single` step (`cost_analysis`), used for every row of a
config (the model and batch are the same); `mfu` is a row's FLOPs per second over
`peak_flops_per_second`, the best float32 matmul JAX runs on this machine, measured once at
the start of the run.
"""

from __future__ import annotations

import statistics
from typing import NamedTuple

import jax

from jaxcnn import cli, results
from jaxcnn.analysis.baselines import flops_of, peak_flops
from jaxcnn.analysis.measure import interleaved, random_batch, timing_program, warm_stepper
from jaxcnn.analysis.torch_twin import TorchWorkers, check_agreement, torch_model
from jaxcnn.config import ModelConfig
from jaxcnn.errors import UserError
from jaxcnn.models import build_model
from jaxcnn.sharding import simulate_cpu_devices

PROG = "compare_backends.py"
KEEP, DEFAULT = "keep-freed", "glibc-default"  # host malloc: jaxcnn.host_memory's settings, or glibc's


class BackendConfig(NamedTuple):
    model: ModelConfig
    image_shape: tuple[int, int, int]
    batch: int
    steps: int  # defaults: a ResNet step takes seconds here, the CNN's a fraction of one
    rounds: int
    ddp: bool  # the 2-process rows


CONFIGS = {
    "cnn-28": BackendConfig(ModelConfig(), (28, 28, 1), 128, 20, 5, True),
    "cnn-224": BackendConfig(ModelConfig(), (224, 224, 3), 8, 20, 5, True),
    "resnet18-32": BackendConfig(ModelConfig(name="resnet18", stem="small"), (32, 32, 3), 128, 4, 2, False),
    "resnet50-224": BackendConfig(ModelConfig(name="resnet50", stem="imagenet"), (224, 224, 3), 8, 4, 2, False),
}
COLUMNS = [
    "config", "model", "backend", "variant", "host_malloc", "image_shape", "global_batch_size", "workers",
    "median_step_seconds", "images_per_second", "ratio_vs_torch", "flops_per_step", "peak_flops_per_second", "mfu",
    "max_logit_diff", "max_logit_diff_vs_float64", "loss_diff", "steps", "torch_threads",
]  # fmt: skip


def parse_flags(argv=None):
    parser = cli.experiment_parser(PROG, __doc__)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"some of {', '.join(CONFIGS)}")
    parser.add_argument("--steps", type=int, help="warm steps timed per row (default: 20 for the CNN, 4 for a ResNet)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds the steps are split into (default: 5, 2)")
    parser.add_argument("--no-ddp", action="store_true", help="skip the 2-process rows")
    cli.add_output_flags(parser, out="runs/compare_backends.csv")
    return parser.parse_args(argv)


def _jaxcnn_stepper(config, image_shape, batch, images, labels, layout, mesh):
    """(steps(n) -> seconds, FLOPs of one compiled step)."""
    program = timing_program(config, image_shape, batch, layout, mesh)
    return warm_stepper(program, images, labels), flops_of(program.train_step)


def main(argv=None) -> list[dict]:
    args = parse_flags(argv)
    names = cli.some_of(args.configs, CONFIGS, "--configs")
    try:
        import torch

        if any(CONFIGS[name].model.is_resnet for name in names):
            import torchvision  # noqa: F401
    except ImportError:
        raise UserError("PyTorch or torchvision is not installed; pip install -e '.[torch]' and run again") from None
    if any(n is not None and n < 1 for n in (args.steps, args.rounds)):
        raise UserError("--steps and --rounds must be positive integers")
    (out,) = cli.writable_outputs(args.out)
    simulate_cpu_devices(2, at_least=True)
    if jax.devices()[0].platform != "cpu":  # torch runs on the CPU: the same device on both sides, or no comparison
        raise UserError("compare_backends compares on the CPU; run it with JAX_PLATFORMS=cpu")
    peak = peak_flops("float32")  # once: every row's MFU is against the same peak
    print(f"peak {peak / 1e9:.1f} GFLOP/s (float32 matmul)")
    rows = []
    for name in names:
        config, image_shape, batch, steps, rounds, ddp = CONFIGS[name]
        steps, rounds = args.steps or steps, args.rounds or rounds
        images, labels = random_batch(image_shape, batch, config.num_classes)
        jax_model = build_model(config, image_shape, 0)
        twin = torch_model(jax_model, config)

        agreement = check_agreement(jax_model, twin, images, labels)
        print(f"{name}: same weights, same batch: max |logit diff| {agreement['max_logit_diff']:.2e} "
              f"(jaxcnn vs float64 {agreement['jaxcnn']:.2e}, torch vs float64 {agreement['torch']:.2e}), "
              f"|loss diff| {agreement['loss_diff']:.2e}")  # fmt: skip

        single, flops = _jaxcnn_stepper(config, image_shape, batch, images, labels, "single", {"data": 1})
        # (backend, variant, host malloc) -> a function timing n warm steps
        steppers = {
            ("jaxcnn", "single", KEEP): single,
            ("torch", "single", DEFAULT): TorchWorkers(config, image_shape, images, labels),
            ("torch", "single", KEEP): TorchWorkers(config, image_shape, images, labels, keep_host_memory=True),
        }
        if ddp and not args.no_ddp:
            steppers[("jaxcnn", "dp2", KEEP)], _ = _jaxcnn_stepper(
                config, image_shape, batch, images, labels, "dp", {"data": 2}
            )
            steppers[("torch", "dp2", DEFAULT)] = TorchWorkers(config, image_shape, images, labels, world=2)

        def progress(i, name=name, rounds=rounds):
            print(f"{name}: round {i + 1}/{rounds} timed", flush=True)

        try:  # rounds interleave the backends, so drifts in the machine's speed hit all alike
            timings = interleaved(steppers, steps, rounds, progress)
        finally:
            for stepper in steppers.values():
                if isinstance(stepper, TorchWorkers):
                    stepper.close()
        config_rows = []
        for (backend, variant, malloc), seconds in timings.items():
            median = statistics.median(seconds)
            config_rows.append({
                "config": name, "model": config.name, "backend": backend, "variant": variant, "host_malloc": malloc,
                "image_shape": "x".join(map(str, image_shape)), "global_batch_size": batch,
                "workers": 2 if variant == "dp2" else 1, "median_step_seconds": median,
                "images_per_second": batch / median, "ratio_vs_torch": None,
                "flops_per_step": flops, "peak_flops_per_second": peak, "mfu": flops / median / peak,
                "max_logit_diff": agreement["max_logit_diff"], "max_logit_diff_vs_float64": agreement[backend],
                "loss_diff": agreement["loss_diff"], "steps": len(seconds), "torch_threads": torch.get_num_threads(),
            })  # fmt: skip
        for row in config_rows:
            torch_row = next(
                r
                for r in config_rows
                if (r["backend"], r["variant"], r["host_malloc"]) == ("torch", row["variant"], DEFAULT)
            )
            row["ratio_vs_torch"] = row["images_per_second"] / torch_row["images_per_second"]
            print(f"{name:<12} {row['backend']:<7} {row['variant']:<7} {row['host_malloc']:<14} "
                  f"{row['images_per_second']:10,.1f} images/s  step {row['median_step_seconds'] * 1e3:8.2f} ms  "
                  f"MFU {row['mfu']:6.1%}  vs torch (default malloc) {row['ratio_vs_torch']:5.2f}")  # fmt: skip
        rows += config_rows
    results.write_csv(out, rows, COLUMNS)
    print("wrote", out)
    return rows


if __name__ == "__main__":
    cli.run_main(PROG, main)
