"""The flags the commands and experiment scripts share, and the wrapper that turns bad
input into one line.

Each flag is named for the config field it sets (jaxcnn.run_config: `--grad-accum` sets
`UpdateConfig.grad_accum`), so the flags become configs by name: `RunConfig.from_flags`
for a training run, `model_from_flags` for the scripts that need one part. Scripts stay
thin: they build a parser from these groups, turn the flags into configs, call the
library and write results.

This module imports nothing that starts JAX at import time (the helpers that need the
sharding, data or results modules import them when called), so a command line can parse
its flags -- and set the simulated device count -- before JAX is loaded.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

from jaxcnn.config import (
    BUNDLED_TEST,
    BUNDLED_TRAIN,
    CONV1X1_KERNELS,
    DEFAULT_MODEL,
    DTYPES,
    IMAGENET_STEM_FROM,
    LAYOUT_NAMES,
    LR_SCALINGS,
    MAX_POOL_KERNELS,
    NORMS,
    OPTIMIZERS,
    REMAT_NAMES,
    REMAT_POLICIES,
    RESNETS,
    SCHEDULES,
    STEMS,
    SYNC_MODES,
    ModelConfig,
    OptimConfig,
    TrainConfig,
)
from jaxcnn.errors import UserError
from jaxcnn.run_config import DEFAULT_SIMULATED_DEVICES, DataConfig, ParallelConfig, part_from_flags


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written, and every flag's default at the end of its help
    (argparse's ArgumentDefaultsHelpFormatter skips flags that have no help text)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS or "default" in text.lower():
            return text
        if action.required:
            return f"{text} (required)"
        if isinstance(action, argparse._StoreTrueAction):
            shown = "off"
        elif action.default is None or action.default == ():
            shown = "none"
        elif isinstance(action.default, tuple):
            shown = ",".join(":".join(map(str, v)) if isinstance(v, tuple) else str(v) for v in action.default)
        else:
            shown = str(action.default)
        return f"{text} (default: {shown.replace('%', '%%')})".lstrip()


class FlagParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr (exit 2), not usage + error, and
    --help shows every flag's default."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.add_argument(
            "--compile-cache", metavar="DIR|off",
            help="keep compiled programs here for later runs, or off (default: $JAXCNN_CACHE, else ~/.cache/jaxcnn)",
        )  # fmt: skip

    def parse_args(self, args=None, namespace=None):
        """The flags; every command's compiled programs then go to the --compile-cache."""
        parsed = super().parse_args(args, namespace)
        from jaxcnn import compile_cache  # imports JAX: only once the flags are known good

        compile_cache.enable(parsed.compile_cache)
        return parsed

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def name_list(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def batch_schedule(text: str) -> tuple[tuple[int, int], ...]:
    """'0:64,10:128' -> ((0, 64), (10, 128))."""
    try:
        pairs = [item.split(":") for item in text.split(",") if item.strip()]
        return tuple((int(epoch), int(batch)) for epoch, batch in pairs)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of EPOCH:BATCH pairs, e.g. 0:64,10:128") from None


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument(
        "--model", default=DEFAULT_MODEL,
        help=f"cnn2d_<N>layer_fullconnected_<M>layer or one of {', '.join(RESNETS)} (default %(default)s)",
    )  # fmt: skip
    g.add_argument(
        "--conv-features", type=int_list, default=(), help="conv widths (a ResNet's: per stage), e.g. 32,64,128"
    )
    g.add_argument(
        "--stem", choices=STEMS, default="auto",
        help="ResNets: small (3x3 conv) or imagenet (7x7 stride-2 conv + max-pool); auto: imagenet from "
        f"{IMAGENET_STEM_FROM} pixels a side (default %(default)s)",
    )  # fmt: skip
    g.add_argument("--dense-features", type=int_list, default=(), help="hidden dense widths, e.g. 256,128")
    g.add_argument(
        "--norm", choices=NORMS, default=ModelConfig().norm, help="normalisation after each conv (default %(default)s)"
    )
    g.add_argument("--dropout", type=float, default=0.0, help="dropout rate between dense layers")
    g.add_argument("--num-classes", type=int, default=10)
    g.add_argument(
        "--remat",
        choices=REMAT_POLICIES,
        default="none",
        help="recompute each conv block in the backward pass (jax.checkpoint): full keeps only its input, "
        "dots its conv outputs, names the activations in --remat-names",
    )
    g.add_argument(
        "--remat-names",
        type=name_list,
        default=ModelConfig().remat_names,
        help=f"with --remat names: activations to keep, some of {','.join(REMAT_NAMES)} (default %(default)s)",
    )
    g.add_argument(
        "--dtype", choices=DTYPES, default="float32", help="compute dtype; parameters and optimizer state stay float32"
    )
    g.add_argument(
        "--conv1x1", choices=CONV1X1_KERNELS, default="auto",
        help="ResNets' 1x1 convolutions as a matrix product (dot) or a convolution; auto: the platform's faster "
        "(jaxcnn.platform_choices); the numbers are the same",
    )  # fmt: skip
    g.add_argument(
        "--max-pool", choices=MAX_POOL_KERNELS, default="auto",
        help="the CNN's 2x2 max-pool: select (gradient to the winner chosen in the forward pass) or window "
        "(reduce_window); auto: the platform's faster; the numbers are the same",
    )  # fmt: skip


def add_data_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data")
    g.add_argument("--dataset", default="digits", help="digits (the CSVs below; default), fashion-mnist or mnist")
    g.add_argument("--data-dir", help="where --dataset's files are (default: the cache, then /usr/share/datasets)")
    g.add_argument(
        "--download", action="store_true",
        help="fetch --dataset's files from their canonical source into --data-dir or the cache when not found",
    )  # fmt: skip
    g.add_argument("--data", help="training CSV (label, pixel0..) or image folder (a subfolder per class); "
                   "default: the bundled digits")  # fmt: skip
    g.add_argument("--test-data", help="test CSV or image folder; a CSV without labels -> submission.csv; default: "
                   "the bundled digits' test file, or --val-split of your --data")  # fmt: skip
    g.add_argument("--val-split", type=float, default=0.1, help="held out of --data when it has no --test-data")
    g.add_argument("--image-size", metavar="HxW", help="resize folder images to this (default: they must match)")
    g.add_argument("--channels", type=int, default=1, help="channels per pixel: CSV columns (HWC), folder images' mode")
    g.add_argument("--synthetic", metavar="HxWxC", help="random images of this shape instead of the CSVs")
    g.add_argument("--synthetic-size", type=int, default=1024, help="training images in --synthetic mode")
    g.add_argument("--augment-shift", type=int, default=0, help="random shifts of up to N pixels (host side)")
    g.add_argument("--augment-flip", action="store_true", help="random horizontal flips (host side)")
    g.add_argument(
        "--input-workers", type=int,
        help="grain worker processes reading, decoding and augmenting batches; 0: one thread of the training process "
        "(default: 0 for data in memory, one per CPU core for an image folder)",
    )  # fmt: skip
    g.add_argument("--prefetch", type=int, default=2, help="batches prepared ahead of the step (default %(default)s)")


def add_mesh_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("parallelism")
    g.add_argument(
        "--layout", default="dp", help="single, dp, fsdp, tp, hybrid, spatial, pipeline (default %(default)s)"
    )
    g.add_argument("--layout-rules", help="your own rules table, e.g. batch=data,conv_out=model")
    g.add_argument("--mesh", help="mesh shape, e.g. data=4,model=2 (-1 fills the rest); default: the layout's")
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
        "--print-shardings",
        action="store_true",
        help="print every parameter's placement, the collectives XLA compiled and the lint's warnings",
    )


def add_train_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    defaults_t, defaults_o = TrainConfig(), OptimConfig()
    g.add_argument("--batch-size", type=int, default=defaults_t.batch_size, help="global batch per optimizer step")
    g.add_argument("--eval-batch-size", type=int, help="default: --batch-size")
    g.add_argument("--epochs", type=int, default=defaults_t.epochs)
    g.add_argument("--max-steps", type=int, help="stop after this many optimizer steps")
    g.add_argument("--seed", type=int, default=defaults_t.seed)
    g.add_argument("--optimizer", choices=OPTIMIZERS, default=defaults_o.name)
    g.add_argument("--learning-rate", "--lr", type=float, default=defaults_o.learning_rate, help="peak learning rate")
    g.add_argument("--schedule", choices=SCHEDULES, default=defaults_o.schedule)
    g.add_argument("--warmup-steps", type=int, default=defaults_o.warmup_steps)
    g.add_argument("--warmup-from", type=float, default=defaults_o.warmup_from, help="the rate the warmup starts at")
    g.add_argument("--weight-decay", type=float, default=defaults_o.weight_decay, help="adamw only")
    g.add_argument("--momentum", type=float, default=defaults_o.momentum, help="sgd only")
    g.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step, gradients summed")
    g.add_argument(
        "--sync",
        choices=SYNC_MODES,
        default="allreduce",
        help="allreduce: gradients averaged every step; local-sgd: each data-parallel replica steps alone",
    )
    g.add_argument("--sync-every", type=int, default=1, help="local-sgd: average the replicas every H steps")
    g.add_argument("--staleness", type=int, default=0, help="apply gradients taken on the parameters of T steps ago")
    g.add_argument(
        "--lr-scaling",
        choices=LR_SCALINGS,
        default="none",
        help="linear: lr x batch / --base-batch, warmup from lr (Goyal et al. 2017)",
    )
    g.add_argument("--base-batch", type=int, help="the batch size --lr was tuned for (with --lr-scaling linear)")
    g.add_argument(
        "--batch-schedule",
        type=batch_schedule,
        default=(),
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
    g = parser.add_argument_group("checkpoints")
    g.add_argument("--checkpoint-dir", help="save Orbax checkpoints here (asynchronously)")
    g.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints (default %(default)s)")
    g.add_argument("--keep-checkpoints", type=int, default=3, help="keep the last K (default %(default)s)")
    g.add_argument(
        "--resume", action="store_true",
        help="continue the run --run-name names from the state a Ctrl-C saved in its directory (or from the newest "
        "good checkpoint in --checkpoint-dir), with its flags as the defaults",
    )  # fmt: skip
    g.add_argument(
        "--skip-nonfinite",
        action="store_true",
        help="skip a step whose loss is NaN/inf instead of stopping the run (default: stop, naming the step)",
    )


def experiment_parser(prog: str, doc: str | None) -> FlagParser:
    """An experiment script's parser: its docstring, as written, as the description."""
    return FlagParser(prog=prog, description=doc)


def add_output_flags(group, out: str | None = None, plot: str | None = None, out_help: str | None = None) -> None:
    """--out (the CSV; None: print only) and, where the script draws one, --plot (the PNG)."""
    group.add_argument("--out", default=out, help=out_help)
    if plot is not None:
        group.add_argument("--plot", default=plot)


def add_dataset_flags(group, test_help: str | None = None) -> None:
    """--data and --test-data, for scripts that train on the CSVs and nothing else."""
    group.add_argument("--data", default=str(BUNDLED_TRAIN), help="default: the bundled digits")
    group.add_argument("--test-data", default=str(BUNDLED_TEST), help=test_help)


def add_layout_flags(group, layout: str = "single", mesh: str | None = None, mesh_help="default: the layout's") -> None:
    """--layout and --mesh: one layout on one mesh."""
    group.add_argument("--layout", default=layout)
    group.add_argument("--mesh", default=mesh, help=mesh_help)


def add_layouts_flag(group, default: str | None = None, help: str = "comma-separated") -> None:
    """--layouts, a comma-separated list (default None: every named layout but `single`)."""
    every = ",".join(n for n in LAYOUT_NAMES if n != "single")
    group.add_argument("--layouts", default=every if default is None else default, help=help)


def add_devices_flag(group, default=DEFAULT_SIMULATED_DEVICES, help: str | None = None, type=int) -> None:
    group.add_argument("--devices", type=type, default=default, help=help)


def layouts_from_flag(text: str, skip: tuple[str, ...] = ()) -> list:
    """The layouts a --layouts list names (an unknown name fails, naming the known ones)."""
    from jaxcnn.sharding import get_layout

    return [get_layout(name) for name in name_list(text) if name not in skip]


def some_of(text: str, known, flag: str) -> list[str]:
    """The names of a comma-separated list, each one of `known` (else a UserError)."""
    names = list(name_list(text))
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise UserError(f"unknown {flag} {', '.join(unknown) or '(none)'}; use some of {', '.join(known)}")
    return names


def writable_outputs(*paths) -> list[Path | None]:
    """The output paths as Paths (None stays None), each directory made and proven writable
    up front: a bad --out fails before any compile."""
    from jaxcnn.results import ensure_writable_dir

    paths = [Path(path) if path else None for path in paths]
    for path in filter(None, paths):
        ensure_writable_dir(path.parent, "--out")
    return paths


def data_from_flags(args, num_classes: int):
    """(image shape, the training set in memory: --dataset's, or --data's CSV or image folder);
    with --synthetic, (its shape, None)."""
    from jaxcnn.data import load_datasets, parse_image_shape

    data = part_from_flags(DataConfig, vars(args))
    if data.synthetic:
        return parse_image_shape(data.synthetic), None
    train_set, _ = load_datasets(data, num_classes, with_test=False)
    return train_set.image_shape, train_set.loaded()


def mesh_from_flags(args) -> tuple:
    """(layout, mesh) as --layout, --layout-rules, --mesh and --host-devices name them
    (jaxcnn.sharding.mesh_for), CPU devices simulated first where there is no accelerator.
    Bad input fails here, before any compile."""
    from jaxcnn.sharding import mesh_for, simulate_devices_for

    parallel = part_from_flags(ParallelConfig, vars(args))
    simulate_devices_for(parallel)
    return mesh_for(parallel)


def model_from_flags(args) -> ModelConfig:
    """The model the scripts' --model flags name (a training run's: RunConfig.from_flags)."""
    return part_from_flags(ModelConfig, vars(args), "model")


@contextlib.contextmanager
def user_errors(prog: str) -> Iterator[None]:
    """Print a UserError as `prog: error: ...` on one line and exit 2; warnings as one line each."""

    def one_line_warning(message, category, filename, lineno, file=None, line=None):
        print(f"{prog}: warning: {message}", file=sys.stderr)

    previous = warnings.showwarning
    warnings.showwarning = one_line_warning
    try:
        yield
    except UserError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(130)
    finally:
        warnings.showwarning = previous


def run_main(prog: str, main: Callable[[], None]) -> None:
    with user_errors(prog):
        main()
