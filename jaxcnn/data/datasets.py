"""Datasets by name (`--dataset`) and by path (`--data`): where their files are looked
for, and how they load.

    train_set, test_set = load_named("fashion-mnist")            # 60,000 + 10,000 28x28 images

The four MNIST-format files (gzipped or not) are looked for in `--data-dir`, then in
jaxcnn's cache (`$JAXCNN_DATA`, default ~/.cache/jaxcnn/<name>), then where Debian's
package puts them (/usr/share/datasets/<name>). Where a published checksum is known, the
decompressed content must match it, so a damaged or mixed-up file stops the run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from jaxcnn.config import BUNDLED_TRAIN
from jaxcnn.data.folders import load_image_folder, parse_image_size
from jaxcnn.data.idx import read_idx
from jaxcnn.data.sources import Dataset, load_csv
from jaxcnn.errors import UserError

FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


@dataclass(frozen=True)
class NamedDataset:
    name: str
    url: str  # where the four files are published
    apt: str | None = None  # the Debian package that installs them
    sha256: dict[str, str] = field(default_factory=dict)  # file -> sha256 of its decompressed content


# sha256 of the published files' content (Debian's package holds the same bytes, recompressed)
FASHION_MNIST_SHA256 = {
    "train-images-idx3-ubyte": "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
    "train-labels-idx1-ubyte": "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
    "t10k-images-idx3-ubyte": "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
    "t10k-labels-idx1-ubyte": "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
}
DATASETS = {
    "fashion-mnist": NamedDataset(
        "fashion-mnist",
        "https://github.com/zalandoresearch/fashion-mnist (data/fashion/*.gz)",
        apt="dataset-fashion-mnist",
        sha256=FASHION_MNIST_SHA256,
    ),
    "mnist": NamedDataset("mnist", "https://ossci-datasets.s3.amazonaws.com/mnist/ (the files torchvision uses)"),
}
BUNDLED = "digits"  # the CSVs in data/: the default, not one of DATASETS


def search_dirs(name: str, data_dir: str | Path | None = None) -> list[Path]:
    cache = Path(os.environ.get("JAXCNN_DATA", Path.home() / ".cache" / "jaxcnn"))
    return [*([Path(data_dir)] if data_dir else []), cache / name, Path("/usr/share/datasets") / name]


def _file(directory: Path, stem: str) -> Path | None:
    return next((p for p in (directory / f"{stem}.gz", directory / stem) if p.is_file()), None)


def locate(name: str, data_dir: str | Path | None = None) -> dict[str, Path]:
    """The four files of dataset `name`, from the first place that has them all."""
    if name not in DATASETS:
        raise UserError(f"unknown --dataset {name!r}; use {BUNDLED} (the bundled CSVs) or one of {', '.join(DATASETS)}")
    places = search_dirs(name, data_dir)
    for directory in places:
        found = {stem: _file(directory, stem) for stem in FILES}
        if all(found.values()):
            return found
    spec = DATASETS[name]
    how = [f"apt-get install {spec.apt}"] if spec.apt else []
    how.append(f"download {', '.join(f + '.gz' for f in FILES)} from {spec.url} into --data-dir")
    raise UserError(f"--dataset {name}: its files are in none of {', '.join(map(str, places))}; {' or '.join(how)}")


def load_named(name: str, data_dir: str | Path | None = None) -> tuple[Dataset, Dataset]:
    """(training set, test set) of a named dataset, images scaled to [0, 1], HWC with C = 1."""
    files, sha256 = locate(name, data_dir), DATASETS[name].sha256
    arrays = {stem: read_idx(path, sha256.get(stem)) for stem, path in files.items()}
    return tuple(
        _dataset(arrays[images], arrays[labels], files[images], files[labels])
        for images, labels in ((FILES[0], FILES[1]), (FILES[2], FILES[3]))
    )


def _dataset(images: np.ndarray, labels: np.ndarray, images_path: Path, labels_path: Path) -> Dataset:
    if images.ndim != 3 or labels.ndim != 1:
        raise UserError(f"{images_path} must hold N x H x W images and {labels_path} N labels; "
                        f"they hold shapes {images.shape} and {labels.shape}")  # fmt: skip
    if len(images) != len(labels):
        raise UserError(f"{images_path} holds {len(images):,} images but {labels_path} {len(labels):,} labels")
    if labels.size and labels.max() > 9:
        raise UserError(f"{labels_path} holds label {int(labels.max())}; MNIST-format labels are 0..9")
    pixels = images.astype(np.float32) / 255.0
    return Dataset(pixels[..., None], labels.astype(np.int32), str(images_path.parent))


def load_source(
    path: str | Path | None, *, channels: int = 1, num_classes: int = 10, image_size: str | None = None,
    classes: tuple[str, ...] | None = None, need_labels: bool = True,
) -> Dataset:  # fmt: skip
    """`--data` / `--test-data`: a folder of class subfolders, or a CSV (None: the bundled digits)."""
    path = Path(path) if path else BUNDLED_TRAIN
    if path.is_dir():
        size = parse_image_size(image_size) if image_size else None
        data = load_image_folder(path, channels=channels, image_size=size, classes=list(classes) if classes else None)
        if len(data.classes) > num_classes:
            raise UserError(f"{path} has {len(data.classes)} classes but the model {num_classes}; pass --num-classes")
        return data
    if image_size:
        raise UserError("--image-size applies to image folders; a CSV's images keep their size")
    return load_csv(path, channels=channels, num_classes=num_classes, need_labels=need_labels)
