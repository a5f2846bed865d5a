"""Your own image folders: classes from subfolders, any mode converted, sizes checked or
resized, a held-out split when there is no test folder, and every broken folder or image
one clear line."""

import numpy as np
import pytest
from conftest import load_train_module, write_folder
from PIL import Image

from jaxcnn.commands import cli
from jaxcnn.data import load_image_folder, split_validation
from jaxcnn.data.folders import parse_image_size
from jaxcnn.errors import UserError


def test_classes_are_the_sorted_subfolders_and_every_mode_converts(tmp_path):
    data = load_image_folder(write_folder(tmp_path / "train", classes=("owl", "cat")), channels=3)
    assert data.classes == ("cat", "owl") and data.images.shape == (12, 10, 12, 3)
    assert list(data.labels) == [0] * 6 + [1] * 6
    pixels = data.images[:]  # decoded only now
    assert pixels.shape == data.images.shape and pixels.dtype == np.uint8  # bytes: scaled on the devices
    # written second, cat's band is the brighter: the label follows the name, not the order written
    assert pixels[data.labels == 0].mean() > pixels[data.labels == 1].mean()
    np.testing.assert_array_equal(data.images[[3, 0]], pixels[[3, 0]])  # any rows, decoded alone
    np.testing.assert_array_equal(data.loaded().images, pixels)
    grey = load_image_folder(tmp_path / "train", channels=1)
    assert grey.images.shape == (12, 10, 12, 1) and grey.images[:].shape == (12, 10, 12, 1)


def test_sizes_must_match_unless_resized_to_a_given_size(tmp_path):
    root = write_folder(tmp_path / "train")
    Image.fromarray(np.zeros((7, 9, 3), np.uint8)).save(root / "dog" / "odd.png")
    with pytest.raises(UserError, match=r"images differ in size .* pass --image-size HxW") as error:
        load_image_folder(root)
    assert "odd.png is 7x9" in str(error.value)
    resized = load_image_folder(root, image_size=parse_image_size("16x20"))
    assert resized.images.shape == (19, 16, 20, 3) and resized.images[:].shape == (19, 16, 20, 3)


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        ("corrupt", "cannot be decoded"),
        ("truncated", "cannot be decoded"),
        ("empty class", "holds no image"),
        ("flat", "has no class subfolders"),
    ],
)
def test_a_broken_folder_is_one_clear_error_naming_the_place(tmp_path, breakage, message):
    root = write_folder(tmp_path / "train")
    if breakage == "corrupt":
        (root / "cat" / "bad.png").write_bytes(b"not a png at all")
    elif breakage == "truncated":
        whole = (root / "dog" / "001.jpg").read_bytes()
        (root / "dog" / "001.jpg").write_bytes(whole[: len(whole) // 3])
    elif breakage == "empty class":
        (root / "emu").mkdir()
    else:
        root = tmp_path / "flat"
        root.mkdir()
        Image.fromarray(np.zeros((4, 4), np.uint8)).save(root / "a.png")
    with pytest.raises(UserError, match=message) as error:
        load_image_folder(root).images[:]  # a truncated file's header reads: its pixels fail when decoded
    assert str(root) in str(error.value)


def test_the_held_out_split_is_stratified_disjoint_and_seeded(tmp_path):
    data = load_image_folder(write_folder(tmp_path / "train", per_class=10))
    train, held = split_validation(data, 0.2, seed=3)
    assert np.bincount(held.labels).tolist() == [2, 2, 2] and np.bincount(train.labels).tolist() == [8, 8, 8]
    rows = {row.tobytes() for row in data.images[:]}
    assert {r.tobytes() for r in train.images[:]} | {r.tobytes() for r in held.images[:]} == rows  # disjoint, complete
    assert split_validation(data, 0.2, seed=3)[1].images == held.images  # the same files
    assert split_validation(data, 0.2, seed=4)[1].images != held.images


def test_train_script_trains_on_a_folder_and_holds_out_a_split(tmp_path):
    root = write_folder(tmp_path / "train", per_class=16, size=(12, 8))
    record = load_train_module().main(
        ["--data", str(root), "--image-size", "12x8", "--channels", "3", "--val-split", "0.25", "--num-classes", "3",
         "--model", "cnn2d_2layer_fullconnected_2layer", "--conv-features", "8,16", "--dense-features", "32",
         "--batch-size", "8", "--max-steps", "3", "--host-devices", "8", "--quiet", "--results-dir", str(tmp_path / "out")]
    )  # fmt: skip
    assert record["data"].endswith("(75% for training)") and record["test_data"].endswith("(25% held out)")
    # 4 of each class's 16 held out: the accuracy is a count out of 12
    assert len(record["loss_history"]) == 3 and round(record["test_accuracy"] * 12, 6) == round(
        record["test_accuracy"] * 12
    )


def test_a_test_folder_with_a_class_the_training_folder_lacks_is_refused(tmp_path, capsys):
    train, test = write_folder(tmp_path / "train"), write_folder(tmp_path / "test", classes=("cat", "yak"))
    with pytest.raises(SystemExit) as exit_info:
        cli.run_main("train.py", lambda: load_train_module().main(
            ["--data", str(train), "--test-data", str(test), "--quiet", "--results-dir", str(tmp_path / "out")]))  # fmt: skip
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"train.py: error: image folder {test} has class 'yak', which the training folder lacks"
    ]


def test_an_image_that_fails_to_decode_in_a_worker_stops_the_run_naming_it(tmp_path, capsys):
    """Decoding happens in grain's worker processes: the error crosses back as one line."""
    root, test = write_folder(tmp_path / "train", per_class=8), write_folder(tmp_path / "test", per_class=2)
    whole = (root / "dog" / "001.jpg").read_bytes()
    (root / "dog" / "001.jpg").write_bytes(whole[: len(whole) // 3])
    with pytest.raises(SystemExit) as exit_info:
        cli.run_main("train.py", lambda: load_train_module().main(
            ["--data", str(root), "--test-data", str(test), "--num-classes", "3", "--input-workers", "2",
             "--model", "cnn2d_2layer_fullconnected_2layer", "--conv-features", "4,8", "--dense-features", "16",
             "--batch-size", "8", "--epochs", "2", "--host-devices", "8", "--quiet",
             "--results-dir", str(tmp_path / "out")]))  # fmt: skip
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"train.py: error: image {root / 'dog' / '001.jpg'} cannot be decoded"
    )
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # nothing written
