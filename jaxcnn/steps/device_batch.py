"""A step's batch from training data held on the devices (`--data-on-device`): gathered by
index inside the compiled step, augmented there.

The training set is placed once, its rows split over the batch's mesh axes (device d of D
holds examples [d*N/D, (d+1)*N/D)); a step is given only its examples' indices, the same
ones, in the same order, as the host loader would read. Each device takes the examples of
the batch that it holds (zeros for the others) and one reduce-scatter over the batch axes
hands every device the rows of the batch it computes on: the batch's bytes cross the
devices once a step, where a replicated training set would cost D times the memory.
Without batch axes (single, tp) every device holds the whole set and takes its rows.

Shifts and flips (`--augment-shift`, `--augment-flip`) are drawn for the global batch from
(seed, epoch, batch index), so every layout draws the same ones (not the host loader's
numpy draws: an augmented run on the devices is not the host path's, an unaugmented one is).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P


def gather_rows(data_N, indices_B, mesh: Mesh, axes: tuple[str, ...]):
    """Rows `indices_B` of `data_N` (split over `axes` on its first dimension), split over
    `axes` in turn: [B, ...]."""
    if not axes:
        return jnp.take(data_N, indices_B, axis=0)

    def own_rows(block, indices):
        held = block.shape[0]
        first = jax.lax.axis_index(axes) * held
        mine = (indices >= first) & (indices < first + held)
        rows = jnp.take(block, jnp.where(mine, indices - first, 0), axis=0)
        rows = jnp.where(mine.reshape(-1, *[1] * (rows.ndim - 1)), rows, jnp.zeros_like(rows))
        return jax.lax.psum_scatter(rows, axes, scatter_dimension=0, tiled=True)  # one holder per row: a sum is a move

    return jax.shard_map(
        own_rows, mesh=mesh, in_specs=(P(axes), P()), out_specs=P(axes), axis_names=set(axes), check_vma=False
    )(data_N, indices_B)


def augment_key(seed: int, epoch, index) -> jax.Array:
    """The key of batch `index` of `epoch`'s shifts and flips."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), epoch), index)


def shift_and_flip(images_BHWC, key, shift: int, flip: bool):
    """Each image shifted by up to `shift` pixels each way (zero fill) and, with `flip`,
    mirrored left-right with probability 1/2 -- the host loader's `Augment`, drawn here."""
    if not shift and not flip:
        return images_BHWC
    b, h, w, _ = images_BHWC.shape
    shift_key, flip_key = jax.random.split(key)
    if shift:
        dy, dx = jax.random.randint(shift_key, (2, b), 0, 2 * shift + 1)
        padded = jnp.pad(images_BHWC, ((0, 0), (shift, shift), (shift, shift), (0, 0)))
        rows = dy[:, None] + jnp.arange(h)[None, :]  # [B, H]
        cols = dx[:, None] + jnp.arange(w)[None, :]  # [B, W]
        images_BHWC = padded[jnp.arange(b)[:, None, None], rows[:, :, None], cols[:, None, :]]
    if flip:
        mirrored = jax.random.bernoulli(flip_key, 0.5, (b,))
        images_BHWC = jnp.where(mirrored[:, None, None, None], images_BHWC[:, :, ::-1], images_BHWC)
    return images_BHWC


def as_pixels(images_BHWC, scale: float | None):
    """Stored bytes back to the host loader's float pixels (x / scale in float32: the same
    numbers), or unchanged (`scale` None: float32, or an image folder's uint8, which the
    model scales itself)."""
    return images_BHWC if scale is None else images_BHWC.astype(jnp.float32) / jnp.float32(scale)
