"""--augment imagenet and bytes to the devices: torchvision's RandomResizedCrop boxes drawn
per (seed, epoch, batch) and the same on any process split, drafted JPEG decodes close to
full ones, evaluation's centre crop, uint8 batches training exactly like the same pixels
sent as floats (dp and the pipeline), and a corrupt JPEG one line."""

import math
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY_PLAIN, load_train_module, write_folder
from PIL import Image

from jaxcnn.build import build_program
from jaxcnn.commands import cli
from jaxcnn.config import OptimConfig, TrainConfig
from jaxcnn.data import Dataset, load_image_folder
from jaxcnn.data.crops import RATIO, SCALE, RandomResizedCrop, centre_box, draft_reduction, example_crop, random_box
from jaxcnn.data.folders import ImageFiles, decode_box, load_unlabelled_folder
from jaxcnn.data.loader import BuildBatch, Schedule
from jaxcnn.data.resize import resize
from jaxcnn.errors import UserError
from jaxcnn.fit import fit
from jaxcnn.sharding import build_mesh, get_layout
from jaxcnn.sharding.placement import BatchShare


def _boxes(height, width, count=400, seed=0, epoch=0, index=0):
    draws = RandomResizedCrop().draws(seed, epoch, index, count)
    return np.array([random_box(example_crop(d)[0], height, width) for d in draws])


def _torchvision_box(uniforms, height, width):
    """torchvision's RandomResizedCrop.get_params, line by line, fed our uniform numbers."""
    area = height * width
    for u_area, u_ratio, u_top, u_left in uniforms:
        target_area = area * (SCALE[0] + u_area * (SCALE[1] - SCALE[0]))
        aspect_ratio = math.exp(math.log(RATIO[0]) + u_ratio * (math.log(RATIO[1]) - math.log(RATIO[0])))
        w = round(math.sqrt(target_area * aspect_ratio))
        h = round(math.sqrt(target_area / aspect_ratio))
        if 0 < w <= width and 0 < h <= height:
            i, j = math.floor(u_top * (height - h + 1)), math.floor(u_left * (width - w + 1))
            return j, i, j + w, i + h
    in_ratio = width / height
    if in_ratio < min(RATIO):
        w, h = width, round(width / min(RATIO))
    elif in_ratio > max(RATIO):
        w, h = round(height * max(RATIO)), height
    else:
        w, h = width, height
    i, j = (height - h) // 2, (width - w) // 2
    return j, i, j + w, i + h


def test_random_resized_crop_boxes_follow_torchvision_and_are_drawn_per_batch():
    for height, width in ((30, 40), (375, 500), (500, 333)):
        left, top, right, bottom = _boxes(height, width).T
        w, h = right - left, bottom - top
        assert (left >= 0).all() and (top >= 0).all() and (right <= width).all() and (bottom <= height).all()
        area, ratio = w * h / (height * width), w / h
        slack = 2.5 / min(h.min(), w.min())  # w and h are rounded to whole pixels
        assert SCALE[0] * (1 - slack) <= area.min() and area.max() <= SCALE[1]
        assert RATIO[0] * (1 - slack) <= ratio.min() and ratio.max() <= RATIO[1] * (1 + slack)
        draws = RandomResizedCrop().draws(0, 0, 0, 400)
        assert [_torchvision_box(example_crop(d)[0], height, width) for d in draws] == list(
            map(tuple, _boxes(height, width))
        )
    np.testing.assert_array_equal(_boxes(375, 500), _boxes(375, 500))  # (seed, epoch, batch) fix the boxes
    assert not np.array_equal(_boxes(375, 500), _boxes(375, 500, epoch=1))
    assert not np.array_equal(_boxes(375, 500), _boxes(375, 500, index=1))
    # no attempt fits a 1x12 strip: torchvision's fallback, the centre at the widest ratio allowed
    assert random_box(np.zeros((10, 4)) + 0.99, 10, 120) == ((120 - 13) // 2, 0, (120 - 13) // 2 + 13, 10)


def test_crops_are_the_same_whatever_process_builds_them(tmp_path):
    files = load_image_folder(write_folder(tmp_path / "train", per_class=6, size=(30, 40)), image_size=(16, 16))
    steps = Schedule([2])

    def rows(share):
        return BuildBatch(files, RandomResizedCrop(), 5, steps, [share]).map(1)[1]

    whole = rows(BatchShare(8, None, slice(0, 8)))
    halves = np.concatenate([rows(BatchShare(8, None, slice(0, 4))), rows(BatchShare(8, None, slice(4, 8)))])
    assert whole.dtype == np.uint8 and whole.shape == (8, 16, 16, 3)
    np.testing.assert_array_equal(whole, halves)
    jpeg = files.images.paths[1]  # a file that breaks after its header: the crop's decode names it
    Path(jpeg).write_bytes(Path(jpeg).read_bytes()[:100])
    with pytest.raises(UserError, match=f"image {jpeg} cannot be decoded"):
        files.images.crops(np.array([1]), RandomResizedCrop().draws(0, 0, 0, 1))


def _photo(path, height=300, width=400, seed=0):
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    smooth = 128 + 60 * np.sin(x / 37.0)[..., None] * np.cos(y[..., None] / 23.0 + rng.uniform(0, 3, 3))
    pixels = np.clip(smooth + rng.normal(0, 4, (height, width, 3)), 0, 255).astype(np.uint8)
    Image.fromarray(pixels).save(path, quality=90)
    return path


def test_a_drafted_decode_is_close_to_a_full_decode_cropped_and_resized(tmp_path):
    path = str(_photo(tmp_path / "photo.jpg"))
    box, size = (10, 20, 390, 290), (64, 64)
    assert draft_reduction(box, size) == 4  # 380x270 at 1/4 is still 95x67
    drafted = decode_box(path, 3, size, lambda h, w: box).astype(float)
    with Image.open(path) as image:
        full = np.asarray(image.convert("RGB").crop(box).resize(size[::-1], Image.Resampling.BILINEAR)).astype(float)
    assert np.abs(drafted - full).mean() < 2.0 and np.abs(drafted - full).max() < 40
    np.testing.assert_array_equal(decode_box(path, 3, size, lambda h, w: box, flip=True), drafted[:, ::-1])


def test_evaluation_and_predict_keep_the_centre_of_the_shorter_side_resized(tmp_path):
    (tmp_path / "a").mkdir()
    pixels = np.random.default_rng(1).integers(0, 256, (24, 48, 3), np.uint8)
    Image.fromarray(pixels).save(tmp_path / "a" / "wide.png")
    # shorter side 24 -> 14 / 0.875 = 16: the image becomes 32x16, its centre 14x14 kept
    assert centre_box(24, 48, (14, 14)) == (13.5, 1.5, 34.5, 22.5)
    centre = load_image_folder(tmp_path, image_size=(14, 14), fit="centre").images
    expected = resize(pixels, (16, 32))[1:15, 9:23]  # (jaxcnn.data.resize: OpenCV's bilinear, not Pillow's)
    assert centre.dtype == np.uint8 and centre[:].shape == (1, 14, 14, 3)
    np.testing.assert_allclose(centre[0], expected, atol=1)
    predicted = load_unlabelled_folder(tmp_path / "a", channels=3, image_size=(14, 14), fit="centre")
    np.testing.assert_array_equal(predicted.images[:], centre[:])
    with pytest.raises(ValueError, match="fit"):
        ImageFiles(("x.png",), 3, (14, 14), fit="stretch")


@pytest.mark.parametrize(("layout", "mesh"), [("dp", {"data": 2}), ("pipeline", {"stage": 2})])
def test_uint8_batches_train_and_evaluate_like_the_same_pixels_as_floats(tmp_path, layout, mesh):
    folder = load_image_folder(write_folder(tmp_path / "train", per_class=6), channels=3)  # 18 of 10x12, uint8
    as_floats = Dataset(folder.images[:].astype(np.float32) / 255, folder.labels, "the same pixels, float32")
    test_bytes = Dataset(folder.images[:8], folder.labels[:8], "test, uint8")
    test_floats = Dataset(as_floats.images[:8], folder.labels[:8], "test, float32")
    config = TrainConfig(batch_size=8, epochs=2, max_steps=4)
    runs = []
    for data, test, dtype in ((folder, test_bytes, "uint8"), (as_floats, test_floats, "float32")):
        program = build_program(
            TINY_PLAIN, OptimConfig(learning_rate=1e-2, warmup_steps=2), get_layout(layout), build_mesh(mesh),
            data.image_shape, 8, 4, eval_batch_size=8, image_dtype=dtype,
            **({"microbatches": 2} if layout == "pipeline" else {}),
        )  # fmt: skip
        assert program.train_input.images.dtype == np.dtype(dtype) == program.eval_input.images.dtype
        runs.append(fit(program, program.init(), data, test, config, progress=False))
    (as_bytes, floats) = runs
    np.testing.assert_allclose(as_bytes.loss_history, floats.loss_history, rtol=1e-5)
    assert as_bytes.epochs[-1]["test_loss"] == pytest.approx(floats.epochs[-1]["test_loss"], rel=1e-5)


def test_augment_imagenet_trains_on_a_folder_and_a_corrupt_jpeg_is_one_line(tmp_path, capsys):
    root = write_folder(tmp_path / "train", per_class=6, size=(30, 40))
    flags = ["--data", str(root), "--augment", "imagenet", "--image-size", "16x16", "--channels", "3",
             "--num-classes", "3", "--model", "cnn2d_2layer_fullconnected_2layer", "--conv-features", "4,8",
             "--dense-features", "16", "--batch-size", "8", "--max-steps", "2", "--input-workers", "0",
             "--host-devices", "8", "--layout", "single", "--val-split", "0.25", "--quiet"]  # fmt: skip
    record = load_train_module().main([*flags, "--results-dir", str(tmp_path / "out")])
    assert len(record["loss_history"]) == 2 and np.isfinite(record["loss_history"]).all()
    (root / "dog" / "001.jpg").write_bytes(b"not a jpeg at all")  # found at load, before anything compiles
    with pytest.raises(SystemExit) as exit_info:
        cli.run_main("train.py", lambda: load_train_module().main([*flags, "--results-dir", str(tmp_path / "bad")]))
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"train.py: error: image {root / 'dog' / '001.jpg'} cannot be")


@pytest.mark.parametrize("channels", [1, 3])
def test_mirrored_equals_numpys_reversed_columns(channels):
    from jaxcnn.data.resize import mirrored

    pixels = np.random.default_rng(0).integers(0, 256, (7, 5, channels), dtype=np.uint8)
    flipped = mirrored(pixels)
    assert flipped.shape == pixels.shape and flipped.flags.c_contiguous
    np.testing.assert_array_equal(flipped, pixels[:, ::-1])
