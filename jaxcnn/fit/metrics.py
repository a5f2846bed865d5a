"""Metrics to the host: the calls in flight, when their metrics are fetched, and the check
that every loss is finite.

Metrics stay on the devices. Once the calls before the newest hold NONFINITE_CHECK_STEPS
steps, their metrics are fetched (copied to the host asynchronously); so are an epoch's
last calls' at its end. One process reads a fetch once its arrays are ready; every process
reads one, waiting if need be, once NONFINITE_CHECK_STEPS more steps have been dispatched
-- so while the devices keep up nothing here waits on them, and a non-finite loss is read
at most two fetches' worth of steps plus a few calls after it, however short the epochs.
Several processes read only then, each at the same call (a non-finite loss must stop every
one of them at the same step: their collectives pair up).
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np

from jaxcnn.data.feed import CallMetrics
from jaxcnn.errors import UserError
from jaxcnn.fit.history import History

NONFINITE_CHECK_STEPS = 64  # metrics come to the host after this many steps (docs: a NaN's latency)


class NonFiniteLoss(UserError):
    """The training loss became NaN or infinite (the run stops; checkpoints stay good)."""

    def __init__(self, loss: float, step: int, last_good: str = ""):
        super().__init__(
            f"training loss is {loss} at step {step}; stopped{last_good}. "
            "Lower --lr, or pass --skip-nonfinite to skip such steps"
        )
        self.loss, self.step = loss, step


@jax.jit
def _joined(metrics: list[dict]) -> dict:
    """Calls' metrics, each metric's values of every call in one flat array (compiled: joined
    eagerly, every array would be an op dispatched from Python)."""
    return {name: jnp.concatenate([jnp.reshape(m[name], -1) for m in metrics]) for name in metrics[0]}


class Fetch:
    """Calls' metrics on their way to the host, copied over asynchronously: with the data on
    the devices, the newest call's log of its epoch (every call before it in the epoch
    written there); else each metric's values of every call joined on the devices into one
    array (a transfer per array costs the host tens of microseconds, per step when a call is
    one step). `ready()` says, without waiting, whether they have been computed; `result()`
    waits for them: each metric's values of the steps that ran, in order, one flat array."""

    def __init__(self, calls: list[CallMetrics]):
        self.calls = list(calls)
        self.joined = self.log = None
        if self.calls[-1].log_row is not None:  # the calls of one epoch (the log's), in order
            last = self.calls[-1]
            self.log, self.span = last.metrics, (self.calls[0].log_row, last.log_row + last.steps)
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
            for m in jax.device_get([c.metrics for c in self.calls]):
                for name, value in m.items():
                    parts.setdefault(name, []).append(np.reshape(value, -1))
            return {name: np.concatenate(values) for name, values in parts.items()}
        # (from the host every call runs all the steps it holds: nothing to drop)
        return jax.device_get(self.joined)


class MetricsReader:
    """The dispatched calls' metrics, brought to the host on the schedule above and handed
    to the history; a non-finite loss raises NonFiniteLoss (unless `skip_nonfinite`: the
    compiled step has already skipped it), after the rows of the epochs before it."""

    def __init__(self, history: History, skip_nonfinite: bool):
        self.history, self.skip_nonfinite = history, skip_nonfinite
        self.dispatched = 0  # steps dispatched in this run
        self._unfetched: list[CallMetrics] = []
        self._unfetched_older = 0  # steps in `_unfetched` before its newest call
        # metrics on their way: (the steps dispatched when each was started, the fetch)
        self._in_flight: collections.deque[tuple[int, Fetch]] = collections.deque()
        self._poll = jax.process_count() == 1  # read a fetch once it is ready (else only when due)

    def add(self, call: CallMetrics) -> None:
        """A call just dispatched: fetches due read, its metrics join those to fetch."""
        self.dispatched += call.steps
        in_flight = self._in_flight
        while in_flight and (
            self.dispatched - in_flight[0][0] >= NONFINITE_CHECK_STEPS or (self._poll and in_flight[0][1].ready())
        ):
            self._read(in_flight.popleft()[1].result())
        self._unfetched_older += self._unfetched[-1].steps if self._unfetched else 0
        if call.log_row is not None and len(self._unfetched) > 1:
            # a fetch reads its last call's log alone: the older calls' logs (each the epoch's
            # length, on every device) are let go
            self._unfetched[-2] = self._unfetched[-2]._replace(metrics=None)
        self._unfetched.append(call)
        if self._unfetched_older >= NONFINITE_CHECK_STEPS:
            in_flight.append((self.dispatched, Fetch(self._unfetched[:-1])))
            del self._unfetched[:-1]
            self._unfetched_older = 0

    def end_epoch(self) -> None:
        """An epoch's end nothing waits for: its last calls' metrics on their way, apart from
        the next epoch's (a fetch never spans epochs: on the devices each has its own log;
        from the host each epoch then joins the same calls: one compiled join each)."""
        if self._unfetched:
            self._in_flight.append((self.dispatched, Fetch(self._unfetched)))
        self._unfetched, self._unfetched_older = [], 0

    def drain(self) -> None:
        """Every dispatched call's metrics on the host and checked (waits for the last)."""
        self.end_epoch()
        while self._in_flight:
            self._read(self._in_flight.popleft()[1].result())

    def _read(self, metrics: dict[str, np.ndarray]) -> None:
        finite = np.isfinite(metrics["loss"])
        bad = None if finite.all() or self.skip_nonfinite else int(np.argmin(finite))
        first = self.history.add(metrics, good=bad)
        if bad is not None:
            raise NonFiniteLoss(float(metrics["loss"][bad]), first + bad + 1)
