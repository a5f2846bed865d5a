"""The input pipeline: each step's examples, read (decoded), augmented and prefetched on
grain's workers -- the `Loader` the fit loop draws batches from -- and handed over placed
on the devices as the step takes them (jaxcnn.sharding.placement), by a thread that keeps
the next batches placed while the current step runs.

Every process computes the same global batch order and builds only the rows its own
devices hold (`BatchShare`), so multi-host input needs no other code and the global
batches are the same for any number of processes.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grain
import numpy as np
from absl import flags

from jaxcnn.data.feed import Batches, Schedule
from jaxcnn.data.sources import Dataset
from jaxcnn.errors import UserError
from jaxcnn.run_config import check_input_options
from jaxcnn.sharding.placement import BatchPlacement, BatchShare


def epoch_order(size: int, epoch: int, seed: int) -> np.ndarray:
    """The example order of one epoch: the same on every process and every layout."""
    return np.random.default_rng([seed, epoch]).permutation(size)


def train_batches(dataset: Dataset, batch_size: int, epoch: int, seed: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Full batches of one shuffled epoch (the remainder is dropped: one compiled shape)."""
    for idx in batch_indices(len(dataset), batch_size, epoch, seed):
        yield dataset.images[idx], dataset.labels[idx]


def batch_indices(size: int, batch_size: int, epoch: int, seed: int) -> list[np.ndarray]:
    """The example indices of each full batch of one epoch: batch i can be built on its own
    (any worker, any order) and a resumed run starts at any batch."""
    order = epoch_order(size, epoch, seed)
    return [order[start : start + batch_size] for start in range(0, size - batch_size + 1, batch_size)]


@dataclass(frozen=True)
class Augment:
    """Host-side augmentation of training images: random shifts of up to `shift` pixels
    each way (zero fill) and, with `flip`, random horizontal flips. The draws for batch i
    of epoch e are made for the whole global batch, seeded by (seed, e, i), and each
    process applies its own rows' draws: the same images whatever builds them, on however
    many processes."""

    shift: int = 0
    flip: bool = False

    def __post_init__(self):
        if self.shift < 0:
            raise UserError(f"--augment-shift must be >= 0, got {self.shift}")

    @property
    def active(self) -> bool:
        return self.shift > 0 or self.flip

    def draws(self, seed: int, epoch: int, index: int, size: int) -> np.ndarray:
        """[size, 3] ints: (row shift, column shift, flip) for each example of the batch."""
        rng = np.random.default_rng([seed, epoch, index, 7])
        dy, dx = rng.integers(0, 2 * self.shift + 1, size=(2, size)) if self.shift else np.zeros((2, size), int)
        flip = rng.random(size) < 0.5 if self.flip else np.zeros(size, bool)
        return np.stack([dy, dx, flip], axis=1)

    def apply(self, images_BHWC: np.ndarray, draws: np.ndarray) -> np.ndarray:
        b, h, w, _ = images_BHWC.shape
        out = images_BHWC
        if self.shift:
            s = self.shift
            padded = np.pad(images_BHWC, ((0, 0), (s, s), (s, s), (0, 0)))
            rows = draws[:, 0, None] + np.arange(h)[None, :]  # [B, H]
            cols = draws[:, 1, None] + np.arange(w)[None, :]  # [B, W]
            out = padded[np.arange(b)[:, None, None], rows[:, :, None], cols[:, None, :]]
        if self.flip:
            out = np.where(draws[:, 2, None, None, None] > 0, out[:, :, ::-1], out)
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


class EvalShare:
    """This process's part of evaluating `dataset` in batches of `batch_size` (the last one
    zero-padded and masked out): the rows `rows` of each batch, the ones its devices hold --
    read (an image folder: decoded) once and kept, as the test set is evaluated every epoch.
    A process of a multi-process run reads only its own examples, not every process the
    whole set."""

    def __init__(self, dataset: Dataset, batch_size: int, rows: np.ndarray | slice):
        self.size, self.batch_size, self.rows = len(dataset), batch_size, np.arange(batch_size)[rows]
        batches = -(-self.size // batch_size)
        examples = np.arange(batches)[:, None] * batch_size + self.rows[None, :]  # [batch, row]: the example there
        self.valid = examples < self.size
        own = examples[self.valid]
        whole = len(own) == self.size  # (ascending: then every example, in order)
        self.own = dataset.loaded() if whole else dataset.subset(own).loaded()
        self.starts = np.concatenate([[0], np.cumsum(self.valid.sum(axis=1))])  # batch b's first in `own`
        self.labels = (
            self.own.labels if self.own.labels is not None else np.zeros(len(self.own), np.int32)
        )  # unlabelled: zeros, masked out of nothing (the step's sums are not read)

    def __len__(self) -> int:
        return self.size

    @property
    def labelled(self) -> bool:
        return self.own.labels is not None

    def batches(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Each batch's (images, labels, mask), this process's rows of them."""
        for b, valid in enumerate(self.valid):
            part = slice(self.starts[b], self.starts[b + 1])
            mask = valid.astype(np.float32)
            if valid.all():
                yield self.own.images[part], self.labels[part], mask
                continue
            images = np.zeros((len(valid), *self.own.image_shape), self.own.images.dtype)
            labels = np.zeros(len(valid), self.labels.dtype)
            images[valid], labels[valid] = self.own.images[part], self.labels[part]
            yield images, labels, mask

    def predictions(self, per_batch: list[np.ndarray]) -> np.ndarray:
        """Every example's prediction, in the dataset's order, from each batch's whole
        (replicated) predictions."""
        kept = [p[: min(self.batch_size, self.size - b * self.batch_size)] for b, p in enumerate(per_batch)]
        return np.concatenate(kept) if kept else np.zeros(0, np.int32)


class BuildBatch(grain.transforms.Map):
    """Step number -> (step, this process's images, its labels): draws the global batch's
    examples from (seed, epoch), keeps this process's share of them (`shares[epoch]`), then
    reads (an image folder: decodes) and augments just those. Runs in grain's workers;
    picklable."""

    def __init__(
        self, dataset: Dataset, augment: Augment | None, seed: int, steps: Schedule, shares: Sequence[BatchShare]
    ):
        self.dataset, self.augment, self.seed, self.steps, self.shares = dataset, augment, seed, steps, shares
        self._epoch_batches: tuple[tuple[int, int], list[np.ndarray]] | None = None  # the last epoch's, kept

    def map(self, step: int):
        where = self.steps[step]
        share = self.shares[where.epoch]
        key = (where.epoch, share.batch_size)
        if self._epoch_batches is None or self._epoch_batches[0] != key:  # a shuffle per epoch, not per step
            self._epoch_batches = key, batch_indices(len(self.dataset), share.batch_size, where.epoch, self.seed)
        examples = share.take(self._epoch_batches[1][where.index])
        if self.augment is None or not self.augment.active:
            return step, self.dataset.images[examples], self.dataset.labels[examples]
        draws = share.take(self.augment.draws(self.seed, where.epoch, where.index, share.batch_size))
        if hasattr(self.augment, "read"):  # it decodes the images itself (crops.RandomResizedCrop)
            images = self.augment.read(self.dataset.images, examples, draws)
        else:
            images = self.augment.apply(self.dataset.images[examples], draws)
        return step, images, self.dataset.labels[examples]


@dataclass
class Loader:
    """Training batches of `dataset` through a grain pipeline: each step's examples drawn
    from (seed, epoch) -- the same on every process, layout and resumed run -- then read,
    decoded and augmented on `workers` grain worker processes (0: one thread of this
    process, enough for data already in memory), at most `depth` batches ahead of the step
    on each."""

    dataset: Dataset
    augment: Augment | None = None
    workers: int = 0
    depth: int = 2

    def __post_init__(self):
        check_input_options(self.workers, self.depth)

    def __len__(self) -> int:
        return len(self.dataset)

    def batches(
        self, epoch_steps: Sequence[int], placements: Sequence[BatchPlacement], seed: int, position: dict | None = None,
        steps_per_call: int = 1,
    ) -> Batches:  # fmt: skip
        """The run's batches, placed: epoch e has `epoch_steps[e]` steps, whose step takes its
        batch as `placements[e]` says; from `position` (a checkpoint's `Batches.position()`;
        None: the first step) to the last; `steps_per_call` steps stacked a call."""
        _accept_grain_defaults()
        first_step = position["next_step"] if position else 0
        steps = Schedule(epoch_steps)
        shares = [placement.share for placement in placements]  # what the workers build: no devices in them
        source = grain.MapDataset.range(len(steps)).map(BuildBatch(self.dataset, self.augment, seed, steps, shares))
        # In a worker, its own output buffer holds the batches ahead; read one at a time into it.
        read_ahead = 1 if self.workers else self.depth
        pipeline = source[first_step:].to_iter_dataset(
            grain.ReadOptions(num_threads=1, prefetch_buffer_size=read_ahead)
        )
        if self.workers:
            # Batches come back pickled, not in shared memory: grain can leave a shared-memory
            # block behind when its iterator closes (a warning at exit), and a copy is cheap.
            pipeline = grain.experimental.WithOptionsIterDataset(
                pipeline, grain.experimental.DatasetOptions(min_shm_size=1 << 62)
            )
            pipeline = pipeline.mp_prefetch(
                grain.MultiprocessingOptions(num_workers=self.workers, per_worker_buffer_size=self.depth),
                worker_init_fn=functools.partial(_exit_with_parent, os.getpid()),
            )
        return Batches(iter(pipeline), steps, placements, first_step, steps_per_call)


def _exit_with_parent(parent: int, worker_index: int, worker_count: int) -> None:
    """In each grain worker: exit once the training process is gone. grain stops its workers
    when the iterator closes or the process exits normally, but a process killed outright
    (SIGKILL, the OOM killer, a preempted job) would leave them running. A Ctrl-C reaches
    the workers too (the terminal signals the whole process group), and a scheduler's stop
    (SIGTERM, SLURM's --signal) every process of the job: it is the training process's to
    handle -- it stops at a step, saves and closes the pipeline -- so the workers ignore it
    rather than die mid-batch and fail the step the run was to stop at."""
    for stop in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(stop, signal.SIG_IGN)

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="jaxcnn-parent-watch", daemon=True).start()


def _accept_grain_defaults() -> None:
    """grain reads absl flags; a program that never parsed them (this one) takes their defaults."""
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
