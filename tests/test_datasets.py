"""Standard datasets by name: the IDX reader, where the files are looked for, checksums,
and each broken file as one clear line. Small IDX files written here; the real
Fashion-MNIST files are read where Debian's package is installed."""

import gzip
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import load_script, load_train_module

from jaxcnn.data import load_named
from jaxcnn.data.datasets import DATASETS, FILES, search_dirs
from jaxcnn.data.idx import read_idx
from jaxcnn.errors import UserError


def write_idx(path: Path, array: np.ndarray, compress: bool = True) -> Path:
    """An IDX file of unsigned bytes (the MNIST format), gzipped if `compress`."""
    content = bytes([0, 0, 0x08, array.ndim]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
    content += array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(content) if compress else content)
    return path


def write_mnist_like(directory: Path, train: int = 64, test: int = 32, side: int = 28, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    for (images, labels), count in zip(((FILES[0], FILES[1]), (FILES[2], FILES[3])), (train, test), strict=True):
        write_idx(directory / f"{images}.gz", rng.integers(0, 256, (count, side, side)))
        write_idx(directory / labels, np.arange(count) % 10, compress=False)  # one of each kind
    return directory


def test_idx_files_read_back_gzipped_or_not(tmp_path):
    array = np.arange(2 * 3 * 4).reshape(2, 3, 4) % 256
    for compress in (True, False):
        got = read_idx(write_idx(tmp_path / f"a{compress}", array, compress))
        assert got.dtype == np.uint8 and np.array_equal(got, array)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x00\x00\x08", "is not an IDX file"),
        (b"PK\x03\x04 not idx", "is not an IDX file"),
        (bytes([0, 0, 8, 3]) + (2).to_bytes(4, "big"), "is truncated: its header needs 16 bytes"),
        (bytes([0, 0, 8, 1]) + (5).to_bytes(4, "big") + b"\x01\x02", "is truncated or padded: shape (5,) needs 13"),
        (gzip.compress(bytes([0, 0, 8, 1]) + (1).to_bytes(4, "big") + b"\x07", mtime=0)[:-6], "is a damaged gzip file"),
    ],
)
def test_a_broken_idx_file_is_one_clear_error_naming_it(tmp_path, content, message):
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(content)
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
        read_idx(path)
    assert str(path) in str(error.value)


def test_a_named_dataset_loads_from_data_dir_scaled_with_labels(tmp_path):
    train, test = load_named("mnist", write_mnist_like(tmp_path / "mnist"))
    assert train.images.shape == (64, 28, 28, 1) and test.images.shape == (32, 28, 28, 1)
    assert train.images.dtype == np.float32 and train.images.min() >= 0.0 and train.images.max() <= 1.0
    assert np.array_equal(test.labels, np.arange(32) % 10)
    assert train.source == str(tmp_path / "mnist")


def test_a_file_that_does_not_match_its_checksum_stops_the_load(tmp_path):
    with pytest.raises(UserError, match="does not match its published checksum"):
        load_named("fashion-mnist", write_mnist_like(tmp_path / "fake"))


def test_missing_files_name_every_place_looked_and_how_to_get_them(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXCNN_DATA", str(tmp_path / "cache"))
    places = search_dirs("mnist", tmp_path / "empty")
    assert places[:2] == [tmp_path / "empty", tmp_path / "cache" / "mnist"]
    with pytest.raises(UserError, match="its files are in none of") as error:
        load_named("mnist", tmp_path / "empty")
    assert all(str(p) in str(error.value) for p in places) and DATASETS["mnist"].url in str(error.value)
    with pytest.raises(UserError, match="unknown --dataset 'cifar'"):
        load_named("cifar")


@pytest.mark.skipif(
    not Path("/usr/share/datasets/fashion-mnist").is_dir(), reason="apt-get install dataset-fashion-mnist"
)
def test_the_real_fashion_mnist_loads_with_its_checksums():
    train, test = load_named("fashion-mnist")
    assert (train.images.shape, test.images.shape) == ((60000, 28, 28, 1), (10000, 28, 28, 1))
    assert np.array_equal(np.bincount(train.labels), [6000] * 10)  # balanced classes, as published


def test_train_script_trains_on_a_named_dataset(tmp_path):
    data_dir = write_mnist_like(tmp_path / "mnist")
    record = load_train_module().main(
        ["--dataset", "mnist", "--data-dir", str(data_dir), "--model", "cnn2d_2layer_fullconnected_2layer",
         "--conv-features", "8,16", "--dense-features", "32", "--batch-size", "32", "--max-steps", "2",
         "--quiet", "--results-dir", str(tmp_path / "out")]
    )  # fmt: skip
    assert record["data"] == record["test_data"] == str(data_dir)
    assert len(record["loss_history"]) == 2 and record["test_accuracy"] * 32 == round(record["test_accuracy"] * 32)


@pytest.fixture
def file_server(tmp_path):
    """A local HTTP server for `tmp_path / "site"` (its base URL): the download path without the internet."""
    import functools
    import http.server
    import threading

    site = tmp_path / "site"
    site.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield site, f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


def test_download_fetches_the_files_into_the_cache_checked_against_their_md5(tmp_path, file_server, monkeypatch):
    import dataclasses
    import hashlib

    from jaxcnn.data import datasets

    site, url = file_server
    write_mnist_like(site)
    for stem in FILES[1::2]:  # the labels were written uncompressed: publish every file as .gz
        write_idx(site / f"{stem}.gz", read_idx(site / stem))
    md5 = {stem: hashlib.md5((site / f"{stem}.gz").read_bytes()).hexdigest() for stem in FILES}
    monkeypatch.setitem(datasets.DATASETS, "mnist", dataclasses.replace(DATASETS["mnist"], download_url=url, md5=md5))
    monkeypatch.setenv("JAXCNN_DATA", str(tmp_path / "cache"))
    with pytest.raises(UserError, match="pass --download"):
        load_named("mnist")  # not found, not asked to download
    train, test = load_named("mnist", download=True)
    assert len(train) == 64 and len(test) == 32
    assert sorted(p.name for p in (tmp_path / "cache" / "mnist").iterdir()) == sorted(f"{s}.gz" for s in FILES)
    # a file that arrives different from what was published is not kept
    monkeypatch.setenv("JAXCNN_DATA", str(tmp_path / "empty cache"))
    monkeypatch.setitem(datasets.DATASETS, "mnist", dataclasses.replace(DATASETS["mnist"], download_url=url,
                                                                        md5={**md5, FILES[0]: "0" * 32}))  # fmt: skip
    with pytest.raises(UserError, match=f"{FILES[0]}.gz downloaded with md5 .*, not the published 0000"):
        load_named("mnist", tmp_path / "fresh", download=True)
    assert not (tmp_path / "fresh" / f"{FILES[0]}.gz").exists() and not list((tmp_path / "fresh").glob(".*part"))
    monkeypatch.setitem(datasets.DATASETS, "mnist", dataclasses.replace(DATASETS["mnist"], download_url=url, md5=md5))
    (site / f"{FILES[2]}.gz").unlink()  # the source lacks a file: one line naming the URL
    with pytest.raises(UserError, match=rf"cannot download {url}{FILES[2]}.gz \(File not found\); put the files in"):
        load_named("mnist", tmp_path / "again", download=True)


def test_real_data_speed_sets_the_loader_against_in_memory_images_round_by_round(tmp_path):
    """experiments/real_data_speed.py: each round runs the dataset through the loader, then
    the same steps on synthetic images of its shape; the share is that round's ratio."""
    data = write_mnist_like(tmp_path / "mnist", train=48)
    out = tmp_path / "speed.csv"
    rows = load_script("real_data_speed").main([
        "--dataset", "mnist", "--data-dir", str(data), "--batch-size", "16", "--rounds", "2",
        "--conv-features", "4,4,4", "--dense-features", "8,8", "--out", str(out),
    ])  # fmt: skip
    assert [r["input"] for r in rows] == ["mnist", "synthetic in memory"] * 2
    assert {r["steps"] for r in rows} == {3}  # one epoch of 48 images, batch 16, for both inputs
    for real, synthetic in zip(rows[::2], rows[1::2], strict=True):
        assert real["share_of_synthetic"] == pytest.approx(real["images_per_second"] / synthetic["images_per_second"])
    assert len(pd.read_csv(out)) == 4
