"""Batches onto the devices: which rows of a global batch each process builds, and the
global arrays a step takes, made from those rows.

Every process draws the same global batch and builds only the rows its own devices hold
(`BatchShare`); `jax.make_array_from_process_local_data` joins the processes' rows into one
global array, so multi-host input needs no other code and a global batch is the same for
any number of processes.

    placement = BatchPlacement(images=images_sds, labels=labels_sds)    # the step's arguments
    images, labels = placement.place(host_images, host_labels)          # a whole host batch
    images, labels = placement.place_rows(*rows)                        # this process's rows only
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec


def process_rows(placements: list[tuple[NamedSharding, tuple[int, ...]]]) -> np.ndarray:
    """The rows of a global batch this process's devices hold, ascending, each once, over
    (sharding, global shape) pairs: the images' and the labels' may differ (a pipeline's
    first and last stage). Not always one span: a table that splits the batch over a fast
    axis first (`batch=model+data`, `data` across hosts) gives a process every other block."""
    return np.unique(np.concatenate([_rows_held(sharding, tuple(shape)) for sharding, shape in placements]))


@functools.lru_cache(maxsize=256)  # asked at every step's placement
def _rows_held(sharding: NamedSharding, shape: tuple[int, ...], dim: int = 0) -> np.ndarray:
    spans = [index[dim].indices(shape[dim]) for index in sharding.addressable_devices_indices_map(shape).values()]
    return np.unique(np.concatenate([np.arange(*span) for span in spans] or [np.zeros(0, np.int64)]))


def to_global(
    array: np.ndarray, sharding: NamedSharding, global_rows: int | None = None, rows: np.ndarray | None = None,
    dim: int = 0,
) -> jax.Array:  # fmt: skip
    """A global sharded array from this process's rows of it.

    `array` holds the rows `rows` (ascending, along `dim`; None: 0, 1, ...) of a global
    array of `global_rows` rows (None: `array` is the whole global array); each process
    hands JAX just the rows its own devices own -- ascending, one block after another, as
    `jax.make_array_from_process_local_data` reads them. (`dim` 1: K steps' batches
    stacked, [K, rows, ...].)
    """
    global_shape = tuple(global_rows or array.shape[dim] if d == dim else n for d, n in enumerate(array.shape))
    own = _rows_held(sharding, global_shape, dim)
    at = own if rows is None else np.searchsorted(rows, own)
    given = array.shape[dim]
    if len(own) and (at[-1] >= given or (rows is not None and not np.array_equal(rows[at], own))):
        raise ValueError(f"this process's rows of the batch ({_spans(own)}) are not all among the rows given")
    if len(at) == given:
        local = array  # every row given is this sharding's
    elif len(at) and at[-1] - at[0] + 1 == len(at):
        local = np.take(array, np.arange(at[0], at[-1] + 1), axis=dim) if dim else array[at[0] : at[-1] + 1]
    else:
        local = np.take(array, at, axis=dim)
    return jax.make_array_from_process_local_data(sharding, local, global_shape)


def put_whole(value, target: NamedSharding) -> jax.Array:
    """A host value (the same on every process) whole on each of `target`'s devices, built
    shard by shard: nothing runs on the devices. (`jax.device_put(value, target)` with
    `target` spanning processes first checks every process gave the same value -- a program
    with an all-gather on all of this process's devices. XLA:CPU keys one gloo communicator
    per device set, every all-gather in one slot, and PJRT:CPU does not order that program
    after programs on fewer of the devices (a pipeline's stage: one of each process), so its
    all-gather could race theirs and two processes pair different ones: gloo's "collective
    mismatch".)"""
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, target, lambda index: value[index])


def _spans(rows: np.ndarray) -> str:
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    return ", ".join(f"{part[0]}-{part[-1]}" for part in np.split(rows, breaks) if len(part))


@dataclass(frozen=True, eq=False)  # holds an array: compared by identity
class BatchShare:
    """This process's share of each global batch: the batch size, the order its step wants
    the examples in (None: as drawn), and the rows of that ordered batch this process
    builds. Holds no device, so the loader's worker processes can take it."""

    batch_size: int
    order: np.ndarray | None
    rows: np.ndarray  # ascending positions in the (ordered) batch

    def take(self, per_example: np.ndarray) -> np.ndarray:
        """This process's rows of anything with one entry per example of the global batch
        (the examples' indices, their augmentation draws, the images themselves), in order."""
        if self.order is not None:
            per_example = per_example[self.order]
        return per_example[self.rows]


@dataclass(frozen=True, eq=False)  # holds an array: compared by identity
class BatchPlacement:
    """How a step takes its batch: each argument's global shape, dtype and sharding, and the
    order it wants the examples in (gradient accumulation's; None: as drawn)."""

    images: jax.ShapeDtypeStruct
    labels: jax.ShapeDtypeStruct
    mask: jax.ShapeDtypeStruct | None = None  # an evaluation batch's: 1 for an example, 0 for padding
    order: np.ndarray | None = None

    @property
    def batch_size(self) -> int:
        return self.images.shape[0]

    @property
    def arrays(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """The step's batch arguments, in the order it takes them."""
        return (self.images, self.labels) if self.mask is None else (self.images, self.labels, self.mask)

    @functools.cached_property  # read by every step's placement: worked out once
    def share(self) -> BatchShare:
        """The rows of each batch this process builds."""
        rows = process_rows([(a.sharding, a.shape) for a in self.arrays])
        return BatchShare(self.batch_size, self.order, rows)

    def place_rows(self, *rows: np.ndarray) -> tuple[jax.Array, ...]:
        """This process's rows of each argument (`share.take`'s) as the step's global arrays."""
        own = self.share.rows
        return tuple(to_global(a, s.sharding, self.batch_size, own) for a, s in zip(rows, self.arrays, strict=True))

    def place(self, *whole: np.ndarray) -> tuple[jax.Array, ...]:
        """A whole global batch, held by every process, as the step's global arrays."""
        return self.place_rows(*(self.share.take(a) for a in whole))


@dataclass(frozen=True, eq=False)  # holds an array: compared by identity
class StackedPlacement:
    """How a call of `steps` steps takes their batches: each of `single`'s arguments with a
    leading [steps] dimension, split as one step's is (jaxcnn.steps.calls)."""

    single: BatchPlacement
    steps: int

    @property
    def share(self) -> BatchShare:
        return self.single.share

    def place_rows(self, *rows: np.ndarray) -> tuple[jax.Array, ...]:
        """Each argument's rows, [steps, this process's rows, ...], as the call's global arrays."""
        own, single = self.single.share.rows, self.single
        return tuple(
            to_global(a, stacked(s.sharding), single.batch_size, own, dim=1)
            for a, s in zip(rows, single.arrays, strict=True)
        )


def stacked(sharding: NamedSharding) -> NamedSharding:
    """A step's argument's sharding with a leading steps dimension, unsplit."""
    return NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))
