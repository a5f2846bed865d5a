"""Know before you rent: the input pipeline alone (no model) on this host -- images/s, and
per core, for each source and worker count -- and how many cores a target rate needs.

jaxcnn bench-input                                   # photo-like 500x375 JPEGs -> 224, workers 0..cores
jaxcnn bench-input --target 5462 --out results/input_rates.csv    # the H200's ResNet-50 rate
jaxcnn bench-input --folder photos/train --sources folder,jpeg --workers 1,2

Sources (--sources), each read by jaxcnn's own loader (grain workers, batches placed on the
device as uint8) at --image-size:
  folder-resize  the image folder, each file fully decoded and resized (no crop)
  folder         the image folder, a random resized crop + flip per example (--augment imagenet)
  jpeg           the folder prepared as JPEG shards (shorter side --short-side, --quality), random crops
  raw            the folder prepared as raw uint8 shards (shorter side --short-side), random crops
Without --folder, --images photo-like JPEGs (smooth colour fields, shapes, texture and
grain, not flat colour; --stored-size, quality 90) are written once to ~/.cache/jaxcnn/;
the shards are prepared once beside the folder (the time it took is printed). A worker
count of 0 decodes on a thread of this process. Per core: images/s / max(workers, 1) (the
process that places the batches takes some of a core too); the cores a target needs use
each source's best per-core rate. The CSV has a row per (source, workers); the verdict is
printed and written beside it (.txt).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from jaxcnn.commands import cli
from jaxcnn.errors import UserError

PROG = "jaxcnn bench-input"
SOURCES = ("folder-resize", "folder", "jpeg", "raw")
COLUMNS = [
    "source", "workers", "images_per_second", "images_per_second_per_core", "cores_for_target", "target",
    "crop", "image_size", "stored", "batch_size", "batches", "cpu_count",
]  # fmt: skip


def parse_flags(argv=None):
    parser = cli.FlagParser(prog=PROG, description=__doc__)
    parser.add_argument("--folder", help="an image folder of class subfolders (default: photo-like JPEGs, made once)")
    parser.add_argument("--images", type=int, default=1024, help="photo-like JPEGs written when no --folder")
    parser.add_argument("--stored-size", default="375x500", help="HxW of the photo-like JPEGs")
    parser.add_argument("--image-size", default="224x224", help="HxW the pipeline delivers")
    parser.add_argument("--short-side", type=int, default=256, help="shorter side of the prepared shards")
    parser.add_argument("--quality", type=int, default=90, help="JPEG quality of the jpeg shards")
    parser.add_argument("--sources", type=cli.name_list, default=SOURCES, help="which sources to measure")
    default_workers = tuple(range(0, (os.cpu_count() or 1) + 1))
    parser.add_argument("--workers", type=cli.int_list, default=default_workers, help="worker counts")
    parser.add_argument("--batch-size", type=int, default=64, help="images per batch")
    parser.add_argument("--batches", type=int, default=12, help="batches timed per row (after the first)")
    parser.add_argument("--target", type=float, default=5462.0, help="images/s to feed (H200 ResNet-50: 5,462)")
    parser.add_argument("--out", help="write the rows to this CSV, the verdict beside it (default: print only)")
    return parser.parse_args(argv)


def photo_like(rng, height: int, width: int):
    """A photo-like RGB picture: smooth colour gradients, a few soft shapes, mid-frequency
    texture and sensor grain -- what makes a JPEG cost what a photograph costs to decode."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFilter

    def field(cells_h, cells_w):
        small = Image.fromarray(rng.integers(0, 256, (cells_h, cells_w, 3), dtype=np.uint8))
        return np.asarray(small.resize((width, height), Image.Resampling.BICUBIC), np.float32)

    picture = Image.fromarray(np.uint8(0.7 * field(3, 4) + 0.3 * field(height // 24, width // 24)))
    draw = ImageDraw.Draw(picture)
    for _ in range(rng.integers(3, 8)):
        x, y = rng.integers(0, width), rng.integers(0, height)
        rx, ry = rng.integers(10, width // 3), rng.integers(10, height // 3)
        draw.ellipse((x - rx, y - ry, x + rx, y + ry), fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
    pixels = np.asarray(picture.filter(ImageFilter.GaussianBlur(1.5)), np.float32)
    pixels += field(height // 4, width // 4) * 0.15 - 19 + rng.normal(0, 4, pixels.shape)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def photo_folder(path: Path, images: int, size: tuple[int, int]) -> Path:
    """`images` photo-like JPEGs (quality 90) in 4 class folders, written whole or not at all."""
    import shutil
    import tempfile

    import numpy as np

    if path.is_dir():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part"))
    try:
        rng = np.random.default_rng(0)
        for i in range(images):
            folder = partial / f"class{i % 4}"
            folder.mkdir(exist_ok=True)
            photo_like(rng, *size).save(folder / f"{i:06d}.jpg", quality=90)
        partial.rename(path)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return path


def prepared(folder: Path, fmt: str, short_side: int, quality: int) -> Path:
    """The folder as shards of `fmt`, prepared once beside it (on every core)."""
    import time

    from jaxcnn import __version__
    from jaxcnn.data import load_image_folder
    from jaxcnn.data.shard_writer import ShardSettings, write_shards
    from jaxcnn.data.shards import is_prepared

    name = f"{fmt}-{short_side}" + (f"-q{quality}" if fmt == "jpeg" else "")
    out = folder.parent / f"{folder.name}-shards" / name
    if is_prepared(out):
        return out
    data = load_image_folder(folder, image_size=(1, 1))  # the paths, labels and classes
    settings = ShardSettings(fmt, short_side, None, quality, 3, 256)
    started = time.perf_counter()
    write_shards(list(data.images.paths), data.labels, data.classes, out, settings, workers=os.cpu_count() or 1,
                 show=None, version=__version__)  # fmt: skip
    seconds = time.perf_counter() - started
    print(f"{PROG}: prepared {len(data):,} images as {fmt} shards in {seconds:.1f} s "
          f"({len(data) / seconds:,.0f} img/s on {os.cpu_count()} cores): {out}", flush=True)  # fmt: skip
    return out


def pipeline_rate(dataset, augment, workers: int, batch_size: int, batches: int) -> float:
    """Images/s through jaxcnn's loader alone (read, decoded, cropped, placed), after its first batch."""
    import time

    import jax
    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    from jaxcnn.data import Loader
    from jaxcnn.sharding.placement import BatchPlacement

    mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:1])
    sharding = NamedSharding(mesh, PartitionSpec())
    shape = (batch_size, *dataset.image_shape)
    placement = BatchPlacement(
        jax.ShapeDtypeStruct(shape, np.uint8, sharding=sharding),
        jax.ShapeDtypeStruct((batch_size,), np.int32, sharding=sharding),
    )
    per_epoch = len(dataset) // batch_size
    epochs = math.ceil((batches + 1) / per_epoch)
    loader = Loader(dataset, augment=augment, workers=workers)
    stream = loader.batches([per_epoch] * epochs, [placement] * epochs, seed=0)
    try:
        jax.block_until_ready(stream.next())  # the workers starting
        start = time.perf_counter()
        for _ in range(batches):
            jax.block_until_ready(stream.next())
        seconds = time.perf_counter() - start
    finally:
        stream.close()
    return batches * batch_size / seconds


def main(argv=None) -> list[dict]:
    args = parse_flags(argv)
    unknown = [s for s in args.sources if s not in SOURCES]
    if unknown or not args.workers or min(args.workers) < 0 or args.batches < 1 or args.target <= 0:
        raise UserError(f"--sources from {', '.join(SOURCES)}; --workers >= 0, --batches >= 1, --target > 0")
    from jaxcnn import results
    from jaxcnn.data import load_image_folder, load_source
    from jaxcnn.data.crops import RandomResizedCrop
    from jaxcnn.data.folders import parse_image_size

    (out,) = cli.writable_outputs(args.out)
    size, stored = parse_image_size(args.image_size), parse_image_size(args.stored_size)
    if args.folder:
        folder = Path(args.folder)
    else:
        folder = Path.home() / ".cache" / "jaxcnn" / f"photos-{args.stored_size}-{args.images}"
        if not folder.is_dir():
            print(f"{PROG}: writing {args.images:,} photo-like {args.stored_size} JPEGs into {folder}", flush=True)
        photo_folder(folder, args.images, stored)
    crop, crop_name = RandomResizedCrop(), "RandomResizedCrop+flip"
    sources = {}
    for name in args.sources:
        if name.startswith("folder"):
            data = load_image_folder(folder, channels=3, image_size=size)
            stored_text = f"files ({args.stored_size})" if not args.folder else "files"
        else:
            shards = prepared(folder, name, args.short_side, args.quality)
            data = load_source(shards, image_size=args.image_size, num_classes=1 << 30)
            stored_text = f"{name} shards, shorter side {args.short_side}" + (
                f", q{args.quality}" if name == "jpeg" else ""
            )
        if len(data) < 2 * args.batch_size:
            raise UserError(f"{folder} holds {len(data)} images; --batch-size {args.batch_size} needs twice that")
        sources[name] = (data, None if name == "folder-resize" else crop, stored_text)
    rows = []
    for name, (data, augment, stored_text) in sources.items():
        for workers in args.workers:
            rate = pipeline_rate(data, augment, workers, args.batch_size, args.batches)
            per_core = rate / max(workers, 1)
            rows.append({
                "source": name, "workers": workers, "images_per_second": rate,
                "images_per_second_per_core": per_core, "target": args.target,
                "crop": "resize" if augment is None else crop_name, "image_size": args.image_size,
                "stored": stored_text, "batch_size": args.batch_size, "batches": args.batches,
                "cpu_count": os.cpu_count(),
            })  # fmt: skip
            print(f"{name:>13} {workers:2d} workers: {rate:7,.0f} img/s   {per_core:7,.0f} img/s per core", flush=True)
    lines = [f"{PROG}: to feed {args.target:,.0f} images/s at {args.image_size} ({os.cpu_count()} cores here):"]
    for name in sources:
        best = max(r["images_per_second_per_core"] for r in rows if r["source"] == name)
        cores = math.ceil(args.target / best)
        for r in rows:
            if r["source"] == name:
                r["cores_for_target"] = cores
        lines.append(f"  {name:>13}: {best:7,.0f} images/s per core -> {cores} cores")
    print("\n".join(lines))
    if out:
        print("wrote", results.write_csv(out, rows, COLUMNS))
        verdict = out.with_suffix(".txt")
        verdict.write_text("\n".join(lines) + "\n")
        print("wrote", verdict)
    return rows


if __name__ == "__main__":
    cli.run_main(PROG, main)
