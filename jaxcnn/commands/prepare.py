"""Prepare a dataset once for fast training: decode every image, resize it and store it in
grain's ArrayRecord shards (raw uint8 or re-encoded small JPEG), which `jaxcnn train --data`
then reads without touching the originals.

jaxcnn prepare --data photos/train --out shards/train                     # JPEG q90, shorter side 256
jaxcnn prepare --data photos/test --out shards/test
jaxcnn prepare --data photos/train --out shards/raw --format raw --short-side 160
jaxcnn prepare --dataset fashion-mnist --out shards/fashion --format raw  # writes shards/fashion/{train,test}
jaxcnn train --data shards/train --test-data shards/test --image-size 224x224 ...

--format jpeg (default) re-encodes each image at --quality (the FFCV trick: small records,
a fast decode); --format raw stores the pixels (no decode at all, 5-10x the bytes). Images
are stored with their shorter side --short-side (downscaled only, aspect kept), so random
crops are still drawn from the whole picture when training; --image-size HxW stores them
at exactly that size instead. Labels and class names go in the output's manifest.json
(jaxcnn.data.shards). Decoding is the cost: --workers processes share it. The output
appears whole or not at all: an interrupted or failed run leaves its finished shards in
.<out>.partial/, and the same command resumes from them.
"""

from __future__ import annotations

import os
from pathlib import Path

from jaxcnn.commands import cli
from jaxcnn.errors import UserError

PROG = "jaxcnn prepare"


def parse_flags(argv=None):
    parser = cli.FlagParser(prog=PROG, description=__doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", metavar="FOLDER", help="a folder of class subfolders of PNG/JPEG images")
    source.add_argument("--dataset", help="a dataset by name (fashion-mnist, mnist): its train and test sets")
    parser.add_argument("--data-dir", help="where --dataset's files are (default: the usual places)")
    parser.add_argument("--download", action="store_true", help="fetch --dataset's files when not found")
    parser.add_argument("--out", required=True, metavar="DIR", help="the directory to write (must not exist)")
    parser.add_argument("--format", choices=("jpeg", "raw"), default="jpeg", help="how each image is stored")
    parser.add_argument("--short-side", type=int, default=256, help="store images with this shorter side")
    parser.add_argument("--image-size", metavar="HxW", help="store every image at exactly this size instead")
    parser.add_argument("--quality", type=int, default=90, help="JPEG quality of --format jpeg")
    parser.add_argument("--channels", type=int, help="1 grey, 3 RGB (raw: also 4) (default: 3; a dataset's own)")
    parser.add_argument("--shard-size", type=int, default=1024, help="examples per shard")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes encoding (0: this one)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_flags(argv)
    import numpy as np

    import jaxcnn
    from jaxcnn.data import load_image_folder, load_named
    from jaxcnn.data.folders import parse_image_size
    from jaxcnn.data.shard_writer import ShardSettings, write_shards

    size = parse_image_size(args.image_size) if args.image_size else None
    channels = args.channels or (3 if args.data else 1)
    settings = ShardSettings(args.format, args.short_side, size, args.quality, channels, args.shard_size)
    show = None if args.quiet else (lambda line: print(line, flush=True))
    out = Path(args.out)
    if args.data:
        # only the paths, labels and classes are used: any size passes the folder's size check
        folder = load_image_folder(args.data, channels=channels, image_size=size or (1, 1))
        sets = [(out, list(folder.images.paths), folder.labels, folder.classes)]
    else:
        for split in ("train", "test"):
            if (out / split).exists():
                raise UserError(f"{out / split} already exists; remove it or give another --out")
        named = load_named(args.dataset, args.data_dir, args.download)
        sets = []
        for split, data in zip(("train", "test"), named, strict=True):
            pixels = np.round(data.images * 255).astype(np.uint8)  # stored as uint8, scaled by 255
            names = tuple(str(c) for c in range(int(data.labels.max()) + 1))
            sets.append((out / split, list(pixels), data.labels, names))
    manifests = []
    for target, items, labels, classes in sets:
        manifest = write_shards(
            items, labels, classes, target, settings, workers=args.workers, show=show, version=jaxcnn.__version__
        )
        stored = manifest["image_shape"] or f"shorter side <= {settings.short_side}"
        total = sum(s["bytes"] for s in manifest["shards"])
        print(f"{PROG}: wrote {target}: {manifest['count']:,} images, {len(manifest['classes'])} classes, "
              f"{len(manifest['shards'])} {settings.format} shards, {total / 2**20:,.1f} MiB, {stored}")  # fmt: skip
        manifests.append(manifest)
    return {"manifests": manifests}


if __name__ == "__main__":
    cli.run_main(PROG, main)
