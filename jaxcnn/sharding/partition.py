"""Logical names -> `PartitionSpec` / `NamedSharding`, for parameters and activations.

Parameters: each dimension's logical name is looked up in the layout's rules. A mesh
axis that does not divide the dimension is *replicated with a `ShardingWarning` naming
the tensor* rather than rejected: a layout written for one model should still run on a
slightly different one, and the lint shows every fallback. A mesh axis already used by
an earlier dimension of the same tensor is likewise dropped (GSPMD allows each once).

Activations: `constrain(x, names)` pins block boundaries to the active layout; names the
table does not mention stay UNCONSTRAINED so XLA propagates whatever the weights imply.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcnn.sharding.axes import IMAGE_BHWC
from jaxcnn.sharding.layouts import Layout

LogicalNames = tuple[str | None, ...]
NAMES_KEY = "out_sharding"  # where nnx.with_partitioning / *_metadata store logical names


class ShardingWarning(UserWarning):
    """A rule could not be applied as written (dimension replicated instead)."""


@contextlib.contextmanager
def quiet_fallbacks() -> Iterator[None]:
    """Silence ShardingWarnings (only those): for placements already reported, or read
    from the lint's table instead (comparisons, plans, golden tables)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardingWarning)
        yield


def bytes_per_device(abstract_tree) -> int:
    """Bytes one device holds of a tree of ShapeDtypeStructs that carry shardings."""
    total = 0
    for leaf in jax.tree.leaves(abstract_tree):
        total += math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize
    return total


@dataclass(frozen=True)
class ParamPlacement:
    """How one parameter ended up placed: one row of the sharding table."""

    path: str
    logical: LogicalNames
    shape: tuple[int, ...]
    dtype: str
    spec: P
    bytes_per_device: int
    notes: tuple[str, ...]


def _as_spec_entry(axes: tuple[str, ...]):
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def param_spec(
    logical: LogicalNames,
    shape: Sequence[int],
    layout: Layout,
    mesh: Mesh,
    label: str = "tensor",
    itemsize: int = 4,
) -> tuple[P, tuple[str, ...]]:
    """PartitionSpec of a parameter, and a note for every rule that could not apply."""
    used: set[str] = set()
    entries: list[tuple[str, ...]] = []
    notes = []
    for dim, (name, size) in enumerate(zip(logical, shape, strict=True)):
        wanted = _live_axes(layout.axes_for(name), mesh)
        clash = [a for a in wanted if a in used]
        ways = math.prod(mesh.shape[a] for a in wanted)
        if clash:
            notes.append(f"{label} dim {dim} ({name}) wants mesh axis {clash[0]!r}, already used; replicated")
            wanted = ()
        elif size % ways:
            notes.append(
                f"{label} dim {dim} ({name}, size {size}) does not divide mesh axes "
                f"{'x'.join(wanted)}={ways}; replicated"
            )
            wanted = ()
        used.update(wanted)
        entries.append(wanted)
    fsdp_axes = tuple(a for a in _live_axes(layout.fsdp, mesh) if a not in used)
    if fsdp_axes and math.prod(shape) * itemsize >= layout.fsdp_min_bytes:
        ways = math.prod(mesh.shape[a] for a in fsdp_axes)
        free = [d for d, e in enumerate(entries) if not e and shape[d] % ways == 0]
        if free:  # the largest dim that divides; on ties the last (output channels, contiguous)
            dim = max(free, key=lambda d: (shape[d], d))
            entries[dim] = fsdp_axes
        else:
            notes.append(
                f"{label}: no free dim of {tuple(shape)} divides {'x'.join(fsdp_axes)}={ways}; not FSDP-sharded"
            )
    return P(*(_as_spec_entry(e) for e in entries)), tuple(notes)


def _live_axes(axes: tuple[str, ...] | None, mesh: Mesh) -> tuple[str, ...]:
    """Those of `axes` that exist in this mesh with more than one device."""
    return tuple(a for a in axes or () if a in mesh.shape and mesh.shape[a] > 1)


def activation_spec(logical: LogicalNames, layout: Layout, mesh: Mesh, shape: Sequence[int] | None = None) -> P:
    """PartitionSpec of an activation. Given its `shape`, an image dimension (height,
    width) is split only while each device keeps at least `MIN_ROWS_PER_SHARD` rows;
    below that it is gathered whole (see `MIN_ROWS_PER_SHARD`)."""
    entries = []
    for dim, name in enumerate(logical):
        axes = layout.axes_for(name)
        if axes is None:
            entries.append(P.UNCONSTRAINED)
            continue
        axes = tuple(a for a in axes if a in mesh.shape)
        if (
            shape is not None
            and name in SPATIAL_NAMES
            and not spatial_split_ok(shape[dim], math.prod(mesh.shape[a] for a in axes))
        ):
            axes = ()
        entries.append(_as_spec_entry(axes))
    return P(*entries)


# A 3x3 conv on a shard of one row needs a halo as big as the shard from each side; XLA
# then splits the kernel's gradient instead, padding kh 3 -> 4 and gathering it (seen:
# 1.2 MB per step on 8x8 digits). So image dims stay split only while shards keep 2 rows.
MIN_ROWS_PER_SHARD = 2
SPATIAL_NAMES = ("height", "width")


def spatial_split_ok(size: int, ways: int) -> bool:
    return ways == 1 or (size % ways == 0 and size // ways >= MIN_ROWS_PER_SHARD)


def data_sharding(logical: LogicalNames, layout: Layout, mesh: Mesh) -> NamedSharding:
    """Sharding of an array crossing the jit boundary (a batch). Its sizes must divide:
    `jaxcnn.sharding.mesh.ParallelDims.validate` checks that up front."""
    entries = [tuple(a for a in layout.axes_for(name) or () if a in mesh.shape) for name in logical]
    return NamedSharding(mesh, P(*(_as_spec_entry(e) for e in entries)))


def _path_text(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def place_variables(tree, layout: Layout, mesh: Mesh) -> tuple[object, list[ParamPlacement]]:
    """NamedShardings for an (abstract) nnx.State, from each Variable's logical names.

    Returns the shardings (the same tree, each Variable holding its NamedSharding) and the
    placement table.
    Variables without names are replicated and noted.
    """
    rows: list[ParamPlacement] = []

    def place(path, variable):
        value = variable.get_value() if hasattr(variable, "get_value") else variable.value
        label = _path_text(path)
        logical = variable.get_metadata().get(NAMES_KEY)
        if logical is None:
            logical, notes = (None,) * len(value.shape), ("no logical names; replicated",)
            spec = P()
        else:
            logical = tuple(logical)
            spec, notes = param_spec(logical, value.shape, layout, mesh, label, value.dtype.itemsize)
        for note in notes:
            if not note.startswith("no logical"):
                warnings.warn(note, ShardingWarning, stacklevel=3)
        sharding = NamedSharding(mesh, spec)
        local = sharding.shard_shape(value.shape)
        rows.append(
            ParamPlacement(
                path=label,
                logical=logical,
                shape=tuple(value.shape),
                dtype=str(value.dtype),
                spec=spec,
                bytes_per_device=math.prod(local) * value.dtype.itemsize,
                notes=notes,
            )
        )
        return variable.replace(sharding)  # keeps the tree's structure: a full-depth shardings tree

    shardings = jax.tree_util.tree_map_with_path(place, tree, is_leaf=_is_variable)
    return shardings, rows


# --- activation constraints -------------------------------------------------------------

_ACTIVE: contextvars.ContextVar[tuple[Layout, Mesh] | None] = contextvars.ContextVar("jaxcnn_layout", default=None)


@contextlib.contextmanager
def activation_layout(layout: Layout, mesh: Mesh) -> Iterator[None]:
    """Make `constrain` pin activations to `layout` while tracing inside this block."""
    token = _ACTIVE.set((layout, mesh))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def constrain(x: jax.Array, logical: LogicalNames) -> jax.Array:
    """Constrain an activation by logical names; a no-op outside `activation_layout`."""
    active = _ACTIVE.get()
    if active is None:
        return x
    layout, mesh = active
    return constrain_sharding(x, NamedSharding(mesh, activation_spec(logical, layout, mesh, x.shape)))


def _image_split() -> tuple[list[tuple[str, ...]], object, Mesh] | None:
    """Under `activation_layout`: the mesh axes (not already a shard_map's) the batch,
    height and width of an image activation split over, its channels' spec entry, the mesh."""
    active = _ACTIVE.get()
    if active is None:
        return None
    layout, mesh = active
    context = jax.sharding.get_abstract_mesh()
    manual = set(context.manual_axes) if not context.empty else set()
    spec = activation_spec(IMAGE_BHWC, layout, mesh)
    axes = []
    for entry in spec[:3]:
        named = () if entry is None or entry is P.UNCONSTRAINED else (entry if isinstance(entry, tuple) else (entry,))
        axes.append(tuple(a for a in named if a not in manual and mesh.shape[a] > 1))
    return axes, spec[3], mesh


def image_pieces(shape: Sequence[int]) -> tuple[int, int, int]:
    """Into how many pieces the active layout cuts an image activation (B, H, W, C) of
    `shape` along batch, height and width (1s outside `activation_layout`). Divisibility
    alone decides, not `MIN_ROWS_PER_SHARD`: inside a block XLA keeps a strided conv's
    output split down to a row a device."""
    split = _image_split()
    if split is None:
        return (1, 1, 1)
    axes, _, mesh = split
    ways = [math.prod(mesh.shape[a] for a in dim_axes) for dim_axes in axes]
    return tuple(w if size % w == 0 else 1 for size, w in zip(shape[:3], ways, strict=True))


def replicate_statistics(x: jax.Array) -> jax.Array:
    """Per-channel statistics summed over the pieces (`image_pieces`; the last dimension is
    channels) whole on every device, so the sum over the pieces is one all-reduce. Where
    the pieces live before is left to XLA -- pinning them to their owners as well made
    XLA:CPU's partitioner compute some gradients of the layers upstream 4x too large (the
    default 3-block CNN under spatial data=4,spatial=2). A no-op outside `activation_layout`."""
    found = _image_split()
    if found is None:
        return x
    _, channels, mesh = found
    entries = [None] * x.ndim
    entries[-1] = channels
    return constrain_sharding(x, NamedSharding(mesh, P(*entries)))


def constrain_sharding(tree, shardings):
    """`with_sharding_constraint`, also inside a `shard_map` over some of the mesh axes
    (jaxcnn.steps), where a constraint must name the context's mesh, whose manual axes
    the specs leave out."""
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and context.are_all_axes_manual:
        return tree  # every axis already taken by hand: nothing left to constrain
    if not context.empty and context.manual_axes:
        shardings = jax.tree.map(
            lambda s: NamedSharding(context, s.spec) if isinstance(s, NamedSharding) else s, shardings
        )
    return jax.lax.with_sharding_constraint(tree, shardings)
