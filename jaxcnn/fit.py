"""The fit loop: train for the run's steps, evaluate after every epoch, checkpoint,
record what happened.

    programs = build_programs(...)                     # jaxcnn.build: one per batch size
    state = programs[batch].init()
    result = fit(programs, state, Loader(train_set), test_set, train_config)

Batches come from the data package's `Loader` (a grain pipeline over the whole run: order,
read, augment, prefetch), told once how each epoch's program takes its batch and handing
each over placed on the devices; the loop steps, collects metrics and keeps the training log.
Progress is a bar on a terminal and one line per epoch in a log. Under
`jaxcnn.stopping.stop_requests`, a Ctrl-C or SIGTERM stops the run at a step every process
agrees on: the state is saved (`Interrupted`) and the run can continue from it exactly.
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxcnn.checkpoint import state_fingerprint
from jaxcnn.config import DIVERGENCE_FACTOR, TrainConfig, epoch_steps
from jaxcnn.data import Batches, Dataset, EvalShare, Loader
from jaxcnn.errors import UserError
from jaxcnn.program import Program
from jaxcnn.resume import Resume, epoch_sizes
from jaxcnn.stopping import StopRequests


@dataclass
class Evaluation:
    loss: float | None  # None when the data has no labels
    accuracy: float | None
    predictions: np.ndarray


EVAL_IN_FLIGHT = 4  # evaluation batches dispatched ahead of the first one not yet finished


def eval_share(program: Program, dataset: Dataset | EvalShare) -> EvalShare:
    """The part of `dataset` this process evaluates with `program` (read and decoded now)."""
    if isinstance(dataset, EvalShare):
        return dataset
    return EvalShare(dataset, program.eval_input.batch_size, program.eval_input.share.rows)


def evaluate(program: Program, state, dataset: Dataset | EvalShare) -> Evaluation:
    """Every process evaluates its own rows of each batch (`EvalShare`). Batches dispatched
    ahead of their results (at most EVAL_IN_FLIGHT unfinished, so the placed inputs stay
    few): the devices do not wait on the host between evaluation batches; the sums and
    predictions come back in one transfer at the end."""
    share = eval_share(program, dataset)
    outputs = []
    for images, labels, mask in share.batches():
        outputs.append(program.eval_step(state, *program.eval_input.place_rows(images, labels, mask)))
        if len(outputs) > EVAL_IN_FLIGHT:
            jax.block_until_ready(outputs[-EVAL_IN_FLIGHT - 1])
    outputs = jax.device_get(outputs)
    loss_sum = sum(float(loss) for loss, _, _ in outputs)
    correct_sum = sum(float(correct) for _, correct, _ in outputs)
    predictions = share.predictions([np.asarray(p) for _, _, p in outputs])
    if not share.labelled:
        return Evaluation(None, None, predictions)
    return Evaluation(loss_sum / len(share), correct_sum / len(share), predictions)


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


def diverged_at(losses: list[float], factor: float = DIVERGENCE_FACTOR) -> int | None:
    """The first step (1-based) whose finite training loss exceeds `factor` x step 1's loss;
    None if none. (Non-finite losses stop the run or, with --skip-nonfinite, are skipped.)"""
    if not losses or not (math.isfinite(losses[0]) and losses[0] > 0):
        return None
    return next((k for k, v in enumerate(losses, 1) if math.isfinite(v) and v > factor * losses[0]), None)


class NonFiniteLoss(UserError):
    """The training loss became NaN or infinite (the run stops; checkpoints stay good)."""


class Interrupted(Exception):
    """A stop (Ctrl-C, SIGTERM): the run stopped between two steps. `result` is what it had
    done (no final evaluation); `saved_to` the checkpoint directories its state was saved in."""

    def __init__(self, result: FitResult, saved_to: list):
        super().__init__(f"interrupted at step {result.steps}")
        self.result, self.saved_to = result, saved_to


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
    on_epoch: Callable[[dict, list[float]], None] | None = None,
    stop: StopRequests | None = None,
    interrupt_saves: Sequence = (),
) -> FitResult:
    """Train for the run's steps, evaluating on `test_set` after every epoch.

    `programs` maps each global batch of `config.batch_sizes` to its program (one compile
    per size); a single program is a run of one batch size. `train` is a Loader, or a
    Dataset to load with the Loader's defaults. With a `checkpointer` (jaxcnn.checkpoint)
    the state is saved every N steps and at the end; `resume` continues a restored run at
    its step, on the same data position. A non-finite loss stops the run (NonFiniteLoss,
    naming the step) before anything non-finite is saved -- unless `skip_nonfinite`,
    where the compiled step has already skipped it. `on_epoch(row, losses)` is called after
    each epoch's evaluation with its row and its steps' losses. Once `stop.check()` agrees
    (jaxcnn.stopping: a Ctrl-C or SIGTERM, in any process), the loop stops at that step
    boundary, saves the state in `checkpointer` and `interrupt_saves`, and raises
    `Interrupted`. `stop.check()` is asked once per step: after each step but an epoch's
    last, and after the epoch's evaluation.
    """
    stop = stop or StopRequests(multi_process=False)
    if not isinstance(programs, dict):
        programs = {programs.batch_size: programs}
    loader = train if isinstance(train, Loader) else Loader(train)
    steps_per_epoch = epoch_steps(len(loader), config)
    training_log = _TrainingLog(resume or Resume(0, [], [], []), steps_per_epoch, config, checkpointer, skip_nonfinite)
    total = sum(steps_per_epoch)
    on_terminal = progress and sys.stdout.isatty()  # a bar to redraw; in a log, a line per epoch
    bar = tqdm(total=total, initial=training_log.step, unit="step", disable=not on_terminal, mininterval=0.1)
    placements = [programs[config.batch_for_epoch(epoch)].train_input for epoch in range(len(steps_per_epoch))]
    # each process's rows of the test set, read (decoded) once, before training: one share per evaluation batch
    tests = {id(p): eval_share(p, test_set) for p in programs.values()} if test_set is not None else {}
    training_log.eval_examples = max((len(t.own) for t in tests.values()), default=None)
    batches = loader.batches(steps_per_epoch, placements, config.seed, resume.loader_position() if resume else None)
    result = None
    first_in_epoch = 0
    try:
        for epoch, count in enumerate(steps_per_epoch):
            first_in_epoch += steps_per_epoch[epoch - 1] if epoch else 0
            if first_in_epoch + count <= training_log.step:
                continue  # finished before the checkpoint this run resumed from
            program = programs[config.batch_for_epoch(epoch)]
            state, row = _train_epoch(program, state, batches, training_log, epoch, first_in_epoch, count, bar, stop)
            if row is not None:  # the epoch ran to its end (a stop mid-epoch leaves no row)
                row, result = _evaluated(row, program, state, tests.get(id(program)))
                training_log.rows.append(row)
                if checkpointer is not None and checkpointer.due(training_log.step, last=training_log.step == total):
                    training_log.save(
                        state, batches
                    )  # at an epoch's end: after its row, so a resumed run's results hold it
                if on_epoch is not None:
                    on_epoch(row, training_log.losses[first_in_epoch : first_in_epoch + count])
                if on_terminal:
                    bar.set_postfix(epoch=epoch + 1, loss=f"{row['train_loss']:.4f}", test_acc=row["test_accuracy"])
                elif progress:
                    print(epoch_line(row, len(steps_per_epoch), total), flush=True)
            if row is None or (stop.check() and training_log.step < total):  # asked to stop, in training or eval
                saved = [c for c in (checkpointer, *interrupt_saves) if c is not None]
                for target in saved:
                    if training_log.step not in target.steps():  # else saved at this very step already
                        training_log.save(state, batches, target)
                bar.close()
                raise Interrupted(training_log.result(state, None), [c.directory for c in saved])
    finally:
        batches.close()
    training_log.input_startup_seconds = batches.startup_seconds
    bar.close()
    if result is None and test_set is not None:  # resumed at the very end: nothing left to train
        last = programs[config.batch_for_epoch(len(steps_per_epoch) - 1)]
        result = evaluate(last, state, tests[id(last)])
    return training_log.result(state, result)


def _evaluated(row: dict, program: Program, state, test_set: EvalShare | None) -> tuple[dict, Evaluation | None]:
    """The epoch's row with its test loss and accuracy filled in (None without a test set)."""
    result = evaluate(program, state, test_set) if test_set is not None else None
    row["test_loss"], row["test_accuracy"] = (result.loss, result.accuracy) if result else (None, None)
    return row, result


def epoch_line(row: dict, epochs: int, total_steps: int) -> str:
    """One epoch, one line: what a log shows instead of the progress bar."""

    def figure(name, value, fmt):
        return "" if value is None else f"  {name} {value:{fmt}}"

    return (
        f"epoch {row['epoch']}/{epochs}  step {row['step']}/{total_steps}  loss {row['train_loss']:.4f}"
        f"  acc {row['train_accuracy']:.4f}" + figure("test_loss", row["test_loss"], ".4f")
        + figure("test_acc", row["test_accuracy"], ".4f") + f"  {row['images_per_second']:,.0f} images/s"
        f"  input wait {100 * row['input_wait_fraction']:.1f}%  {row['epoch_seconds']:.1f} s"
    )  # fmt: skip


def _train_epoch(
    program: Program,
    state,
    batches: Batches,
    training_log: _TrainingLog,
    epoch: int,
    first: int,
    count: int,
    bar,
    stop: StopRequests,
):
    """Run epoch `epoch`'s steps from where `training_log` stands; (new state, the epoch's row).
    The row is None when a stop was requested before the epoch's last step."""
    batch, total = program.batch_size, sum(training_log.steps_per_epoch)
    todo = first + count - training_log.step
    pending = []
    start = time.perf_counter()
    done = 0
    for _ in range(todo):
        state, step_metrics = program.train_step(state, *batches.next())
        if program.averaging is not None:  # local SGD: the replicas meet when due
            state = program.averaging.after_step(state, training_log.step + 1, total)
        pending.append(step_metrics)
        if training_log.images_seen == 0:  # one-off costs: keep them out of steady state
            jax.block_until_ready(state)
            training_log.first_step_finished = time.perf_counter()
            training_log.first_step_seconds = training_log.first_step_finished - start
        batches.dispatched(step_metrics["loss"])  # the stall's clock: when this step finishes
        training_log.step += 1
        training_log.images_seen += batch
        done += 1
        bar.update(1)
        if done < todo and stop.check():
            break
        if (
            training_log.checkpointer is not None
            and training_log.checkpointer.due(training_log.step)
            and training_log.step < first + count
        ):
            training_log.collect(pending)  # never save a state that followed a non-finite loss
            training_log.save(state, batches)
    jax.block_until_ready(state)
    seconds = time.perf_counter() - start
    stall = batches.take_stall_seconds()
    training_log.train_seconds += seconds
    training_log.stall_seconds += stall
    training_log.collect(pending)
    if done < todo:
        return state, None
    return state, {
        "epoch": epoch + 1,
        "step": training_log.step,
        "global_batch_size": batch,
        "train_loss": float(np.mean(training_log.losses[first : first + count])),
        "train_accuracy": float(np.mean(training_log.accuracies[first : first + count])),
        "test_loss": None,
        "test_accuracy": None,
        "epoch_seconds": seconds,
        "images_per_second": todo * batch / seconds,
        "input_wait_fraction": stall / seconds,
    }


class _TrainingLog:
    """What the loop records: histories, epoch rows, timings, checkpoints saved."""

    def __init__(
        self, resume: Resume, steps_per_epoch: list[int], config: TrainConfig, checkpointer, skip_nonfinite: bool
    ):
        self.steps_per_epoch, self.config, self.checkpointer, self.skip_nonfinite = (
            steps_per_epoch,
            config,
            checkpointer,
            skip_nonfinite,
        )
        self.resumed_from = resume.step
        self.losses, self.accuracies = list(resume.loss_history), list(resume.accuracy_history)
        self.rows = resume.rows(steps_per_epoch, config)
        self.skipped, self.step, self.saved_at = resume.skipped_steps, resume.step, resume.step
        self.images_seen = 0
        self.train_seconds = self.stall_seconds = self.first_step_seconds = 0.0
        self.first_step_finished = None  # time.perf_counter() when the run's first step had finished
        self.input_startup_seconds = None
        self.eval_examples = None  # test examples this process reads (its rows of each batch)
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

    def save(self, state, batches: Batches, checkpointer=None) -> None:
        """Save to `checkpointer` (default: the run's periodic one)."""
        checkpointer = checkpointer or self.checkpointer
        self.fingerprint = self.fingerprint or state_fingerprint(state)
        record = {
            "step": self.step, "loss_history": self.losses, "accuracy_history": self.accuracies, "epochs": self.rows,
            "skipped_steps": self.skipped, "fingerprint": self.fingerprint, "loader": batches.position(),
            "epoch_sizes": epoch_sizes(self.steps_per_epoch, self.config), "seed": self.config.seed,
        }  # fmt: skip
        checkpointer.save(self.step, state, record)
        if checkpointer is self.checkpointer:
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
                "eval_examples_per_process": self.eval_examples,
                "first_step_seconds": self.first_step_seconds if self.images_seen else None,
                "first_step_finished": self.first_step_finished,
            },
        )
