"""jaxcnn's models in PyTorch, for comparing backends (experiments/compare_backends.py): the
default CNN written out, the ResNets as torchvision builds them.

    twin = torch_model(jax_model, config)            # the same weights, NCHW inside, NHWC in
    check_agreement(jax_model, twin, images, labels) # the same logits and loss, or UserError
    workers = TorchWorkers(config, image_shape, images, labels, world=2)   # DDP over 2 processes
    seconds = workers(10)                            # 10 warm steps, rank 0's seconds
    setup = torch_setup(jax.devices()[0].platform, "bfloat16", torch.cuda.is_available())
    workers = TorchWorkers(config, image_shape, images, labels, setup=setup, compiled=True)  # torch.compile

On a GPU (`torch_setup`) torch runs as its GPU users run it: on `cuda`, cuDNN autotuning on
(`cudnn.benchmark`), model and input channels_last, and a bfloat16 step under autocast.

PyTorch (and torchvision, for the ResNets) is optional: it is imported inside the functions
that need it, so importing this module works without it.
"""

from __future__ import annotations

import copy
import os
import queue
import signal
import time
import warnings
from typing import NamedTuple

import jax
import numpy as np

from jaxcnn import host_memory
from jaxcnn.config import RESNET_WIDTHS, ModelConfig
from jaxcnn.errors import UserError
from jaxcnn.models import build_model, cross_entropy

TORCHVISION_RESNETS = ("resnet18", "resnet34", "resnet50")  # the ones torchvision.models builds
FIRST_STEPS = 5  # a fresh model's first steps, timed together: the time to first steps a user sees


class TorchSetup(NamedTuple):
    """How torch runs a training step on a device, as its users run it there."""

    device: str  # "cpu" or "cuda"
    channels_last: bool  # model and input in torch.channels_last (else NCHW contiguous)
    cudnn_benchmark: bool  # cuDNN times its algorithms in the first steps and keeps the fastest
    dtype: str  # "float32", or "bfloat16": forward and loss under torch.autocast, parameters fp32


CPU_FLOAT32 = TorchSetup("cpu", channels_last=False, cudnn_benchmark=False, dtype="float32")


def torch_setup(jax_platform: str, dtype: str, cuda_available: bool) -> TorchSetup:
    """Torch on the kind of device JAX runs on: the same device on both sides, or no comparison.
    On the CPU, NCHW contiguous (what torch's CPU users feed); on a GPU, what its GPU users run:
    cuDNN autotuning and channels_last, where Tensor Cores take their NHWC kernels."""
    if dtype not in ("float32", "bfloat16"):
        raise UserError(f"dtype {dtype!r}: float32 or bfloat16")
    if jax_platform == "cpu":
        return CPU_FLOAT32._replace(dtype=dtype)
    if jax_platform != "gpu":
        raise UserError(f"torch runs here on the CPU or an NVIDIA GPU, not {jax_platform}; run with JAX_PLATFORMS=cpu")
    if not cuda_available:
        raise UserError(
            "JAX runs on a GPU but this torch has no CUDA (torch.cuda.is_available() is false): "
            "install a CUDA build of torch, or compare on the CPU with JAX_PLATFORMS=cpu"
        )
    return TorchSetup("cuda", channels_last=True, cudnn_benchmark=True, dtype=dtype)


class TorchWorkerError(UserError):
    """A torch worker failed (its error, on one line) or died."""


def torch_model(jax_model, config: ModelConfig):
    """`config`'s model in torch, holding `jax_model`'s weights: the default CNN, or a
    torchvision ResNet (its stem as the jax model's: `config.resnet_stem`). The forward
    takes NHWC images, as jaxcnn does, and runs NCHW contiguous, as torch users run it."""
    if config.norm != "batch" or config.dropout:
        raise UserError("the torch twin is written for batch norm without dropout")
    return _torch_resnet(jax_model, config) if config.is_resnet else _torch_cnn(jax_model)


def _to_nchw(x_nhwc, memory_format):
    # a bare permute of NHWC is channels_last in memory, which torch's convs keep through the
    # network: a CPU user's batches are NCHW contiguous (a copy), a GPU user's channels_last (none)
    return x_nhwc.permute(0, 3, 1, 2).contiguous(memory_format=memory_format)


def place(twin, setup: TorchSetup):
    """The twin on `setup`'s device, in its memory format (the input's too: forward converts)."""
    import torch

    twin.memory_format = torch.channels_last if setup.channels_last else torch.contiguous_format
    return twin.to(setup.device, memory_format=twin.memory_format)


def _assign(tensor, value) -> None:
    """Overwrite a torch parameter or buffer in place with a jax value, shapes checked."""
    import torch

    value = np.asarray(value)
    if tuple(tensor.shape) != value.shape:
        raise ValueError(f"torch twin: shape {tuple(tensor.shape)} for a jax value of shape {value.shape}")
    with torch.no_grad():
        tensor.copy_(torch.from_numpy(value.copy()))


def _copy_layer(theirs, ours) -> None:
    """One torch layer (Conv2d, BatchNorm2d, Linear) := the jax layer's weights."""
    from torch import nn

    if isinstance(theirs, nn.Conv2d):
        _assign(theirs.weight, np.asarray(ours.kernel.get_value()).transpose(3, 2, 0, 1))  # HWIO -> OIHW
    elif isinstance(theirs, nn.BatchNorm2d):
        theirs.eps, theirs.momentum = ours.epsilon, 1 - ours.momentum  # flax keeps 0.9 of the old statistics
        # (torch updates running_var with the unbiased batch variance, flax with the biased one: the
        # running statistics part after the first training step; training steps and their timing do not)
        for tensor, variable in [(theirs.weight, ours.scale), (theirs.bias, ours.bias),
                                 (theirs.running_mean, ours.mean), (theirs.running_var, ours.var)]:  # fmt: skip
            _assign(tensor, variable.get_value())
    elif isinstance(theirs, nn.Linear):
        _assign(theirs.weight, np.asarray(ours.kernel.get_value()).T)  # (in, out) -> (out, in)
        _assign(theirs.bias, ours.bias.get_value())
    else:
        raise TypeError(f"torch twin: no weights to copy into {type(theirs).__name__}")


def _torch_cnn(jax_model):
    """The default CNN: conv -> batch norm -> ReLU -> 2x2 max-pool blocks, then dense layers."""
    import torch
    from torch import nn

    class TorchCNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.memory_format = torch.contiguous_format
            blocks = []
            for block in jax_model.blocks:
                _, _, cin, cout = block.conv.kernel.get_value().shape
                conv, norm = nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout)
                _copy_layer(conv, block.conv)
                _copy_layer(norm, block.norm)
                # MaxPool ceil_mode: an odd side keeps its last row, as SAME pooling does
                blocks += [conv, norm, nn.ReLU(), nn.MaxPool2d(2, ceil_mode=True)]
            self.blocks = nn.Sequential(*blocks)
            self.dense = nn.ModuleList()
            for layer in jax_model.dense:
                linear = nn.Linear(*layer.kernel.get_value().shape)
                _copy_layer(linear, layer)
                self.dense.append(linear)

        def forward(self, x_nhwc):
            x = self.blocks(_to_nchw(x_nhwc, self.memory_format))
            x = x.permute(0, 2, 3, 1).flatten(1)  # flatten in jax's (H, W, C) order
            for layer in self.dense[:-1]:
                x = torch.relu(layer(x))
            return self.dense[-1](x)

    return TorchCNN()


def _torch_resnet(jax_model, config: ModelConfig):
    """torchvision's ResNet-18/34/50 with the jax model's weights. The small stem (a 3x3
    stride-1 conv, no pool) replaces torchvision's conv1 and maxpool, as CIFAR code does."""
    import torch
    import torchvision
    from torch import nn

    if config.name not in TORCHVISION_RESNETS or config.conv_features != RESNET_WIDTHS:
        raise UserError(f"the torch twin builds torchvision's {', '.join(TORCHVISION_RESNETS)} at their own widths")
    net = getattr(torchvision.models, config.name)(num_classes=config.num_classes)
    stem = jax_model.stem
    _, _, channels, width = stem.conv.kernel.get_value().shape
    if not stem.pool:  # the small stem
        net.conv1, net.maxpool = nn.Conv2d(channels, width, 3, padding=1, bias=False), nn.Identity()
    elif channels != 3:  # torchvision's stem takes RGB
        net.conv1 = nn.Conv2d(channels, width, 7, stride=2, padding=3, bias=False)
    pairs = [(net.conv1, stem.conv), (net.bn1, stem.norm)]
    torch_blocks = [block for stage in (net.layer1, net.layer2, net.layer3, net.layer4) for block in stage]
    for theirs, ours in zip(torch_blocks, jax_model.blocks, strict=True):
        for i in range(1, ours.depth + 1):
            pairs += [(getattr(theirs, f"conv{i}"), getattr(ours, f"conv{i}")),
                      (getattr(theirs, f"bn{i}"), getattr(ours, f"norm{i}"))]  # fmt: skip
        if (theirs.downsample is None) != (ours.shortcut is None):
            raise ValueError("torch twin: torchvision's projection shortcuts are not where jaxcnn's are")
        if ours.shortcut is not None:
            pairs += [(theirs.downsample[0], ours.shortcut.conv), (theirs.downsample[1], ours.shortcut.norm)]
    pairs.append((net.fc, jax_model.head.fc))
    for theirs, ours in pairs:
        _copy_layer(theirs, ours)

    class NHWCInput(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net
            self.memory_format = torch.contiguous_format

        def forward(self, x_nhwc):
            return self.net(_to_nchw(x_nhwc, self.memory_format))

    return NHWCInput()


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


def torch_step_seconds(
    model, images, labels, steps: int, optimizer=None, setup: TorchSetup = CPU_FLOAT32, warmup: int = 1
) -> list[float]:
    """Seconds of each of `steps` Adam steps on one fixed batch, after `warmup` untimed ones.
    On a GPU each step is waited for (torch.cuda.synchronize: a launch returns before its
    kernels have run), so these are step times there too, not the time to queue the work."""
    import torch

    optimizer = optimizer or torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.from_numpy(images).to(setup.device)  # NHWC: the forward permutes to NCHW (setup's memory format)
    y = torch.from_numpy(labels.astype(np.int64)).to(setup.device)
    wait = torch.cuda.synchronize if setup.device == "cuda" else lambda: None
    model.train()
    seconds = []
    wait()
    for i in range(warmup + steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        # AMP as torch documents it: the forward and loss in bfloat16 where safe, fp32 parameters (no scaler: bf16
        # has fp32's range)
        with torch.autocast(setup.device, dtype=torch.bfloat16, enabled=setup.dtype == "bfloat16"):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        wait()
        if i >= warmup:
            seconds.append(time.perf_counter() - start)
    return seconds


def _torch_worker(rank, world, port, config, image_shape, images, labels, setup, compiled, commands, replies):
    """One torch process: builds `config`'s twin from the jax model of the same seed, times
    its first FIRST_STEPS steps (torch.compile compiles in them), then warm steps on request.
    A fresh (spawned) interpreter with glibc's default malloc, as torch users run it, unless
    the parent asked for jaxcnn's settings (JAXCNN_KEEP_HOST_MEMORY). Every reply is
    (rank, dict); a failure is replied as one line, or the parent would wait for a reply."""
    import torch
    import torch.distributed as dist

    try:
        # the jax model only lends its weights: on the CPU, so that JAX opens no GPU client (and its memory) here
        jax.config.update("jax_platforms", "cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
        torch.backends.cudnn.benchmark = setup.cudnn_benchmark
        # DDP notes that the 1-input-channel kernel's gradient has other strides than its bucket: harmless
        warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
        model = place(torch_model(build_model(config, image_shape, 0), config), setup)
        if world > 1:
            os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port))
            dist.init_process_group("gloo", rank=rank, world_size=world)
            model = torch.nn.parallel.DistributedDataParallel(model)
            share = len(images) // world
            images, labels = images[rank * share : (rank + 1) * share], labels[rank * share : (rank + 1) * share]
        if compiled:
            model = torch.compile(model)  # lazily: the first steps compile it
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        first = sum(torch_step_seconds(model, images, labels, FIRST_STEPS, optimizer, setup, warmup=0))
        replies.put((rank, {"first_steps_seconds": first}))
        while (steps := commands.get()) is not None:
            seconds = torch_step_seconds(model, images, labels, steps, optimizer, setup)
            peak = torch.cuda.max_memory_allocated() if setup.device == "cuda" else None
            replies.put((rank, {"seconds": seconds, "peak_memory_bytes": peak}))
    except Exception as error:
        replies.put((rank, {"error": _one_line(error)}))
        return
    if world > 1:
        dist.destroy_process_group()


def _one_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {' / '.join(lines)[:400]}"


class TorchWorkers:
    """`world` spawned torch processes, each with `config`'s twin (world > 1:
    DistributedDataParallel over gloo, on the CPU), run as `setup` says, kept alive so that
    their timed rounds interleave with jaxcnn's: both see the same machine. Between rounds
    they are stopped (SIGSTOP): idle OpenMP and gloo threads spin, and would otherwise take
    cores from whoever is timed. `steps(n)` (or calling the workers) times n warm steps on
    every process and returns rank 0's seconds. Rank 0's `first_steps_seconds` (its first
    FIRST_STEPS steps, `compiled`: under torch.compile) and `peak_memory_bytes` (so far:
    torch.cuda.max_memory_allocated; None on the CPU) are kept. A worker's failure raises
    TorchWorkerError."""

    def __init__(
        self, config: ModelConfig, image_shape, images, labels, world: int = 1, keep_host_memory: bool = False,
        setup: TorchSetup = CPU_FLOAT32, compiled: bool = False,
    ):  # fmt: skip
        import socket

        import torch.multiprocessing as mp

        if world > 1 and setup.device != "cpu":
            raise ValueError("torch twin: several workers (DDP over gloo) run on the CPU only")
        with socket.socket() as s:
            s.bind(("localhost", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")  # not fork: this process has started JAX's threads
        self.commands = [ctx.Queue() for _ in range(world)]
        self.replies = ctx.Queue()
        self.procs, self.peak_memory_bytes = [], None
        previous = os.environ.get(host_memory.OPT_OUT)
        os.environ[host_memory.OPT_OUT] = "1" if keep_host_memory else "0"  # the children's malloc
        try:
            shared = (world, port, config, image_shape, images, labels, setup, compiled)
            self.procs = [
                ctx.Process(target=_torch_worker, args=(rank, *shared, self.commands[rank], self.replies))
                for rank in range(world)
            ]
            for proc in self.procs:
                proc.start()
            self.first_steps_seconds = self._replies()["first_steps_seconds"]  # every process built and warm
            self._signal(signal.SIGSTOP)
        except BaseException:
            self.close()
            raise
        finally:
            if previous is None:
                os.environ.pop(host_memory.OPT_OUT)
            else:
                os.environ[host_memory.OPT_OUT] = previous

    def _signal(self, signum):
        for proc in self.procs:
            if proc.is_alive():
                os.kill(proc.pid, signum)

    def _replies(self) -> dict:
        """Rank 0's reply, once every process has replied; a worker's error or death raises."""
        replies = {}
        while len(replies) < len(self.procs):
            try:
                rank, reply = self.replies.get(timeout=1)
            except queue.Empty:
                if died := [proc.exitcode for proc in self.procs if proc.exitcode is not None]:
                    raise TorchWorkerError(f"a torch worker died (exit code {died[0]})") from None
                continue
            if "error" in reply:
                raise TorchWorkerError(f"torch worker: {reply['error']}")
            replies[rank] = reply
        return replies[0]

    def steps(self, n: int) -> list[float]:
        self._signal(signal.SIGCONT)
        for commands in self.commands:
            commands.put(n)
        reply = self._replies()
        self._signal(signal.SIGSTOP)
        self.peak_memory_bytes = reply["peak_memory_bytes"]
        return reply["seconds"]

    __call__ = steps

    def close(self):
        self._signal(signal.SIGCONT)
        for commands in self.commands:
            commands.put(None)
        for proc in self.procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
