"""A stop every process agrees on: a run told to stop -- SIGTERM (a scheduler's preemption,
time limit or `scancel`), a second signal of the user's choosing (`--stop-signal USR1`, for
SLURM's `--signal`) or Ctrl-C -- stops all its processes at one step, where each saves its
part of the state, and exits with a code a requeue can test.

    with stop_requests(multi_process, extra="SIGUSR1") as stop:
        ...
        if stop.check():          # every process, once per step: True at the agreed step
            save; exit(stop.exit_code)

One process decides alone: a handler notes the signal and the loop stops after the step in
flight. Several processes must stop at the same step, or the ones that go on wait forever in
a collective for the ones that stopped. JAX's preemption sync service agrees on it: its
handler takes SIGTERM in any process and tells the others through the coordinator, and
`reached_preemption_sync_point`, called by every process at every step, turns True on all of
them at the same one. A Ctrl-C or the second signal is passed to it as a SIGTERM to this
process. A second Ctrl-C exits at once, without saving.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence

STOPPED_EXIT_CODE = 75  # sysexits.h EX_TEMPFAIL, "try again later": the state is saved; run the same command again
INTERRUPTED_EXIT_CODE = 130  # a Ctrl-C (128 + SIGINT), the state saved


def signal_number(name: str) -> signal.Signals:
    """A signal by name ("USR1" or "SIGUSR1")."""
    return signal.Signals["SIG" + name.upper().removeprefix("SIG")]


_EARLY: list[signal.Signals] = []  # stops sent before stop_requests opened, kept for it (keep_early_stops)


def keep_early_stops(argv: Sequence[str]) -> None:
    """First thing in a training process: a SIGTERM, or the `--stop-signal` named in `argv`,
    sent while the process starts is kept for `stop_requests` to act on at the first step.
    Importing JAX takes seconds (tens on a loaded machine): a time limit's SIGUSR1 arriving
    then would otherwise end the process (its default action) before anything is saved."""
    names = [value for flag, value in itertools.pairwise(argv) if flag == "--stop-signal"]
    names += [arg.split("=", 1)[1] for arg in argv if arg.startswith("--stop-signal=")]
    numbers = [signal.SIGTERM]
    for name in names[-1:]:
        with contextlib.suppress(KeyError):  # a bad name is the flags' to refuse
            numbers.append(signal_number(name))
    for number in numbers:
        signal.signal(number, lambda signum, frame: _EARLY.append(signal.Signals(signum)))


class StopRequests:
    """Whether the run has been asked to stop; `check()` is the step boundary's question."""

    def __init__(self, multi_process: bool):
        self.multi_process = multi_process
        self.received: list[signal.Signals] = []  # what this process was sent
        self._agreed = False
        self._calls = 0
        self.joined = False  # jax.distributed started: JAX's preemption notifier has SIGTERM

    def join(self) -> None:
        """Call once jax.distributed has started (several processes): from now JAX's
        notifier takes SIGTERM and tells the other processes; a stop asked before it is
        passed on to it."""
        if not self.multi_process or self.joined:
            return
        self.joined = True
        if self.received:
            os.kill(os.getpid(), signal.SIGTERM)

    def check(self) -> bool:
        """Stop here? Every process calls this once per step boundary, the same number of
        times; once True it stays True."""
        if not self._agreed:
            if self.multi_process:
                from jax.experimental import multihost_utils

                self._agreed = multihost_utils.reached_preemption_sync_point(self._calls)
            else:
                self._agreed = bool(self.received)
            self._calls += 1
        return self._agreed

    @property
    def requested(self) -> bool:
        """A stop was asked of this process (it may not have been agreed yet)."""
        return bool(self.received) or self._agreed

    @property
    def reason(self) -> str:
        if self.received:
            return self.received[0].name
        return "SIGTERM" if self._agreed else "none"  # JAX's notifier took it, here or in another process

    @property
    def exit_code(self) -> int:
        """130 when this process was sent a Ctrl-C, else 75 (a stop to requeue)."""
        return INTERRUPTED_EXIT_CODE if signal.SIGINT in self.received else STOPPED_EXIT_CODE


@contextlib.contextmanager
def stop_requests(multi_process: bool, extra: str | None = None) -> Iterator[StopRequests]:
    """While open, SIGTERM, SIGINT and `extra` ask the run to stop at the next step boundary
    (outside the main thread, where no handler can be set: nothing is caught). Open it
    before anything slow: a stop asked while the data loads or the step compiles is kept.
    With several processes, `join()` after jax.distributed starts: JAX's notifier then
    replaces this handler for SIGTERM."""
    stop = StopRequests(multi_process)
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    numbers = [signal.SIGINT, signal.SIGTERM, *([signal_number(extra)] if extra else [])]

    def handler(signum, frame):
        signum = signal.Signals(signum)
        if signum == signal.SIGINT and signal.SIGINT in stop.received:
            print("interrupted again: exiting now, without saving", file=sys.stderr, flush=True)
            os._exit(INTERRUPTED_EXIT_CODE)
        first = not stop.received
        stop.received.append(signum)
        if not first:
            return
        again = " (Ctrl-C again to exit at once)" if signum == signal.SIGINT else ""
        print(f"\n{signum.name}: stopping at the next step boundary to save{again}", file=sys.stderr, flush=True)
        if stop.joined:  # every process must stop at the same step: JAX's notifier tells the others
            os.kill(os.getpid(), signal.SIGTERM)

    previous = {number: signal.signal(number, handler) for number in numbers}
    for signum in _EARLY:  # sent while the process started
        handler(signum, None)
    _EARLY.clear()
    try:
        yield stop
    finally:
        for number, old in previous.items():
            signal.signal(number, old)
