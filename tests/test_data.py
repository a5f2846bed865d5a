"""The CSV loader: good files, the label-free test file, each malformed case; batching."""

import time

import jax
import numpy as np
import pytest
from conftest import REPO, load_script, write_digits_csv
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcnn.data import Loader, eval_batches, load_csv, parse_image_shape, train_batches
from jaxcnn.errors import UserError
from jaxcnn.sharding import BatchPlacement, build_mesh, to_global


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


def _placement(batch: int, image_shape: tuple, devices: int = 8) -> BatchPlacement:
    """Batches of `batch` examples split over a data axis of `devices` devices."""
    sharding = NamedSharding(build_mesh({"data": devices}), P("data"))
    return BatchPlacement(
        images=jax.ShapeDtypeStruct((batch, *image_shape), np.float32, sharding=sharding),
        labels=jax.ShapeDtypeStruct((batch,), np.int32, sharding=sharding),
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_the_loader_gives_each_steps_examples_and_resumes_from_its_saved_position(workers):
    from jaxcnn.data import Augment, batch_indices, synthetic_dataset

    data = synthetic_dataset((6, 6, 1), 40, 10, 0)
    epochs, placements = [5, 5, 5], [_placement(8, (6, 6, 1))] * 3  # prefetch runs across the epoch boundaries
    loader = Loader(data, augment=Augment(shift=1, flip=True), workers=workers)
    batches = loader.batches(epochs, placements, seed=4)
    got = []
    for _ in range(7):
        got.append(batches.next())
        batches.dispatched(got[-1][1])  # the next batch is placed ahead, as in training
    position = batches.position()
    rest = [batches.next() for _ in range(15 - 7)]
    batches.close()
    for k, (images, labels) in enumerate(got + rest):
        assert images.sharding == placements[0].images.sharding and labels.sharding == placements[0].labels.sharding
        epoch, index = divmod(k, 5)
        examples = batch_indices(40, 8, epoch, 4)[index]
        np.testing.assert_array_equal(labels, data.labels[examples])
        draws = Augment(shift=1, flip=True).draws(4, epoch, index, 8)
        np.testing.assert_array_equal(images, Augment(shift=1, flip=True).apply(data.images[examples], draws))
    assert position == {"next_step": 7}
    for other_workers in (workers, 1 - min(workers, 1)):  # a restored run's loader, on as many workers or not
        resumed = Loader(data, augment=Augment(shift=1, flip=True), workers=other_workers)
        resumed = resumed.batches(epochs, placements, 4, position)
        again = [resumed.next() for _ in range(15 - 7)]
        resumed.close()
        for (a, b), (c, d) in zip(rest, again, strict=True):
            np.testing.assert_array_equal(a, c)
            np.testing.assert_array_equal(b, d)


def test_the_schedule_is_the_list_of_steps_without_the_list():
    from jaxcnn.data import Schedule, Step

    schedule = Schedule([3, 2, 2])
    listed = [Step(0, 0), Step(0, 1), Step(0, 2), Step(1, 0), Step(1, 1), Step(2, 0), Step(2, 1)]
    assert len(schedule) == 7 and list(schedule) == listed
    with pytest.raises(IndexError):
        schedule[7]
    assert len(Schedule([44] * 100_000)) == 4_400_000  # no list of millions


def test_each_process_builds_only_its_rows_of_the_same_global_batch():
    """Two processes' rows (in the program's batch order) put together are the one
    process's batch: augmentation draws too, so the global batch does not depend on the
    process count."""
    from jaxcnn.data import Augment, Schedule, synthetic_dataset
    from jaxcnn.data.loader import BuildBatch
    from jaxcnn.sharding import BatchShare

    data = synthetic_dataset((5, 5, 1), 48, 10, 1)
    order = np.random.default_rng(0).permutation(16)  # e.g. gradient accumulation's

    def first_batches(rows):  # what a process whose devices hold `rows` builds (in grain's workers)
        build = BuildBatch(data, Augment(shift=2, flip=True), 9, Schedule([3]), [BatchShare(16, order, rows)])
        return [build.map(k)[1:] for k in range(3)]

    whole, first, second = first_batches(slice(0, 16)), first_batches(slice(0, 8)), first_batches(slice(8, 16))
    for (images, labels), (a, la), (b, lb) in zip(whole, first, second, strict=True):
        assert len(a) == len(b) == 8
        np.testing.assert_array_equal(images, np.concatenate([a, b]))
        np.testing.assert_array_equal(labels, np.concatenate([la, lb]))


class _Device:
    """A step's outputs that finish `seconds` after they are dispatched."""

    def __init__(self, seconds: float):
        self.done_at = time.perf_counter() + seconds

    def block_until_ready(self):
        time.sleep(max(0.0, self.done_at - time.perf_counter()))
        return self


class _SlowIterator:
    """A grain iterator stand-in: each batch takes `seconds` to arrive."""

    def __init__(self, seconds: float):
        self.seconds, self.step = seconds, 0

    def __next__(self):
        time.sleep(self.seconds)
        self.step += 1
        return self.step - 1, np.zeros(1), np.zeros(1)

    def get_state(self):
        return {"next_index": self.step}

    def close(self):
        pass


def test_a_wait_for_input_counts_as_a_stall_only_once_the_devices_have_finished():
    from jaxcnn.data import Batches, Schedule

    # a batch every 0.3 s, read ahead by the placing thread from the start: ready at
    # 0.3 (the pipeline starting), 0.6, 0.9, 1.2
    batches = Batches(_SlowIterator(0.3), Schedule([5]), [_placement(1, (), devices=1)], first_step=0)
    batches.next()  # the pipeline starting: not a stall
    assert batches.startup_seconds >= 0.3
    batches.dispatched(_Device(0.5))  # busy until 0.8: the wait for batch 1 (until 0.6) idles nothing
    batches.next()
    batches.dispatched(_Device(0.1))  # queued behind it: the devices finish both at 0.8
    batches.next()  # batch 2 at 0.9: the devices idle from 0.8, 0.1 s of this 0.3 s wait
    stall = batches.take_stall_seconds()
    assert 0.05 <= stall <= 0.16, stall
    assert batches.wait_seconds >= 0.5  # the host waited through both; only the idle part stalls
    batches.next()  # batch 3 at 1.2; the last step had finished at 0.8: all of this wait idles
    assert batches.take_stall_seconds() >= 0.2
    assert batches.position()["next_step"] == 4
    batches.close()


def test_augmentation_shifts_and_flips_deterministically():
    from jaxcnn.data import Augment

    images = np.arange(2 * 6 * 6, dtype=np.float32).reshape(2, 6, 6, 1) + 1

    def augmented(augment, index=0):
        return augment.apply(images, augment.draws(0, 0, index, len(images)))

    assert not Augment().active
    np.testing.assert_array_equal(augmented(Augment()), images)  # nothing drawn: untouched
    shifted = augmented(Augment(shift=2))
    assert shifted.shape == images.shape and not np.array_equal(shifted, images)
    np.testing.assert_array_equal(shifted, augmented(Augment(shift=2)))  # same batch, same draws
    assert not np.array_equal(shifted, augmented(Augment(shift=2), index=1))  # the next batch, new draws
    for original, moved in zip(images[..., 0], shifted[..., 0], strict=True):
        # a translation: every kept pixel is an original one, the rest is zero fill
        kept = moved[moved > 0]
        assert set(kept.tolist()) <= set(original.ravel().tolist()) and len(kept) >= 4 * 4
    flipped = augmented(Augment(flip=True))
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
    """fit with a loader that takes `delay` seconds a batch (one thread: one batch every
    delay, at most 2 ahead): experiments/input_wait.py's deliberately slow loader."""
    from jaxcnn.config import TrainConfig
    from jaxcnn.fit import fit

    program, data = timed_program
    config = TrainConfig(batch_size=IDLE_BATCH, epochs=1, max_steps=IDLE_STEPS)
    loader = Loader(data, augment=load_script("input_wait").DelayedLoader(delay), workers=0, depth=2)
    return fit(program, program.init(), loader, None, config, progress=False)


def _with_loader(timed_program, delay_in_steps: float):
    """(the step time s, a fit whose loader takes `delay_in_steps` x s a batch -- one thread:
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
        # over the steady state -- the window images/s covers: the loop's time less the first
        # step, which waits for the pipeline to start and is reported apart -- the time the
        # devices did not compute is idle time: about X / (step + X) = 50%
        steady = slow.train_seconds - slow.extra["first_step_seconds"]
        expected = 1 - (IDLE_STEPS - 1) * step / steady
        attempts.append((round(slow.input_wait_fraction, 3), round(expected, 3)))
        # within 20 points: the step is timed apart from the run, and another test computing on
        # the same two cores slows the run's steps more than those (under -n 2 the clock read
        # 6-18 points below the expected 50%, the last beside the SLURM tests' processes; a
        # clock that missed the stalls, or counted the pipeline's start, would be 40-50 points off)
        if abs(slow.input_wait_fraction - expected) < 0.2:
            break
    else:
        pytest.fail(f"devices idle for input vs expected, each attempt: {attempts}")
    rows = [{"num_devices": 8, "speedup": 1.0, "input_wait_fraction": slow.input_wait_fraction}]
    assert verdict(rows).startswith("input-bound")


def test_a_loader_faster_than_the_step_idles_the_devices_about_never(timed_program):
    from jaxcnn.analysis.verdicts import verdict

    _, fast = _with_loader(timed_program, 0.5)
    # the devices never wait: only the first batch is waited for, and that is the pipeline
    # starting, reported apart. (The figure before issue 15, the host's wait for each batch
    # while the step ran, read about 40% here and 50% in the issue.)
    assert fast.input_wait_fraction < 0.03 and fast.extra["input_startup_seconds"] > 0
    rows = [{"num_devices": 8, "speedup": 1.0, "input_wait_fraction": fast.input_wait_fraction}]
    assert not verdict(rows).startswith("input-bound")
    slow = _run(timed_program, 0.01)
    np.testing.assert_allclose(slow.loss_history, fast.loss_history)  # the same batches, only later


@pytest.mark.parametrize("size", [5, 19, 24], ids=["smaller-than-a-batch", "a-partial-last-batch", "whole-batches"])
def test_processes_holding_interleaved_rows_evaluate_every_example_once_in_order(size):
    """Two processes whose rows of each batch of 8 interleave (a custom rules table can give
    that): each reads only its examples, masks the padding, and their rows put back together
    are the test set in its order."""
    from jaxcnn.data import Dataset, EvalShare

    images = np.arange(size, dtype=np.float32).reshape(size, 1, 1, 1)
    dataset = Dataset(images=images, labels=np.arange(size, dtype=np.int32) % 10, source="counted")
    shares = [EvalShare(dataset, 8, np.array(rows)) for rows in ([0, 2, 4, 6], [1, 3, 5, 7])]
    assert sum(len(s.own) for s in shares) == size  # nobody reads an example twice
    rebuilt, labels = [], []
    for (x0, y0, m0), (x1, y1, m1) in zip(shares[0].batches(), shares[1].batches(), strict=True):
        batch, label, mask = np.empty((8, 1, 1, 1), np.float32), np.empty(8, np.int32), np.empty(8, np.float32)
        batch[0::2], batch[1::2], label[0::2], label[1::2], mask[0::2], mask[1::2] = x0, x1, y0, y1, m0, m1
        rebuilt.append(batch[mask == 1])
        labels.append(label[mask == 1])
        np.testing.assert_array_equal(batch[mask == 0], 0)  # padding: zero images, masked out
    np.testing.assert_array_equal(np.concatenate(rebuilt).ravel(), np.arange(size))
    np.testing.assert_array_equal(np.concatenate(labels), dataset.labels)


@pytest.mark.parametrize("fit", ["resize", "centre"])
def test_each_process_decodes_only_its_own_test_images(tmp_path, monkeypatch, fit):
    """An image folder's test set of 18 evaluated by two processes whose rows of each batch of
    8 interleave: the files each process's share decodes (counted at the decoder, per
    process) are exactly its own examples, each once -- 9 each, not the 18 of the whole set."""
    from conftest import write_folder

    import jaxcnn.data.folders as folders
    from jaxcnn.data import EvalShare, load_image_folder

    dataset = load_image_folder(write_folder(tmp_path / "test"), image_size=(10, 12), fit=fit)
    assert len(dataset) == 18 and not dataset.in_memory
    decoded = []  # the files decoded, one entry a decode

    def counted(decoder):
        return lambda path, *args, **kwargs: decoded.append(path) or decoder(path, *args, **kwargs)

    for name in ("_decode", "decode_box"):
        monkeypatch.setattr(folders, name, counted(getattr(folders, name)))
    for rows in ([0, 2, 4, 6], [1, 3, 5, 7]):
        decoded.clear()
        share = EvalShare(dataset, 8, np.array(rows))
        own = [b + r for b in range(0, 18, 8) for r in rows if b + r < 18]
        assert sorted(decoded) == sorted(dataset.images.paths[i] for i in own) and len(own) == 9
        assert len(share.own) == 9
