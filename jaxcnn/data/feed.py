"""The loop's inputs, a call at a time: the `Feed` interface the fit loop reads, and the host
loader's feed (`Batches`: batches read by grain, placed on the devices by a thread, the
input stall clocked). The training set held on the devices has its own (jaxcnn.data.on_device's
`DeviceFeed`); the loop does not ask which it has.

    feed = loader.batches(epoch_steps, placements, seed)    # or DeviceFeed(...)
    feed.start_epoch(program, steps, last)
    steps, held, inputs = feed.next_call()
    state, outputs = feed.compiled(program, steps, held)(state, *inputs)
    metrics = feed.dispatched(outputs)                      # a CallMetrics for the metrics reader
"""

from __future__ import annotations

import gc
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import jax
import numpy as np

from jaxcnn.sharding.placement import BatchPlacement, StackedPlacement


@dataclass(frozen=True)
class Step:
    """One optimizer step's place in the run: its epoch and its batch's index there."""

    epoch: int
    index: int


class Schedule(Sequence):
    """The run's steps as a sequence of `Step`s, without a list of them (a run of 100,000
    epochs has millions): epoch e has `counts[e]` steps."""

    def __init__(self, counts: Sequence[int]):
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # epoch e's first step

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, step: int) -> Step:
        if not 0 <= step < len(self):
            raise IndexError(step)
        epoch = int(np.searchsorted(self.starts, step, side="right")) - 1
        return Step(epoch, step - int(self.starts[epoch]))


class CallMetrics(NamedTuple):
    """A dispatched call's metrics as its feed hands them on: from the host each metric
    [steps] (a call of several steps) or a scalar; on the devices its epoch's metric log,
    which holds every earlier call of the epoch too, its steps written from `log_row` on."""

    metrics: dict | None  # None once a newer call's log holds them (the metrics reader lets it go)
    steps: int
    log_row: int | None = None  # on the devices: the epoch's log row its first step's metrics are in


class Feed(Protocol):
    """What the fit loop asks of its inputs, whichever way they reach the devices."""

    steps_per_call: int
    startup_seconds: float | None  # the first call's wait: the pipeline starting, not a stall
    epoch_end_waits: bool  # its stall clock waits for every dispatched call at an epoch's end

    def start_epoch(self, program: Any, steps: int, last: bool) -> None:
        """Before an epoch of `steps` steps with `program` (`last`: the run's last epoch)."""

    def next_call(self) -> tuple[int, int, tuple]:
        """(steps the call runs, steps its program holds, its inputs after the state)."""

    def compiled(self, program: Any, steps: int, held: int) -> Callable:
        """The compiled call: (state, *inputs) -> (state, outputs)."""

    def dispatched(self, outputs: Any) -> CallMetrics:
        """The call just dispatched: its outputs, for the clock or the next call; its metrics."""

    def take_stall_seconds(self) -> float:
        """The input stall since the last time asked."""

    def position(self) -> dict:
        """Where it stands, for a checkpoint (JSON)."""

    def close(self) -> None: ...


DEVICE_PREFETCH = 2  # batches placed on the devices ahead of the loop (flax's prefetch_to_device size)
READER_JOIN_S = 30  # on close, how long to let the reader finish the batch it is reading (a hung worker: no longer)


class Batches:
    """The host loader's `Feed`: the run's training batches, in step order, from one grain iterator that spans every
    epoch (so prefetch crosses epoch boundaries). A reader thread takes each step's rows
    from the pipeline and places them on the devices as its step takes them
    (`placements[epoch]`), up to `DEVICE_PREFETCH` batches ahead, so host-to-device copies
    overlap the running steps; `next()` hands them over in order. `position()` is the
    loader's place for a checkpoint: the next step the loop takes, which with the seed fixes
    the next example exactly (batch k's examples depend on nothing else), whatever the
    worker count of the run that resumes from it.

    The input stall: the part of each wait for a batch during which the devices had nothing
    left to run. Tell it each step's outputs (`dispatched`); a watcher thread notes when
    each finishes, so a wait that overlaps a running step costs nothing and only the rest of
    it counts -- the idle time `input_wait_fraction` reports. The first wait is the
    pipeline starting (its worker processes too): `startup_seconds`, not a stall.
    """

    def __init__(
        self, iterator, steps: Schedule, placements: Sequence[BatchPlacement], first_step: int, steps_per_call: int = 1
    ):
        self._iterator, self._steps, self._placements = iterator, steps, placements
        self._stacked = [StackedPlacement(p, steps_per_call) for p in placements] if steps_per_call > 1 else None
        self.steps_per_call = steps_per_call
        self._next_step = first_step  # the next step the loop takes
        self._waits: list[tuple[int, float, float]] = []  # (steps dispatched before it, start, end)
        self._finished: dict[int, float] = {}  # step count -> when that many had finished
        self._dispatched = 0
        self._watch: queue.Queue = queue.Queue()
        self._watcher = threading.Thread(target=self._note_finishes, name="jaxcnn-device-clock", daemon=True)
        self._watcher.start()
        self._placed: queue.Queue = queue.Queue(maxsize=DEVICE_PREFETCH)
        self._closing = threading.Event()
        self._reader = threading.Thread(target=self._read_ahead, name="jaxcnn-device-prefetch", daemon=True)
        self._reader.start()
        self.wait_seconds = 0.0
        self.startup_seconds: float | None = None
        self._call_steps = 0  # the last call's

    epoch_end_waits = True  # take_stall_seconds waits for every call dispatched

    def start_epoch(self, program, steps: int, last: bool) -> None:
        pass

    def next(self) -> tuple[jax.Array, jax.Array]:
        """The next step's (images, labels), placed as its step takes them; the wait timed."""
        steps, _, batch = self.next_call()
        if steps != 1:
            raise RuntimeError(f"the loader stacks {steps} steps a call here: take them with next_call()")
        return batch

    def next_call(self) -> tuple[int, int, tuple[jax.Array, ...]]:
        """(steps in the next call, twice -- the steps it runs, the steps its program holds --,
        their batches placed as the call takes them): K steps stacked [K, B, ...] while an
        epoch has K left, then one by one; the wait timed."""
        if self._next_step >= len(self._steps):
            raise RuntimeError(f"the loader has no step {self._next_step}: the run has {len(self._steps)}")
        start = time.perf_counter()
        item = self._placed.get()
        end = time.perf_counter()
        if isinstance(item, BaseException):  # the reader's error (a corrupt file...), raised where it is read
            raise item
        if self.startup_seconds is None:
            self.startup_seconds = end - start
        else:
            self._waits.append((self._dispatched, start, end))
            self.wait_seconds += end - start
        steps, batch = item
        self._next_step += steps
        self._call_steps = steps
        return steps, steps, batch

    def compiled(self, program, steps: int, held: int) -> Callable:
        return program.train_step if held == 1 else program.calls.get(held, False).run

    def dispatched(self, outputs) -> CallMetrics:
        """`outputs` of the call just dispatched (its metrics, or any of its arrays), for the
        stall's clock."""
        self._dispatched += 1
        self._watch.put((self._dispatched, outputs["loss"] if isinstance(outputs, dict) else outputs))
        return CallMetrics(outputs, self._call_steps)

    def _read_ahead(self) -> None:
        """The reader thread: every call's rows from the pipeline, placed on the devices."""
        step = self._next_step
        try:
            while step < len(self._steps) and not self._closing.is_set():
                epoch = self._steps[step].epoch
                left = int(self._steps.starts[epoch + 1]) - step
                count = self.steps_per_call if left >= self.steps_per_call > 1 else 1
                rows = []
                for expected in range(step, step + count):
                    got, images, labels = next(self._iterator)
                    if got != expected:  # a restored loader must stand exactly where its run stopped
                        raise RuntimeError(f"the loader gave step {got} where step {expected} was due")
                    rows.append((images, labels))
                if count == 1:
                    placed = self._placements[epoch].place_rows(*rows[0])
                else:
                    placed = self._stacked[epoch].place_rows(*(np.stack(part) for part in zip(*rows, strict=True)))
                self._hand_over((count, placed))
                step += count
        except BaseException as err:  # handed to the loop, which raises it
            self._hand_over(err)

    def _hand_over(self, item) -> None:
        while not self._closing.is_set():
            try:
                self._placed.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _note_finishes(self) -> None:
        while (item := self._watch.get()) is not None:
            count, outputs = item
            try:
                jax.block_until_ready(outputs)
            except Exception:  # a failed step: the loop sees its error; keep the clock running
                pass
            finally:
                self._finished[count] = time.perf_counter()
                self._watch.task_done()
        self._watch.task_done()

    def take_stall_seconds(self) -> float:
        """The stall since the last call (waits until every dispatched step has finished)."""
        self._watch.join()
        stall = 0.0
        for count, start, end in self._waits:
            stall += max(0.0, end - max(start, self._finished[count]))
        self._waits.clear()
        # the next wait follows the last step dispatched: keep only when that one finished
        self._finished = {self._dispatched: self._finished[self._dispatched]} if self._dispatched else {}
        return stall

    def position(self) -> dict:
        """Where the loader stands, to save with a checkpoint (JSON)."""
        return {"next_step": self._next_step}

    def close(self) -> None:
        if self._closing.is_set():
            return
        self._closing.set()
        self._reader.join(timeout=READER_JOIN_S)  # after the batch it may be reading
        while not self._placed.empty():  # release the batches placed ahead
            self._placed.get_nowait()
        self._watch.put(None)
        self._watcher.join()
        self._iterator.close()
        # Release the workers' queues and semaphores now: collected later, in the middle of
        # the next pipeline's start, multiprocessing's resource tracker is re-entered and warns.
        del self._iterator
        gc.collect()
