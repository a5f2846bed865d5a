"""Training data held on the devices (`--data-on-device auto|on|off`): the training set
placed once, split over the batch's mesh axes, and each step given only its examples'
indices -- the same examples, in the same order, as the host loader reads -- which the
compiled step gathers (jaxcnn.steps.device_batch).

    on_device = choose(config.data.data_on_device, train_set, layout, mesh, augment, seed)  # or None
    feed = DeviceFeed(placed(train_set, on_device, layout, mesh), len(train_set), epoch_steps, placements,
                      carries, seed, first_step)

The pixels travel as uint8 where that is exact: a file of 8-bit pixels scaled to [0, 1]
(Fashion-MNIST's x / 255, the digits' x / 16) is stored as its bytes and scaled back in the
step to the same float32 numbers -- a quarter of the memory. `auto` puts a training set on
the devices when it is in memory and its share per device is at most DEVICE_DATA_FRACTION of
a device's memory (on a CPU, of this host's memory shared among its devices).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcnn.data.feed import CallMetrics, Schedule
from jaxcnn.data.loader import Augment, epoch_order
from jaxcnn.data.sources import FULL_SCALES, Dataset
from jaxcnn.errors import UserError
from jaxcnn.run_config import check_data_on_device
from jaxcnn.sharding import axes as ax
from jaxcnn.sharding.layouts import Layout
from jaxcnn.sharding.partition import data_sharding
from jaxcnn.sharding.placement import BatchPlacement, put_whole, to_global

DEVICE_DATA_FRACTION = 0.25  # auto: a device's share of the training set, at most this part of its memory


@dataclass(frozen=True)
class OnDevice:
    """What a step compiled for data on the devices takes: the stored set's rows (padded to
    divide over the batch axes), its pixels' dtype and scale, and the augmentation drawn in
    the step."""

    rows: int
    size: int  # the training set's examples (rows: padded)
    image_shape: tuple[int, int, int]
    dtype: str  # "uint8" or "float32"
    scale: float | None  # uint8 stored for float pixels: x / scale in the step; None: as stored
    seed: int
    shift: int = 0
    flip: bool = False


def batch_axes(layout: Layout, mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes a batch is split over (those the stored set is split over too)."""
    entry = data_sharding((ax.BATCH,), layout, mesh).spec[0]
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def stored_pixels(images: np.ndarray) -> tuple[np.ndarray, float | None]:
    """(the pixels as stored on the devices, the scale that gives back the host's floats):
    uint8 when some full scale s makes every pixel k / s in float32 for an integer k in
    0..255 -- checked exactly, value by value -- else as they are."""
    if images.dtype == np.uint8 or images.dtype != np.float32:
        return images, None
    for scale in FULL_SCALES:
        if scale > 255:
            break
        levels = np.rint(images * scale)
        if levels.min() < 0 or levels.max() > 255:
            continue
        stored = levels.astype(np.uint8)
        if np.array_equal(stored.astype(np.float32) / np.float32(scale), images):
            return stored, scale
    return images, None


def device_memory_bytes(mesh: Mesh) -> float:
    """One device's memory: its allocator's limit, or on a CPU this host's memory shared
    among its devices."""
    device = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return float(stats["bytes_limit"])
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host / max(1, len(jax.local_devices()))


def choose(mode: str, dataset: Dataset, layout: Layout, mesh: Mesh, augment, seed: int) -> tuple[OnDevice | None, str]:
    """(the on-device description, or None for the host loader; why), for --data-on-device."""
    check_data_on_device(mode)
    if mode == "off":
        return None, "off"
    refusal = None
    if layout.stage_axis:
        refusal = "the pipeline feeds its stages from the host"
    elif not isinstance(augment, Augment):
        refusal = "--augment imagenet cuts its crops from the files"
    elif not dataset.in_memory and mode == "auto":
        refusal = "the images are files, decoded as they are read (--data-on-device on decodes them all first)"
    if refusal:
        if mode == "on":
            raise UserError(f"--data-on-device on: {refusal}; use --data-on-device off (or auto)")
        return None, f"off ({refusal})"
    if not dataset.in_memory:
        raise UserError("--data-on-device on: decode the images first (Dataset.loaded()), then place them")
    stored, scale = stored_pixels(dataset.images)
    ways = math.prod(mesh.shape[a] for a in batch_axes(layout, mesh))
    share = stored.nbytes / ways + dataset.labels.nbytes / ways
    budget = DEVICE_DATA_FRACTION * device_memory_bytes(mesh)
    fits = share <= budget
    if mode == "auto" and jax.process_count() > 1:  # every process compiles the same step: process 0 decides
        from jax.experimental import multihost_utils

        fits = bool(multihost_utils.broadcast_one_to_all(np.int32(fits)))
    if mode == "auto" and not fits:
        return None, f"off ({share / 2**20:,.0f} MiB per device > {budget / 2**20:,.0f} MiB)"
    rows = -(-len(dataset) // ways) * ways
    on = OnDevice(rows, len(dataset), dataset.image_shape, stored.dtype.name, scale, seed, augment.shift, augment.flip)
    return on, f"on ({share / 2**20:,.1f} MiB per device, {stored.dtype.name})"


def placed(dataset: Dataset, on: OnDevice, layout: Layout, mesh: Mesh) -> tuple[jax.Array, jax.Array]:
    """The training set on the devices, rows split over the batch axes (each process gives
    its own devices' rows); padded with zero rows no index names."""
    stored, _ = stored_pixels(dataset.images)
    pad = on.rows - len(dataset)
    images = np.concatenate([stored, np.zeros((pad, *stored.shape[1:]), stored.dtype)]) if pad else stored
    labels = np.concatenate([dataset.labels, np.zeros(pad, dataset.labels.dtype)]) if pad else dataset.labels
    spec = P(batch_axes(layout, mesh) or None)
    return to_global(images, NamedSharding(mesh, spec)), to_global(labels, NamedSharding(mesh, spec))


def epoch_rows(size: int, placement: BatchPlacement, epoch: int, seed: int, steps: int) -> np.ndarray:
    """Epoch `epoch`'s rows [2S, B + 3] for a training set of `size` examples (S whole
    batches): row r is step r's example indices (the host loader's, in the order the
    step's program takes its batch), its epoch, r, and the epoch's `steps` (fewer than S
    where the run ends mid-epoch); rows past S are zeros."""
    batch = placement.batch_size
    full = size // batch  # batch_indices' batches, without a list of them
    batches = epoch_order(size, epoch, seed)[: full * batch].reshape(full, batch)
    if placement.order is not None:
        batches = batches[:, placement.order]
    where = np.stack([np.full(full, epoch), np.arange(full), np.full(full, steps)], axis=1)
    rows = np.zeros((2 * full, batch + 3), np.int32)
    rows[:full] = np.concatenate([batches, where], axis=1)
    return rows


def carry_at(carry, row: int) -> dict:
    """A call's carry (jaxcnn.steps.calls.epoch_carry; `carry` abstract) at epoch row `row`,
    its log zeros (rows before `row`, not written here, are never read)."""
    log = {name: put_whole(np.zeros(a.shape, a.dtype), a.sharding) for name, a in carry["log"].items()}
    return {"row": put_whole(np.int32(row), carry["row"].sharding), "log": log}


class DeviceFeed:
    """The `Feed` (jaxcnn.data.feed) of the run's steps as calls on data held on the devices. Once an epoch, its rows
    [steps, B + 3] -- each step's examples' indices (in the order the epoch's program takes
    its batch), its epoch, its batch index and the epoch's steps -- go to every device; each
    call takes its rows from there and hands back its carry -- the next row, and its epoch's
    metrics so far -- which the next call takes (jaxcnn.steps.calls.steps_on_device_data), so
    a call costs the host its dispatch and nothing else. A call never crosses an epoch: the
    epoch's last may run fewer steps than it holds. Nothing waits on the host: no input stall to clock."""

    def __init__(
        self, data: tuple[jax.Array, jax.Array], size: int, epoch_steps: Sequence[int],
        placements: Sequence[BatchPlacement], carries: Sequence[dict], seed: int, first_step: int = 0,
        steps_per_call: int = 1,
    ):  # fmt: skip
        self.data, self.size, self.seed = data, size, seed
        self._steps, self._placements, self._carries = Schedule(epoch_steps), placements, carries
        self._next_step = first_step
        self.steps_per_call = steps_per_call
        self._epoch: tuple[int, jax.Array] | None = None  # (epoch, its rows on the devices)
        self._epoch_end = 0  # the run's step after the epoch's last
        self._ahead: tuple[int, jax.Array] | None = None  # the next epoch's (epoch, rows)
        self._carry = None  # the next call's: the last call's
        self._first_carries: dict[int, dict] = {}  # id(abstract carry) -> at row 0 (never changed: reused)
        self._replicated = NamedSharding(placements[0].images.sharding.mesh, P())
        self.startup_seconds = 0.0
        self._call = (0, 0)  # the last call's (steps, epoch log row it began at)

    epoch_end_waits = False  # nothing to clock: an epoch's end need not wait for the devices

    def start_epoch(self, program, steps: int, last: bool) -> None:
        """An epoch's last call runs exactly its steps left, compiled on a thread for the
        epochs after this one (and this one's, if in time); until then that call holds idle
        steps (`compiled`)."""
        remainder = steps % self.steps_per_call
        if self.steps_per_call > 1 and remainder and not last:
            program.calls.compile_ahead(remainder, True)

    def compiled(self, program, steps: int, held: int) -> Callable:
        if steps < held and program.calls.ready(steps, True):
            held = steps
        return program.calls.get(held, True).run

    def _epoch_rows(self, epoch: int) -> jax.Array:
        """Epoch `epoch`'s rows, placed."""
        steps = int(self._steps.starts[epoch + 1] - self._steps.starts[epoch])
        return put_whole(epoch_rows(self.size, self._placements[epoch], epoch, self.seed, steps), self._replicated)

    def _first_carry(self, epoch: int, row: int) -> dict:
        carry = self._carries[epoch]
        if row:
            return carry_at(carry, row)
        if id(carry) not in self._first_carries:
            self._first_carries[id(carry)] = carry_at(carry, 0)
        return self._first_carries[id(carry)]

    def next_call(self) -> tuple[int, int, tuple]:
        """(steps this call runs, the steps it holds: its program's, its inputs after the state)."""
        if self._epoch is None or self._next_step >= self._epoch_end:
            where = self._steps[self._next_step]
            if self._ahead is not None and self._ahead[0] == where.epoch and where.index == 0:
                self._epoch = self._ahead
            else:
                self._epoch = where.epoch, self._epoch_rows(where.epoch)
            self._carry = self._first_carry(where.epoch, where.index)
            self._ahead = None
            self._epoch_end = int(self._steps.starts[where.epoch + 1])
        call = self.steps_per_call
        if call > self._epoch[1].shape[0] // 2:
            raise ValueError(f"a call of {call} steps holds more than an epoch's {self._epoch[1].shape[0] // 2}")
        steps = min(call, self._epoch_end - self._next_step)  # an epoch's last call may run fewer steps than it holds
        self._call = steps, self._next_step - int(self._steps.starts[self._epoch[0]])
        self._next_step += steps
        return steps, call, (*self.data, self._epoch[1], self._carry)

    def dispatched(self, carry: dict) -> CallMetrics:
        """The call's carry, the next call's; its metrics: the epoch's log. After an epoch's
        last call, the next epoch's rows are placed while the devices run it."""
        self._carry = carry
        if self._next_step == self._epoch_end < len(self._steps) and self._ahead is None:
            epoch = self._epoch[0] + 1
            self._ahead = epoch, self._epoch_rows(epoch)
        return CallMetrics(carry["log"], *self._call)

    def position(self) -> dict:
        return {"next_step": self._next_step}

    def take_stall_seconds(self) -> float:
        return 0.0

    def close(self) -> None:
        pass
