"""How fast can one core turn ImageNet-like JPEGs into RandomResizedCrop training images?

python experiments/jpeg_decode.py --out results/jpeg_decode.csv
python experiments/jpeg_decode.py --sizes 224 --rounds 3       # quicker

Writes --images photo-like JPEGs (500x375, quality 90: smooth gradients, shapes, texture
and noise -- not flat colour, which decodes unrealistically fast) into --folder once, draws
one RandomResizedCrop box per image (jaxcnn.data.crops, as `--augment imagenet` does), then
decodes every image to each of --sizes on one thread, one way after another, for --rounds
rounds:

  full-decode      the whole JPEG decoded, the box cropped, then resized (torchvision's
                   PIL path, and jaxcnn's before --augment imagenet): the baseline
  box-resize       the whole JPEG decoded, only the box resampled (`resize(box=...)`)
  draft+box        `Image.draft`: the JPEG decoded at 1/2, 1/4 or 1/8 scale in the DCT
                   domain when the box stays at least --size, then the box resampled
                   (jaxcnn.data.folders.decode_box: what --augment imagenet runs)
  simplejpeg       libjpeg-turbo through simplejpeg (min_width/min_height: the same DCT
                   scaling), then the box resampled by Pillow; only where it is importable

Rounds alternate the ways, so a drift in the machine's speed hits each alike. One thread
is one input-worker core: images/s here is images per second of this thread's CPU time
(`time.thread_time`), so other work sharing the machine slows the wall clock, not the
figure; the input pipeline runs one such decoder per grain worker process. A 1/2-scale draft needs a box of at least
twice the size on both sides: from a 375-pixel-high photograph, never at 224, often at 128.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
from PIL import Image

from jaxcnn import results
from jaxcnn.commands import cli
from jaxcnn.data.crops import RandomResizedCrop, draft_reduction, example_crop, random_box
from jaxcnn.data.folders import decode_box
from jaxcnn.errors import UserError

PROG = "jpeg_decode.py"
COLUMNS = [
    "image_size", "way", "images_per_second_per_core", "speedup", "drafted_share", "cpu_seconds_per_round_median",
    "rounds", "images", "stored_size", "quality", "pillow", "machine",
]  # fmt: skip
STORED = (375, 500)  # (H, W): a typical ImageNet photograph


def parse_flags(argv=None):
    parser = cli.experiment_parser(PROG, __doc__)
    g = parser.add_argument_group("jpeg decode")
    g.add_argument("--folder", help="where the JPEGs go (default: ~/.cache/jaxcnn/photo-jpeg-500x375-<images>)")
    g.add_argument("--images", type=int, default=200, help="JPEGs written and decoded per round (default %(default)s)")
    g.add_argument("--sizes", type=cli.int_list, default=(224, 128), help="the model's input sides (default 224,128)")
    g.add_argument("--rounds", type=int, default=5, help="rounds, each decoding every image every way (default 5)")
    g.add_argument("--seed", type=int, default=0)
    cli.add_output_flags(g, out_help="write the rows to this CSV (default: print only)")
    return parser.parse_args(argv)


def photo_like(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """A uint8 [H, W, 3] image with a photograph's statistics, roughly: smooth colour
    gradients, a few soft-edged shapes, fine texture and sensor noise."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    image = np.zeros((height, width, 3), np.float32)
    for c in range(3):  # a smooth background: a tilted gradient and a slow wave per channel
        a, b, f = rng.uniform(-1, 1), rng.uniform(-1, 1), rng.uniform(0.005, 0.03)
        image[..., c] = 128 + 60 * (a * x / width + b * y / height) + 40 * np.sin(f * (x + 2 * y) + rng.uniform(0, 6))
    for _ in range(int(rng.integers(4, 9))):  # shapes: soft ellipses of their own colour
        cy, cx = rng.uniform(0, height), rng.uniform(0, width)
        ry, rx = rng.uniform(15, height / 3), rng.uniform(15, width / 3)
        inside = np.clip(1.5 - np.hypot((y - cy) / ry, (x - cx) / rx), 0, 1)[..., None]
        image = image * (1 - inside) + rng.uniform(0, 255, 3) * inside
    texture = np.sin(rng.uniform(0.2, 0.6) * x) * np.cos(rng.uniform(0.2, 0.6) * y)
    image += 12 * texture[..., None] + rng.normal(0, 6, image.shape)
    return np.clip(image, 0, 255).astype(np.uint8)


def write_photos(folder: Path, count: int, seed: int) -> list[Path]:
    """`count` photo-like JPEGs (quality 90) in `folder`: written once, then reused."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = [folder / f"{i:05d}.jpg" for i in range(count)]
    for path in paths:
        if not path.exists():
            partial = path.with_suffix(".part")
            Image.fromarray(photo_like(rng, *STORED)).save(partial, format="JPEG", quality=90)
            os.replace(partial, path)
    return paths


def full_decode(path, box, size):
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB").crop(box).resize(size[::-1], Image.Resampling.BILINEAR))


def box_resize(path, box, size):
    return decode_box(str(path), 3, size, lambda h, w: box, draft=False)


def draft_box(path, box, size):
    return decode_box(str(path), 3, size, lambda h, w: box, draft=True)


def simplejpeg_box(path, box, size):
    import simplejpeg

    data = Path(path).read_bytes()
    height, width, _, _ = simplejpeg.decode_jpeg_header(data)
    box_w, box_h = box[2] - box[0], box[3] - box[1]
    min_w, min_h = math.ceil(width * size[1] / box_w), math.ceil(height * size[0] / box_h)
    pixels = simplejpeg.decode_jpeg(data, colorspace="RGB", min_width=min_w, min_height=min_h)
    eighths = round(8 * pixels.shape[1] / width)  # libjpeg-turbo decodes at k/8 scale, sizes rounded up
    limits = (pixels.shape[1], pixels.shape[0]) * 2
    scaled = tuple(min(v * eighths / 8, limit) for v, limit in zip(box, limits, strict=True))
    return np.asarray(Image.fromarray(pixels).resize(size[::-1], Image.Resampling.BILINEAR, box=scaled))


def main(argv=None) -> list[dict]:
    args = parse_flags(argv)
    if args.images < 1 or args.rounds < 1 or min(args.sizes, default=0) < 1:
        raise UserError("--images, --rounds and --sizes must be positive")
    (out,) = cli.writable_outputs(args.out)
    folder = Path(args.folder or Path.home() / ".cache" / "jaxcnn" / f"photo-jpeg-500x375-{args.images}")
    started = time.perf_counter()
    paths = write_photos(folder, args.images, args.seed)
    print(f"{PROG}: {len(paths)} JPEGs of 500x375 (q90) in {folder} ({time.perf_counter() - started:.1f} s)")
    draws = RandomResizedCrop().draws(args.seed, 0, 0, len(paths))
    boxes = [random_box(example_crop(d)[0], *STORED) for d in draws]
    ways = {"full-decode": full_decode, "box-resize": box_resize, "draft+box": draft_box}
    try:
        import simplejpeg  # noqa: F401

        ways["simplejpeg"] = simplejpeg_box
    except ImportError:
        print(f"{PROG}: simplejpeg is not installed: its row is left out")
    seconds = {(side, way): [] for side in args.sizes for way in ways}
    for r in range(args.rounds):
        for side in args.sizes:
            for way, decode in ways.items():
                start = time.thread_time()
                for path, box in zip(paths, boxes, strict=True):
                    decode(path, box, (side, side))
                seconds[side, way].append(time.thread_time() - start)
            print(f"round {r + 1}, {side}: "
                  + "   ".join(f"{w} {len(paths) / seconds[side, w][-1]:5.0f} img/s" for w in ways))  # fmt: skip
    from PIL import __version__ as pillow

    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    rows = []
    for (side, way), times in seconds.items():
        median = statistics.median(times)
        drafted = np.mean([draft_reduction(box, (side, side)) > 1 for box in boxes])
        rows.append({
            "image_size": f"{side}x{side}", "way": way, "images_per_second_per_core": len(paths) / median,
            "drafted_share": drafted if way == "draft+box" else None,
            "cpu_seconds_per_round_median": median, "rounds": args.rounds, "images": len(paths), "stored_size": "375x500",
            "quality": 90, "pillow": pillow, "machine": machine,
        })  # fmt: skip
    for row in rows:
        baseline = next(b for b in rows if b["image_size"] == row["image_size"])  # full-decode, the first way
        row["speedup"] = row["images_per_second_per_core"] / baseline["images_per_second_per_core"]
        print(f"{row['image_size']:>8} {row['way']:>12}: {row['images_per_second_per_core']:6.0f} images/s per core "
              f"({row['speedup']:.2f}x)")  # fmt: skip
    if out:
        print("wrote", results.write_csv(out, rows, COLUMNS))
    return rows


if __name__ == "__main__":
    cli.run_main(PROG, main)
