"""Batch assembly: each epoch's order, gather, augmentation, placement with the step's
sharding, and prefetch on worker threads -- the `Loader` the fit loop draws batches from.

Every process computes the same global batch order and hands JAX only the rows its own
devices own (`to_global`), so multi-host input needs no other code.
"""

from __future__ import annotations

import collections
import concurrent.futures
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxcnn.data.sources import Dataset
from jaxcnn.errors import UserError


def epoch_order(size: int, epoch: int, seed: int) -> np.ndarray:
    """The example order of one epoch: the same on every process and every layout."""
    return np.random.default_rng([seed, epoch]).permutation(size)


def train_batches(dataset: Dataset, batch_size: int, epoch: int, seed: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Full batches of one shuffled epoch (the remainder is dropped: one compiled shape)."""
    for idx in batch_indices(len(dataset), batch_size, epoch, seed):
        yield dataset.images[idx], dataset.labels[idx]


def batch_indices(size: int, batch_size: int, epoch: int, seed: int) -> list[np.ndarray]:
    """The example indices of each full batch of one epoch: batch i can be built on its own
    (any worker thread, any order) and a resumed run starts at any batch."""
    order = epoch_order(size, epoch, seed)
    return [order[start : start + batch_size] for start in range(0, size - batch_size + 1, batch_size)]


@dataclass(frozen=True)
class Augment:
    """Host-side augmentation of a training batch: random shifts of up to `shift` pixels
    each way (zero fill) and, with `flip`, random horizontal flips. Batch i of epoch e
    always gets the same draws (seeded by (seed, e, i)), whatever thread builds it."""

    shift: int = 0
    flip: bool = False

    def __post_init__(self):
        if self.shift < 0:
            raise UserError(f"--augment-shift must be >= 0, got {self.shift}")

    @property
    def active(self) -> bool:
        return self.shift > 0 or self.flip

    def __call__(self, images_BHWC: np.ndarray, seed: int, epoch: int, index: int) -> np.ndarray:
        if not self.active:
            return images_BHWC
        rng = np.random.default_rng([seed, epoch, index, 7])
        b, h, w, _ = images_BHWC.shape
        out = images_BHWC
        if self.shift:
            s = self.shift
            padded = np.pad(images_BHWC, ((0, 0), (s, s), (s, s), (0, 0)))
            dy, dx = rng.integers(0, 2 * s + 1, size=(2, b))
            rows = dy[:, None] + np.arange(h)[None, :]  # [B, H]
            cols = dx[:, None] + np.arange(w)[None, :]  # [B, W]
            out = padded[np.arange(b)[:, None, None], rows[:, :, None], cols[:, None, :]]
        if self.flip:
            flip = rng.random(b) < 0.5
            out = np.where(flip[:, None, None, None], out[:, :, ::-1], out)
        return np.ascontiguousarray(out, dtype=images_BHWC.dtype)


def eval_batches(dataset: Dataset, batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Every example once, in order; the last batch is zero-padded and masked out."""
    labels = dataset.labels if dataset.labels is not None else np.zeros(len(dataset), np.int32)
    for start in range(0, len(dataset), batch_size):
        images, batch_labels = dataset.images[start : start + batch_size], labels[start : start + batch_size]
        mask = np.ones(len(images), np.float32)
        pad = batch_size - len(images)
        if pad:
            images = np.concatenate([images, np.zeros((pad, *images.shape[1:]), images.dtype)])
            batch_labels = np.concatenate([batch_labels, np.zeros(pad, batch_labels.dtype)])
            mask = np.concatenate([mask, np.zeros(pad, np.float32)])
        yield images, batch_labels, mask


def to_global(array: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global sharded array from the host's copy, sending each process only its rows.

    Every process holds the same global batch order; it hands JAX just the rows its own
    devices own (one process: all of them), so multi-host input needs no other code.
    """
    index_map = sharding.addressable_devices_indices_map(array.shape)
    starts = [idx[0].start or 0 for idx in index_map.values()]
    stops = [array.shape[0] if idx[0].stop is None else idx[0].stop for idx in index_map.values()]
    local = array[min(starts) : max(stops)]
    return jax.make_array_from_process_local_data(sharding, local, array.shape)


def check_input_options(workers: int, depth: int) -> None:
    if workers < 1 or depth < 1:
        raise UserError(f"--input-workers and --prefetch must be >= 1, got {workers} and {depth}")


class Prefetcher:
    """Builds `produce(i)` for i in range(count) ahead of the consumer on `workers` threads,
    at most `depth` batches ahead, and yields them in order.

    Two clocks. `wait_seconds`: all the time the consumer blocked in here, `idle()`
    included. `stall_seconds`: the part of it after `idle()` returned -- give `idle` a
    function that blocks until the devices have finished the work already dispatched (the
    fit loop blocks on the last step's outputs); a wait after it is time the devices sit
    with nothing to do for want of input: the stall `input_wait_fraction` reports. (The
    host's wait for a batch while a dispatched step still computes costs nothing; before
    issue 15 it was counted.) `idle` runs only when the next item is not built yet, so a
    loader that keeps ahead costs nothing and keeps async dispatch's queue intact. Without
    `idle` the two clocks are equal.
    (Threads suffice: numpy's indexing and arithmetic and JAX's host-to-device copies
    release the GIL.)
    """

    def __init__(
        self,
        produce: Callable[[int], object],
        count: int,
        depth: int = 2,
        workers: int = 1,
        idle: Callable[[], object] | None = None,
    ):
        check_input_options(workers, depth)
        self.wait_seconds = 0.0
        self.stall_seconds = 0.0
        self._produce, self._count, self._depth, self._idle = produce, count, depth, idle
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="jaxcnn-input")
        self._pending: collections.deque = collections.deque()
        self._next = 0
        self._top_up()

    def _top_up(self):
        while self._next < self._count and len(self._pending) < self._depth:
            self._pending.append(self._pool.submit(self._produce, self._next))
            self._next += 1

    def __iter__(self):
        while self._pending:
            future = self._pending.popleft()
            start = time.perf_counter()
            ready = future.done()
            if not ready and self._idle is not None:
                self._idle()  # the devices catch up first: only what is left of the wait idles them
            caught_up = time.perf_counter()
            try:
                item = future.result()  # re-raises a worker's error here
            finally:
                end = time.perf_counter()
                self.wait_seconds += end - start
                if not ready:
                    self.stall_seconds += end - caught_up
            self._top_up()
            yield item

    def close(self):
        for future in self._pending:
            future.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=True)


Placer = Callable[[np.ndarray, np.ndarray], tuple[jax.Array, jax.Array]]


@dataclass
class Loader:
    """Training batches of `dataset`: batch i of an epoch gathered, augmented and placed
    on a worker thread (`workers` of them, at most `depth` batches ahead of the step).

    The order depends only on (seed, epoch), so every process, every layout and a resumed
    run see the same batches (`batch_indices`)."""

    dataset: Dataset
    augment: Augment | None = None
    workers: int = 2
    depth: int = 2

    def __post_init__(self):
        check_input_options(self.workers, self.depth)

    def __len__(self) -> int:
        return len(self.dataset)

    def epoch(
        self, epoch: int, batch_size: int, seed: int, place: Placer, start: int = 0, count: int | None = None,
        idle: Callable[[], object] | None = None,
    ) -> Prefetcher:  # fmt: skip
        """Batches start .. start+count-1 of `epoch` (count None: to the epoch's end), each
        placed by `place(images, labels)`; `idle` as in Prefetcher."""
        indices = batch_indices(len(self.dataset), batch_size, epoch, seed)
        count = len(indices) - start if count is None else count

        def produce(i: int):
            idx = indices[start + i]
            images = self.dataset.images[idx]
            if self.augment is not None:
                images = self.augment(images, seed, epoch, start + i)
            return place(images, self.dataset.labels[idx])

        return Prefetcher(produce, count, depth=self.depth, workers=self.workers, idle=idle)
