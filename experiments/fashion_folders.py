"""Image folders cut from Fashion-MNIST, for the fine-tuning walkthrough
(docs/pretrained-and-export.md): a source task (some classes) to pretrain on, and a target task
(the other classes) with few training images, as PNG files in class subfolders.

    python experiments/fashion_folders.py --out /tmp/fashion --source 0-6 --target 7-9 \
        --source-per-class 500 --target-per-class 100 --test-per-class 100

writes OUT/source/train/<class>/*.png, OUT/target/train/<class>/*.png and
OUT/target/test/<class>/*.png (the test images from Fashion-MNIST's own test set), the first
images of each class in the files' order.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image

from jaxcnn.data.datasets import load_named

CLASSES = ("t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle-boot")


def classes(text: str) -> list[int]:
    low, _, high = text.partition("-")
    return list(range(int(low), int(high or low) + 1))


def write(images_NHW1: np.ndarray, labels: np.ndarray, wanted: list[int], per_class: int, root: Path) -> int:
    written = 0
    for label in wanted:
        folder = root / f"{label}-{CLASSES[label]}"
        folder.mkdir(parents=True, exist_ok=True)
        for i, index in enumerate(np.flatnonzero(labels == label)[:per_class]):
            Image.fromarray(images_NHW1[index, ..., 0]).save(folder / f"{i:05d}.png")
            written += 1
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--source", default="0-6", help="source classes, e.g. 0-6")
    parser.add_argument("--target", default="7-9", help="target classes, e.g. 7-9")
    parser.add_argument("--source-per-class", type=int, default=500)
    parser.add_argument("--target-per-class", type=int, default=100)
    parser.add_argument("--test-per-class", type=int, default=100)
    parser.add_argument("--data-dir", help="where the Fashion-MNIST IDX files are (default: jaxcnn's search path)")
    args = parser.parse_args(argv)
    train, test = load_named("fashion-mnist", args.data_dir)
    as_bytes = [np.round(np.asarray(d.images) * 255).astype(np.uint8) if d.images.dtype != np.uint8
                else np.asarray(d.images) for d in (train, test)]  # fmt: skip
    counts = [
        write(as_bytes[0], train.labels, classes(args.source), args.source_per_class, args.out / "source/train"),
        write(as_bytes[0], train.labels, classes(args.target), args.target_per_class, args.out / "target/train"),
        write(as_bytes[1], test.labels, classes(args.target), args.test_per_class, args.out / "target/test"),
    ]
    print(f"wrote {counts[0]} source, {counts[1]} target training and {counts[2]} target test images under {args.out}")


if __name__ == "__main__":
    main()
