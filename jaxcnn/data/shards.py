"""Prepared shards: a dataset decoded, resized and re-stored once (`jaxcnn prepare`), in
grain's ArrayRecord format, so training reads small records instead of large photographs.

    shards/train/manifest.json                     what is there (below)
    shards/train/labels.npy                        int32 [N], the label of each example
    shards/train/shard-00000-of-00012.array_record  --shard-size examples each, in order

Each record is one image, either `raw` (a 5-byte header, height and width as uint16 and
the channel count, then the HxWxC uint8 pixels: no decoding at all) or `jpeg` (the image
re-encoded at --quality: the FFCV trick, 5-10x smaller than raw, a fast decode because it is
small). Images are stored at their shorter side --short-side (downscaled only, aspect kept),
so random crops are still drawn from the whole picture when training; or, with
--image-size HxW, at exactly that size (what a model without crops reads directly).

The manifest says the format version (a reader refuses another), the jaxcnn version, the
example count, the class names (label order), the channels, how the images were sized
(`short_side` or `image_size`; `image_shape` when every image has one shape) and each shard
with its example count, byte size and sha256. `ShardImages` reads the records by global index
through grain's `ArrayRecordDataSource` (random access), so the loader's per-(epoch, index)
order, resume and per-process rows work as for any other source.

Writing is atomic and resumable: everything goes into `.<name>.partial/` beside the
output, renamed to the output when complete; each finished shard is noted there with a key
of what went into it (settings, files and labels) and its checksum, and a rerun keeps the
shards whose key and checksum still match.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from grain.sources import ArrayRecordDataSource
from PIL import Image, UnidentifiedImageError

from jaxcnn.data.crops import centre_box, example_crop, random_box
from jaxcnn.data.resize import decode_jpeg_rgb, mirrored, resize, resize_box
from jaxcnn.errors import UserError

FORMAT_VERSION = 1
FORMATS = ("raw", "jpeg")
MANIFEST = "manifest.json"
LABELS = "labels.npy"
PROGRESS = "progress.json"  # the manifest in progress, in the partial directory
MODES = {1: "L", 3: "RGB", 4: "RGBA"}
RAW_HEADER = struct.Struct("<HHB")  # height, width, channels
WRITER_OPTIONS = "group_size:1,uncompressed"  # one record per group: random access (grain's advice)
_DECODE_ERRORS = (UnidentifiedImageError, OSError, SyntaxError, ValueError)


def is_prepared(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def read_manifest(directory: str | Path) -> dict:
    """The manifest of a prepared directory, checked: its version, and every shard there at its size."""
    directory = Path(directory)
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        version = manifest.get("format_version")
    except (OSError, ValueError, AttributeError) as err:
        raise UserError(f"{directory / MANIFEST} cannot be read ({err}); prepare the shards again") from None
    if version != FORMAT_VERSION:
        raise UserError(
            f"{directory} holds shards of format version {version}, written by jaxcnn "
            f"{manifest.get('jaxcnn_version') or '?'}; this jaxcnn reads version {FORMAT_VERSION}: run jaxcnn prepare again"
        )
    try:
        shards = [(s["file"], int(s["count"]), int(s["bytes"])) for s in manifest["shards"]]
        count, channels = int(manifest["count"]), int(manifest["channels"])
        if manifest["format"] not in FORMATS or sum(c for _, c, _ in shards) != count or channels not in MODES:
            raise ValueError("its counts, format or channels do not add up")
    except (KeyError, TypeError, ValueError) as err:
        raise UserError(
            f"{directory / MANIFEST} is not a complete manifest ({err}); prepare the shards again"
        ) from None
    for name, _, size in shards:
        path = directory / name
        if not path.is_file():
            raise UserError(f"shard {path} is missing; prepare the shards again")
        if path.stat().st_size != size:
            raise UserError(
                f"shard {path} is {path.stat().st_size:,} bytes, not the {size:,} written (truncated or damaged); "
                "prepare the shards again"
            )
    return manifest


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True, eq=False)
class ShardImages:
    """Prepared shards that index like an image folder's `ImageFiles`: `images[idx]` reads
    and decodes just those records, as uint8 [n, H, W, C] (0-255) at `image_size`, each
    fitted as `fit` says ("resize": the whole image; "centre": evaluation's centre crop,
    --augment imagenet); `crops(rows, draws)` the random resized crops of training
    (jaxcnn.data.crops), cut from the stored image. `decode(i)` is one example as stored.
    Small and picklable: grain's workers each open their own readers."""

    directory: str
    files: tuple[str, ...]
    counts: tuple[int, ...]
    format: str
    channels: int
    image_size: tuple[int, int]  # (H, W) every image is read at
    fit: str = "resize"
    rows: np.ndarray | None = None  # which examples of the shards this view holds (None: all)

    dtype = np.dtype(np.uint8)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (len(self), *self.image_size, self.channels)

    def __len__(self) -> int:
        return sum(self.counts) if self.rows is None else len(self.rows)

    def _source(self) -> ArrayRecordDataSource:
        source = self.__dict__.get("_data_source")
        if source is None:
            # "path[start:end]": no file is opened to count its records (the manifest has them)
            paths = [f"{Path(self.directory) / f}[0:{n}]" for f, n in zip(self.files, self.counts, strict=True)]
            source = ArrayRecordDataSource(paths)
            object.__setattr__(self, "_data_source", source)
        return source

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_data_source"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def _key(self, row) -> int:
        return int(row if self.rows is None else self.rows[row])

    def _pixels(self, row) -> np.ndarray:
        """Example `row` of this view as stored: HxWxC uint8."""
        key = self._key(row)
        try:
            record = self._source()[key]
        except Exception as err:  # the reader's own errors: a damaged file
            raise UserError(f"record {key} of {self.directory} cannot be read ({err}); prepare again") from None
        if self.format == "raw":
            if len(record) >= RAW_HEADER.size:
                h, w, c = RAW_HEADER.unpack_from(record)
                if len(record) == RAW_HEADER.size + h * w * c and c == self.channels:
                    return np.frombuffer(record, np.uint8, offset=RAW_HEADER.size).reshape(h, w, c)
            raise UserError(f"record {key} of {self.directory} is damaged (wrong length); prepare the shards again")
        if self.channels == 3:  # OpenCV (jaxcnn.data.resize): the same pixels as Pillow, faster
            pixels = decode_jpeg_rgb(record)
            if pixels is None:
                raise UserError(f"record {key} of {self.directory} cannot be decoded; prepare again")
            return pixels
        try:
            image = Image.open(io.BytesIO(record))
            image = image.convert(MODES[self.channels])
            return np.asarray(image, dtype=np.uint8).reshape(image.size[1], image.size[0], self.channels)
        except _DECODE_ERRORS as err:
            raise UserError(f"record {key} of {self.directory} cannot be decoded ({err}); prepare again") from None

    def decode(self, row: int) -> np.ndarray:
        """Example `row` of this view as stored: HxWxC uint8."""
        return self._pixels(row)

    def _fitted(self, row) -> np.ndarray:
        pixels = self._pixels(row)
        if self.fit == "centre":
            return resize_box(pixels, centre_box(*pixels.shape[:2], self.image_size), self.image_size)
        return resize(pixels, self.image_size)

    def _stack(self, images: list[np.ndarray]) -> np.ndarray:
        return np.stack(images) if images else np.zeros((0, *self.shape[1:]), np.uint8)

    def __getitem__(self, index) -> np.ndarray:
        rows = np.arange(len(self))[index]
        if np.ndim(rows) == 0:
            return self[np.asarray([rows])][0]
        return self._stack([self._fitted(row) for row in rows])

    def crops(self, rows: np.ndarray, draws: np.ndarray) -> np.ndarray:
        """The images at `rows`, each a random resized crop of the stored image (then maybe
        flipped) as its row of `draws` says (jaxcnn.data.crops.RandomResizedCrop.draws)."""
        out = []
        for row, draws_D in zip(rows, draws, strict=True):
            uniforms_A4, flip = example_crop(draws_D)
            pixels = self._pixels(row)
            pixels = resize_box(pixels, random_box(uniforms_A4, *pixels.shape[:2]), self.image_size)
            out.append(mirrored(pixels) if flip else pixels)
        return self._stack(out)

    def subset(self, index) -> ShardImages:
        """The examples at `index` (indices or a boolean mask), still in the shards."""
        rows = np.arange(len(self))[index]
        return dataclasses.replace(self, rows=rows if self.rows is None else self.rows[rows])

    def decode_all(self) -> np.ndarray:
        """Every image decoded at once (a test set, read every epoch)."""
        return self[:]


def load_shards(
    directory: str | Path, *, image_size: tuple[int, int] | None = None, classes: Sequence[str] | None = None,
    fit: str = "resize",
) -> tuple[ShardImages, np.ndarray, tuple[str, ...]]:  # fmt: skip
    """(images, labels, class names) of a prepared directory, read at `image_size` (None: the
    stored size, which every image must share) fitted as `fit` says. With `classes` (the
    training set's), labels are renumbered to them by name; a class they lack is an error."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    try:
        labels = np.load(directory / LABELS)
    except (OSError, ValueError) as err:
        raise UserError(f"{directory / LABELS} cannot be read ({err}); prepare the shards again") from None
    if labels.shape != (manifest["count"],) or file_sha256(directory / LABELS) != manifest.get("labels_sha256"):
        raise UserError(f"{directory / LABELS} does not match its manifest; prepare the shards again")
    names = tuple(manifest["classes"])
    if classes is not None:
        unknown = [n for n in names if n not in classes]
        if unknown:
            raise UserError(f"prepared set {directory} has class {unknown[0]!r}, which the training set lacks")
        labels = np.asarray([list(classes).index(n) for n in names], np.int32)[labels]
        names = tuple(classes)
    if image_size is None:
        if manifest["image_shape"] is None:
            raise UserError(
                f"the images in {directory} differ in size (shorter side {manifest['short_side']}); "
                "pass --image-size HxW to read them at one size"
            )
        image_size = tuple(manifest["image_shape"][:2])
    files = tuple(s["file"] for s in manifest["shards"])
    counts = tuple(int(s["count"]) for s in manifest["shards"])
    channels = int(manifest["channels"])
    images = ShardImages(str(directory), files, counts, manifest["format"], channels, tuple(image_size), fit)
    return images, labels.astype(np.int32), names
