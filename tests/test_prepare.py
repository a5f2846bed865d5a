"""`jaxcnn prepare` and the shards `--data` reads: the pixels and labels come back, an
interrupted run resumes to the same bytes, bad input is one line (exit 2) with nothing left
as if complete, and training on shards equals training on the same pixels in memory."""

import json

import numpy as np
import pytest
from conftest import TINY_PLAIN, load_train_module
from PIL import Image

from jaxcnn.commands import main as jaxcnn_main
from jaxcnn.data import Dataset, Loader, load_image_folder, load_source, shard_writer
from jaxcnn.errors import UserError

SWATCH = (200, 40, 120)  # RGB: owl/0.jpg and cat/0.jpg are all this one colour


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """12 30x40 (HxW) JPEGs, 2 classes; each class a brightness band. The first of each
    class is all SWATCH; the others are smooth, their channels differing (red rises across,
    green down, blue falls across)."""
    root = tmp_path_factory.mktemp("photos") / "train"
    rng = np.random.default_rng(0)
    across, down = np.linspace(0, 1, 40)[None, :], np.linspace(0, 1, 30)[:, None]
    ramps_RGB = np.stack(np.broadcast_arrays(90 * across, 60 * down, 60 * (1 - across)), axis=-1)
    for c, name in enumerate(("owl", "cat")):
        (root / name).mkdir(parents=True)
        for i in range(6):
            pixels = 40 + 80 * c + ramps_RGB + rng.normal(0, 3, (30, 40, 3))
            pixels = pixels if i else np.broadcast_to(SWATCH, pixels.shape)
            Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(root / name / f"{i}.jpg", quality=95)
    return root


def prepare(*flags):
    jaxcnn_main(["prepare", "--quiet", "--workers", "0", *map(str, flags)])


def one_line_exit_2(capsys, run) -> str:
    with pytest.raises(SystemExit) as stop:
        run()
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(lines) == 1, lines
    return lines[0]


def test_raw_shards_give_back_the_pixels_labels_and_classes(folder, tmp_path):
    prepare("--data", folder, "--out", tmp_path / "raw", "--format", "raw", "--shard-size", 5)
    data, original = load_source(tmp_path / "raw"), load_image_folder(folder)
    manifest = json.loads((tmp_path / "raw" / "manifest.json").read_text())
    assert manifest["format_version"] == 1 and manifest["count"] == 12 and manifest["image_shape"] == [30, 40, 3]
    assert [s["count"] for s in manifest["shards"]] == [5, 5, 2] and all(
        len(s["sha256"]) == 64 for s in manifest["shards"]
    )
    assert data.classes == original.classes == ("cat", "owl") and list(data.labels) == list(original.labels)
    assert data.images.dtype == np.uint8 and data.images.shape == (12, 30, 40, 3)
    np.testing.assert_array_equal(data.images[:], original.images[:])  # every pixel, as decoded from the file
    np.testing.assert_array_equal(data.images[[7, 2]], original.images[[7, 2]])  # any rows, read alone
    draws = np.random.default_rng(1).random((3, 41))  # the same random resized crops as the folder's
    np.testing.assert_array_equal(data.images.crops(np.arange(3), draws), original.images.crops(np.arange(3), draws))
    held = data.subset([1, 9])
    np.testing.assert_array_equal(held.images[:], original.images[[1, 9]])


def test_jpeg_shards_are_small_resized_and_within_jpeg_tolerance(folder, tmp_path):
    prepare("--data", folder, "--out", tmp_path / "jpeg", "--short-side", 15)
    data, original = load_source(tmp_path / "jpeg"), load_image_folder(folder, image_size=(15, 20))
    assert (
        data.images.shape == (12, 15, 20, 3)
        and json.loads((tmp_path / "jpeg" / "manifest.json").read_text())["short_side"] == 15
    )
    stored, source = data.images[:].astype(int), original.images[:].astype(int)
    for channel, name in enumerate("RGB"):  # each channel against its own: channels swapped would be far off
        error = np.abs(stored[..., channel] - source[..., channel])
        assert error.mean() < 2 and error.max() < 12, (name, error.mean(), error.max())
    swatches = np.all(np.abs(source - SWATCH) <= 1, axis=(1, 2, 3))  # the known colour, as decoded from the file
    assert swatches.sum() == 2 and np.abs(stored[swatches] - SWATCH).max() <= 3, stored[swatches, 0, 0]
    assert list(data.labels) == list(original.labels)


def test_an_interrupted_prepare_resumes_to_identical_shards(folder, tmp_path, monkeypatch):
    prepare("--data", folder, "--out", tmp_path / "whole", "--shard-size", 4)
    write = shard_writer._write_shard
    calls, interrupt = [], {"armed": True}

    def interrupted(*args):
        calls.append(args[0])
        if len(calls) == 2 and interrupt["armed"]:  # Ctrl-C while the second shard is written
            interrupt["armed"] = False
            raise KeyboardInterrupt
        return write(*args)

    monkeypatch.setattr(shard_writer, "_write_shard", interrupted)
    with pytest.raises(SystemExit):
        prepare("--data", folder, "--out", tmp_path / "again", "--shard-size", 4)
    assert not (tmp_path / "again").exists() and (tmp_path / ".again.partial").is_dir()
    calls.clear()
    prepare("--data", folder, "--out", tmp_path / "again", "--shard-size", 4)
    assert len(calls) == 2  # the first of 3 shards was kept
    assert not (tmp_path / ".again.partial").exists()
    for name in sorted(p.name for p in (tmp_path / "whole").iterdir()):
        assert (tmp_path / "again" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name


def test_a_corrupt_jpeg_is_one_line_and_nothing_is_written(folder, tmp_path, capsys):
    broken = tmp_path / "broken"
    for path in folder.rglob("*.jpg"):
        (broken / path.parent.name).mkdir(parents=True, exist_ok=True)
        (broken / path.parent.name / path.name).write_bytes(path.read_bytes())
    whole = (broken / "owl" / "3.jpg").read_bytes()
    (broken / "owl" / "3.jpg").write_bytes(whole[: len(whole) // 2])  # the header reads; the pixels do not
    line = one_line_exit_2(capsys, lambda: prepare("--data", broken, "--out", tmp_path / "out", "--format", "raw"))
    assert line.startswith(f"jaxcnn prepare: error: image {broken / 'owl' / '3.jpg'} cannot be decoded")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["truncated shard", "another version"])
def test_damaged_shards_are_one_line_exit_2_and_train_writes_nothing(folder, tmp_path, capsys, damage):
    out = tmp_path / "raw"
    prepare("--data", folder, "--out", out, "--format", "raw", "--shard-size", 5)
    if damage == "truncated shard":
        shard = next(out.glob("shard-00001-*"))
        shard.write_bytes(shard.read_bytes()[:1000])
        expected = f"shard {shard} is 1,000 bytes"
    else:
        manifest = json.loads((out / "manifest.json").read_text())
        (out / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99}))
        expected = "holds shards of format version 99"
    with pytest.raises(UserError, match=expected):
        load_source(out)
    runs = tmp_path / "runs"
    line = one_line_exit_2(capsys, lambda: jaxcnn_main(["train", "--data", str(out), "--results-dir", str(runs)]))
    assert line.startswith("jaxcnn train: error:") and expected in line
    assert not runs.exists() or not any(runs.iterdir())


def test_training_on_shards_equals_training_on_the_same_pixels_in_memory(folder, tmp_path):
    from jaxcnn.build import build_program
    from jaxcnn.config import OptimConfig, TrainConfig
    from jaxcnn.fit import fit
    from jaxcnn.sharding import LAYOUTS, build_mesh

    prepare("--data", folder, "--out", tmp_path / "raw", "--format", "raw", "--shard-size", 5)
    shards = load_source(tmp_path / "raw")
    in_memory = Dataset(shards.images[:], shards.labels, "in memory")
    program = build_program(TINY_PLAIN, OptimConfig(learning_rate=0.05), LAYOUTS["single"], build_mesh({"data": 1}),
                            (30, 40, 3), 4, 2, with_eval=False, image_dtype="uint8")  # fmt: skip
    config = TrainConfig(batch_size=4, epochs=1, max_steps=2)
    losses = [fit(program, program.init(), Loader(data), None, config, progress=False).loss_history
              for data in (shards, in_memory)]  # fmt: skip
    assert len(losses[0]) == 2 and losses[0] == losses[1]
    # and `jaxcnn train --data SHARDS` end to end: 2 steps, as from the original folder
    flags = ["--model", "cnn2d_2layer_fullconnected_2layer", "--conv-features", "4,8", "--dense-features", "16",
             "--num-classes", "2", "--batch-size", "4", "--max-steps", "2", "--val-split", "0.25", "--quiet",
             "--channels", "3", "--host-devices", "8", "--layout", "single", "--input-workers", "0", "--compile-cache", str(tmp_path / "cache")]  # fmt: skip
    train = load_train_module()
    on_shards = train.main(["--data", str(tmp_path / "raw"), "--results-dir", str(tmp_path / "a"), *flags])
    on_files = train.main(["--data", str(folder), "--results-dir", str(tmp_path / "b"), *flags])
    assert len(on_shards["loss_history"]) == 2 and on_shards["loss_history"] == on_files["loss_history"]
    assert on_shards["test_accuracy"] == on_files["test_accuracy"]
