"""The fit loop: train for the planned steps, evaluate after every epoch, checkpoint,
record what happened.

    programs = build_programs(...)                     # jaxcnn.build: one per batch size
    state = programs[batch].init()
    result = fit(programs, state, Loader(train_set), test_set, train_config)

Batches come from the data package's `Loader` (a grain pipeline over the whole run: order,
read, augment, prefetch); the loop places them, steps, collects metrics and keeps the books.
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from dataclasses import dataclass, field

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxcnn.checkpoint import state_fingerprint
from jaxcnn.config import DIVERGENCE_FACTOR, TrainConfig, epoch_steps
from jaxcnn.data import Batches, Dataset, Loader, Schedule, eval_batches, to_global
from jaxcnn.errors import UserError
from jaxcnn.program import Program


@dataclass
class Evaluation:
    loss: float | None  # None when the data has no labels
    accuracy: float | None
    predictions: np.ndarray


def evaluate(program: Program, state, dataset: Dataset) -> Evaluation:
    loss_sum = correct_sum = 0.0
    predictions = []
    for batch in eval_batches(dataset, program.eval_batch_size):
        arrays = [to_global(a, s) for a, s in zip(batch, program.eval_shardings, strict=True)]
        loss, correct, predicted = program.eval_step(state, *arrays)
        loss_sum, correct_sum = loss_sum + float(loss), correct_sum + float(correct)
        predictions.append(np.asarray(predicted)[batch[2] > 0])
    predictions = np.concatenate(predictions)
    if dataset.labels is None:
        return Evaluation(None, None, predictions)
    return Evaluation(loss_sum / len(dataset), correct_sum / len(dataset), predictions)


@dataclass
class FitResult:
    state: object
    loss_history: list[float]  # training loss of every optimizer step
    epochs: list[dict]  # one row per epoch: the DESIGN's CSV columns
    steps: int
    train_seconds: float  # training loop only (no compile, no eval)
    images_per_second: float | None  # steady state: the first step (warm-up) excluded; None: no step ran
    input_wait_fraction: float | None  # share of train_seconds the devices idled for input; None: no step ran
    final_eval: Evaluation | None = None
    extra: dict = field(default_factory=dict)


def diverged_at(losses: list[float], factor: float = DIVERGENCE_FACTOR) -> int | None:
    """The first step (1-based) whose finite training loss exceeds `factor` x step 1's loss;
    None if none. (Non-finite losses stop the run or, with --skip-nonfinite, are skipped.)"""
    if not losses or not (math.isfinite(losses[0]) and losses[0] > 0):
        return None
    return next((k for k, v in enumerate(losses, 1) if math.isfinite(v) and v > factor * losses[0]), None)


class NonFiniteLoss(UserError):
    """The training loss became NaN or infinite (the run stops; checkpoints stay good)."""


@dataclass
class Resume:
    """Where a restored run continues: its step and what it had recorded so far."""

    step: int
    loss_history: list[float]
    accuracy_history: list[float]
    epochs: list[dict]
    skipped_steps: int = 0
    loader: dict | None = None  # the loader's position (Batches.position); None: from the step

    @classmethod
    def from_record(cls, record: dict) -> Resume:
        return cls(
            record["step"], record["loss_history"], record["accuracy_history"], record["epochs"],
            record.get("skipped_steps", 0), record.get("loader"),
        )  # fmt: skip

    def rows(self, plan: list[int], config: TrainConfig) -> list[dict]:
        """The epoch rows of a restored run, one for every epoch it had finished. Checkpoints
        saved at an epoch's last step by jaxcnn before the fix of issue 15 lack that epoch's
        row: it is rebuilt from the loss and accuracy histories (test figures and timings,
        which cannot be rebuilt, are None)."""
        rows, recorded, first = [], {r["epoch"]: r for r in self.epochs}, 0
        for epoch, count in enumerate(plan):
            if first + count > self.step:
                break
            rows.append(recorded.get(epoch + 1) or {
                "epoch": epoch + 1, "step": first + count, "global_batch_size": config.batch_for_epoch(epoch),
                "train_loss": float(np.mean(self.loss_history[first : first + count])),
                "train_accuracy": float(np.mean(self.accuracy_history[first : first + count])),
                "test_loss": None, "test_accuracy": None, "epoch_seconds": None, "images_per_second": None,
                "input_wait_fraction": None,
            })  # fmt: skip
            first += count
        return rows


def fit(
    programs: Program | dict[int, Program],
    state,
    train: Loader | Dataset,
    test_set: Dataset | None,
    config: TrainConfig,
    *,
    progress: bool = True,
    checkpointer=None,
    resume: Resume | None = None,
    skip_nonfinite: bool = False,
) -> FitResult:
    """Train for the planned steps, evaluating on `test_set` after every epoch.

    `programs` maps each global batch of `config.batch_sizes` to its program (one compile
    per size); a single program is a run of one batch size. `train` is a Loader, or a
    Dataset to load with the Loader's defaults. With a `checkpointer` (jaxcnn.checkpoint)
    the state is saved every N steps and at the end; `resume` continues a restored run at
    its step, on the same data position. A non-finite loss stops the run (NonFiniteLoss,
    naming the step) before anything non-finite is saved -- unless `skip_nonfinite`,
    where the compiled step has already skipped it.
    """
    if not isinstance(programs, dict):
        programs = {programs.batch_size: programs}
    loader = train if isinstance(train, Loader) else Loader(train)
    plan = epoch_steps(len(loader), config)
    books = _Books(resume or Resume(0, [], [], []), plan, config, checkpointer, skip_nonfinite)
    interactive = sys.stderr.isatty()  # in a log, a line every 10 s rather than a redraw per step
    bar = tqdm(
        total=sum(plan), initial=books.step, unit="step", disable=not progress,
        mininterval=0.1 if interactive else 10, leave=interactive,
    )  # fmt: skip
    feeds = {size: program.feed for size, program in programs.items()}
    steps = Schedule(plan, [feeds[config.batch_for_epoch(epoch)] for epoch in range(len(plan))])
    batches = loader.batches(steps, config.seed, _loader_position(resume))
    result = None
    first_in_epoch = 0
    try:
        for epoch, count in enumerate(plan):
            first_in_epoch += plan[epoch - 1] if epoch else 0
            if first_in_epoch + count <= books.step:
                continue  # finished before the checkpoint this run resumed from
            program = programs[config.batch_for_epoch(epoch)]
            state, row = _train_epoch(program, state, batches, books, epoch, first_in_epoch, count, bar)
            result = evaluate(program, state, test_set) if test_set is not None else None
            row["test_loss"], row["test_accuracy"] = (result.loss, result.accuracy) if result else (None, None)
            books.rows.append(row)
            if checkpointer is not None and (checkpointer.due(books.step) or books.step == sum(plan)):
                books.save(
                    state, batches
                )  # at an epoch's end: after its row, so a resumed run's results hold every epoch
            postfix = {"epoch": epoch + 1, "loss": f"{row['train_loss']:.4f}"}
            if row["test_accuracy"] is not None:
                postfix["test_acc"] = f"{row['test_accuracy']:.4f}"
            bar.set_postfix(postfix)
    finally:
        batches.close()
    books.input_startup_seconds = batches.startup_seconds
    bar.close()
    if result is None and test_set is not None:  # resumed at the very end: nothing left to train
        result = evaluate(programs[config.batch_for_epoch(len(plan) - 1)], state, test_set)
    return books.result(state, result)


def _loader_position(resume: Resume | None) -> dict | None:
    """Where a restored run's loader continues: the position its checkpoint saved (from the
    step, for checkpoints made before the loader saved one)."""
    if resume is None:
        return None
    position = resume.loader or {"next_step": resume.step}
    if position["next_step"] != resume.step:
        raise UserError(
            f"the checkpoint's loader stands at step {position['next_step']} but its state at step {resume.step}; "
            "the checkpoint is inconsistent: resume from an earlier one"
        )
    return position


def _train_epoch(program: Program, state, batches: Batches, books: _Books, epoch: int, first: int, count: int, bar):
    """Run epoch `epoch`'s steps from where `books` stands; (new state, the epoch's row)."""
    batch, total = program.batch_size, sum(books.plan)
    todo = first + count - books.step
    pending = []
    start = time.perf_counter()
    for _ in range(todo):
        images, labels = program.place_rows(*batches.next())
        state, step_metrics = program.train_step(state, images, labels)
        if program.sync_every and ((books.step + 1) % program.sync_every == 0 or books.step + 1 == total):
            state = program.average_step(state)  # local SGD: replicas meet (and at the end)
        batches.dispatched(step_metrics["loss"])
        pending.append(step_metrics)
        if books.images_seen == 0:  # one-off costs: keep them out of steady state
            jax.block_until_ready(state)
            books.first_step_seconds = time.perf_counter() - start
        books.step += 1
        books.images_seen += batch
        bar.update(1)
        if books.checkpointer is not None and books.checkpointer.due(books.step) and books.step < first + count:
            books.collect(pending)  # never save a state that followed a non-finite loss
            books.save(state, batches)
    jax.block_until_ready(state)
    seconds = time.perf_counter() - start
    stall = batches.take_stall_seconds()
    books.train_seconds += seconds
    books.stall_seconds += stall
    books.collect(pending)
    return state, {
        "epoch": epoch + 1,
        "step": books.step,
        "global_batch_size": batch,
        "train_loss": float(np.mean(books.losses[first : first + count])),
        "train_accuracy": float(np.mean(books.accuracies[first : first + count])),
        "test_loss": None,
        "test_accuracy": None,
        "epoch_seconds": seconds,
        "images_per_second": todo * batch / seconds,
        "input_wait_fraction": stall / seconds,
    }


class _Books:
    """What the loop records: histories, epoch rows, timings, checkpoints saved."""

    def __init__(self, resume: Resume, plan: list[int], config: TrainConfig, checkpointer, skip_nonfinite: bool):
        self.plan, self.config, self.checkpointer, self.skip_nonfinite = plan, config, checkpointer, skip_nonfinite
        self.resumed_from = resume.step
        self.losses, self.accuracies = list(resume.loss_history), list(resume.accuracy_history)
        self.rows = resume.rows(plan, config)
        self.skipped, self.step, self.saved_at = resume.skipped_steps, resume.step, resume.step
        self.images_seen = 0
        self.train_seconds = self.stall_seconds = self.first_step_seconds = 0.0
        self.input_startup_seconds = None
        self.fingerprint = None

    def collect(self, metrics: list) -> None:
        """Move pending step metrics to the host and check them (a sync point)."""
        start = len(self.losses)
        for m in jax.device_get(metrics):
            self.losses.append(float(m["loss"]))
            self.accuracies.append(float(m["accuracy"]))
            self.skipped += int(m.get("skipped", 0))
        metrics.clear()
        bad = [k for k, v in enumerate(self.losses[start:], start + 1) if not math.isfinite(v)]
        if bad and not self.skip_nonfinite:
            where = ""
            if self.checkpointer is not None:
                where = (
                    f"; the last good checkpoint is step {self.saved_at} in {self.checkpointer.directory}"
                    if self.saved_at
                    else "; no checkpoint was saved before it"
                )
            raise NonFiniteLoss(
                f"training loss is {self.losses[bad[0] - 1]} at step {bad[0]}; stopped{where}. "
                "Lower --lr, or pass --skip-nonfinite to skip such steps"
            )

    def save(self, state, batches: Batches) -> None:
        self.fingerprint = self.fingerprint or state_fingerprint(state)
        record = {
            "step": self.step, "loss_history": self.losses, "accuracy_history": self.accuracies, "epochs": self.rows,
            "skipped_steps": self.skipped, "fingerprint": self.fingerprint, "loader": batches.position(),
        }  # fmt: skip
        self.checkpointer.save(self.step, state, record)
        self.saved_at = self.step

    def result(self, state, final_eval: Evaluation | None) -> FitResult:
        images_per_second = wait_fraction = None
        if self.images_seen:  # else resumed with nothing left to train: no throughput to report
            steady_images = self.images_seen - self.config.batch_for_epoch(0)
            steady_seconds = self.train_seconds - self.first_step_seconds
            if steady_images <= 0 or steady_seconds <= 0:  # one step only: warm-up included
                steady_images, steady_seconds = self.images_seen, self.train_seconds
            images_per_second = steady_images / steady_seconds
            wait_fraction = self.stall_seconds / self.train_seconds
        diverged = diverged_at(self.losses)
        if diverged is not None:
            losses = self.losses
            warnings.warn(
                f"training diverged: the loss first exceeded {DIVERGENCE_FACTOR:g}x step 1's ({losses[0]:.4g}) at "
                f"step {diverged} ({losses[diverged - 1]:.4g}) and ends at {losses[-1]:.4g}; lower --lr",
                stacklevel=3,
            )
        return FitResult(
            state=state,
            loss_history=self.losses,
            epochs=self.rows,
            steps=self.step,
            train_seconds=self.train_seconds,
            images_per_second=images_per_second,
            input_wait_fraction=wait_fraction,
            final_eval=final_eval,
            extra={
                "skipped_steps": self.skipped,
                "resumed_from_step": self.resumed_from or None,
                "diverged_at_step": diverged,
                "input_startup_seconds": self.input_startup_seconds,
            },
        )
