"""The same models in jaxcnn and in PyTorch, side by side on this machine: on the CPU, or on one NVIDIA GPU.

python experiments/compare_backends.py                   # every config below, on the CPU
python experiments/compare_backends.py --configs cnn-28 --steps 20 --no-ddp
python experiments/compare_backends.py --configs cnn-224,resnet50-224 --batch 256 --dtype bfloat16 \
    --torch-compile --steps 20 --rounds 4 --out results/gpu_h200_compare_backends.csv   # on a GPU

Needs PyTorch and torchvision (`pip install -e '.[torch]'`; measured with torch 2.14.1,
torchvision 0.29.1, run on the CPU). The configs (--configs, default all; --batch N replaces
every chosen config's batch):

  cnn-28        the default CNN (3 conv blocks with batch norm, dense 256 -> 128 -> 10), 28x28x1, batch 128
  cnn-224       the default CNN, 224x224x3, batch 8
  resnet18-32   ResNet-18 with the small stem (3x3 stride-1 conv, no pool), 32x32x3, batch 128
  resnet50-224  ResNet-50 with the ImageNet stem (7x7/2 conv, 3x3/2 max-pool), 224x224x3, batch 8

In torch the CNN is written out (jaxcnn.benchmarks.torch_twin) and the ResNets are
torchvision's (`torchvision.models.resnet18/50`, the small stem swapped in as CIFAR code
does), fed NCHW contiguous batches as torch's CPU users feed them (a GPU's: below). Both backends run the same
architecture, the same initial weights (copied from the jaxcnn model), the same batch and
Adam (lr 1e-3, constant). First it checks that the two compute the same thing -- logits and
loss of one training-mode forward from the same weights on the same batch (its first 128
images), in float32 on the CPU whatever the run's device and dtype, and each against the
torch twin in float64 (`max_logit_diff_vs_float64`: whose fp32 rounding a difference is) --
then times the median of warm steps: jaxcnn's `single` layout against torch eager on one
process and, for the CNN configs, jaxcnn `dp` on 2 devices against torch
DistributedDataParallel over 2 local processes (gloo; a ResNet's 2-process rows would take
too long here). A ResNet's step takes seconds on a CPU, so the ResNets default to 4 steps
in 2 rounds, the CNN to 20 in 5 (--steps, --rounds set every config's), so that the
default run takes about 10 minutes on 2 cores (a ResNet-18 step at 32x32, batch 128, ~8 s).
--torch-compile adds a row: torch with `torch.compile(model)` (default mode).

Torch runs in spawned worker processes (jaxcnn.benchmarks.torch_twin) kept alive for the
whole config, and the timed rounds alternate between backends, so both see the same
machine. Torch gets glibc's default malloc, as torch users run it, and once more with the
settings jaxcnn applies to its own process (`jaxcnn.host_memory`, `host_malloc=keep-freed`),
which speed torch up too. Rows share one schema; `ratio_vs_torch` is a row's images/s over
torch's with the default malloc (same variant; for `compiled`, torch eager's), from this one
run. `flops_per_step` is XLA's count for jaxcnn's compiled `single` step (`cost_analysis`),
used for every row of a config (the model and batch are the same); `mfu` is a row's FLOPs
per second over `peak_flops_per_second`, the best matmul JAX runs on this machine in the
run's --dtype, measured once at the start of the run.

Getting to the first steps, per row (a fresh model, weights on the device, batch placed):
`first_steps_seconds` is the wall time to finish its first 5 training steps -- for jaxcnn
its tracing and lowering, its compile (`compile_seconds`) and its first 5 steps, for torch its first 5 steps (eager:
cuDNN's autotuning on a GPU falls in them; compiled: torch.compile compiles in them).
`compile_seconds` is jaxcnn's `program.compile_seconds` (XLA's compile of its train step and
init, or reading them from the compile cache: `compile_cached`), for torch compiled `first_steps_seconds` less 5 of its median
warm steps (what compiling added), for torch eager empty. `peak_memory_bytes` is the peak
device memory of a row's process over the config, first steps included: torch's
`torch.cuda.max_memory_allocated()`, jaxcnn's `peak_bytes_in_use` of its device (JAX cannot
reset that high-water mark: it is reported for the config that raised it, else empty, so
list the configs smallest first); empty on the CPU, which reports none. Both libraries keep
their compile caches as their users do, so a run compiles cold only where nothing was
cached before: for cold compiles again pass `--compile-cache off` (jaxcnn's, which says
when it was read) and set TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 (torch.compile's).

On a GPU (JAX's default device a GPU; torch must have CUDA) torch runs on the same GPU as
its GPU users run it: `torch.backends.cudnn.benchmark = True`, model and input
channels_last, with --dtype bfloat16 the forward and loss under
`torch.autocast("cuda", dtype=torch.bfloat16)` with fp32 parameters (jaxcnn: the same,
`ModelConfig(dtype=...)`); in float32 each library keeps its default precision there (both
run convolutions in TF32, XLA its matrix products too, torch those in full float32, and the
measured peak is JAX's: TF32). JAX does not preallocate GPU memory in this script (it would take
75% and leave torch too little). The 2-process rows and torch's keep-freed malloc row are
left out there: 2 processes on one GPU measure nothing, and the host's malloc hardly touches
a GPU step. On the CPU, --dtype bfloat16 is allowed (torch.autocast("cpu")): a comparison
on the same footing, though neither backend is fast there without bfloat16 matrix units.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import time
from typing import NamedTuple

import jax

from jaxcnn import results
from jaxcnn.analysis.baselines import flops_of, peak_flops
from jaxcnn.analysis.measure import interleaved, random_batch, timing_program, warm_stepper
from jaxcnn.benchmarks.torch_twin import (
    FIRST_STEPS,
    TorchWorkerError,
    TorchWorkers,
    check_agreement,
    torch_model,
    torch_setup,
)
from jaxcnn.commands import cli
from jaxcnn.compiling import all_cached
from jaxcnn.config import ModelConfig
from jaxcnn.errors import UserError
from jaxcnn.models import build_model
from jaxcnn.sharding import simulate_cpu_devices

PROG = "compare_backends.py"
KEEP, DEFAULT = "keep-freed", "glibc-default"  # host malloc: jaxcnn.host_memory's settings, or glibc's
CHECK_IMAGES = 128  # the agreement check's images: every default batch whole, a GPU-sized one's first 128


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
    "config", "model", "backend", "variant", "host_malloc", "device", "dtype", "image_shape", "global_batch_size",
    "workers", "median_step_seconds", "images_per_second", "ratio_vs_torch", "flops_per_step", "peak_flops_per_second",
    "mfu", "compile_seconds", "compile_cached", "first_steps_seconds", "peak_memory_bytes", "max_logit_diff",
    "max_logit_diff_vs_float64", "loss_diff", "steps", "torch_threads",
]  # fmt: skip


def parse_flags(argv=None):
    parser = cli.experiment_parser(PROG, __doc__)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"some of {', '.join(CONFIGS)}")
    parser.add_argument("--batch", type=int, help="every chosen config's batch (default: each config's own)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="compute dtype of both backends; parameters stay float32")  # fmt: skip
    parser.add_argument("--steps", type=int, help="warm steps timed per row (default: 20 for the CNN, 4 for a ResNet)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds the steps are split into (default: 5, 2)")
    parser.add_argument("--no-ddp", action="store_true", help="skip the 2-process rows (a GPU run always does)")
    parser.add_argument("--torch-compile", action="store_true", help="add a row: torch with torch.compile(model)")
    cli.add_output_flags(parser, out="runs/compare_backends.csv")
    return parser.parse_args(argv)


def _jaxcnn_stepper(config, image_shape, batch, images, labels, layout, mesh):
    """(steps(n) -> seconds, FLOPs of one compiled step, {compile_seconds, first_steps_seconds})."""
    program = timing_program(config, image_shape, batch, layout, mesh)
    if any(timing.cached for timing in program.compile_timings):
        print(f"jaxcnn's {layout} step was read from the compile cache: its compile_seconds is that read")
    startup = program.lower_seconds + program.compile_seconds
    first_steps_seconds = startup + _first_steps_seconds(program, images, labels)
    first = {
        "compile_seconds": program.compile_seconds,
        "compile_cached": all_cached(program.compile_timings),
        "first_steps_seconds": first_steps_seconds,
    }
    return warm_stepper(program, images, labels), flops_of(program.train_step), first


def _first_steps_seconds(program, images, labels) -> float:
    """Seconds of a fresh state's first FIRST_STEPS steps, the last one waited for."""
    x, y = program.train_input.place(images, labels)
    state = jax.block_until_ready(program.init())
    start = time.perf_counter()
    for _ in range(FIRST_STEPS):
        state, metrics = program.train_step(state, x, y)
    jax.block_until_ready(metrics)
    return time.perf_counter() - start


def _peak_bytes_in_use(device) -> int | None:
    stats = device.memory_stats()  # None on the CPU
    return stats.get("peak_bytes_in_use") if stats else None


def _torch_first_steps(workers: TorchWorkers, compiled: bool, seconds: list[float]) -> dict:
    first = workers.first_steps_seconds
    # compiled: what its first steps took beyond as many warm ones -- the compile
    compile_seconds = first - FIRST_STEPS * statistics.median(seconds) if compiled else None
    return {"compile_seconds": compile_seconds, "first_steps_seconds": first}


def main(argv=None) -> list[dict]:
    args = parse_flags(argv)
    names = cli.some_of(args.configs, CONFIGS, "--configs")
    # JAX reads this when it creates its GPU client (the first device query, below): by default it takes 75% of
    # the GPU up front and the torch workers on the same GPU would run out of memory
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    try:
        import torch

        if any(CONFIGS[name].model.is_resnet for name in names):
            import torchvision  # noqa: F401
    except ImportError:
        raise UserError("PyTorch or torchvision is not installed; pip install -e '.[torch]' and run again") from None
    if any(n is not None and n < 1 for n in (args.steps, args.rounds, args.batch)):
        raise UserError("--steps, --rounds and --batch must be positive integers")
    (out,) = cli.writable_outputs(args.out)
    simulate_cpu_devices(2, at_least=True)
    device = jax.devices()[0]
    # torch on the kind of device JAX runs on: the same device on both sides, or no comparison
    setup = torch_setup(device.platform, args.dtype, device.platform == "gpu" and torch.cuda.is_available())
    on_cpu = setup.device == "cpu"
    if not on_cpu and not args.no_ddp and any(CONFIGS[name].ddp for name in names):
        print("the 2-process (DDP) rows are left out on a GPU: 2 processes on one GPU measure nothing")
    peak = peak_flops(args.dtype)  # once: every row's MFU is against the same peak
    print(f"peak {peak / 1e9:.1f} GFLOP/s ({args.dtype} matmul)")
    rows = []
    for name in names:
        config, image_shape, batch, steps, rounds, ddp = CONFIGS[name]
        batch, steps, rounds = args.batch or batch, args.steps or steps, args.rounds or rounds
        images, labels = random_batch(image_shape, batch, config.num_classes)
        with jax.default_device(jax.devices("cpu")[0]):  # the check is of the model, not of the device
            check_model = build_model(config, image_shape, 0)
            twin = torch_model(check_model, config)
            agreement = check_agreement(check_model, twin, images[:CHECK_IMAGES], labels[:CHECK_IMAGES])
        print(f"{name}: same weights, same batch: max |logit diff| {agreement['max_logit_diff']:.2e} "
              f"(jaxcnn vs float64 {agreement['jaxcnn']:.2e}, torch vs float64 {agreement['torch']:.2e}), "
              f"|loss diff| {agreement['loss_diff']:.2e}")  # fmt: skip

        jax_peak_before = _peak_bytes_in_use(device)
        run_config = dataclasses.replace(config, dtype=args.dtype)
        single, flops, first = _jaxcnn_stepper(run_config, image_shape, batch, images, labels, "single", {"data": 1})
        # (backend, variant, host malloc) -> a function timing n warm steps
        steppers = {("jaxcnn", "single", KEEP): single}
        firsts = {("jaxcnn", "single", KEEP): first}
        workers = {}  # the torch rows' steppers
        torch_workers = functools.partial(TorchWorkers, config, image_shape, images, labels, setup=setup)
        try:
            workers[("torch", "single", DEFAULT)] = torch_workers()
            if on_cpu:
                workers[("torch", "single", KEEP)] = torch_workers(keep_host_memory=True)
            if args.torch_compile:
                try:
                    workers[("torch", "compiled", DEFAULT)] = torch_workers(compiled=True)
                except TorchWorkerError as error:
                    print(f"{name}: no torch.compile row: {error}")
            if ddp and not args.no_ddp and on_cpu:
                key = ("jaxcnn", "dp2", KEEP)
                steppers[key], _, firsts[key] = _jaxcnn_stepper(
                    run_config, image_shape, batch, images, labels, "dp", {"data": 2}
                )
                workers[("torch", "dp2", DEFAULT)] = torch_workers(world=2)

            def progress(i, name=name, rounds=rounds):
                print(f"{name}: round {i + 1}/{rounds} timed", flush=True)

            # rounds interleave the backends, so drifts in the machine's speed hit all alike
            timings = interleaved(steppers | workers, steps, rounds, progress)
        finally:
            for stepper in workers.values():
                stepper.close()
        jax_peak = _peak_bytes_in_use(device)
        if jax_peak is not None and jax_peak_before is not None and jax_peak <= jax_peak_before:
            print(f"{name}: jaxcnn's peak memory not reported: an earlier config's peak was higher")
            jax_peak = None
        for key, stepper in workers.items():
            firsts[key] = _torch_first_steps(stepper, key[1] == "compiled", timings[key])
        config_rows = []
        for (backend, variant, malloc), seconds in timings.items():
            median = statistics.median(seconds)
            stepper = workers.get((backend, variant, malloc))
            config_rows.append({
                "config": name, "model": config.name, "backend": backend, "variant": variant, "host_malloc": malloc,
                "device": device.device_kind, "dtype": args.dtype,
                "image_shape": "x".join(map(str, image_shape)), "global_batch_size": batch,
                "workers": 2 if variant == "dp2" else 1, "median_step_seconds": median,
                "images_per_second": batch / median, "ratio_vs_torch": None,
                "flops_per_step": flops, "peak_flops_per_second": peak, "mfu": flops / median / peak,
                **firsts[(backend, variant, malloc)],
                "peak_memory_bytes": stepper.peak_memory_bytes if stepper else jax_peak,
                "max_logit_diff": agreement["max_logit_diff"], "max_logit_diff_vs_float64": agreement[backend],
                "loss_diff": agreement["loss_diff"], "steps": len(seconds), "torch_threads": torch.get_num_threads(),
            })  # fmt: skip
        for row in config_rows:
            baseline = ("torch", "single" if row["variant"] == "compiled" else row["variant"], DEFAULT)
            torch_row = next(r for r in config_rows if (r["backend"], r["variant"], r["host_malloc"]) == baseline)
            row["ratio_vs_torch"] = row["images_per_second"] / torch_row["images_per_second"]
            memory = f"  peak {row['peak_memory_bytes'] / 2**30:5.1f} GiB" if row["peak_memory_bytes"] else ""
            print(f"{name:<12} {row['backend']:<7} {row['variant']:<8} {row['host_malloc']:<14} "
                  f"{row['images_per_second']:10,.1f} images/s  step {row['median_step_seconds'] * 1e3:8.2f} ms  "
                  f"MFU {row['mfu']:6.1%}  vs torch (default malloc) {row['ratio_vs_torch']:5.2f}  "
                  f"first {FIRST_STEPS} steps {row['first_steps_seconds']:6.1f} s{memory}")  # fmt: skip
        rows += config_rows
        del steppers, single  # jaxcnn's state: the next config's peak memory is its own
    results.write_csv(out, rows, COLUMNS)
    print("wrote", out)
    return rows


if __name__ == "__main__":
    cli.run_main(PROG, main)
