"""Flags shared by the experiment scripts, and the wrapper that turns bad input into one line.

Scripts stay thin: they build a parser from these groups, turn the flags into configs
with the `*_from_flags` helpers, call the library and write results.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator

from jaxcnn.config import DEFAULT_MODEL, NORMS, OPTIMIZERS, SCHEDULES, ModelConfig, OptimConfig, TrainConfig
from jaxcnn.errors import UserError

DEFAULT_SIMULATED_DEVICES = 8


class FlagParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr (exit 2), not usage + error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--model", default=DEFAULT_MODEL, help="cnn2d_<N>layer_fullconnected_<M>layer (default %(default)s)")
    g.add_argument("--conv-features", type=int_list, default=(), help="conv widths, e.g. 32,64,128")
    g.add_argument("--dense-features", type=int_list, default=(), help="hidden dense widths, e.g. 256,128")
    g.add_argument(
        "--norm", choices=NORMS, default=ModelConfig().norm, help="normalisation after each conv (default %(default)s)"
    )
    g.add_argument("--dropout", type=float, default=0.0, help="dropout rate between dense layers")
    g.add_argument("--num-classes", type=int, default=10)


def add_data_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data")
    g.add_argument("--data", default="data/train.csv", help="training CSV (label, pixel0..)")
    g.add_argument("--test-data", default="data/test.csv", help="test CSV; without labels -> submission.csv")
    g.add_argument("--channels", type=int, default=1, help="channels per pixel in the CSV (pixels are HWC)")
    g.add_argument("--synthetic", metavar="HxWxC", help="random images of this shape instead of the CSVs")
    g.add_argument("--synthetic-size", type=int, default=1024, help="training images in --synthetic mode")


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
        help="pipeline: first layer of each stage after the first, e.g. 2,4 (default: balanced by FLOPs)",
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
    g.add_argument("--lr", type=float, default=defaults_o.learning_rate, help="peak learning rate")
    g.add_argument("--schedule", choices=SCHEDULES, default=defaults_o.schedule)
    g.add_argument("--warmup-steps", type=int, default=defaults_o.warmup_steps)
    g.add_argument("--weight-decay", type=float, default=defaults_o.weight_decay, help="adamw only")
    g.add_argument("--momentum", type=float, default=defaults_o.momentum, help="sgd only")


def model_from_flags(args) -> ModelConfig:
    return ModelConfig(
        name=args.model,
        conv_features=args.conv_features,
        dense_features=args.dense_features,
        norm=args.norm,
        dropout=args.dropout,
        num_classes=args.num_classes,
    )


def optim_from_flags(args) -> OptimConfig:
    return OptimConfig(
        name=args.optimizer,
        learning_rate=args.lr,
        schedule=args.schedule,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        momentum=args.momentum,
    )


def train_from_flags(args) -> TrainConfig:
    return TrainConfig(
        batch_size=args.batch_size,
        epochs=args.epochs,
        max_steps=args.max_steps,
        seed=args.seed,
        eval_batch_size=args.eval_batch_size,
    )


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
