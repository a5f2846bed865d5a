"""The parser every command and experiment script uses, the small flags they share, flags
-> configs, and the wrapper that turns bad input into one line.

A training run's flags (jaxcnn.commands.run_flags) are each named for the config field they
set, so the flags become configs by name: `RunConfig.from_flags` for a training run,
`model_from_flags` for the scripts that need one part. Scripts stay thin: they build a
parser, turn the flags into configs, call the library and write results.

This module imports nothing that starts JAX at import time (the helpers that need the
sharding, data or results modules import them when called), so a command line can parse
its flags -- and set the simulated device count -- before JAX is loaded.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

from jaxcnn.config import (
    BUNDLED_TEST,
    BUNDLED_TRAIN,
    LAYOUT_NAMES,
    ModelConfig,
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


def positive_int_or(word: str) -> Callable[[str], int | str]:
    """A flag type taking a positive integer or `word` (--batch fill)."""

    def parse(text: str) -> int | str:
        if text.strip().lower() == word.lower():
            return word
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"must be a positive integer or {word}, got {text!r}")
        return value

    return parse


def batch_schedule(text: str) -> tuple[tuple[int, int], ...]:
    """'0:64,10:128' -> ((0, 64), (10, 128))."""
    try:
        pairs = [item.split(":") for item in text.split(",") if item.strip()]
        return tuple((int(epoch), int(batch)) for epoch, batch in pairs)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of EPOCH:BATCH pairs, e.g. 0:64,10:128") from None


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
        _exit_now_if_in_a_multi_process_run(2)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(130)
    finally:
        warnings.showwarning = previous


def _exit_now_if_in_a_multi_process_run(code: int) -> None:
    """A process of a multi-process run that fails alone leaves at once: exiting normally it
    would wait in JAX's shutdown barrier for peers that wait in a collective for it (up to
    5 minutes); gone, its dropped connection fails theirs."""
    if "jax" not in sys.modules:  # JAX never started: nothing joined
        return
    from jax._src import distributed

    if distributed.global_state.client is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_main(prog: str, main: Callable[[], None]) -> None:
    with user_errors(prog):
        main()
