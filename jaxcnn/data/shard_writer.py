"""Writing prepared shards (`jaxcnn prepare`): each example decoded once, resized to the
stored size and re-stored raw or as a small JPEG, shard by shard in parallel processes,
atomically and resumably. jaxcnn.data.shards describes the format and reads it back.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import io
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter
from PIL import Image

from jaxcnn.data.resize import resize
from jaxcnn.data.shards import (
    _DECODE_ERRORS,
    FORMAT_VERSION,
    FORMATS,
    LABELS,
    MANIFEST,
    MODES,
    PROGRESS,
    RAW_HEADER,
    WRITER_OPTIONS,
    file_sha256,
)
from jaxcnn.errors import UserError


@dataclass(frozen=True)
class ShardSettings:
    """How `jaxcnn prepare` stores images: the format, how they are sized, the JPEG quality,
    the channels and how many examples go in a shard."""

    format: str = "jpeg"
    short_side: int = 256
    image_size: tuple[int, int] | None = None  # (H, W): every image stored at exactly this size
    quality: int = 90
    channels: int = 3
    shard_size: int = 1024

    def __post_init__(self):
        if self.format not in FORMATS:
            raise UserError(f"--format {self.format!r} is not one of {', '.join(FORMATS)}")
        if self.short_side < 1 or self.shard_size < 1 or not 1 <= self.quality <= 100:
            raise UserError("--short-side and --shard-size must be >= 1 and --quality 1..100")
        if self.channels not in MODES or (self.format == "jpeg" and self.channels == 4):
            raise UserError(f"--channels {self.channels} cannot be stored as {self.format}; use 1 or 3 (raw: also 4)")


# --- writing -----------------------------------------------------------------------------


def _open_image(item, channels: int, draft_to: tuple[int, int] | None) -> Image.Image:
    """A file path or a uint8 HxWxC array as a Pillow image of the wanted mode."""
    if isinstance(item, np.ndarray):
        return Image.fromarray(item[..., 0] if item.shape[-1] == 1 else item).convert(MODES[channels])
    try:
        with Image.open(item) as image:
            if draft_to is not None and image.format == "JPEG":
                image.draft(MODES[channels], draft_to)  # decode at 1/2, 1/4, 1/8 in the DCT where that suffices
            return image.convert(MODES[channels])
    except _DECODE_ERRORS as err:
        raise UserError(f"image {item} cannot be decoded ({err}); fix or remove it, then run prepare again") from None


def stored_size(height: int, width: int, settings: ShardSettings) -> tuple[int, int]:
    """(H, W) an image of `height` x `width` is stored at."""
    if settings.image_size is not None:
        return settings.image_size
    scale = settings.short_side / min(height, width)
    if scale >= 1:  # never enlarged: that adds bytes, not information
        return height, width
    return max(1, round(height * scale)), max(1, round(width * scale))


def _header_size(item) -> tuple[int, int] | None:
    if isinstance(item, np.ndarray):
        return item.shape[0], item.shape[1]
    try:
        with Image.open(item) as image:
            return image.size[1], image.size[0]
    except _DECODE_ERRORS as err:
        raise UserError(f"image {item} cannot be decoded ({err}); fix or remove it, then run prepare again") from None


def encode_example(item, settings: ShardSettings) -> tuple[bytes, tuple[int, int, int]]:
    """One image (a path or a uint8 array) as a record, and the shape it is stored at."""
    height, width = _header_size(item)
    target = stored_size(height, width, settings)
    draft = None if settings.image_size is not None or target == (height, width) else target[::-1]
    image = _open_image(item, settings.channels, draft)
    shape = (*target, settings.channels)
    pixels = np.asarray(image, dtype=np.uint8).reshape(image.size[1], image.size[0], settings.channels)
    pixels = resize(pixels, target)  # as the readers resize (jaxcnn.data.resize)
    if settings.format == "raw":
        return RAW_HEADER.pack(*shape) + np.ascontiguousarray(pixels).tobytes(), shape
    out = io.BytesIO()
    Image.fromarray(pixels[..., 0] if settings.channels == 1 else pixels).save(
        out, format="JPEG", quality=settings.quality
    )
    return out.getvalue(), shape


def _write_shard(path: str, items: Sequence, settings: ShardSettings) -> dict:
    """Write one shard (under a temporary name, renamed when closed): its entry for the manifest."""
    partial = path + ".tmp"
    writer = ArrayRecordWriter(partial, WRITER_OPTIONS)
    shapes = set()
    try:
        for item in items:
            record, shape = encode_example(item, settings)
            writer.write(record)
            shapes.add(shape)
    finally:
        writer.close()
    os.replace(partial, path)
    return {"count": len(items), "bytes": os.path.getsize(path), "sha256": file_sha256(path), "shapes": sorted(shapes)}


def _item_key(item) -> str:
    if isinstance(item, np.ndarray):
        return hashlib.sha256(item.tobytes()).hexdigest()
    stat = os.stat(item)
    return f"{item}:{stat.st_size}:{stat.st_mtime_ns}"


def shard_key(items: Sequence, labels: np.ndarray, settings: ShardSettings) -> str:
    """What went into a shard: the format version, the settings, each input and its label."""
    digest = hashlib.sha256(json.dumps([FORMAT_VERSION, asdict(settings)]).encode())
    for item, label in zip(items, labels, strict=True):
        digest.update(f"{_item_key(item)}:{int(label)}\n".encode())
    return digest.hexdigest()


def _write_json(path: Path, value) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


def _read_progress(partial: Path) -> dict:
    try:
        progress = json.loads((partial / PROGRESS).read_text())
        return progress["shards"] if progress.get("format_version") == FORMAT_VERSION else {}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


@dataclass
class Progress:
    """Images written so far, shown every `every` seconds (and at the end) by `show`."""

    total: int
    show: Callable[[str], None] | None = print
    every: float = 2.0
    done: int = 0
    started: float = field(default_factory=time.perf_counter)
    _shown: float = 0.0

    def add(self, count: int, shards_done: int, shards: int) -> None:
        self.done += count
        now = time.perf_counter()
        if self.show and (now - self._shown >= self.every or shards_done == shards):
            rate = self.done / max(now - self.started, 1e-9)
            self.show(
                f"prepare: {shards_done}/{shards} shards, {self.done:,}/{self.total:,} images ({rate:,.0f} img/s)"
            )
            self._shown = now


def write_shards(
    items: Sequence, labels: np.ndarray, classes: Sequence[str], out: str | Path, settings: ShardSettings,
    *, workers: int = 0, show: Callable[[str], None] | None = print, version: str = "",
) -> dict:  # fmt: skip
    """Store `items` (image paths or uint8 HxWxC arrays) with their `labels` as shards in
    `out`, which must not exist; return the manifest. `workers` processes encode the shards
    (0: this process). Interrupted or failed, the shards finished so far stay in
    `.<out>.partial/` and a rerun with the same inputs and settings keeps them."""
    out = Path(out)
    if out.exists():
        what = "holds prepared shards" if (out / MANIFEST).exists() else "exists"
        raise UserError(f"{out} already {what}; remove it or give another --out")
    if len(items) == 0:
        raise UserError("nothing to prepare: no images")
    labels = np.asarray(labels, np.int32)
    partial = out.parent / f".{out.name}.partial"
    partial.mkdir(parents=True, exist_ok=True)
    starts = range(0, len(items), settings.shard_size)
    names = [f"shard-{i:05d}-of-{len(starts):05d}.array_record" for i in range(len(starts))]
    keys = [
        shard_key(items[s : s + settings.shard_size], labels[s : s + settings.shard_size], settings) for s in starts
    ]
    done = _read_progress(partial)
    entries: dict[str, dict] = {}
    for name, key in zip(names, keys, strict=True):
        entry, path = done.get(name) or {}, partial / name
        same = entry.get("key") == key and path.is_file() and path.stat().st_size == entry.get("bytes")
        if same and file_sha256(path) == entry.get("sha256"):
            entries[name] = entry
    for stale in partial.iterdir():  # another plan's shards, temporary files
        if stale.name not in entries and stale.name != PROGRESS:
            stale.unlink()
    np.save(partial / LABELS, labels)

    def note(name: str, entry: dict) -> None:
        entries[name] = entry
        _write_json(partial / PROGRESS, {"format_version": FORMAT_VERSION, "shards": entries})
        progress.add(entry["count"], len(entries), len(names))

    progress = Progress(len(items), show)
    if entries and show:
        show(f"prepare: resuming: {len(entries)} of {len(names)} shards already written in {partial}")
    pending = [(i, n) for i, n in enumerate(names) if n not in entries]
    jobs = [(str(partial / n), items[i * settings.shard_size : (i + 1) * settings.shard_size], keys[i], n)
            for i, n in pending]  # fmt: skip
    if workers <= 0:
        for path, chunk, key, name in jobs:
            note(name, {**_write_shard(path, chunk, settings), "key": key})
    else:
        with concurrent.futures.ProcessPoolExecutor(workers) as pool:
            futures = {pool.submit(_write_shard, path, chunk, settings): (key, name) for path, chunk, key, name in jobs}
            try:
                for future in concurrent.futures.as_completed(futures):
                    key, name = futures[future]
                    note(name, {**future.result(), "key": key})
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)
                raise
    shapes = {tuple(s) for name in names for s in entries[name]["shapes"]}
    manifest = {
        "format_version": FORMAT_VERSION,
        "jaxcnn_version": version,
        "count": len(items),
        "classes": list(classes),
        "format": settings.format,
        "quality": settings.quality if settings.format == "jpeg" else None,
        "channels": settings.channels,
        "short_side": None if settings.image_size else settings.short_side,
        "image_size": list(settings.image_size) if settings.image_size else None,
        "image_shape": list(next(iter(shapes))) if len(shapes) == 1 else None,
        "labels_sha256": file_sha256(partial / LABELS),
        "shards": [{"file": n, **{k: entries[n][k] for k in ("count", "bytes", "sha256")}} for n in names],
    }
    _write_json(partial / MANIFEST, manifest)
    (partial / PROGRESS).unlink()
    partial.rename(out)
    return manifest
