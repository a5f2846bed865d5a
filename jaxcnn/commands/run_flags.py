"""The flags of a training run, in groups, each named for the RunConfig field it sets
(jaxcnn.run_config: `--grad-accum` sets `update.grad_accum`; a part's `name` is set by the
part's own flag, `--model` or `--optimizer`), with the configs' defaults. `jaxcnn train`
takes every group; compare, scale, plan and the experiment scripts take some.

Nothing here imports JAX: a command line parses its flags before JAX is loaded.
"""

from __future__ import annotations

import argparse

from jaxcnn.commands.cli import batch_schedule, int_list, name_list
from jaxcnn.config import (
    CONV1X1_KERNELS,
    CONVNEXTS,
    DTYPES,
    IMAGENET_STEM_FROM,
    LR_SCALINGS,
    MAX_POOL_KERNELS,
    MOBILENETS,
    NORM_STATISTICS,
    NORMS,
    OPTIMIZERS,
    PIPELINE_SCHEDULES,
    REMAT_NAMES,
    REMAT_POLICIES,
    RESNETS,
    SCHEDULES,
    STEMS,
    SYNC_MODES,
    ModelConfig,
    OptimConfig,
    TrainConfig,
    UpdateConfig,
)
from jaxcnn.run_config import (
    AUGMENTS,
    DATA_ON_DEVICE,
    DEFAULT_SIMULATED_DEVICES,
    RESUME_AUTO,
    STOP_SIGNALS,
    CheckpointConfig,
    ClusterConfig,
    DataConfig,
    ParallelConfig,
)
from jaxcnn.stopping import INTERRUPTED_EXIT_CODE, STOPPED_EXIT_CODE


def resume_mode(text: str) -> str:
    """--resume's optional value: only 'auto'."""
    if text != RESUME_AUTO:
        raise argparse.ArgumentTypeError(f"takes no value or {RESUME_AUTO!r} (continue a saved state, else start)")
    return text


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    defaults = ModelConfig()
    g.add_argument(
        "--model", default=defaults.name,
        help=f"cnn2d_<N>layer_fullconnected_<M>layer or one of {', '.join((*RESNETS, *CONVNEXTS, *MOBILENETS))} "
        "(default %(default)s)",
    )  # fmt: skip
    g.add_argument(
        "--conv-features", type=int_list, default=(), help="conv widths (a ResNet's: per stage), e.g. 32,64,128"
    )
    g.add_argument(
        "--stem", choices=STEMS, default=defaults.stem,
        help="ResNets: small (3x3 conv) or imagenet (7x7 stride-2 conv + max-pool); ConvNeXt: small (2x2 stride-2 "
        "patchify) or imagenet (4x4 stride 4); MobileNetV2: small (stride-1 stem) or imagenet (stride 2); auto: "
        f"imagenet from {IMAGENET_STEM_FROM} pixels a side (default %(default)s)",
    )  # fmt: skip
    g.add_argument(
        "--stochastic-depth", type=float, default=defaults.stochastic_depth,
        help="ConvNeXt: the last residual block's drop rate, linear from 0 at the first (torchvision's "
        "convnext_tiny: 0.1) (default %(default)s)",
    )  # fmt: skip
    g.add_argument(
        "--width-multiplier", type=float, default=defaults.width_multiplier,
        help="MobileNetV2: every width times this, rounded to multiples of 8 (default %(default)s)",
    )  # fmt: skip
    g.add_argument("--dense-features", type=int_list, default=(), help="hidden dense widths, e.g. 256,128")
    g.add_argument(
        "--norm", choices=NORMS, default=defaults.norm,
        help="normalisation after each conv; ConvNeXt's is always LayerNorm (default %(default)s)",
    )  # fmt: skip
    g.add_argument(
        "--norm-statistics", choices=NORM_STATISTICS, default=defaults.norm_statistics,
        help="batch norm in training: the global batch's statistics, or each device's own (no collective; "
        "noisier on small per-device batches) (default %(default)s)",
    )  # fmt: skip
    g.add_argument(
        "--dropout", type=float, default=defaults.dropout,
        help="dropout rate between dense layers (MobileNetV2: before its classifier; torchvision's 0.2)",
    )  # fmt: skip
    g.add_argument("--num-classes", type=int, default=defaults.num_classes)
    g.add_argument(
        "--remat",
        choices=REMAT_POLICIES,
        default=defaults.remat,
        help="recompute each conv block in the backward pass (jax.checkpoint): full keeps only its input, "
        "dots its conv outputs, names the activations in --remat-names",
    )
    g.add_argument(
        "--remat-names",
        type=name_list,
        default=defaults.remat_names,
        help=f"with --remat names: activations to keep, some of {','.join(REMAT_NAMES)} (default %(default)s)",
    )
    g.add_argument(
        "--dtype",
        choices=DTYPES,
        default=defaults.dtype,
        help="compute dtype; parameters and optimizer state stay float32",
    )
    g.add_argument(
        "--conv1x1", choices=CONV1X1_KERNELS, default=defaults.conv1x1,
        help="ResNets' 1x1 convolutions as a matrix product (dot) or a convolution; auto: the platform's faster "
        "(jaxcnn.platform_choices); the numbers are the same",
    )  # fmt: skip
    g.add_argument(
        "--max-pool", choices=MAX_POOL_KERNELS, default=defaults.max_pool,
        help="the CNN's 2x2 max-pool: select (gradient to the winner chosen in the forward pass) or window "
        "(reduce_window); auto: the platform's faster; the numbers are the same",
    )  # fmt: skip


def add_data_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data")
    defaults = DataConfig()
    g.add_argument(
        "--dataset", default=defaults.dataset, help="digits (the CSVs below; default), fashion-mnist or mnist"
    )
    g.add_argument("--data-dir", help="where --dataset's files are (default: the cache, then /usr/share/datasets)")
    g.add_argument(
        "--download", action="store_true",
        help="fetch --dataset's files from their canonical source into --data-dir or the cache when not found",
    )  # fmt: skip
    g.add_argument("--data", help="training CSV (label, pixel0..) or image folder (a subfolder per class); "
                   "default: the bundled digits")  # fmt: skip
    g.add_argument("--test-data", help="test CSV or image folder; a CSV without labels -> submission.csv; default: "
                   "the bundled digits' test file, or --val-split of your --data")  # fmt: skip
    g.add_argument(
        "--val-split", type=float, default=defaults.val_split, help="held out of --data when it has no --test-data"
    )
    g.add_argument("--image-size", metavar="HxW", help="resize folder images to this (default: they must match)")
    g.add_argument(
        "--channels",
        type=int,
        default=defaults.channels,
        help="channels per pixel: CSV columns (HWC), folder images' mode",
    )
    g.add_argument("--synthetic", metavar="HxWxC", help="random images of this shape instead of the CSVs")
    g.add_argument(
        "--synthetic-size", type=int, default=defaults.synthetic_size, help="training images in --synthetic mode"
    )
    g.add_argument(
        "--augment", choices=AUGMENTS, default=defaults.augment,
        help="imagenet: an image folder's training images random-resized-cropped to --image-size and flipped as they "
        "are decoded, evaluation and predict centre-cropped (torchvision's ImageNet recipe); default: none",
    )  # fmt: skip
    g.add_argument(
        "--augment-shift", type=int, default=defaults.augment_shift, help="random shifts of up to N pixels (host side)"
    )
    g.add_argument("--augment-flip", action="store_true", help="random horizontal flips (host side)")
    g.add_argument(
        "--input-workers", type=int,
        help="grain worker processes reading, decoding and augmenting batches; 0: one thread of the training process "
        "(default: 0 for data in memory, one per CPU core for an image folder)",
    )  # fmt: skip
    g.add_argument(
        "--prefetch",
        type=int,
        default=defaults.prefetch,
        help="batches prepared ahead of the step (default %(default)s)",
    )
    g.add_argument(
        "--data-on-device", choices=DATA_ON_DEVICE, default=defaults.data_on_device,
        help="hold the training set on the devices, each step gathering its examples there (auto: when it is in "
        "memory and a device's share fits a quarter of its memory; default %(default)s)",
    )  # fmt: skip


def add_mesh_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("parallelism")
    defaults = ParallelConfig()
    g.add_argument(
        "--layout",
        default=defaults.layout,
        help="single, dp, fsdp, tp, hybrid, spatial, pipeline (default %(default)s)",
    )
    g.add_argument("--layout-rules", help="your own rules table, e.g. batch=data,conv_out=model")
    g.add_argument("--mesh", help="mesh shape, e.g. data=4,model=2 (-1 fills the rest); default: the layout's")
    g.add_argument(
        "--dcn-mesh",
        help="several processes: how many ways each mesh axis runs across them (hosts; with one process per GPU, "
        "GPUs), e.g. data=2, the rest of each axis inside one; default: the processes split data first",
    )
    g.add_argument(
        "--host-devices",
        type=int,
        help=f"simulate N CPU devices (default on a CPU-only machine: what the mesh needs, else "
        f"{DEFAULT_SIMULATED_DEVICES})",
    )
    g.add_argument(
        "--microbatches",
        type=int,
        help="pipeline: micro-batches per step (default 2 x stages, fewer to keep 16+ images each); must divide the batch",
    )
    g.add_argument(
        "--stage-split",
        type=int_list,
        help="pipeline: first layer (a ResNet: unit, the stem 0, blocks 1..N) of each stage after the first, "
        "e.g. 2,4 (default: balanced by FLOPs)",
    )
    g.add_argument(
        "--pipeline-schedule",
        choices=PIPELINE_SCHEDULES,
        default=defaults.pipeline_schedule,
        help="pipeline: gpipe (every forward, then every backward) or 1f1b (one forward, one backward in turn: "
        "at most S micro-batches held a stage, whatever M)",
    )
    g.add_argument(
        "--virtual-stages",
        type=int,
        default=defaults.virtual_stages,
        help="pipeline: chunks of layers each stage holds, not neighbours (with 1f1b: interleaved 1F1B, bubble "
        "(S-1)/(V*M+S-1))",
    )
    g.add_argument(
        "--print-shardings",
        action="store_true",
        help="print every parameter's placement, the collectives XLA compiled and the lint's warnings",
    )


def add_train_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    defaults_t, defaults_o, defaults_u = TrainConfig(), OptimConfig(), UpdateConfig()
    g.add_argument("--batch-size", type=int, default=defaults_t.batch_size, help="global batch per optimizer step")
    g.add_argument("--eval-batch-size", type=int, help="default: --batch-size")
    g.add_argument("--epochs", type=int, default=defaults_t.epochs)
    g.add_argument("--max-steps", type=int, help="stop after this many optimizer steps")
    g.add_argument("--seed", type=int, default=defaults_t.seed)
    g.add_argument(
        "--steps-per-call", type=int, default=defaults_t.steps_per_call, metavar="K",
        help="optimizer steps in one compiled call: more than 1 pays where the host's part of a call (inputs, "
        "dispatch) is a large share of a short step, on an accelerator (default %(default)s)",
    )  # fmt: skip
    g.add_argument("--optimizer", choices=OPTIMIZERS, default=defaults_o.name)
    g.add_argument("--learning-rate", "--lr", type=float, default=defaults_o.learning_rate, help="peak learning rate")
    g.add_argument("--schedule", choices=SCHEDULES, default=defaults_o.schedule)
    g.add_argument("--warmup-steps", type=int, default=defaults_o.warmup_steps)
    g.add_argument("--warmup-from", type=float, default=defaults_o.warmup_from, help="the rate the warmup starts at")
    g.add_argument("--weight-decay", type=float, default=defaults_o.weight_decay, help="adamw only")
    g.add_argument("--momentum", type=float, default=defaults_o.momentum, help="sgd only")
    g.add_argument(
        "--freeze", metavar="PARTS", default=defaults_o.freeze, type=lambda text: tuple(p for p in text.split(",") if p),
        help="parameters that do not move: 'backbone' (all but the head) or parts, e.g. stem,stage1 "
        "(docs/pretrained-and-export.md names each model's parts)",
    )  # fmt: skip
    g.add_argument(
        "--backbone-lr", type=float, metavar="LR",
        help="peak learning rate of every part but the head (default: --learning-rate), same schedule",
    )  # fmt: skip
    g.add_argument(
        "--grad-accum",
        type=int,
        default=defaults_u.grad_accum,
        help="micro-batches per optimizer step, gradients summed",
    )
    g.add_argument(
        "--sync",
        choices=SYNC_MODES,
        default=defaults_u.sync,
        help="allreduce: gradients averaged every step; local-sgd: each data-parallel replica steps alone",
    )
    g.add_argument(
        "--sync-every", type=int, default=defaults_u.sync_every, help="local-sgd: average the replicas every H steps"
    )
    g.add_argument(
        "--staleness",
        type=int,
        default=defaults_u.staleness,
        help="apply gradients taken on the parameters of T steps ago",
    )
    g.add_argument(
        "--lr-scaling",
        choices=LR_SCALINGS,
        default=defaults_t.lr_scaling,
        help="linear: lr x batch / --base-batch, warmup from lr (Goyal et al. 2017)",
    )
    g.add_argument("--base-batch", type=int, help="the batch size --lr was tuned for (with --lr-scaling linear)")
    g.add_argument(
        "--batch-schedule",
        type=batch_schedule,
        default=defaults_t.batch_schedule,
        help="grow the global batch at these epochs, e.g. 0:64,10:128 (lr scaled to match; overrides --batch-size)",
    )
    g.add_argument(
        "--auto-batch",
        metavar="BYTES",
        help="use the largest global batch whose compiled step fits this much memory per device, e.g. 2GiB",
    )


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    """Multi-host and checkpoint flags (jaxcnn.distributed, jaxcnn.checkpoint)."""
    g = parser.add_argument_group("multi-host (default: one process, or SLURM / Open MPI when launched there)")
    g.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address (env JAXCNN_COORDINATOR)")
    g.add_argument("--num-processes", type=int, help="processes in the run (env JAXCNN_NUM_PROCESSES)")
    g.add_argument("--process-id", type=int, help="this process, 0..N-1 (env JAXCNN_PROCESS_ID)")
    g.add_argument(
        "--local-devices", type=int_list,
        help="this process's GPUs, e.g. 3 for one process per GPU (default: all of the host's; under SLURM, the "
        "task's); on a CPU-only machine, that many simulated devices",
    )  # fmt: skip
    g.add_argument(
        "--heartbeat-timeout", type=int, default=ClusterConfig().heartbeat_timeout,
        help="seconds without a peer's heartbeat before the others stop (default %(default)s)",
    )  # fmt: skip
    g.add_argument(
        "--join-timeout", type=int, default=ClusterConfig().join_timeout,
        help="seconds process 0 waits for the others to join (default %(default)s)",
    )  # fmt: skip
    g = parser.add_argument_group("checkpoints")
    defaults_c = CheckpointConfig()
    g.add_argument("--checkpoint-dir", help="save Orbax checkpoints here (asynchronously)")
    g.add_argument(
        "--checkpoint-every",
        type=int,
        default=defaults_c.checkpoint_every,
        help="steps between checkpoints (default %(default)s)",
    )
    g.add_argument(
        "--keep-checkpoints",
        type=int,
        default=defaults_c.keep_checkpoints,
        help="keep the last K (default %(default)s)",
    )
    g.add_argument(
        "--resume", nargs="?", const=True, default=False, type=resume_mode, metavar="auto",
        help="continue the run --run-name names from the state a stop saved in its directory (or from the newest "
        "good checkpoint in --checkpoint-dir), with its flags as the defaults; '--resume auto': continue when there "
        "is a saved state, else start (a requeued job reruns its own command line)",
    )  # fmt: skip
    g.add_argument(
        "--init-from", metavar="FILE",
        help="start from the weights in this safetensors file, in torchvision's, timm's or jaxcnn's names "
        "(docs/pretrained-and-export.md); a resumed run continues its checkpoint instead",
    )  # fmt: skip
    g.add_argument(
        "--stop-signal", metavar="NAME", choices=STOP_SIGNALS,
        help="a signal that stops the run and saves, as SIGTERM and Ctrl-C do (e.g. USR1 for SLURM's --signal); "
        f"the run exits {STOPPED_EXIT_CODE} (Ctrl-C: {INTERRUPTED_EXIT_CODE}) and --resume continues it",
    )  # fmt: skip
    g.add_argument(
        "--skip-nonfinite",
        action="store_true",
        help="skip a step whose loss is NaN/inf instead of stopping the run (default: stop, naming the step)",
    )
