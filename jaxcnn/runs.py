"""The run directory: everything one training run leaves behind, in one place.

    runs/<name>/
      config.json        the run's RunConfig: what `predict`, `evaluate` and `--resume` read
      <name>.json, .csv  the result record and one row per epoch (jaxcnn.results)
      model/             the trained model, parameters and statistics (jaxcnn.saved_model)
      curves.png         loss and accuracy, per step and per epoch
      tensorboard/       event files: loss, accuracy, images/s, input stall, learning rate
      checkpoints/       the training state a Ctrl-C saved (what `--resume` continues)
      submission.csv     predictions for a label-free test file

A run directory is never overwritten: a run whose directory exists is refused unless it
says `--overwrite` (the old one is replaced) or `--resume` (it is continued).
"""

from __future__ import annotations

import json
import shlex
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tensorboardX import SummaryWriter

from jaxcnn.errors import UserError
from jaxcnn.results import write_json
from jaxcnn.run_config import RunConfig, check_run_name

CONFIG = "config.json"
MODEL = "model"
CHECKPOINTS = "checkpoints"
CURVES = "curves.png"
TENSORBOARD = "tensorboard"
SUBMISSION = "submission.csv"


def check_run_dir(path: Path, *, overwrite: bool, resume: bool, must_exist: bool = False) -> None:
    """Refuse what would clobber a run or resume nothing (a UserError naming what to do)."""
    if resume:
        if must_exist and not path.is_dir():
            raise UserError(f"nothing to resume: no run directory {path}; check --run-name and --results-dir")
        if (path / MODEL).exists():
            raise UserError(
                f"run {path} has finished (its model is in {path / MODEL}); nothing to resume: "
                "start a new --run-name (with --checkpoint-dir and --resume to train on from its checkpoints)"
            )
    elif path.exists():
        if not overwrite:
            raise UserError(
                f"run directory {path} already exists; pass another --run-name, --overwrite to replace it, "
                "or --resume to continue it"
            )
        if not (path / CONFIG).is_file():
            raise UserError(f"{path} exists and is not a run directory (no {CONFIG}); pick another --run-name")


def prepare_run_dir(
    results_dir: str | Path, name: str, *, overwrite: bool, resume: bool, must_exist: bool = False, create: bool = True
) -> Path:
    """The run's directory, made empty -- or, to `resume`, the existing one (`must_exist`:
    it is where the state to resume is). An existing directory is refused unless
    `overwrite` (then replaced: it must be a run directory). `create` False: the path only
    (the processes of a multi-host run but the first, which checked it with `check_run_dir`
    before the first process made it)."""
    path = Path(results_dir) / check_run_name(name)
    if not create:  # the first process creates it (and may have already)
        return path
    check_run_dir(path, overwrite=overwrite, resume=resume, must_exist=must_exist)
    if path.exists() and not resume:  # --overwrite: the old run waits aside until the new one has finished
        if _aside(path).is_dir() and not (path / MODEL).exists():
            shutil.rmtree(path)  # an earlier --overwrite never finished: what it replaces is still aside
        else:
            shutil.rmtree(_aside(path), ignore_errors=True)
            path.rename(_aside(path))
    path.mkdir(parents=True, exist_ok=True)
    return path


def _aside(path: Path) -> Path:
    return path.with_name(f".{path.name}.replaced")


def finish_overwrite(path: Path) -> None:
    """The new run has finished (or stopped with its state saved): the run it replaces goes."""
    shutil.rmtree(_aside(path), ignore_errors=True)


def undo_overwrite(path: Path) -> None:
    """The new run failed: the run it was to replace comes back in its place."""
    if _aside(path).is_dir():
        shutil.rmtree(path, ignore_errors=True)
        _aside(path).rename(path)


def write_config(run_dir: Path, config: RunConfig) -> Path:
    """The run's whole config: `--resume` and the commands read it back. How it was launched
    (coordinator, processes, devices) belongs to each launch, not to the run: left out, so
    a resumed run -- on new nodes, another process count -- takes its own."""
    return write_json(run_dir / CONFIG, {part: v for part, v in config.to_json().items() if part != "cluster"})


def read_config(run_dir: Path) -> RunConfig:
    try:
        saved = json.loads((run_dir / CONFIG).read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"cannot read {run_dir / CONFIG} ({err}); is {run_dir} a run directory?") from None
    return RunConfig.from_json(saved)


@dataclass
class Run:
    """A finished run, as `predict` and `evaluate` read it."""

    directory: Path
    config: RunConfig  # the training run's (config.json)
    record: dict  # its result JSON

    @property
    def name(self) -> str:
        return self.directory.name

    @property
    def model_dir(self) -> Path:
        return self.directory / MODEL


def open_run(path: str | Path) -> Run:
    """The run in `path` (a directory `jaxcnn train` wrote), checked to hold a trained model."""
    directory = Path(path).resolve()  # `--run .` is named by the directory's own name
    if not directory.is_dir():
        raise UserError(f"run directory {path} not found; pass --run runs/<name>, a directory `jaxcnn train` wrote")
    if not (directory / CONFIG).is_file():
        raise UserError(f"{path} is not a run directory (no {CONFIG}); pass one `jaxcnn train` wrote")
    config = read_config(directory)
    if not (directory / MODEL).is_dir():
        if any(p.name.isdigit() for p in (directory / CHECKPOINTS).glob("*")):
            again = shlex.join(["jaxcnn", "train", "--resume", "--run-name", directory.name, "--results-dir",
                                str(directory.parent)])  # fmt: skip
            raise UserError(f"run {directory} has no trained model: it did not finish; continue it with `{again}`")
        raise UserError(
            f"run {directory} has no trained model: it stopped before finishing and saved no state to continue "
            "from; train it again (--overwrite)"
        )
    # <run name>.json; any other name when the directory was copied or renamed
    found = [directory / f"{directory.name}.json", *sorted(p for p in directory.glob("*.json") if p.name != CONFIG)]
    record_path = next((p for p in found if p.is_file()), found[0])
    try:
        record = json.loads(record_path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"cannot read the run's result {record_path} ({err})") from None
    return Run(directory, config, record)


class TensorBoardLog:
    """A run's TensorBoard event files (tensorboardX): the loss and learning rate of every
    step; accuracy, test figures, images/s and input stall of every epoch."""

    def __init__(self, directory: Path, learning_rates: Callable[[np.ndarray], np.ndarray]):
        self.writer = SummaryWriter(str(directory), flush_secs=30)
        self.learning_rates = learning_rates  # optim.learning_rates: step (0-based) -> rate

    def epoch(self, row: dict, losses: list[float]) -> None:
        first = row["step"] - len(losses)
        rates = self.learning_rates(np.arange(first, row["step"]))
        for step, loss, rate in zip(range(first + 1, row["step"] + 1), losses, rates, strict=True):
            self.writer.add_scalar("train/loss", loss, step)
            self.writer.add_scalar("train/learning_rate", rate, step)
        step = row["step"]
        self.writer.add_scalar("train/accuracy", row["train_accuracy"], step)
        if row["test_accuracy"] is not None:
            self.writer.add_scalar("test/accuracy", row["test_accuracy"], step)
            self.writer.add_scalar("test/loss", row["test_loss"], step)
        self.writer.add_scalar("speed/images_per_second", row["images_per_second"], step)
        self.writer.add_scalar("speed/input_wait_fraction", row["input_wait_fraction"], step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
