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

Torch runs in spawned worker processes kept alive for the whole run, and the timed rounds
alternate between backends, so both see the same machine. Torch gets glibc's default
malloc, as torch users run it, and once more with the settings jaxcnn applies to its own
process (`jaxcnn.host_memory`, `host_malloc=keep-freed`), which speed torch up too. Rows
share one schema; `ratio_vs_torch` is a row's images/s over torch's with the default malloc
(same variant), from this one run.
"""

from __future__ import annotations

import copy
import os
import signal
import statistics
import time
import warnings
from pathlib import Path

import jax
import numpy as np

from jaxcnn import cli, host_memory, results
from jaxcnn.analysis.measure import time_steps
from jaxcnn.build import build_program
from jaxcnn.config import ModelConfig, OptimConfig
from jaxcnn.errors import UserError
from jaxcnn.models import build_model, cross_entropy
from jaxcnn.sharding import build_mesh, get_layout
from jaxcnn.sharding.mesh import simulate_cpu_devices

PROG = "compare_backends.py"
KEEP, DEFAULT = "keep-freed", "glibc-default"  # host malloc: jaxcnn.host_memory's settings, or glibc's
SIZES = {"28": ((28, 28, 1), 128), "224": ((224, 224, 3), 8)}
COLUMNS = [
    "backend", "variant", "host_malloc", "image_shape", "global_batch_size", "workers", "median_step_seconds", "images_per_second",
    "ratio_vs_torch", "max_logit_diff", "max_logit_diff_vs_float64", "loss_diff", "steps", "torch_threads",
]  # fmt: skip


def parse_flags(argv=None):
    parser = cli.FlagParser(prog=PROG, description=__doc__, formatter_class=cli.argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="28,224", help=f"some of {', '.join(SIZES)}")
    parser.add_argument("--steps", type=int, default=20, help="warm steps timed per row (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds the steps are split into")
    parser.add_argument("--no-ddp", action="store_true", help="skip the 2-process rows")
    parser.add_argument("--out", default="results/compare_backends.csv")
    return parser.parse_args(argv)


# --- the torch twin -------------------------------------------------------------------------


def torch_model(jax_model, config: ModelConfig):
    """The jaxcnn CNN in torch, holding the jax model's weights (NCHW inside, NHWC in)."""
    import torch
    from torch import nn

    class TorchCNN(nn.Module):
        def __init__(self):
            super().__init__()
            blocks = []
            for block in jax_model.blocks:
                kernel = np.asarray(block.conv.kernel.get_value())  # (kh, kw, cin, cout)
                conv = nn.Conv2d(kernel.shape[2], kernel.shape[3], 3, padding=1, bias=False)
                conv.weight.data.copy_(torch.from_numpy(kernel.transpose(3, 2, 0, 1).copy()))
                norm = nn.BatchNorm2d(kernel.shape[3], eps=block.norm.epsilon, momentum=1 - block.norm.momentum)
                norm.weight.data.copy_(torch.from_numpy(np.asarray(block.norm.scale.get_value()).copy()))
                norm.bias.data.copy_(torch.from_numpy(np.asarray(block.norm.bias.get_value()).copy()))
                # MaxPool ceil_mode: an odd side keeps its last row, as SAME pooling does
                blocks += [conv, norm, nn.ReLU(), nn.MaxPool2d(2, ceil_mode=True)]
            self.blocks = nn.Sequential(*blocks)
            self.dense = nn.ModuleList()
            for layer in jax_model.dense:
                kernel = np.asarray(layer.kernel.get_value())
                linear = nn.Linear(*kernel.shape)
                linear.weight.data.copy_(torch.from_numpy(kernel.T.copy()))
                linear.bias.data.copy_(torch.from_numpy(np.asarray(layer.bias.get_value()).copy()))
                self.dense.append(linear)

        def forward(self, x_nhwc):
            x = self.blocks(x_nhwc.permute(0, 3, 1, 2))
            x = x.permute(0, 2, 3, 1).flatten(1)  # flatten in jax's (H, W, C) order
            for layer in self.dense[:-1]:
                x = torch.relu(layer(x))
            return self.dense[-1](x)

    if config.norm != "batch" or config.dropout:
        raise UserError("the torch twin is written for the default model (batch norm, no dropout)")
    return TorchCNN()


def check_agreement(jax_model, twin, images: np.ndarray, labels: np.ndarray) -> dict:
    """Do the two compute the same thing? Logits and loss of one training-mode forward from
    the same weights on the same batch, each backend also against the torch twin run in
    float64 (the exact answer up to float64 rounding), which says whose fp32 rounding a
    difference is. Raises UserError when the losses disagree beyond 1e-5."""
    import torch

    jax_logits = np.asarray(jax_model(jax.numpy.asarray(images), train=True))
    jax_loss = float(cross_entropy(jax_logits, labels).mean())
    exact_twin = copy.deepcopy(twin).double().train()  # a copy: its BN statistics update too
    twin.train()
    with torch.no_grad():
        torch_logits = twin(torch.from_numpy(images)).numpy()
        exact_logits = exact_twin(torch.from_numpy(images.astype(np.float64))).numpy()
    torch_loss = float(
        torch.nn.functional.cross_entropy(torch.from_numpy(torch_logits), torch.from_numpy(labels.astype(np.int64)))
    )
    if abs(jax_loss - torch_loss) > 1e-5 * max(1.0, abs(jax_loss)):
        raise UserError(f"jaxcnn and torch disagree on the loss ({jax_loss} vs {torch_loss}): not comparable")
    return {
        "max_logit_diff": float(np.max(np.abs(jax_logits - torch_logits))),
        "loss_diff": abs(jax_loss - torch_loss),
        "jaxcnn": float(np.max(np.abs(jax_logits - exact_logits))),
        "torch": float(np.max(np.abs(torch_logits - exact_logits))),
    }


def torch_step_seconds(model, images, labels, steps: int, optimizer=None) -> list[float]:
    """Seconds of each of `steps` warm Adam steps on one fixed batch (one warm-up first)."""
    import torch

    optimizer = optimizer or torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.from_numpy(images), torch.from_numpy(labels.astype(np.int64))
    model.train()
    seconds = []
    for i in range(steps + 1):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if i:  # the first step is warm-up
            seconds.append(time.perf_counter() - start)
    return seconds


def _torch_worker(rank, world, port, image_shape, images, labels, commands, replies):
    """One torch process: builds the twin from the same seed, then times steps on request.
    A fresh (spawned) interpreter with glibc's default malloc, as torch users run it,
    unless the parent asked for jaxcnn's settings (JAXCNN_KEEP_HOST_MEMORY)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    # DDP notes that the 1-input-channel kernel's gradient has other strides than its bucket: harmless
    warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
    config = ModelConfig()
    model = torch_model(build_model(config, image_shape, 0), config)
    if world > 1:
        os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        model = torch.nn.parallel.DistributedDataParallel(model)
        share = len(images) // world
        images, labels = images[rank * share : (rank + 1) * share], labels[rank * share : (rank + 1) * share]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    torch_step_seconds(model, images, labels, 1, optimizer)  # warm-up outside the timed rounds
    replies.put((rank, []))
    while (steps := commands.get()) is not None:
        replies.put((rank, torch_step_seconds(model, images, labels, steps, optimizer)))
    if world > 1:
        dist.destroy_process_group()


class TorchWorkers:
    """`world` spawned torch processes (world > 1: DistributedDataParallel over gloo), kept
    alive so that their timed rounds interleave with jaxcnn's: both see the same machine.
    Between rounds they are stopped (SIGSTOP): idle OpenMP and gloo threads spin, and would
    otherwise take cores from whoever is timed. `steps(n)` times n warm steps on every
    process and returns rank 0's seconds."""

    def __init__(self, image_shape, images, labels, world: int = 1, keep_host_memory: bool = False):
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("localhost", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")  # not fork: this process has started JAX's threads
        self.commands = [ctx.Queue() for _ in range(world)]
        self.replies = ctx.Queue()
        previous = os.environ.get(host_memory.OPT_OUT)
        os.environ[host_memory.OPT_OUT] = "1" if keep_host_memory else "0"  # the children's malloc
        try:
            self.procs = [
                ctx.Process(
                    target=_torch_worker,
                    args=(rank, world, port, image_shape, images, labels, self.commands[rank], self.replies),
                )
                for rank in range(world)
            ]
            for proc in self.procs:
                proc.start()
            self._replies()  # every process built and warmed up
            self._signal(signal.SIGSTOP)
        finally:
            if previous is None:
                os.environ.pop(host_memory.OPT_OUT)
            else:
                os.environ[host_memory.OPT_OUT] = previous

    def _signal(self, signum):
        for proc in self.procs:
            if proc.is_alive():
                os.kill(proc.pid, signum)

    def _replies(self) -> list[float]:
        seconds = dict(self.replies.get(timeout=600) for _ in self.procs)
        return seconds[0]

    def steps(self, n: int) -> list[float]:
        self._signal(signal.SIGCONT)
        for queue in self.commands:
            queue.put(n)
        seconds = self._replies()
        self._signal(signal.SIGSTOP)
        return seconds

    def close(self):
        self._signal(signal.SIGCONT)
        for queue in self.commands:
            queue.put(None)
        for proc in self.procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()


# --- the run ---------------------------------------------------------------------------------


def _jaxcnn_stepper(config, image_shape, batch, images, labels, layout, mesh):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = build_program(
            config, OptimConfig(learning_rate=1e-3, schedule="constant", warmup_steps=0),
            get_layout(layout), build_mesh(mesh), image_shape, batch, 1000, with_eval=False,
        )  # fmt: skip
    state = [program.init()]

    def steps(n: int) -> list[float]:
        seconds, state[0] = time_steps(program, state[0], images, labels, n)
        return seconds

    return steps


def main(argv=None) -> list[dict]:
    args = parse_flags(argv)
    try:
        import torch
    except ImportError:
        raise UserError("PyTorch is not installed; pip install torch==2.13.0 (a CPU build) and run again") from None
    names = [s.strip() for s in args.sizes.split(",") if s.strip()]
    if not names or any(n not in SIZES for n in names):
        raise UserError(f"--sizes must be some of {', '.join(SIZES)}")
    if args.steps < 1 or args.rounds < 1:
        raise UserError("--steps and --rounds must be positive integers")
    out = Path(args.out)
    results.ensure_writable_dir(out.parent)
    simulate_cpu_devices(2, at_least=True)
    config = ModelConfig()
    rows = []
    for name in names:
        image_shape, batch = SIZES[name]
        rng = np.random.default_rng(0)
        images = rng.random((batch, *image_shape), dtype=np.float32)
        labels = rng.integers(0, config.num_classes, batch).astype(np.int32)
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
        timings = {key: [] for key in steppers}
        try:  # rounds interleave the backends, so drifts in the machine's speed hit all alike
            per_round = -(-args.steps // args.rounds)
            for round_ in range(args.rounds):
                for key, stepper in steppers.items():
                    timings[key] += (stepper.steps if isinstance(stepper, TorchWorkers) else stepper)(per_round)
                print(f"{name}: round {round_ + 1}/{args.rounds} timed", flush=True)
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
