"""What the loop does now and then, each with one rule for when it is due (`crossed`: a
multiple of its period reached or passed by the last call, the checkpointer's rule):

- `Checkpoints`: a save every `checkpointer.every` steps, at an epoch's end that reaches
  one, and at the run's end -- and the stop, owned beside them (MaxText's
  maybe_save_checkpoint: one owner of JAX's sync point): `stop.check()` is asked once a
  call on every process, the same number of times, and a stop saves the state once;
- `Progress`: the bar on a terminal, or one line per epoch in a log;
- `StepCallback`: the user's own, every N steps (the user's `on_epoch` is told each
  epoch's row where it is published, beside the progress line).
An epoch's evaluation is the loop's own (every epoch with a test set).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from jaxcnn.checkpoint import state_fingerprint
from jaxcnn.data.feed import Feed
from jaxcnn.fit.history import History
from jaxcnn.fit.metrics import MetricsReader
from jaxcnn.stopping import StopRequests


def crossed(every: int | None, step: int, since: int) -> bool:
    """Whether a multiple of `every` lies in (since, step]: the calls of several steps pass
    over multiples of it. Never with no period."""
    return bool(every) and step // every > since // every


class Checkpoints:
    """The run's saves, to `checkpointer` (jaxcnn.checkpoint; None: none), and its stop."""

    def __init__(
        self, checkpointer, interrupt_saves, stop: StopRequests, history: History, reader: MetricsReader, feed: Feed
    ):
        self.checkpointer, self.interrupt_saves, self.stop = checkpointer, interrupt_saves, stop
        self.history, self.reader, self.feed = history, reader, feed
        self.saved_at = history.step  # the step of the last periodic save (the resumed one at first)
        self._fingerprint = None

    def due(self, step: int, since: int, last: bool = False) -> bool:
        """A periodic save at `step`, the last call having started at `since` (`last`: the
        run's last step)?"""
        every = self.checkpointer.every if self.checkpointer is not None else None
        return bool(every) and (last or crossed(every, step, since))

    def stop_agreed(self) -> bool:
        """Stop here? Every process asks at the same places (jaxcnn.stopping)."""
        return self.stop.check()

    def save(self, program, state, target=None) -> None:
        """Save to `target` (default: the periodic checkpointer), every call's metrics read
        and checked first: never a state that followed a non-finite loss."""
        target = target or self.checkpointer
        self.reader.drain()
        saved = program.saved_form(state)
        self._fingerprint = self._fingerprint or state_fingerprint(saved)
        target.save(self.history.step, saved, self.history.snapshot(self.feed.position()).to_record(self._fingerprint))
        if target is self.checkpointer:
            self.saved_at = self.history.step

    def save_for_stop(self, program, state) -> list:
        """A stop's save, once, in the checkpointer or else the first of `interrupt_saves`:
        two Orbax managers saving one step at once share that step's barrier across
        processes, and one process fails on it. Returns the directories saved in."""
        target = next((c for c in (self.checkpointer, *self.interrupt_saves) if c is not None), None)
        if target is not None and self.history.step not in target.steps():  # else saved here already
            self.save(program, state, target)
        return [target.directory] if target else []

    def last_good(self) -> str:
        """Where a non-finite loss's error says the last good state is."""
        if self.checkpointer is None:
            return ""
        if not self.saved_at:
            return "; no checkpoint was saved before it"
        return f"; the last good checkpoint is step {self.saved_at} in {self.checkpointer.directory}"


@dataclass(frozen=True)
class StepCallback:
    """The user's `call(step, state)` every `every` steps (at the first call boundary at or
    past each multiple; on every process). It runs in the loop: what it waits for, the loop
    waits for."""

    every: int
    call: Callable[[int, Any], None]

    def due(self, step: int, since: int) -> bool:
        return crossed(self.every, step, since)


class Progress:
    """A bar to redraw on a terminal; in a log, a line per epoch; nothing with `show` off."""

    def __init__(self, show: bool, initial: int, epochs: int, total: int):
        self.show, self.on_terminal, self.epochs, self.total = show, show and sys.stdout.isatty(), epochs, total
        self.bar = tqdm(total=total, initial=initial, unit="step", disable=not self.on_terminal, mininterval=0.1)

    def advance(self, steps: int) -> None:
        self.bar.update(steps)

    def epoch_done(self, row: dict) -> None:
        if self.on_terminal:
            self.bar.set_postfix(epoch=row["epoch"], loss=f"{row['train_loss']:.4f}", test_acc=row["test_accuracy"])
        elif self.show:
            print(epoch_line(row, self.epochs, self.total), flush=True)

    def close(self) -> None:
        self.bar.close()


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
