"""Side by side on real data: Fashion-MNIST, the default CNN, one device -- jaxcnn's host
loader, its data on the device, its data on the device with K steps a call, and PyTorch
eager on the same model (the same initial weights: jaxcnn.benchmarks.torch_twin; on a GPU
where torch sees one), recipe
(Adam, the same warm-up and cosine learning rate step by step, batch 128) and shuffled
batches (a DataLoader over tensors in memory).

python experiments/loop_fashion.py --rounds 1 --epochs 6 --out results/loop_fashion.csv

Every variant trains whole epochs and evaluates the test set after each; a round runs the
variants one after another (alternating, so drifts in the machine's speed hit all alike).
The CSV has a row per (round, variant, epoch): its seconds, steady images/s, test accuracy,
and the training seconds so far (compiles not included; `compile_seconds` beside them).
Printed: per variant, images/s and the time and epochs to --target test accuracy. Needs
torch (the `torch` extra; on Python 3.11 with jaxcnn from the checkout, see the README).
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import jax
import numpy as np

from jaxcnn import results
from jaxcnn.build import build_program
from jaxcnn.commands import cli
from jaxcnn.config import ModelConfig, OptimConfig, TrainConfig, epoch_steps
from jaxcnn.data import Augment, Loader, load_named
from jaxcnn.data.on_device import choose, placed
from jaxcnn.errors import UserError
from jaxcnn.fit import fit
from jaxcnn.optim import make_schedule
from jaxcnn.sharding import build_mesh, get_layout

PROG = "loop_fashion.py"
VARIANTS = ("jaxcnn-host", "jaxcnn-device", "jaxcnn-device-K", "torch-eager")
COLUMNS = ["round", "variant", "epoch", "epoch_seconds", "images_per_second", "test_accuracy", "train_seconds_so_far",
           "compile_seconds", "steps_per_call", "global_batch_size", "model", "machine"]  # fmt: skip


def parse_flags(argv=None):
    parser = cli.experiment_parser(PROG, __doc__)
    parser.add_argument("--data-dir", help="Fashion-MNIST's IDX files (default: the system's)")
    parser.add_argument("--epochs", type=int, default=6, help="epochs per run (default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=128, help="(default %(default)s)")
    parser.add_argument("--rounds", type=int, default=1, help="(default %(default)s)")
    parser.add_argument("--steps-per-call", type=int, default=8, help="K of jaxcnn-device-K (default %(default)s)")
    parser.add_argument("--target", type=float, default=0.90, help="test accuracy to time (default %(default)s)")
    parser.add_argument("--variants", type=cli.name_list, default=VARIANTS, help=", ".join(VARIANTS))
    parser.add_argument("--train-size", type=int, help="the first N training examples only (a smoke run)")
    cli.add_output_flags(parser, out="runs/loop_fashion.csv")
    return parser.parse_args(argv)


def _jaxcnn_run(variant: str, train_set, test_set, config: TrainConfig, per_call: int) -> tuple[list[dict], float]:
    """(a row per epoch, compile seconds) of jaxcnn's fit on one device."""
    layout, mesh = get_layout("single"), build_mesh({"data": 1})
    on = None
    if variant != "jaxcnn-host":
        on, _ = choose("on", train_set, layout, mesh, Augment(), config.seed)
    k = per_call if variant == "jaxcnn-device-K" else 1
    config = TrainConfig(**{**config.__dict__, "steps_per_call": k})
    started = time.perf_counter()
    program = build_program(
        ModelConfig(), OptimConfig(), layout, mesh, train_set.image_shape, config.batch_size,
        sum(epoch_steps(len(train_set), config)), seed=config.seed, on_device=on, steps_per_call=k,
    )  # fmt: skip
    if on is not None:
        program.calls.get(k, True)  # compiled here, with the others, not inside the first epoch
    compile_seconds = time.perf_counter() - started
    device_data = placed(train_set, on, layout, mesh) if on is not None else None
    result = fit(program, program.init(), Loader(train_set), test_set, config, progress=False, device_data=device_data)
    rows = [{"epoch": r["epoch"], "epoch_seconds": r["epoch_seconds"], "images_per_second": r["images_per_second"],
             "test_accuracy": r["test_accuracy"], "steps_per_call": k} for r in result.epochs]  # fmt: skip
    return rows, compile_seconds


def _torch_run(train_set, test_set, config: TrainConfig) -> tuple[list[dict], float]:
    """The same model, weights, recipe and batches' sizes in PyTorch eager, on a GPU where
    torch sees one (each batch copied over as a torch user's loop does), else the CPU."""
    import torch

    from jaxcnn.benchmarks.torch_twin import torch_model
    from jaxcnn.models import build_model

    torch.manual_seed(config.seed)
    model_config = ModelConfig()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = torch_model(build_model(model_config, train_set.image_shape, config.seed), model_config).to(device)
    steps = sum(epoch_steps(len(train_set), config))
    rate = make_schedule(OptimConfig(), steps)  # optax's schedule, read step by step
    optimizer = torch.optim.Adam(model.parameters(), lr=float(rate(0)))
    x, y = torch.from_numpy(train_set.images), torch.from_numpy(train_set.labels.astype(np.int64))
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=config.batch_size, shuffle=True, drop_last=True
    )
    test_x = torch.from_numpy(test_set.images).to(device)
    test_y = torch.from_numpy(test_set.labels.astype(np.int64)).to(device)
    rows, step = [], 0
    for epoch in range(config.epochs):
        model.train()
        start = time.perf_counter()
        for images, labels in loader:
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            for group in optimizer.param_groups:
                group["lr"] = float(rate(step))
            optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(images), labels).backward()
            optimizer.step()
            step += 1
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        model.eval()
        with torch.no_grad():
            correct = sum(
                int((model(test_x[i : i + 1000]).argmax(1) == test_y[i : i + 1000]).sum())
                for i in range(0, len(test_x), 1000)
            )
        rows.append({"epoch": epoch + 1, "epoch_seconds": seconds, "steps_per_call": 1,
                     "images_per_second": len(loader) * config.batch_size / seconds,
                     "test_accuracy": correct / len(test_x)})  # fmt: skip
    return rows, 0.0


def main(argv=None) -> list[dict]:
    args = parse_flags(argv)
    unknown = set(args.variants) - set(VARIANTS)
    if unknown or args.epochs < 1 or args.rounds < 1:
        raise UserError(f"variants from {', '.join(VARIANTS)}; --epochs and --rounds >= 1")
    train_set, test_set = load_named("fashion-mnist", args.data_dir)
    if args.train_size:
        train_set = train_set.subset(np.arange(min(args.train_size, len(train_set))))
    config = TrainConfig(batch_size=args.batch_size, epochs=args.epochs, seed=0)
    machine = f"{_cpu_name()}, {os.cpu_count()} cores"
    if jax.devices()[0].platform != "cpu":
        machine = f"{jax.devices()[0].device_kind}, {machine}"
    rows = []
    for round_ in range(1, args.rounds + 1):
        for variant in args.variants:
            if variant == "torch-eager":
                epochs, compile_seconds = _torch_run(train_set, test_set, config)
            else:
                epochs, compile_seconds = _jaxcnn_run(variant, train_set, test_set, config, args.steps_per_call)
            so_far = 0.0
            for row in epochs:
                so_far += row["epoch_seconds"]
                rows.append({"round": round_, "variant": variant, **row, "train_seconds_so_far": so_far,
                             "compile_seconds": compile_seconds, "global_batch_size": args.batch_size,
                             "model": ModelConfig().name, "machine": machine})  # fmt: skip
            print(_summary(variant, round_, rows, args.target), flush=True)
    if args.out:
        results.write_csv(args.out, rows, COLUMNS)
        print(f"wrote {args.out}")
    return rows


def _cpu_name() -> str:
    info = Path("/proc/cpuinfo")
    for line in info.read_text().splitlines() if info.exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _summary(variant: str, round_: int, rows: list[dict], target: float) -> str:
    mine = [r for r in rows if r["variant"] == variant and r["round"] == round_]
    steady = np.median([r["images_per_second"] for r in mine[1:]] or [mine[0]["images_per_second"]])
    reached = next((r for r in mine if r["test_accuracy"] >= target), None)
    when = (
        f"{100 * target:.0f}% test accuracy after epoch {reached['epoch']}, {reached['train_seconds_so_far']:.1f} s "
        f"of training (+{reached['compile_seconds']:.1f} s compiling)"
        if reached else f"{100 * target:.0f}% not reached in {len(mine)} epochs (best {max(r['test_accuracy'] for r in mine):.4f})"
    )  # fmt: skip
    return f"round {round_} {variant}: {steady:,.0f} images/s; {when}"


if __name__ == "__main__":
    cli.run_main(PROG, main)
