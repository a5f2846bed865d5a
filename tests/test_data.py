"""The CSV loader: good files, the label-free test file, each malformed case; batching."""

import time

import jax
import numpy as np
import pytest
from conftest import REPO, load_script, write_digits_csv
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcnn.data import Loader, Prefetcher, eval_batches, load_csv, parse_image_shape, to_global, train_batches
from jaxcnn.errors import UserError
from jaxcnn.sharding import build_mesh


def test_bundled_files_are_8x8_digits_scaled_to_unit_range():
    train, test = load_csv(REPO / "data/train.csv"), load_csv(REPO / "data/test.csv")
    assert train.images.shape == (1437, 8, 8, 1) and test.images.shape == (360, 8, 8, 1)
    assert train.images.min() == 0.0 and train.images.max() == 1.0
    assert set(np.unique(train.labels)) == set(range(10))
    # stratified split: each class's share of the test set is within 1 image of 20%
    for digit in range(10):
        total = (train.labels == digit).sum() + (test.labels == digit).sum()
        assert abs((test.labels == digit).sum() - 0.2 * total) <= 1


@pytest.mark.parametrize(("side", "channels", "shape"), [(8, 1, (8, 8, 1)), (28, 1, (28, 28, 1)), (4, 3, (4, 4, 3))])
def test_image_side_inferred_from_pixel_count(tmp_path, side, channels, shape):
    path = write_digits_csv(tmp_path / "x.csv", rows=5, side=side, channels=channels)
    assert load_csv(path, channels=channels).image_shape == shape


def test_pixels_scaled_by_the_files_full_scale(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text("label,pixel0,pixel1,pixel2,pixel3\n1,0,255,128,3\n")
    np.testing.assert_allclose(load_csv(path).images.ravel(), [0, 1, 128 / 255, 3 / 255], rtol=1e-6)
    path.write_text("label,pixel0,pixel1,pixel2,pixel3\n1,0,12,8,3\n")  # no pixel at 16, still the 0..16 scale
    np.testing.assert_allclose(load_csv(path).images.ravel(), [0, 12 / 16, 8 / 16, 3 / 16], rtol=1e-6)


def test_label_free_test_file_loads_without_labels(tmp_path):
    ds = load_csv(write_digits_csv(tmp_path / "t.csv", rows=7, labels=False), need_labels=False)
    assert ds.labels is None and ds.images.shape == (7, 8, 8, 1)


def test_training_file_needs_labels(tmp_path):
    with pytest.raises(UserError, match="no 'label' column"):
        load_csv(write_digits_csv(tmp_path / "t.csv", labels=False))


HEADER = "label,pixel0,pixel1,pixel2,pixel3\n"
MALFORMED = {
    "empty": ("", "is empty"),
    "header only": (HEADER, "no image rows"),
    "too many cells": (HEADER + "1,0,1,2,3\n2,0,1,2,3,4\n", "ragged rows"),
    "too few cells": (HEADER + "1,0,1,2,3\n2,0,1\n", "row 2 has no value"),
    "non-numeric": (HEADER + "1,0,1,2,3\n2,0,x,2,3\n", "'x', not a number"),
    "pixel count": ("label,pixel0,pixel1,pixel2\n1,0,1,2\n", "3 pixel columns is not side"),
    "fractional label": (HEADER + "1.5,0,1,2,3\n", "label 1.5"),
    "label out of range": (HEADER + "10,0,1,2,3\n", "label 10; labels must be integers 0..9"),
    "negative label": (HEADER + "-1,0,1,2,3\n", "label -1"),
    "negative pixel": (HEADER + "1,0,-1,2,3\n", "negative pixel"),
    "bad header": ("label,a,b,c,d\n1,0,1,2,3\n", "column 'a' is not the expected pixel column"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_file_gets_a_clear_error(tmp_path, case):
    text, message = MALFORMED[case]
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(UserError, match=message) as info:
        load_csv(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_csv(tmp_path / "nope.csv")
    with pytest.raises(UserError, match="is a directory"):
        load_csv(tmp_path)


def test_synthetic_shape_flag():
    assert parse_image_shape("224x224x3") == (224, 224, 3)
    assert parse_image_shape("28x28") == (28, 28, 1)
    for bad in ("224", "ax3x3", "0x8x1"):
        with pytest.raises(UserError, match="not an image shape"):
            parse_image_shape(bad)


def test_train_batches_are_full_deterministic_and_cover_each_example_once(digits_csv):
    ds = load_csv(digits_csv)
    first = [labels for _, labels in train_batches(ds, 16, epoch=0, seed=3)]
    again = [labels for _, labels in train_batches(ds, 16, epoch=0, seed=3)]
    other_epoch = [labels for _, labels in train_batches(ds, 16, epoch=1, seed=3)]
    assert len(first) == 2 and all(len(b) == 16 for b in first)  # 40 // 16, remainder dropped
    assert all((a == b).all() for a, b in zip(first, again, strict=True))
    assert not all((a == b).all() for a, b in zip(first, other_epoch, strict=True))


def test_eval_batches_pad_and_mask_the_last_batch(digits_csv):
    ds = load_csv(digits_csv)
    batches = list(eval_batches(ds, 16))
    assert [len(b[0]) for b in batches] == [16, 16, 16]
    assert [int(b[2].sum()) for b in batches] == [16, 16, 8]
    np.testing.assert_array_equal(np.concatenate([b[1][b[2] > 0] for b in batches]), ds.labels)


def test_global_batch_is_sharded_over_data_axis():
    mesh = build_mesh({"data": 8})
    sharding = NamedSharding(mesh, P("data"))
    batch = np.arange(32, dtype=np.float32).reshape(16, 2)
    array = to_global(batch, sharding)
    assert array.sharding == sharding and len(array.addressable_shards) == 8
    assert {s.data.shape for s in array.addressable_shards} == {(2, 2)}
    np.testing.assert_array_equal(jax.device_get(array), batch)


def test_prefetcher_keeps_order_counts_waiting_and_reraises():
    def produce(i):
        if i == 0:
            time.sleep(0.05)  # a deliberately slow first item: the consumer must wait for it
        return i * i

    started = time.perf_counter()
    loader = Prefetcher(produce, count=5, depth=2)
    assert list(loader) == [0, 1, 4, 9, 16]
    elapsed = time.perf_counter() - started
    # the wait for item 0 is counted, and no more than the consumer spent in the loop;
    # without idle() every wait for an unbuilt item is a stall
    assert 0.04 <= loader.stall_seconds <= loader.wait_seconds <= elapsed
    loader.close()

    def broken(i):
        if i == 2:
            raise RuntimeError("boom")
        return i

    with pytest.raises(RuntimeError, match="boom"):
        list(Prefetcher(broken, count=5))


def test_prefetcher_workers_keep_order_and_count_the_wait():
    finished = []

    def slow(i):
        time.sleep(0.02 * (5 - i))  # deliberately slow, later items faster: they finish first on 4 threads
        finished.append(i)
        return i

    started = time.perf_counter()
    loader = Prefetcher(slow, count=5, depth=4, workers=4)
    assert list(loader) == [0, 1, 2, 3, 4]
    elapsed = time.perf_counter() - started
    assert finished.index(3) < finished.index(0)  # built out of order, yielded in order
    assert 0.05 <= loader.wait_seconds <= elapsed  # the consumer really waited for item 0 (0.1 s)
    loader.close()


def test_augmentation_shifts_and_flips_deterministically():
    from jaxcnn.data import Augment

    images = np.arange(2 * 6 * 6, dtype=np.float32).reshape(2, 6, 6, 1) + 1
    assert Augment()(images, 0, 0, 0) is images  # off: untouched
    shifted = Augment(shift=2)(images, 0, 0, 0)
    assert shifted.shape == images.shape and not np.array_equal(shifted, images)
    np.testing.assert_array_equal(shifted, Augment(shift=2)(images, 0, 0, 0))  # same batch, same draws
    assert not np.array_equal(shifted, Augment(shift=2)(images, 0, 0, 1))  # the next batch, new draws
    for original, moved in zip(images[..., 0], shifted[..., 0], strict=True):
        # a translation: every kept pixel is an original one, the rest is zero fill
        kept = moved[moved > 0]
        assert set(kept.tolist()) <= set(original.ravel().tolist()) and len(kept) >= 4 * 4
    flipped = Augment(flip=True)(images, 0, 0, 0)
    for original, out in zip(images, flipped, strict=True):
        assert np.array_equal(out, original) or np.array_equal(out, original[:, ::-1])
    with pytest.raises(UserError, match="--augment-shift must be >= 0"):
        Augment(shift=-1)


IDLE_STEPS, IDLE_BATCH, IDLE_SHAPE = 12, 128, (24, 24, 1)


@pytest.fixture(scope="module")
def timed_program():
    """A single-device program whose step (~45 ms here) is long next to the ~1 ms it takes
    to dispatch one and to timer and thread noise."""
    from conftest import compiled_program

    from jaxcnn.config import ModelConfig
    from jaxcnn.data import synthetic_dataset
    from jaxcnn.sharding import get_layout

    model = ModelConfig(
        name="cnn2d_2layer_fullconnected_2layer", conv_features=(32, 64), dense_features=(32,), norm="none"
    )
    program = compiled_program(get_layout("single"), {"data": 1}, model, IDLE_STEPS, IDLE_BATCH, image_shape=IDLE_SHAPE)
    return program, synthetic_dataset(IDLE_SHAPE, IDLE_BATCH * IDLE_STEPS, 10, 0)


def _run(timed_program, delay: float):
    """fit with a loader that takes `delay` seconds a batch (one worker: one batch every
    delay, at most 2 ahead): experiments/input_wait.py's deliberately slow loader."""
    from jaxcnn.config import TrainConfig
    from jaxcnn.fit import fit

    program, data = timed_program
    config = TrainConfig(batch_size=IDLE_BATCH, epochs=1, max_steps=IDLE_STEPS)
    loader = Loader(data, augment=load_script("input_wait").DelayedLoader(delay), workers=1, depth=2)
    return fit(program, program.init(), loader, None, config, progress=False)


def _with_loader(timed_program, delay_in_steps: float):
    """(the step time s, a fit whose loader takes `delay_in_steps` x s a batch -- one worker:
    one batch every delay). s is the median of 10 steps, each waited for, measured before
    and after the fit (their mean: the machine's load moves it)."""
    import statistics

    from jaxcnn.analysis.measure import time_steps

    program, data = timed_program

    def step_seconds():
        seconds, _ = time_steps(program, program.init(), data.images[:IDLE_BATCH], data.labels[:IDLE_BATCH], 10)
        return statistics.median(seconds)

    before = step_seconds()
    result = _run(timed_program, delay_in_steps * before)
    return (before + step_seconds()) / 2, result


def test_a_loader_slower_than_the_step_idles_the_devices_by_the_difference(timed_program):
    from jaxcnn.analysis.verdicts import verdict

    attempts = []
    for _ in range(3):  # other work on the machine moves the step time under a measurement: retry
        step, slow = _with_loader(timed_program, 2.0)  # slower than the step by X = one step
        # the loop's time less the devices' work is idle time: about X / (step + X) = 50% (a
        # bit more: the first batch is waited for in full)
        expected = 1 - IDLE_STEPS * step / slow.train_seconds
        attempts.append((round(slow.input_wait_fraction, 3), round(expected, 3)))
        if abs(slow.input_wait_fraction - expected) < 0.06:
            break
    else:
        pytest.fail(f"devices idle for input vs expected, each attempt: {attempts}")
    rows = [{"num_devices": 8, "speedup": 1.0, "input_wait_fraction": slow.input_wait_fraction}]
    assert verdict(rows).startswith("input-bound")


def test_a_loader_faster_than_the_step_idles_the_devices_about_never(timed_program):
    from jaxcnn.analysis.verdicts import verdict

    _, fast = _with_loader(timed_program, 0.5)
    # only the first batch is waited for: 4% with 12 steps. (The figure before issue 15, the
    # host's wait for each batch while the step ran, read about 40% here and 50% in the issue.)
    assert fast.input_wait_fraction < 0.07
    rows = [{"num_devices": 8, "speedup": 1.0, "input_wait_fraction": fast.input_wait_fraction}]
    assert not verdict(rows).startswith("input-bound")
    slow = _run(timed_program, 0.01)
    np.testing.assert_allclose(slow.loss_history, fast.loss_history)  # the same batches, only later


def test_prefetcher_lets_the_devices_catch_up_before_it_times_a_stall():
    import concurrent.futures
    import threading

    built_after_idle, calls = threading.Event(), []

    def produce(i):
        if i == 0:
            assert built_after_idle.wait(timeout=30)  # item 0 exists only once idle() has run
        return i

    def idle():  # the devices finishing 0.2 s of dispatched work
        calls.append(len(calls))
        time.sleep(0.2)
        built_after_idle.set()

    loader = Prefetcher(produce, count=1, depth=1, idle=idle)
    assert list(loader) == [0] and calls == [0]  # not ready: idle() first, then the (short) stall
    assert loader.wait_seconds >= 0.2  # the host waited through the devices' work ...
    assert loader.stall_seconds < 0.1  # ... which is not a stall: only the wait after it is
    loader.close()

    ready = Prefetcher(lambda i: i, count=2, depth=2, idle=idle)
    concurrent.futures.wait(list(ready._pending))  # both items built before they are asked for
    assert list(ready) == [0, 1] and calls == [0]  # ready: no idle(), nothing stalled
    assert ready.stall_seconds == 0
    ready.close()
