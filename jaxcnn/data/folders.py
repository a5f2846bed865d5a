"""Your own images: a folder whose subfolders are the classes (torchvision's ImageFolder
convention), PNG or JPEG, any size and mode.

    data/train/cat/0001.jpg, data/train/dog/0001.png, ...   ->  label 0 = cat, 1 = dog

Images are decoded once, on a thread pool (Pillow releases the GIL while decoding),
converted to `channels` (1: grey, 3: RGB, 4: RGBA) and resized to `image_size` (H, W;
bilinear) when given; without it every image must already share one size. A file that
cannot be decoded stops the load, naming it: a damaged training set should be fixed, not
silently shrunk. With no test folder, `split_validation` holds out a stratified fraction.
"""

from __future__ import annotations

import concurrent.futures
import os
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from jaxcnn.data.sources import Dataset
from jaxcnn.errors import UserError

EXTENSIONS = (".png", ".jpg", ".jpeg")
MODES = {1: "L", 3: "RGB", 4: "RGBA"}


def class_folders(root: Path) -> list[Path]:
    """The class subfolders of `root`, sorted by name (a class's label is its index)."""
    if not root.is_dir():
        raise UserError(f"image folder {root} not found; pass a folder whose subfolders are the classes")
    classes = sorted(p for p in root.iterdir() if p.is_dir())
    if not classes:
        raise UserError(f"image folder {root} has no class subfolders; put each class's images in a folder of its own")
    return classes


def _images_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.suffix.lower() in EXTENSIONS and p.is_file())


def _decode(path: Path, channels: int, image_size: tuple[int, int] | None) -> np.ndarray:
    try:
        with Image.open(path) as image:
            image = image.convert(MODES[channels])
            if image_size is not None and image.size != image_size[::-1]:
                image = image.resize(image_size[::-1], Image.Resampling.BILINEAR)
            return np.asarray(image, dtype=np.uint8).reshape(image.size[1], image.size[0], channels)
    except (UnidentifiedImageError, OSError, SyntaxError) as err:
        raise UserError(f"image {path} cannot be decoded ({err}); fix or remove it") from None


def load_image_folder(
    root: str | Path, *, channels: int = 3, image_size: tuple[int, int] | None = None, classes: list[str] | None = None
) -> Dataset:
    """The folder's images as a Dataset in [0, 1]. `classes` (a training folder's class
    names, for its test folder) fixes the labels; a class it lacks is an error."""
    if channels not in MODES:
        raise UserError(f"--channels {channels} does not apply to images; use 1 (grey), 3 (RGB) or 4 (RGBA)")
    root = Path(root)
    folders = class_folders(root)
    names = classes or [f.name for f in folders]
    unknown = [f.name for f in folders if f.name not in names]
    if unknown:
        raise UserError(f"image folder {root} has class {unknown[0]!r}, which the training folder lacks")
    files, labels = [], []
    for folder in folders:
        found = _images_in(folder)
        if not found:
            raise UserError(
                f"class folder {folder} holds no image ({', '.join(EXTENSIONS)}); add some or remove the folder"
            )
        files += found
        labels += [names.index(folder.name)] * len(found)
    with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        images = list(pool.map(lambda p: _decode(p, channels, image_size), files))
    sizes: dict[tuple[int, int], Path] = {}  # each size and the first image of it
    for image, path in zip(images, files, strict=True):
        sizes.setdefault(image.shape[:2], path)
    if len(sizes) > 1:
        (a, path_a), (b, path_b) = list(sizes.items())[:2]
        raise UserError(
            f"images differ in size ({path_a} is {a[0]}x{a[1]}, {path_b} is {b[0]}x{b[1]}); "
            "pass --image-size HxW to resize them all"
        )
    pixels = np.stack(images).astype(np.float32) / 255.0
    return Dataset(pixels, np.asarray(labels, np.int32), str(root), classes=tuple(names))


def split_validation(dataset: Dataset, fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """(training part, held-out part): `fraction` of every class held out (at least one
    image of each), the same for a given seed."""
    if not 0 < fraction < 1:
        raise UserError(f"--val-split must be between 0 and 1, got {fraction}")
    rng = np.random.default_rng([seed, 17])
    held = []
    for label in np.unique(dataset.labels):
        members = rng.permutation(np.flatnonzero(dataset.labels == label))
        if len(members) < 2:
            raise UserError(f"class {label} of {dataset.source} has one image: too few to hold any out for validation")
        held += list(members[: max(1, round(fraction * len(members)))])
    mask = np.zeros(len(dataset), bool)
    mask[held] = True

    def part(keep, what):
        return Dataset(dataset.images[keep], dataset.labels[keep], f"{dataset.source} ({what})", dataset.classes)

    return part(~mask, f"{1 - fraction:.0%} for training"), part(mask, f"{fraction:.0%} held out")


def parse_image_size(text: str) -> tuple[int, int]:
    """'96x128' -> (96, 128): height x width."""
    try:
        height, width = (int(v) for v in text.lower().split("x"))
    except ValueError:
        height = width = 0
    if min(height, width) < 1:
        raise UserError(f"--image-size {text!r} is not HxW; write e.g. 96x96 or 64x128")
    return height, width
