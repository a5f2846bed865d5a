"""What `fit` hands back: the state and what the run recorded and measured (`FitResult`),
or, for a stop, the same inside `Interrupted`."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

from jaxcnn.config import DIVERGENCE_FACTOR
from jaxcnn.fit.clock import Clock
from jaxcnn.fit.evaluation import Evaluation
from jaxcnn.fit.history import History


@dataclass
class FitResult:
    state: object
    loss_history: list[float]  # training loss of every optimizer step
    epochs: list[dict]  # one row per epoch: the per-epoch CSV's columns (results.EPOCH_COLUMNS)
    steps: int
    train_seconds: float  # training loop only (no compile, no eval)
    images_per_second: float | None  # steady state: the first step (warm-up) excluded; None: no step ran
    input_wait_fraction: float | None  # share of train_seconds the devices idled for input; None: no step ran
    final_eval: Evaluation | None = None
    extra: dict = field(default_factory=dict)


class Interrupted(Exception):
    """A stop (Ctrl-C, SIGTERM): the run stopped between two steps. `result` is what it had
    done (no final evaluation); `saved_to` the checkpoint directories its state was saved in."""

    def __init__(self, result: FitResult, saved_to: list):
        super().__init__(f"interrupted at step {result.steps}")
        self.result, self.saved_to = result, saved_to


def diverged_at(losses: list[float], factor: float = DIVERGENCE_FACTOR) -> int | None:
    """The first step (1-based) whose finite training loss exceeds `factor` x step 1's loss;
    None if none. (Non-finite losses stop the run or, with --skip-nonfinite, are skipped.)"""
    if not losses or not (math.isfinite(losses[0]) and losses[0] > 0):
        return None
    return next((k for k, v in enumerate(losses, 1) if math.isfinite(v) and v > factor * losses[0]), None)


def fit_result(state, history: History, clock: Clock, final_eval: Evaluation | None, extra: dict) -> FitResult:
    """The run's result (a warning where its loss diverged); `extra`: more for its record."""
    images_per_second, wait_fraction = clock.throughput()
    losses = history.losses
    diverged = diverged_at(losses)
    if diverged is not None:
        warnings.warn(
            f"training diverged: the loss first exceeded {DIVERGENCE_FACTOR:g}x step 1's ({losses[0]:.4g}) at "
            f"step {diverged} ({losses[diverged - 1]:.4g}) and ends at {losses[-1]:.4g}; lower --lr",
            stacklevel=3,
        )
    return FitResult(
        state=state,
        loss_history=losses,
        epochs=history.rows,
        steps=history.step,
        train_seconds=clock.train_seconds,
        images_per_second=images_per_second,
        input_wait_fraction=wait_fraction,
        final_eval=final_eval,
        extra={
            "skipped_steps": history.skipped,
            "resumed_from_step": history.resumed_from or None,
            "diverged_at_step": diverged,
            **extra,
            "first_step_seconds": clock.first_step_seconds if clock.images else None,
            "first_step_finished": clock.first_step_finished,
        },
    )
