"""Where images come from: Kaggle-layout CSVs and synthetic images, as in-memory Datasets.

Files use the Kaggle "Digit Recognizer" layout: an optional `label` column, then
`pixel0` ... `pixel{N-1}`. N = side^2 * C (C from `channels`, pixels in HWC order).
Pixels are scaled to [0, 1] by the file's full scale: the smallest conventional maximum
(1, 16, 255, 65535) that holds its brightest pixel -- so a train and a test file from
the same source scale identically even if one lacks a fully bright pixel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from jaxcnn.errors import UserError

FULL_SCALES = (1.0, 16.0, 255.0, 65535.0)
LABEL = "label"


@dataclass(frozen=True)
class Dataset:
    """Images and labels. `images` is a float32 [N, H, W, C] array in [0, 1], a uint8 one
    in 0-255 (scaled to [0, 1] on the devices: jaxcnn.models.unit_pixels), or anything that
    indexes like one (an image folder's uint8 `ImageFiles`, decoded when indexed)."""

    images: np.ndarray  # or folders.ImageFiles
    labels: np.ndarray | None  # int32 [N], None for a label-free test file
    source: str
    classes: tuple[str, ...] | None = None  # an image folder's class names, label order

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(self.images.shape[1:])

    @property
    def in_memory(self) -> bool:
        return isinstance(self.images, np.ndarray)

    def __len__(self) -> int:
        return len(self.images)

    def subset(self, index, source: str | None = None) -> Dataset:
        """The examples at `index` (indices or a boolean mask); files stay on disk."""
        images = self.images[index] if self.in_memory else self.images.subset(index)
        labels = None if self.labels is None else self.labels[index]
        return Dataset(images, labels, source or self.source, self.classes)

    def loaded(self) -> Dataset:
        """The same examples with every image decoded into memory (a test set, read every epoch)."""
        return self if self.in_memory else Dataset(self.images.decode_all(), self.labels, self.source, self.classes)


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
    images = (pixels / full_scale(float(pixels.max()))).astype(np.float32).reshape((-1, *shape))
    return Dataset(images=images, labels=labels, source=str(path))


def full_scale(brightest: float) -> float:
    """What a CSV's pixels are divided by: the smallest of FULL_SCALES that holds its
    brightest pixel (beyond them, that pixel's value)."""
    return next((s for s in FULL_SCALES if brightest <= s), brightest)


def csv_full_scale(path: str | Path) -> float:
    """The full scale `load_csv` divides the CSV at `path` by (a server exporting the
    model needs the number: jaxcnn.export.sidecar)."""
    path = Path(path)
    frame = _read_frame(path)
    columns = [frame.columns.get_loc(c) for c in _check_columns(frame, path)]
    return full_scale(float(_numeric(frame, path)[:, columns].max()))


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
