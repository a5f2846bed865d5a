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
from jax.sharding import NamedSharding


def process_rows(placements: list[tuple[NamedSharding, tuple[int, ...]]]) -> slice:
    """The rows of a global batch this process's devices hold, over (sharding, global shape)
    pairs: the images' and the labels' may differ (a pipeline's first and last stage)."""
    starts, stops = [], []
    for sharding, shape in placements:
        for index in sharding.addressable_devices_indices_map(shape).values():
            starts.append(index[0].start or 0)
            stops.append(shape[0] if index[0].stop is None else index[0].stop)
    return slice(min(starts), max(stops)) if starts else slice(0, 0)


def to_global(
    array: np.ndarray, sharding: NamedSharding, global_rows: int | None = None, first_row: int = 0
) -> jax.Array:
    """A global sharded array from this process's rows of it.

    `array` holds rows first_row .. first_row + len(array) of a global array of
    `global_rows` rows (None: `array` is the whole global array); each process hands JAX
    just the rows its own devices own.
    """
    global_shape = (global_rows or len(array), *array.shape[1:])
    rows = process_rows([(sharding, global_shape)])
    local = array[rows.start - first_row : rows.stop - first_row]
    return jax.make_array_from_process_local_data(sharding, local, global_shape)


@dataclass(frozen=True, eq=False)  # holds an array: compared by identity
class BatchShare:
    """This process's share of each global batch: the batch size, the order its step wants
    the examples in (None: as drawn), and the rows of that ordered batch this process
    builds. Holds no device, so the loader's worker processes can take it."""

    batch_size: int
    order: np.ndarray | None
    rows: slice

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
        first = self.share.rows.start
        return tuple(to_global(a, s.sharding, self.batch_size, first) for a, s in zip(rows, self.arrays, strict=True))

    def place(self, *whole: np.ndarray) -> tuple[jax.Array, ...]:
        """A whole global batch, held by every process, as the step's global arrays."""
        return self.place_rows(*(self.share.take(a) for a in whole))
