"""Your own images: a folder whose subfolders are the classes (torchvision's ImageFolder
convention), PNG or JPEG, any size and mode.

    data/train/cat/0001.jpg, data/train/dog/0001.png, ...   ->  label 0 = cat, 1 = dog

Loading reads only each file's header (format and size); the pixels are decoded when a
batch needs them (`ImageFiles`), in the input pipeline's worker processes -- so a folder
larger than memory trains, and decoding is the input cost it really is. Each image is
converted to `channels` (1: grey, 3: RGB, 4: RGBA) and resized to `image_size` (H, W;
bilinear) when given; without it every image must already share one size. With
`fit="centre"` (--augment imagenet) an image is instead resized to cover `image_size` and
its centre kept, and training reads random crops of it (`crops`, jaxcnn.data.crops): only
the crop is resampled, and a JPEG much larger than it is decoded at a reduced scale
(libjpeg's DCT scaling); decoding and resizing go through jaxcnn.data.resize (OpenCV).
Pixels stay uint8 (0-255) all the way to the devices, which scale them
(jaxcnn.models.unit_pixels): a quarter of float32's bytes to move. A file that
cannot be decoded stops the run, naming it (at load if its header is broken, at its first
batch otherwise): a damaged training set should be fixed, not silently shrunk. With no
test folder, `split_validation` holds out a stratified fraction.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from jaxcnn.data.crops import Box, centre_box, draft_reduction, example_crop, random_box
from jaxcnn.data.resize import decode_jpeg_rgb, mirrored, resize, resize_box
from jaxcnn.data.sources import Dataset
from jaxcnn.errors import UserError

EXTENSIONS = (".png", ".jpg", ".jpeg")
MODES = {1: "L", 3: "RGB", 4: "RGBA"}
FITS = ("resize", "centre")  # an image to `image_size`: resized whole, or its centre crop
_DECODE_ERRORS = (UnidentifiedImageError, OSError, SyntaxError, ValueError)


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


def _header_size(path: Path) -> tuple[int, int]:
    """(H, W) from the file's header, without decoding its pixels."""
    try:
        with Image.open(path) as image:
            return image.size[1], image.size[0]
    except _DECODE_ERRORS as err:
        raise UserError(f"image {path} cannot be decoded ({err}); fix or remove it") from None


def _decode(path: str, channels: int, image_size: tuple[int, int]) -> np.ndarray:
    try:
        with Image.open(path) as image:
            pixels = _pixels(image, path, channels)
    except _DECODE_ERRORS as err:
        raise UserError(f"image {path} cannot be decoded ({err}); fix or remove it") from None
    return resize(pixels, image_size)


def _pixels(image: Image.Image, path: str, channels: int, reduction: int = 1) -> np.ndarray:
    """The opened `image` as uint8 [H, W, channels], a JPEG decoded at 1/`reduction` scale
    in the DCT domain (RGB JPEGs by OpenCV, jaxcnn.data.resize: faster, the same pixels)."""
    if image.format == "JPEG" and channels == 3:
        pixels = decode_jpeg_rgb(Path(path).read_bytes(), reduction)
        if pixels is None:
            raise OSError("corrupt or truncated JPEG")
        return pixels
    if reduction > 1 and image.format == "JPEG":  # grey, RGBA: Pillow's draft, the same DCT scaling
        width, height = image.size
        image.draft(
            MODES[channels] if channels < 4 else None, (max(1, width // reduction), max(1, height // reduction))
        )
    if image.mode != MODES[channels]:  # (convert copies even when the mode is already right)
        image = image.convert(MODES[channels])
    return np.asarray(image, dtype=np.uint8).reshape(image.size[1], image.size[0], channels)


def decode_box(
    path: str, channels: int, image_size: tuple[int, int], box_of, *, flip: bool = False, draft: bool = True
) -> np.ndarray:
    """The part `box_of(height, width)` of the image at `path`, resized to `image_size`
    as it is cut -- the rest is never resampled (jaxcnn.data.resize.resize_box) -- and
    flipped left-right with `flip`. With `draft`, a JPEG whose box is at least twice
    `image_size` is decoded at 1/2, 1/4 or 1/8 scale in the DCT domain (the largest that
    keeps the box at least that size)."""
    try:
        with Image.open(path) as image:
            width, height = image.size
            box: Box = box_of(height, width)
            reduction = draft_reduction(box, image_size) if draft else 1
            pixels = _pixels(image, path, channels, reduction)
    except _DECODE_ERRORS as err:
        raise UserError(f"image {path} cannot be decoded ({err}); fix or remove it") from None
    if pixels.shape[1] != width:  # decoded at a reduced scale: the box in its pixels
        scale = width / pixels.shape[1]
        box = tuple(v / scale for v in box)
    pixels = resize_box(pixels, box, image_size)
    return mirrored(pixels) if flip else pixels


@dataclass(frozen=True)
class ImageFiles:
    """Images on disk that index like a uint8 [N, H, W, C] array (0-255): `files[idx]`
    decodes just those files, each fitted to `image_size` as `fit` says (FITS). Small and
    picklable, so the input pipeline's worker processes each get a copy and decode their
    own batches."""

    paths: tuple[str, ...]
    channels: int
    image_size: tuple[int, int]  # every image is decoded at this (H, W)
    fit: str = "resize"  # "centre": evaluation's centre crop (--augment imagenet)

    def __post_init__(self):
        if self.fit not in FITS:
            raise ValueError(f"fit {self.fit!r}: one of {FITS}")

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (len(self.paths), *self.image_size, self.channels)

    dtype = np.dtype(np.uint8)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index) -> np.ndarray:
        rows = np.arange(len(self.paths))[index]
        if np.ndim(rows) == 0:
            return self[np.asarray([rows])][0]
        if self.fit == "centre":
            centre = lambda height, width: centre_box(height, width, self.image_size)  # noqa: E731
            decoded = [decode_box(self.paths[i], self.channels, self.image_size, centre) for i in rows]
        else:
            decoded = [_decode(self.paths[i], self.channels, self.image_size) for i in rows]
        return np.stack(decoded) if decoded else np.zeros((0, *self.shape[1:]), np.uint8)

    def crops(self, rows: np.ndarray, draws: np.ndarray) -> np.ndarray:
        """The images at `rows`, each a random resized crop (then maybe flipped) as its row of
        `draws` says (jaxcnn.data.crops.RandomResizedCrop.draws)."""
        decoded = []
        for i, draws_D in zip(rows, draws, strict=True):
            uniforms_A4, flip = example_crop(draws_D)
            box_of = lambda height, width, u=uniforms_A4: random_box(u, height, width)  # noqa: E731
            decoded.append(decode_box(self.paths[i], self.channels, self.image_size, box_of, flip=flip))
        return np.stack(decoded) if decoded else np.zeros((0, *self.shape[1:]), np.uint8)

    def subset(self, index) -> ImageFiles:
        """The files at `index` (indices or a boolean mask), still on disk."""
        return dataclasses.replace(self, paths=tuple(self.paths[i] for i in np.arange(len(self.paths))[index]))

    def decode_all(self) -> np.ndarray:
        """Every image decoded at once, on a thread pool (Pillow releases the GIL)."""
        chunks = np.array_split(np.arange(len(self.paths)), max(1, len(self.paths) // 256))
        with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
            return np.concatenate(list(pool.map(self.__getitem__, chunks)))


def load_image_folder(
    root: str | Path, *, channels: int = 3, image_size: tuple[int, int] | None = None,
    classes: list[str] | None = None, fit: str = "resize",
) -> Dataset:  # fmt: skip
    """The folder's images as a Dataset of `ImageFiles` (decoded when used, fitted to the
    size as `fit` says). `classes` (a training folder's class names, for its test folder)
    fixes the labels; a class it lacks is an error."""
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
        sizes_found = list(pool.map(_header_size, files))
    sizes: dict[tuple[int, int], Path] = {}  # each size and the first image of it
    for size, path in zip(sizes_found, files, strict=True):
        sizes.setdefault(size, path)
    if image_size is None and len(sizes) > 1:
        (a, path_a), (b, path_b) = list(sizes.items())[:2]
        raise UserError(
            f"images differ in size ({path_a} is {a[0]}x{a[1]}, {path_b} is {b[0]}x{b[1]}); "
            "pass --image-size HxW to resize them all"
        )
    images = ImageFiles(tuple(map(str, files)), channels, image_size or next(iter(sizes)), fit)
    return Dataset(images, np.asarray(labels, np.int32), str(root), classes=tuple(names))


def load_unlabelled_folder(
    root: str | Path, *, channels: int, image_size: tuple[int, int], fit: str = "resize"
) -> Dataset:
    """A folder of images to predict (no class subfolders): every PNG/JPEG in it, sorted,
    decoded at `image_size` (the model's input) when used."""
    if channels not in MODES:
        raise UserError(f"--channels {channels} does not apply to images; use 1 (grey), 3 (RGB) or 4 (RGBA)")
    root = Path(root)
    files = _images_in(root)
    if not files:
        raise UserError(f"{root} holds no image ({', '.join(EXTENSIONS)}); pass a folder of images or a CSV")
    for path in files[:1]:  # a broken first header fails here, the rest when decoded
        _header_size(path)
    return Dataset(ImageFiles(tuple(map(str, files)), channels, image_size, fit), None, str(root))


def write_image_folder(dataset: Dataset, root: str | Path, *, size: tuple[int, int] | None = None,
                       channels: int = 3, quality: int = 90) -> Path:  # fmt: skip
    """`dataset` as an image folder of JPEGs (a subfolder per class), each image resized to
    `size` (H, W) and converted to `channels` (1 or 3: JPEG has no alpha): real files to
    decode, for measuring an input pipeline. `root` must not exist yet; it is written
    beside under a temporary name and appears whole or not at all."""
    root = Path(root)
    if channels not in (1, 3):
        raise UserError(f"JPEG images have 1 or 3 channels, not {channels}")
    if root.exists():
        raise UserError(f"{root} already exists; give a new folder to write the images into")
    root.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{root.name}.", suffix=".part"))
    try:
        names = dataset.classes or tuple(str(label) for label in range(int(dataset.labels.max()) + 1))
        for name in names:
            (partial / name).mkdir()
        pixels = dataset.images if dataset.in_memory else dataset.images[:]
        for i, (image, label) in enumerate(zip(pixels, dataset.labels, strict=True)):
            values = image if image.dtype == np.uint8 else np.round(image * 255).astype(np.uint8)
            picture = Image.fromarray(values[..., 0] if values.shape[-1] == 1 else values).convert(MODES[channels])
            if size is not None:
                picture = picture.resize(size[::-1], Image.Resampling.BILINEAR)
            picture.save(partial / names[label] / f"{i:06d}.jpg", quality=quality)
        partial.rename(root)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return root


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
        return dataset.subset(keep, f"{dataset.source} ({what})")

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
