"""The loop's clock: the seconds it trains (compiles and evaluations kept out), the images
it trains on, the first call (compiling or warming up) kept apart from the steady state,
and the devices' idle time waiting for input (the feed's stall clock)."""

from __future__ import annotations

import time

import jax

from jaxcnn.data.feed import Feed


class Clock:
    def __init__(self):
        self.train_seconds = self.stall_seconds = self.first_step_seconds = 0.0
        self.first_step_finished: float | None = None  # time.perf_counter() when the run's first call had finished
        self.images = 0
        self.first_call_images = 0  # the first call's: warm-up, kept out of the steady state
        self._epoch_start = 0.0

    def start_epoch(self) -> None:
        self._epoch_start = time.perf_counter()

    def called(self, state, images: int) -> None:
        """After a call of `images` images is dispatched. The run's first is waited for: its
        one-off costs (compiling, warming up) are kept out of the steady state."""
        if self.images == 0:
            jax.block_until_ready(state)
            self.first_step_finished = time.perf_counter()
            self.first_step_seconds = self.first_step_finished - self._epoch_start
            self.first_call_images = images
        self.images += images

    def end_epoch(self, feed: Feed) -> tuple[float, float]:
        """(the epoch's seconds, its input stall's): to the last call's dispatch, or to its
        end where the epoch's end waited for it."""
        seconds = time.perf_counter() - self._epoch_start
        stall = feed.take_stall_seconds()
        self.train_seconds += seconds
        self.stall_seconds += stall
        return seconds, stall

    def throughput(self) -> tuple[float | None, float | None]:
        """(steady-state images a second, the share of it the devices waited for input);
        (None, None) where no call ran (resumed with nothing left to train)."""
        if not self.images:
            return None, None
        # the steady state: the first call (compiling or warming up) left out of both figures
        steady_images = self.images - self.first_call_images
        steady_seconds = self.train_seconds - self.first_step_seconds
        if steady_images <= 0 or steady_seconds <= 0:  # one call only: warm-up included
            steady_images, steady_seconds = self.images, self.train_seconds
        return steady_images / steady_seconds, self.stall_seconds / steady_seconds
