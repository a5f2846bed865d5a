"""The loop: per call, next inputs -> run -> clock -> metrics handed on -> stop? -> each
periodic action asked whether it is due; per epoch, its end -> evaluation -> checkpoint
-> its row published -> stop? Each concern lives in its own module: the feed
(jaxcnn.data.feed: the inputs, a call at a time, and how each call is compiled), the
metrics reader (metrics.py), the history (history.py), the actions and the stop
(actions.py), the clock (clock.py), the evaluation (evaluation.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax

from jaxcnn.config import TrainConfig, epoch_steps
from jaxcnn.data import Dataset, EvalShare, Loader
from jaxcnn.data.feed import Feed
from jaxcnn.data.on_device import DeviceFeed
from jaxcnn.fit.actions import Checkpoints, Progress, StepCallback
from jaxcnn.fit.clock import Clock
from jaxcnn.fit.evaluation import Evaluation, eval_shares, evaluate
from jaxcnn.fit.history import History
from jaxcnn.fit.metrics import MetricsReader, NonFiniteLoss
from jaxcnn.fit.result import FitResult, Interrupted, fit_result
from jaxcnn.program import Program
from jaxcnn.resume import Resume
from jaxcnn.stopping import StopRequests


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
    on_steps: StepCallback | None = None,
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
    where the compiled step has already skipped it. `on_epoch(row, losses)` is called once
    per epoch, in order, with its row and its steps' losses; `on_steps` every N steps.
    Once `stop.check()` agrees (jaxcnn.stopping: a Ctrl-C or SIGTERM, in any process), the
    loop stops at that step boundary, saves the state once, in `checkpointer` or else the
    first of `interrupt_saves`, and raises `Interrupted`. `stop.check()` is asked once per
    call: after each but an epoch's last, and after the epoch's evaluation.

    `device_data` is the training set placed on the devices (jaxcnn.data.on_device; the
    programs compiled for it): each call gets its examples' indices instead of batches.
    `config.steps_per_call` steps run in one compiled call (jaxcnn.steps.calls). Metrics
    come to the host every NONFINITE_CHECK_STEPS steps (jaxcnn.fit.metrics): a non-finite
    loss stops the run at most twice that many steps plus four calls after it. An epoch's
    end waits for the devices only where something needs it -- its evaluation, a
    checkpoint, the run's end, the host loader's stall clock; else (the data on the
    devices, no test set) its row is filled in once its metrics arrive and published at
    the next epoch's end, and it is timed to its last call's dispatch, the devices' backlog
    counted in the next epoch's time.
    """
    programs = programs if isinstance(programs, dict) else {programs.batch_size: programs}
    loader = train if isinstance(train, Loader) else Loader(train)
    plan = epoch_steps(len(loader), config)
    epochs = [programs[config.batch_for_epoch(epoch)] for epoch in range(len(plan))]
    tests = eval_shares(programs, test_set)
    feed = _open_feed(loader, epochs, plan, config, resume, device_data)
    run = _Run(feed, History(resume or Resume(0, [], [], []), plan, config), skip_nonfinite, progress,
               checkpointer, interrupt_saves, stop or StopRequests(multi_process=False), on_epoch, on_steps)  # fmt: skip
    run.extra["eval_examples_per_process"] = max((len(t.own) for t in tests.values()), default=None)
    evaluation, end = None, 0
    try:
        for epoch, (program, count) in enumerate(zip(epochs, plan, strict=True)):
            end += count
            if end <= run.history.step:
                continue  # finished before the checkpoint this run resumed from
            test = tests.get(id(program))
            state, row = _train_epoch(run, program, state, epoch, end - count, count, evaluates=test is not None)
            if row is not None:
                evaluation = _end_epoch(run, program, state, row, test)
            if row is None or (run.checkpoints.stop_agreed() and run.history.step < run.total):  # stop?
                raise run.interrupted(program, state)
    except NonFiniteLoss as bad:
        run.publish()  # the epochs before the non-finite step ended well: shown as such
        raise NonFiniteLoss(bad.loss, bad.step, run.checkpoints.last_good()) from None
    finally:
        feed.close()
    run.extra["input_startup_seconds"] = feed.startup_seconds
    run.progress.close()
    if evaluation is None and test_set is not None:  # resumed at the very end: nothing left to train
        evaluation = evaluate(epochs[-1], state, tests[id(epochs[-1])])
    return fit_result(state, run.history, run.clock, evaluation, run.extra)


def _train_epoch(run: _Run, program: Program, state, epoch: int, first: int, count: int, evaluates: bool):
    """Run epoch `epoch`'s steps from where the run stands, a call at a time; (new state,
    the epoch's row), the row None where a stop was agreed before the epoch's last call.
    Its end waits for its last call where something needs it now -- its evaluation
    (`evaluates`), a checkpoint, the run's end, the feed's stall clock -- and its row then
    holds its training metrics; else (None there) the devices run on into the next epoch
    and the metrics are filled in once they arrive."""
    end, history, feed = first + count, run.history, run.feed
    feed.start_epoch(program, count, last=end == run.total)
    run.clock.start_epoch()
    while history.step < end:
        steps, held, inputs = feed.next_call()
        state, outputs = feed.compiled(program, steps, held)(state, *inputs)
        if program.averaging is not None:  # local SGD (one step a call): the replicas meet when due
            state = program.averaging.after_step(state, history.step + 1, run.total)
        run.clock.called(state, steps * program.batch_size)
        history.call_from, history.step = history.step, history.step + steps
        run.reader.add(feed.dispatched(outputs))
        run.progress.advance(steps)
        if history.step < end:  # (after an epoch's last call, its end asks)
            if run.checkpoints.stop_agreed():
                break
            run.periodic(program, state)
    stopped = history.step < end
    settle = (
        stopped or evaluates or end == run.total or feed.epoch_end_waits
        or run.checkpoints.due(end, history.call_from)
    )  # fmt: skip
    if settle:
        run.reader.drain()  # joined behind the last call: the devices run it meanwhile
        jax.block_until_ready(state)
    else:
        run.reader.end_epoch()
    seconds, stall = run.clock.end_epoch(feed)
    if stopped:
        return state, None
    return state, history.epoch_row(epoch, program.batch_size, count, seconds, stall, settled=settle)


def _end_epoch(run: _Run, program: Program, state, row: dict, test: EvalShare | None) -> Evaluation | None:
    """An epoch's end: the rows completed meanwhile published; then this epoch's, where its
    metrics are on the host, evaluated, recorded, checkpointed if due and published (else it
    waits for its metrics). Returns its evaluation."""
    run.publish()
    if row["train_loss"] is None:
        run.history.wait_for_metrics(row)
        return None
    evaluation = evaluate(program, state, test) if test is not None else None
    row["test_loss"], row["test_accuracy"] = (evaluation.loss, evaluation.accuracy) if evaluation else (None, None)
    run.history.add_row(row)
    history = run.history
    if run.checkpoints.due(history.step, history.call_from, last=history.step == run.total):
        run.checkpoints.save(program, state)  # after its row, so a resumed run's results hold it
    run.publish()
    return evaluation


def _open_feed(
    loader: Loader, epochs: list[Program], plan: list[int], config: TrainConfig, resume, device_data
) -> Feed:
    """The run's inputs: the host loader's batches, or the feed of the data on the devices."""
    position = resume.loader_position() if resume else None
    placements = [program.train_input for program in epochs]
    if device_data is None:
        return loader.batches(plan, placements, config.seed, position, steps_per_call=config.steps_per_call)
    first = position["next_step"] if position else 0
    carries = [program.calls.carry for program in epochs]
    return DeviceFeed(device_data, len(loader), plan, placements, carries, config.seed, first, config.steps_per_call)


@dataclass
class _Run:
    """One run's parts, each owning one concern, as the loop asks them."""

    feed: Feed
    history: History
    skip_nonfinite: bool
    show_progress: bool
    checkpointer: object
    interrupt_saves: Sequence
    stop: StopRequests
    on_epoch: Callable[[dict, list[float]], None] | None
    on_steps: StepCallback | None

    def __post_init__(self):
        self.total = sum(self.history.steps_per_epoch)
        self.reader = MetricsReader(self.history, self.skip_nonfinite)
        self.clock = Clock()
        self.checkpoints = Checkpoints(
            self.checkpointer, self.interrupt_saves, self.stop, self.history, self.reader, self.feed
        )
        self.progress = Progress(self.show_progress, self.history.step, len(self.history.steps_per_epoch), self.total)
        self.extra = {"steps_per_call": self.feed.steps_per_call}  # more for the run's record

    def periodic(self, program: Program, state) -> None:
        """After a call inside an epoch: each periodic action that is due."""
        step, since = self.history.step, self.history.call_from
        if self.checkpoints.due(step, since):
            self.checkpoints.save(program, state)  # (reads every call before it first)
        if self.on_steps is not None and self.on_steps.due(step, since):
            self.on_steps.call(step, state)

    def publish(self) -> None:
        """Completed rows to the screen and `on_epoch`, in order, once each (outside the
        timed part of the loop: a callback's writing is not the loop's)."""
        for row in self.history.take_ready():
            self.progress.epoch_done(row)
            if self.on_epoch is not None:
                self.on_epoch(row, self.history.epoch_losses(row))

    def interrupted(self, program: Program, state) -> Interrupted:
        """A stop agreed: the state saved once, every call's metrics read, the rows published."""
        self.publish()
        saved_to = self.checkpoints.save_for_stop(program, state)
        self.reader.drain()
        self.publish()
        self.progress.close()
        self.extra["input_startup_seconds"] = None
        return Interrupted(fit_result(state, self.history, self.clock, None, self.extra), saved_to)
