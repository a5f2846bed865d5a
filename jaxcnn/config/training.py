"""The training run's sizes: TrainConfig (batch, epochs, steps, seed, the batch schedule, steps
per call), the steps each epoch runs, the bundled data a run defaults to, and byte sizes read
from text. Frozen and validated where it is built."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

from jaxcnn.errors import UserError

# The bundled digits, found from the package so that the defaults work from any directory.
BUNDLED_TRAIN, BUNDLED_TEST = (
    Path(__file__).resolve().parents[2] / "data" / name for name in ("train.csv", "test.csv")
)
DIVERGENCE_FACTOR = 10.0  # a training loss above this many times step 1's counts as diverged (fit warns)

LR_SCALINGS = ("none", "linear")


@dataclass(frozen=True)
class TrainConfig:
    batch_size: int = 64  # global, per optimizer step
    epochs: int = 30
    max_steps: int | None = None  # stop early after this many optimizer steps
    seed: int = 0
    eval_batch_size: int | None = None  # default: batch_size
    # (first epoch, global batch) pairs, from epoch 0: the batch grows during training and
    # the learning rate with it (jaxcnn.optim.optim_for_batch). Overrides batch_size.
    batch_schedule: tuple[tuple[int, int], ...] = ()
    lr_scaling: str = "none"  # "linear": lr x batch / base_batch, warmup from lr (Goyal et al. 2017)
    base_batch: int | None = None  # the batch the base learning rate was tuned for
    auto_batch: str | None = None  # "2GiB": the largest batch whose compiled step fits this per device
    steps_per_call: int = 1  # optimizer steps per compiled call (docs/performance-and-gpu.md: when K > 1 pays)

    def __post_init__(self):
        if not isinstance(self.steps_per_call, int) or self.steps_per_call < 1:
            raise UserError(f"--steps-per-call must be a positive integer, got {self.steps_per_call!r}")
        if self.batch_schedule:
            epochs = [e for e, _ in self.batch_schedule]
            if epochs[0] != 0 or any(b <= a for a, b in itertools.pairwise(epochs)):
                raise UserError("--batch-schedule must start at epoch 0 with increasing epochs, e.g. 0:64,10:128")
            if min(b for _, b in self.batch_schedule) < 1:
                raise UserError("--batch-schedule batches must be positive integers")
            object.__setattr__(self, "batch_size", self.batch_schedule[0][1])
        if self.lr_scaling not in LR_SCALINGS:
            raise UserError(f"unknown --lr-scaling {self.lr_scaling!r}; use one of {', '.join(LR_SCALINGS)}")
        if self.lr_scaling == "linear" and not self.base_batch:
            raise UserError("--lr-scaling linear needs --base-batch B0: the batch size --lr was tuned for")
        if self.base_batch is not None and self.base_batch < 1:
            raise UserError(f"--base-batch must be a positive integer, got {self.base_batch}")
        if self.auto_batch is not None:
            parse_bytes(self.auto_batch)
            if self.batch_schedule:
                raise UserError("--auto-batch picks one batch size; drop it or --batch-schedule")
        if self.batch_size < 1:
            raise UserError(f"--batch-size must be a positive integer, got {self.batch_size}")
        if self.epochs < 1:
            raise UserError(f"--epochs must be a positive integer, got {self.epochs}")
        if self.max_steps is not None and self.max_steps < 1:
            raise UserError(f"--max-steps must be a positive integer, got {self.max_steps}")

    def batch_for_epoch(self, epoch: int) -> int:
        return max(((e, b) for e, b in self.batch_schedule if e <= epoch), default=(0, self.batch_size))[1]

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """Every global batch the run uses, in order (one compiled program each)."""
        return tuple(dict.fromkeys(b for _, b in self.batch_schedule)) or (self.batch_size,)

    @property
    def auto_batch_bytes(self) -> float | None:
        return parse_bytes(self.auto_batch) if self.auto_batch else None


def epoch_steps(train_size: int, config: TrainConfig) -> list[int]:
    """Optimizer steps in each epoch that runs (a batch schedule changes them; `max_steps` cuts them)."""
    steps, left = [], config.max_steps
    for epoch in range(config.epochs):
        batch = config.batch_for_epoch(epoch)
        per_epoch = train_size // batch
        if per_epoch == 0:
            raise UserError(
                f"--batch-size {batch} is larger than the {train_size} training images; use a smaller batch"
            )
        if left is not None:
            per_epoch = min(per_epoch, left)
            left -= per_epoch
        if per_epoch == 0:
            break
        steps.append(per_epoch)
    return steps


def total_steps(train_size: int, config: TrainConfig) -> int:
    return sum(epoch_steps(train_size, config))


def parse_bytes(text: str) -> float:
    """'16GiB', '512MiB', '80GB', '1e9' -> bytes."""
    units = {
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "tib": 2**40,
        "kb": 1e3,
        "mb": 1e6,
        "gb": 1e9,
        "tb": 1e12,
        "b": 1,
    }
    clean = text.strip().lower().replace(" ", "")
    unit = next((u for u in units if clean.endswith(u)), None)
    number, factor = (clean[: -len(unit)], units[unit]) if unit else (clean, 1)
    try:
        value = float(number) * factor
    except ValueError:
        raise UserError(f"cannot read {text!r} as a size; write e.g. 16GiB, 512MiB or 80GB") from None
    if value <= 0:
        raise UserError(f"a memory budget must be positive, got {text!r}")
    return value
