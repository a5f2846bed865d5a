"""Datasets by name (`--dataset`) and by path (`--data`): where their files are looked
for, and how they load.

    train_set, test_set = load_named("fashion-mnist")            # 60,000 + 10,000 28x28 images
    train_set, test_set = load_datasets(run_config.data, num_classes=10, seed=0)   # what a run's flags name

The four MNIST-format files (gzipped or not) are looked for in `--data-dir`, then in
jaxcnn's cache (`$JAXCNN_DATA`, default ~/.cache/jaxcnn/<name>), then where Debian's
package puts them (/usr/share/datasets/<name>); with `--download`, fetched from the
canonical source into --data-dir or the cache, each .gz checked against its published md5.
Where a checksum of the content is known, the decompressed content must match it too, so a
damaged or mixed-up file stops the run.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import shutil
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from jaxcnn.config import BUNDLED_TEST, BUNDLED_TRAIN
from jaxcnn.data.folders import load_image_folder, load_unlabelled_folder, parse_image_size, split_validation
from jaxcnn.data.idx import read_idx
from jaxcnn.data.shards import is_prepared, load_shards
from jaxcnn.data.sources import Dataset, load_csv, parse_image_shape, synthetic_dataset
from jaxcnn.errors import UserError
from jaxcnn.run_config import BUNDLED_DATASET, DataConfig

FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


@dataclass(frozen=True)
class NamedDataset:
    name: str
    url: str  # where the four files are published
    apt: str | None = None  # the Debian package that installs them
    sha256: dict[str, str] = field(default_factory=dict)  # file -> sha256 of its decompressed content
    download_url: str | None = None  # the folder --download fetches <file>.gz from
    md5: dict[str, str] = field(default_factory=dict)  # file -> md5 of its published .gz (torchvision's)


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
        download_url="http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
        md5={
            "train-images-idx3-ubyte": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
            "train-labels-idx1-ubyte": "25c81989df183df01b3e8a0aad5dffbe",
            "t10k-images-idx3-ubyte": "bef4ecab320f06d8554ea6380940ec79",
            "t10k-labels-idx1-ubyte": "bb300cfdad3c16e7a12a480ee83cd310",
        },
    ),
    "mnist": NamedDataset(
        "mnist",
        "https://ossci-datasets.s3.amazonaws.com/mnist/ (the files torchvision uses)",
        download_url="https://ossci-datasets.s3.amazonaws.com/mnist/",
        md5={
            "train-images-idx3-ubyte": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
            "train-labels-idx1-ubyte": "d53e105ee54ea40749a09fcbcd1e9432",
            "t10k-images-idx3-ubyte": "9fb629c4189551a2d022fa330f9573f3",
            "t10k-labels-idx1-ubyte": "ec29112dd5afa0611ce80d1b7f02629c",
        },
    ),
}
BUNDLED = BUNDLED_DATASET  # the CSVs in data/: the default, not one of DATASETS
NOT_CROPPABLE = (
    "--augment imagenet crops images as they are decoded: it needs --data IMAGE_FOLDER; "
    "for images in memory use --augment-shift/--augment-flip"
)


def search_dirs(name: str, data_dir: str | Path | None = None) -> list[Path]:
    cache = Path(os.environ.get("JAXCNN_DATA", Path.home() / ".cache" / "jaxcnn"))
    return [*([Path(data_dir)] if data_dir else []), cache / name, Path("/usr/share/datasets") / name]


def _file(directory: Path, stem: str) -> Path | None:
    return next((p for p in (directory / f"{stem}.gz", directory / stem) if p.is_file()), None)


def locate(name: str, data_dir: str | Path | None = None, download: bool = False) -> dict[str, Path]:
    """The four files of dataset `name`, from the first place that has them all; with
    `download`, fetched into --data-dir (or the cache) when no place has them."""
    if name not in DATASETS:
        raise UserError(f"unknown --dataset {name!r}; use {BUNDLED} (the bundled CSVs) or one of {', '.join(DATASETS)}")
    places = search_dirs(name, data_dir)
    for directory in places:
        found = {stem: _file(directory, stem) for stem in FILES}
        if all(found.values()):
            return found
    spec = DATASETS[name]
    if download:
        return fetch(spec, places[0])
    how = [f"apt-get install {spec.apt}"] if spec.apt else []
    how += ["pass --download"] if spec.download_url else []
    how.append(f"download {', '.join(f + '.gz' for f in FILES)} from {spec.url} into --data-dir")
    raise UserError(f"--dataset {name}: its files are in none of {', '.join(map(str, places))}; {' or '.join(how)}")


def fetch(spec: NamedDataset, directory: Path) -> dict[str, Path]:
    """Download the four .gz files into `directory`, each checked against its published md5
    before it is kept: a file is written under a temporary name of its own (processes
    sharing a cache do not collide) and renamed when good, so a failed or cut-off download
    leaves no file of that name."""
    if not spec.download_url:
        raise UserError(f"--dataset {spec.name} has no download source; get its files from {spec.url}")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"cannot download into {directory}: {err.strerror or err}") from None
    found = {}
    for stem in FILES:
        target = directory / f"{stem}.gz"
        if not target.is_file():
            _download(spec, stem, target)
        found[stem] = target
    return found


def _download(spec: NamedDataset, stem: str, target: Path) -> None:
    url = spec.download_url + target.name
    print(f"downloading {url}", flush=True)
    handle, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    try:
        with urllib.request.urlopen(url, timeout=60) as response, os.fdopen(handle, "wb") as out:
            shutil.copyfileobj(response, out)
        md5 = hashlib.md5(Path(partial).read_bytes(), usedforsecurity=False).hexdigest()
        if spec.md5.get(stem) and md5 != spec.md5[stem]:
            raise UserError(f"{url} downloaded with md5 {md5}, not the published {spec.md5[stem]}; nothing was kept")
        os.replace(partial, target)
    except (OSError, urllib.error.URLError, http.client.HTTPException) as err:
        reason = getattr(err, "reason", None) or getattr(err, "strerror", None) or err
        how = f"apt-get install {spec.apt} or " if spec.apt else ""
        raise UserError(f"cannot download {url} ({reason}); {how}put the files in {target.parent}") from None
    finally:
        Path(partial).unlink(missing_ok=True)


def load_named(name: str, data_dir: str | Path | None = None, download: bool = False) -> tuple[Dataset, Dataset]:
    """(training set, test set) of a named dataset, images scaled to [0, 1], HWC with C = 1."""
    files, sha256 = locate(name, data_dir, download), DATASETS[name].sha256
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
    classes: tuple[str, ...] | None = None, need_labels: bool = True, fit: str = "resize",
) -> Dataset:  # fmt: skip
    """`--data` / `--test-data`: a folder of class subfolders, a directory of prepared shards
    (`jaxcnn prepare`), or a CSV (None: the bundled digits).
    Where labels are not needed and `image_size` is given, also a flat folder of images."""
    path = Path(path) if path else BUNDLED_TRAIN
    if path.is_dir() and is_prepared(path):  # `jaxcnn prepare`'s shards: channels and classes from its manifest
        size = parse_image_size(image_size) if image_size else None
        images, labels, names = load_shards(path, image_size=size, classes=classes, fit=fit)
        if len(names) > num_classes:
            raise UserError(f"{path} has {len(names)} classes but the model {num_classes}; pass --num-classes")
        return Dataset(images, labels, str(path), classes=names)
    if path.is_dir() and not need_labels and image_size and not any(p.is_dir() for p in path.iterdir()):
        return load_unlabelled_folder(path, channels=channels, image_size=parse_image_size(image_size), fit=fit)
    if path.is_dir():
        size = parse_image_size(image_size) if image_size else None
        data = load_image_folder(
            path, channels=channels, image_size=size, classes=list(classes) if classes else None, fit=fit
        )
        if len(data.classes) > num_classes:
            raise UserError(f"{path} has {len(data.classes)} classes but the model {num_classes}; pass --num-classes")
        return data
    if image_size:
        raise UserError("--image-size applies to image folders; a CSV's images keep their size")
    return load_csv(path, channels=channels, num_classes=num_classes, need_labels=need_labels)


def load_datasets(
    config: DataConfig, num_classes: int, seed: int = 0, *, decode_test: bool = True, with_test: bool = True
) -> tuple[Dataset, Dataset | None]:
    """(training set, test set) as `config` names them: synthetic images, a dataset by name,
    or files (a CSV or an image folder) with their test files -- or, for your own training
    files without any, `val_split` of them held out (never the bundled test file beside your
    training file). The test set is decoded into memory (it is evaluated every epoch) unless
    `decode_test` is False. With --augment imagenet, images are fitted to the size by the
    evaluation's centre crop (training reads random crops: jaxcnn.data.crops)."""
    if config.augment == "imagenet" and (config.synthetic or config.dataset != BUNDLED):
        raise UserError(NOT_CROPPABLE)
    if config.synthetic:
        shape = parse_image_shape(config.synthetic)
        train_set = synthetic_dataset(shape, config.synthetic_size, num_classes, seed)
        return train_set, synthetic_dataset(shape, max(config.synthetic_size // 4, 1), num_classes, seed + 1)
    if config.dataset != BUNDLED:
        return load_named(config.dataset, config.data_dir, config.download)
    fit = "centre" if config.augment == "imagenet" else "resize"
    source = dict(channels=config.channels, num_classes=num_classes, image_size=config.image_size, fit=fit)
    train_set = load_source(config.data, **source)
    if config.augment == "imagenet" and not hasattr(train_set.images, "crops"):
        raise UserError(NOT_CROPPABLE)
    if not with_test:
        return train_set, None
    if config.test_data or not config.data:
        test_set = load_source(config.test_data or BUNDLED_TEST, **source, classes=train_set.classes, need_labels=False)
    else:
        train_set, test_set = split_validation(train_set, config.val_split, seed)
    if test_set.image_shape != train_set.image_shape:
        raise UserError(
            f"test images are {test_set.image_shape}, training images {train_set.image_shape}; use matching files"
        )
    if test_set.images.dtype != train_set.images.dtype:  # one compiled program takes both
        raise UserError(
            f"test images are {test_set.images.dtype}, training images {train_set.images.dtype} (an image folder's "
            "pixels travel as uint8 bytes, a CSV's as floats); use test data of the training data's kind"
        )
    return train_set, test_set.loaded() if decode_test else test_set
