"""CSV -> arrays, epoch batching, per-process slices of global sharded batches, prefetch.

Files use the Kaggle "Digit Recognizer" layout: an optional `label` column, then
`pixel0` ... `pixel{N-1}`. N = side^2 * C (C from `channels`, pixels in HWC order).
Pixels are scaled to [0, 1] by the file's full scale: the smallest conventional maximum
(1, 16, 255, 65535) that holds its brightest pixel -- so a train and a test file from
the same source scale identically even if one lacks a fully bright pixel.
"""

from __future__ import annotations

import collections
import concurrent.futures
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
import pandas as pd
from jax.sharding import NamedSharding

from jaxcnn.errors import UserError

FULL_SCALES = (1.0, 16.0, 255.0, 65535.0)
LABEL = "label"


@dataclass(frozen=True)
class Dataset:
    images: np.ndarray  # float32 [N, H, W, C] in [0, 1]
    labels: np.ndarray | None  # int32 [N], None for a label-free test file
    source: str

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(self.images.shape[1:])

    def __len__(self) -> int:
        return len(self.images)


def _read_frame(path: Path) -> pd.DataFrame:
    if not path.exists():
        raise UserError(f"data file {path} not found; pass an existing CSV with --data / --test-data")
    if path.is_dir():
        raise UserError(f"data path {path} is a directory; pass a CSV file")
    try:
        frame = pd.read_csv(path)
    except pd.errors.EmptyDataError:
        raise UserError(f"data file {path} is empty; it needs a header row (label,pixel0,...) and image rows") from None
    except pd.errors.ParserError as err:
        detail = str(err).strip().splitlines()[-1].removeprefix("Error tokenizing data. C error: ")
        raise UserError(f"data file {path} has ragged rows ({detail}); every row needs one cell per column") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"data file {path} cannot be read as CSV text: {err}") from None
    if frame.empty:
        raise UserError(f"data file {path} has a header but no image rows")
    return frame


def _check_columns(frame: pd.DataFrame, path: Path) -> list[str]:
    pixels = [c for c in frame.columns if c != LABEL]
    expected = [f"pixel{i}" for i in range(len(pixels))]
    if pixels != expected:
        bad = next(c for c, e in zip(pixels, expected, strict=True) if c != e)
        raise UserError(
            f"data file {path}: column {bad!r} is not the expected pixel column; "
            f"the header must be 'label' (optional) then pixel0..pixel{len(pixels) - 1}"
        )
    return pixels


def _numeric(frame: pd.DataFrame, path: Path) -> np.ndarray:
    values = frame.apply(pd.to_numeric, errors="coerce")
    missing = frame.isna().to_numpy()
    if missing.any():
        row, col = map(int, np.argwhere(missing)[0])
        raise UserError(
            f"data file {path}: row {row + 1} has no value in column {frame.columns[col]!r} "
            "(ragged or empty cells); every row needs one number per column"
        )
    bad = values.isna().to_numpy()
    if bad.any():
        row, col = map(int, np.argwhere(bad)[0])
        raise UserError(
            f"data file {path}: row {row + 1}, column {frame.columns[col]!r} holds "
            f"{frame.iat[row, col]!r}, not a number; every cell must be numeric"
        )
    return values.to_numpy(dtype=np.float64)


def image_shape_for(num_pixels: int, channels: int, source: str) -> tuple[int, int, int]:
    side = math.isqrt(num_pixels // channels) if num_pixels % channels == 0 else 0
    if side == 0 or side * side * channels != num_pixels:
        raise UserError(
            f"{source}: {num_pixels} pixel columns is not side^2 x channels for --channels {channels} "
            "(e.g. 64 -> 8x8, 784 -> 28x28); fix the file or --channels"
        )
    return side, side, channels


def load_csv(path: str | Path, *, channels: int = 1, num_classes: int = 10, need_labels: bool = True) -> Dataset:
    """Read one CSV into a Dataset; every malformed case raises UserError naming it."""
    path = Path(path)
    frame = _read_frame(path)
    pixel_columns = _check_columns(frame, path)
    values = _numeric(frame, path)
    has_labels = LABEL in frame.columns
    if need_labels and not has_labels:
        raise UserError(f"data file {path} has no 'label' column; training data needs labels")
    labels = None
    if has_labels:
        raw = values[:, frame.columns.get_loc(LABEL)]
        bad = (raw != np.round(raw)) | (raw < 0) | (raw >= num_classes)
        if bad.any():
            row = int(np.argmax(bad))
            raise UserError(
                f"data file {path}: row {row + 1} has label {raw[row]:g}; labels must be integers "
                f"0..{num_classes - 1} (set --num-classes for more classes)"
            )
        labels = raw.astype(np.int32)
    pixels = values[:, [frame.columns.get_loc(c) for c in pixel_columns]]
    shape = image_shape_for(pixels.shape[1], channels, str(path))
    if pixels.min() < 0:
        raise UserError(f"data file {path} has negative pixel values; pixels must be intensities >= 0")
    brightest = float(pixels.max())
    scale = next((s for s in FULL_SCALES if brightest <= s), brightest)
    images = (pixels / scale).astype(np.float32).reshape((-1, *shape))
    return Dataset(images=images, labels=labels, source=str(path))


def parse_image_shape(text: str) -> tuple[int, int, int]:
    """'224x224x3' -> (224, 224, 3); 'HxW' means one channel."""
    try:
        dims = tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        dims = ()
    if len(dims) == 2:
        dims = (*dims, 1)
    if len(dims) != 3 or min(dims) < 1:
        raise UserError(f"--synthetic {text!r} is not an image shape; write HxWxC, e.g. 28x28x1 or 224x224x3")
    return dims


def synthetic_dataset(image_shape: tuple[int, int, int], size: int, num_classes: int, seed: int) -> Dataset:
    """Random images with labels that depend on them (so a model can learn something)."""
    rng = np.random.default_rng(seed)
    images = rng.random((size, *image_shape), dtype=np.float32)
    labels = (images.reshape(size, -1).mean(axis=1) * 1e4).astype(np.int64) % num_classes
    return Dataset(images=images, labels=labels.astype(np.int32), source=f"synthetic {'x'.join(map(str, image_shape))}")


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
        if depth < 1 or workers < 1:
            raise UserError(f"--prefetch and --input-workers must be >= 1, got {depth} and {workers}")
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
