"""How the configured update rule maps onto a layout and mesh: which mesh axes the step
maps over by hand (`jax.shard_map`), and the layout the model sees inside that map."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh

from jaxcnn.config import UpdateConfig
from jaxcnn.errors import UserError
from jaxcnn.sharding import axes as ax
from jaxcnn.sharding.layouts import Layout


@dataclass(frozen=True)
class UpdateRule:
    """How the configured update rule maps onto this layout and mesh."""

    config: UpdateConfig
    groups_axes: tuple[str, ...]  # the axes the step shard_maps over (data shards or replicas)
    groups: int  # D (accumulation) or R (local SGD): the product of those axes
    inner_layout: Layout  # the layout inside the shard_map: its batch rule less those axes

    def batch_order(self, batch_size: int) -> np.ndarray | None:
        """Host-side order of a global batch for gradient accumulation, or None.

        Each device takes its K micro-batches from its own block of the batch, so micro-
        batch k would be the k-th slice of every block: a different set of images for
        every data-axis size. Ordered by this permutation first, micro-batch k is global
        images [k*B/K, (k+1)*B/K) under every layout -- which batch norm's statistics
        see -- and no image crosses devices."""
        k, d = self.config.grad_accum, self.groups
        if k == 1 or d == 1 or self.config.local:
            return None
        return np.arange(batch_size).reshape(k, d, batch_size // (k * d)).transpose(1, 0, 2).reshape(-1)


def update_rule(config: UpdateConfig, layout: Layout, mesh: Mesh) -> UpdateRule:
    """Check that the update rule fits the layout and mesh; say how it maps. (The batch's
    divisibility is `jaxcnn.sharding.mesh.ParallelDims.validate`'s.)"""
    batch_axes = layout.axes_for(ax.BATCH) or ()
    live = [a for a in batch_axes if mesh.shape.get(a, 1) > 1]
    param_axes = {a for _, axes in layout.params for a in axes} | set(layout.fsdp)
    if config.local:
        # a replica is a group of devices holding whole parameters: axes the batch is split
        # over but no parameter is (FSDP's axis holds shards of one replica, not replicas)
        groups_axes = tuple(a for a in live if a not in param_axes)
        if not groups_axes:
            raise UserError(
                f"--sync local-sgd needs a mesh axis of 2+ devices that splits the batch but not the parameters "
                f"(layout {layout.name} on mesh {dict(mesh.shape)} has none); use dp or hybrid with data=2 or more"
            )
    else:
        groups_axes = tuple(live)
    groups = math.prod(mesh.shape[a] for a in groups_axes)
    inner = layout.with_batch_axes(tuple(a for a in batch_axes if a not in groups_axes))
    return UpdateRule(config, groups_axes, groups, inner)


def over_groups(f: Callable, mesh: Mesh, axes: tuple[str, ...], in_specs: NamedTuple, out_specs: NamedTuple):
    """`f(arguments) -> results`, both NamedTuples, mapped over the device groups of `axes`:
    inside, each group sees its own part of every argument whose spec in `in_specs` splits
    it (the layout's other axes -- model, spatial -- stay XLA's). No axes: `f` itself."""
    if not axes:
        return f
    return jax.shard_map(f, mesh=mesh, in_specs=(in_specs,), out_specs=out_specs, axis_names=set(axes), check_vma=False)
