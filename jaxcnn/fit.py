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

import collections
import math
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxcnn.checkpoint import state_fingerprint
from jaxcnn.config import DIVERGENCE_FACTOR, TrainConfig, epoch_steps
from jaxcnn.data import Batches, Dataset, EvalShare, Loader
from jaxcnn.data.on_device import DeviceFeed
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


def _eval_shares(programs: dict[int, Program], test_set: Dataset | None) -> dict[int, EvalShare]:
    """Each program's share of the test set, read (decoded) once, before training. Programs
    of a batch schedule that evaluate the same rows share one; where they differ, the set is
    decoded once, whole, and each takes its rows from memory."""
    if test_set is None:
        return {}
    key = {id(p): (p.eval_input.batch_size, p.eval_input.share.rows.tobytes()) for p in programs.values()}
    if len(set(key.values())) > 1 and not test_set.in_memory:
        test_set = test_set.loaded()
    shares: dict = {}
    for p in programs.values():
        if key[id(p)] not in shares:
            shares[key[id(p)]] = eval_share(p, test_set)
    return {id(p): shares[key[id(p)]] for p in programs.values()}


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
    device_data: tuple | None = None,
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
    boundary, saves the state once, in `checkpointer` or else the first of `interrupt_saves`,
    and raises `Interrupted`. `stop.check()` is asked once per call: after each but an epoch's last,
    and after the epoch's evaluation.

    `device_data` is the training set placed on the devices (jaxcnn.data.on_device; the
    programs compiled for it): each call gets its examples' indices instead of batches.
    `config.steps_per_call` steps run in one compiled call (jaxcnn.steps.calls).
    Metrics come to the host every NONFINITE_CHECK_STEPS steps (from calls already done,
    read once they are, at the latest that many steps later): a non-finite loss stops the
    run at most twice that many steps plus four calls after it. An epoch's end waits for
    the devices only where something needs it -- its evaluation, a checkpoint, the run's
    end, the host loader's stall clock; else (the data on the devices, no test set) its
    row is filled in once its metrics arrive and published (`on_epoch`, its line) at the
    next epoch's end, and it is timed to its last call's dispatch, the devices' backlog
    counted in the next epoch's time.
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
    tests = _eval_shares(programs, test_set)
    training_log.eval_examples = max((len(t.own) for t in tests.values()), default=None)
    position = resume.loader_position() if resume else None
    fixed = config.steps_per_call
    if device_data is not None:
        first = position["next_step"] if position else 0
        carries = [programs[config.batch_for_epoch(epoch)].calls.carry for epoch in range(len(steps_per_epoch))]
        batches = DeviceFeed(device_data, len(loader), steps_per_epoch, placements, carries, config.seed, first, fixed)
    else:
        batches = loader.batches(steps_per_epoch, placements, config.seed, position, steps_per_call=fixed)
    result = None
    first_in_epoch = 0

    def publish(row: dict) -> None:
        """A finished epoch's row to the callback and the screen (after its evaluation, or,
        for an epoch whose end nothing waited on, once its metrics reach the host)."""
        first = row["step"] - steps_per_epoch[row["epoch"] - 1]
        if on_epoch is not None:
            on_epoch(row, training_log.losses[first : row["step"]])
        if on_terminal:
            bar.set_postfix(epoch=row["epoch"], loss=f"{row['train_loss']:.4f}", test_acc=row["test_accuracy"])
        elif progress:
            print(epoch_line(row, len(steps_per_epoch), total), flush=True)

    training_log.publish = publish
    try:
        for epoch, count in enumerate(steps_per_epoch):
            first_in_epoch += steps_per_epoch[epoch - 1] if epoch else 0
            if first_in_epoch + count <= training_log.step:
                continue  # finished before the checkpoint this run resumed from
            program = programs[config.batch_for_epoch(epoch)]
            test = tests.get(id(program))
            state, row = _train_epoch(
                program, state, batches, training_log, epoch, first_in_epoch, count, bar, stop,
                evaluates=test is not None,
            )  # fmt: skip
            training_log.publish_finished()  # earlier epochs' rows whose metrics arrived meanwhile
            if row is not None and row["train_loss"] is not None:  # the epoch ended and waited for its end
                row, result = _evaluated(row, program, state, test)
                training_log.rows.append(row)
                if checkpointer is not None and checkpointer.due(
                    training_log.step, last=training_log.step == total, since=training_log.last_call_from
                ):
                    # at an epoch's end: after its row, so a resumed run's results hold it
                    training_log.save(program.saved_form(state), batches)
                publish(row)
            elif row is not None:
                training_log.unfinished.append(row)  # filled in once its metrics arrive
            if row is None or (stop.check() and training_log.step < total):  # asked to stop, in training or eval
                # saved once, in the first of them: two Orbax managers saving one step at once
                # share that step's barrier across processes, and one process fails on it
                target = next((c for c in (checkpointer, *interrupt_saves) if c is not None), None)
                if target is not None and training_log.step not in target.steps():  # else saved here already
                    training_log.save(program.saved_form(state), batches, target)
                training_log.drain()
                training_log.publish_finished()
                bar.close()
                raise Interrupted(training_log.result(state, None), [target.directory] if target else [])
    finally:
        batches.close()
    training_log.input_startup_seconds = batches.startup_seconds
    training_log.calls = {"steps_per_call": batches.steps_per_call}
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


NONFINITE_CHECK_STEPS = 64  # metrics come to the host after this many steps (docs: a NaN's latency)


def _step_runner(program: Program, steps: int, held: int, on_device: bool):
    """(the compiled call for a call of `held` steps that runs `steps` of them, whether its
    metrics come stacked [held]). On the devices an epoch's last call runs fewer steps than
    the others hold: a call of exactly those steps once it is compiled, else the others'
    call, its extra steps computed and dropped."""
    if held == 1 and not on_device:
        return program.train_step, False
    if on_device and steps < held and program.calls.ready(steps, True):
        held = steps
    call = program.calls.get(held, on_device)
    return call.run, call.stacked


def _train_epoch(
    program: Program,
    state,
    batches: Batches | DeviceFeed,
    training_log: _TrainingLog,
    epoch: int,
    first: int,
    count: int,
    bar,
    stop: StopRequests,
    evaluates: bool,
):
    """Run epoch `epoch`'s steps from where `training_log` stands, a call at a time; (new
    state, the epoch's row). The row is None when a stop was requested before the epoch's
    last call. Per call the host dispatches, notes it for the stall clock, and moves the
    bar; metrics come to the host now and then, from calls already done. The epoch's end
    waits for its last call where something needs it now -- its evaluation (`evaluates`),
    a checkpoint, the run's end, the host loader's stall clock -- and its row then holds
    its training metrics; else (None there) the devices run on into the next epoch and
    the metrics are filled in once they arrive."""
    batch, total = program.batch_size, sum(training_log.steps_per_epoch)
    on_device = isinstance(batches, DeviceFeed)
    end = first + count
    if on_device and batches.steps_per_call > 1 and end < total:
        # an epoch's last call, of exactly the steps left, for the epochs after this one (and
        # this one's, if compiled in time); until then that call holds idle steps
        remainder = count % batches.steps_per_call
        if remainder:
            program.calls.compile_ahead(remainder, True)
    runners = {}  # (steps, held) -> _step_runner's answer, for full calls (a short one's may change)
    start = time.perf_counter()
    while training_log.step < end:
        steps, held, inputs = batches.next_call()
        run, stacked = runners.get((steps, held)) or _step_runner(program, steps, held, on_device)
        if steps == held:
            runners[steps, held] = run, stacked
        state, outputs = run(state, *inputs)
        if program.averaging is not None:  # local SGD (one step a call): the replicas meet when due
            state = program.averaging.after_step(state, training_log.step + 1, total)
        if training_log.images_seen == 0:  # one-off costs: keep them out of steady state
            jax.block_until_ready(state)
            training_log.first_step_finished = time.perf_counter()
            training_log.first_step_seconds = training_log.first_step_finished - start
            training_log.first_call_images = steps * batch
        batches.dispatched(outputs)  # the stall's clock: when this call finishes; on the devices, the next's carry
        row = training_log.step - first if on_device else None  # (the epoch's log holds its metrics from here)
        training_log.last_call_from = training_log.step
        training_log.step += steps
        training_log.images_seen += steps * batch
        bar.update(steps)
        training_log.add_call(_Call(outputs["log"] if on_device else outputs, steps, stacked, row))
        if training_log.step < end and stop.check():
            break
        checkpointer = training_log.checkpointer
        if (
            checkpointer is not None
            and checkpointer.due(training_log.step, since=training_log.last_call_from)
            and training_log.step < end
        ):
            training_log.save(program.saved_form(state), batches)  # (reads every call before it first)
    stopped = training_log.step < end
    checkpointer = training_log.checkpointer
    settle = (
        stopped or evaluates or end == total
        or not on_device  # (the host loader's stall clock waits for every step dispatched anyway)
        or (checkpointer is not None and checkpointer.due(end, since=training_log.last_call_from))
    )  # fmt: skip
    if settle:
        training_log.drain()  # joined behind the last call: the devices run it meanwhile
        jax.block_until_ready(state)
    else:
        training_log.end_epoch()
    seconds = time.perf_counter() - start
    stall = batches.take_stall_seconds()
    training_log.train_seconds += seconds
    training_log.stall_seconds += stall
    if stopped:
        return state, None
    row = {
        "epoch": epoch + 1,
        "step": training_log.step,
        "global_batch_size": batch,
        "train_loss": None,
        "train_accuracy": None,
        "test_loss": None,
        "test_accuracy": None,
        "epoch_seconds": seconds,
        "images_per_second": count * batch / seconds,
        "input_wait_fraction": stall / seconds,
    }
    if settle:
        training_log.fill_training_metrics(row, first)
    return state, row


@jax.jit
def _joined(metrics: list[dict]) -> dict:
    """Calls' metrics, each metric's values of every call in one flat array (compiled: joined
    eagerly, every array would be an op dispatched from Python)."""
    return {name: jnp.concatenate([jnp.reshape(m[name], -1) for m in metrics]) for name in metrics[0]}


class _Call(NamedTuple):
    """A call dispatched, as the training log keeps it until its metrics are fetched."""

    # each metric [held] when `stacked`, else a scalar; on the devices its epoch's log (None once a
    # newer call's holds it too)
    metrics: dict | None
    steps: int  # the steps it ran
    stacked: bool
    row: int | None = None  # on the devices: its epoch's row it began at (its metrics' place in the log)


class _Fetch:
    """Calls' metrics on their way to the host, copied over asynchronously: with the data on
    the devices, the newest call's log of its epoch (every call before it in the epoch
    written there); else each metric's values of every call joined on the devices into one
    array (a transfer per array costs the host tens of microseconds, per step when a call is
    one step). `ready()` says, without waiting, whether they have been computed; `result()`
    waits for them: each metric's values of the steps that ran, in order, one flat array."""

    def __init__(self, calls: list[_Call]):
        self.calls = list(calls)
        self.joined = self.log = None
        if self.calls[-1].row is not None:  # the calls of one epoch (the log's), in order
            self.log, self.span = self.calls[-1].metrics, (self.calls[0].row, self.calls[-1].row + self.calls[-1].steps)
            arrays = list(self.log.values())
        elif len(self.calls) > 1 and all(c.metrics.keys() == self.calls[0].metrics.keys() for c in self.calls):
            self.joined = _joined([c.metrics for c in self.calls])
            arrays = list(self.joined.values())
        else:  # one call, or (rare) calls of different metrics: one by one
            arrays = jax.tree.leaves([c.metrics for c in self.calls])
        for array in arrays:
            array.copy_to_host_async()
        # what ready() asks: one program's outputs are ready together
        self.arrays = arrays[:1] if self.joined is not None or self.log is not None else arrays

    def ready(self) -> bool:
        return all(a.is_ready() for a in self.arrays)

    def result(self) -> dict[str, np.ndarray]:
        if self.log is not None:
            start, stop = self.span
            return {name: values[start:stop] for name, values in jax.device_get(self.log).items()}
        if self.joined is None:  # each metric of the calls with it
            parts: dict[str, list] = {}
            for m, *_ in jax.device_get(self.calls):
                for name, value in m.items():
                    parts.setdefault(name, []).append(np.reshape(value, -1))
            return {name: np.concatenate(values) for name, values in parts.items()}
        # (from the host every call runs all the steps it holds: nothing to drop)
        return jax.device_get(self.joined)


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
        self.first_call_images = 0  # the first call's: warm-up, kept out of the steady state
        self.last_call_from = resume.step  # the step the last call started at
        self.train_seconds = self.stall_seconds = self.first_step_seconds = 0.0
        self.first_step_finished = None  # time.perf_counter() when the run's first step had finished
        self.input_startup_seconds = None
        self.eval_examples = None  # test examples this process reads (its rows of each batch)
        self.calls = {}  # the steps per call
        self.fingerprint = None
        self.pending: list[_Call] = []  # calls not yet fetched
        self.older = 0  # steps in `pending` before its newest call
        # older calls' metrics on their way: (the run's step when each was started, the fetch)
        self.fetching: collections.deque[tuple[int, _Fetch]] = collections.deque()
        self.poll = jax.process_count() == 1  # read a fetch once it is ready (else only when due)
        self.unfinished: list[dict] = []  # epochs' rows waiting for their training metrics
        self.finished: list[dict] = []  # rows filled in, not yet published
        self.publish: Callable[[dict], None] = lambda row: None

    def add_call(self, call: _Call) -> None:
        """A call just dispatched: its metrics join those on their way to the host. Once the
        calls before the newest hold NONFINITE_CHECK_STEPS steps, they are fetched (copied
        asynchronously); so is an epoch's last calls' at its end. One process reads a fetch
        once its arrays are ready; every process reads one, waiting if need be, once
        NONFINITE_CHECK_STEPS more steps have been dispatched -- so while the devices keep
        up, nothing here waits on them, and a non-finite loss is read at most two fetches'
        worth of steps plus a few calls after it, however short the epochs. Several
        processes read only then, each at the same call (a non-finite loss must stop every
        one of them at the same step: their collectives pair up)."""
        fetching = self.fetching
        while fetching and (
            self.step - fetching[0][0] >= NONFINITE_CHECK_STEPS or (self.poll and fetching[0][1].ready())
        ):
            self.record(fetching.popleft()[1].result())
        self.older += self.pending[-1].steps if self.pending else 0
        if call.row is not None and len(self.pending) > 1:
            # a fetch reads its last call's log alone: the older calls' logs (each the epoch's
            # length, on every device) are let go
            self.pending[-2] = self.pending[-2]._replace(metrics=None)
        self.pending.append(call)
        if self.older >= NONFINITE_CHECK_STEPS:
            fetching.append((self.step, _Fetch(self.pending[:-1])))
            del self.pending[:-1]
            self.older = 0

    def end_epoch(self) -> None:
        """An epoch's end nothing waits for: its last calls' metrics on their way, apart from
        the next epoch's (a fetch never spans epochs: on the devices each has its own log;
        from the host each epoch then joins the same calls: one compiled join each)."""
        if self.pending:
            self.fetching.append((self.step, _Fetch(self.pending)))
        self.pending, self.older = [], 0

    def drain(self) -> None:
        """Every dispatched call's metrics on the host and checked (waits for the last)."""
        self.end_epoch()
        while self.fetching:
            self.record(self.fetching.popleft()[1].result())

    def record(self, metrics: dict[str, np.ndarray]) -> None:
        """Steps' metrics, on the host, into the histories; checked. The rows of epochs whose
        metrics these complete are filled in (published at the loop's next epoch boundary)."""
        start = len(self.losses)
        self.losses.extend(metrics["loss"].tolist())
        self.accuracies.extend(metrics["accuracy"].tolist())
        self.skipped += int(np.sum(metrics["skipped"])) if "skipped" in metrics else 0
        finite = np.isfinite(metrics["loss"])
        bad = None if finite.all() or self.skip_nonfinite else start + int(np.argmin(finite))  # 0-based step
        while self.unfinished and self.unfinished[0]["step"] <= (len(self.losses) if bad is None else bad):
            row = self.unfinished.pop(0)
            self.fill_training_metrics(row, row["step"] - self.steps_per_epoch[row["epoch"] - 1])
            self.rows.append(row)
            self.finished.append(row)
        if bad is not None:
            self.publish_finished()  # the epochs before the non-finite step ended well: shown as such
            where = ""
            if self.checkpointer is not None:
                where = (
                    f"; the last good checkpoint is step {self.saved_at} in {self.checkpointer.directory}"
                    if self.saved_at
                    else "; no checkpoint was saved before it"
                )
            raise NonFiniteLoss(
                f"training loss is {self.losses[bad]} at step {bad + 1}; stopped{where}. "
                "Lower --lr, or pass --skip-nonfinite to skip such steps"
            )

    def publish_finished(self) -> None:
        """Rows filled in since the last call: to `on_epoch` and the screen (outside the
        timed loop: a callback's writing is not the loop's)."""
        finished, self.finished = self.finished, []
        for row in finished:
            self.publish(row)

    def fill_training_metrics(self, row: dict, first: int) -> None:
        row["train_loss"] = float(np.mean(self.losses[first : row["step"]]))
        row["train_accuracy"] = float(np.mean(self.accuracies[first : row["step"]]))

    def save(self, state, batches: Batches, checkpointer=None) -> None:
        """Save to `checkpointer` (default: the run's periodic one)."""
        checkpointer = checkpointer or self.checkpointer
        self.drain()  # never save a state that followed a non-finite loss
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
            # the steady state: the first call (compiling or warming up) left out of both figures
            steady_images = self.images_seen - self.first_call_images
            steady_seconds = self.train_seconds - self.first_step_seconds
            if steady_images <= 0 or steady_seconds <= 0:  # one call only: warm-up included
                steady_images, steady_seconds = self.images_seen, self.train_seconds
            images_per_second = steady_images / steady_seconds
            wait_fraction = self.stall_seconds / steady_seconds
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
                **self.calls,
                "first_step_seconds": self.first_step_seconds if self.images_seen else None,
                "first_step_finished": self.first_step_finished,
            },
        )
