"""A run's parallel config -> its layout and `jax.sharding.Mesh`, and simulated CPU devices.

simulate_devices_for(config.parallel)          # on a CPU-only machine, before JAX starts
layout, mesh = mesh_for(config.parallel)       # train, predict, evaluate, compare, scale, bench
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from jaxcnn.errors import UserError
from jaxcnn.run_config import DEFAULT_SIMULATED_DEVICES, ParallelConfig
from jaxcnn.sharding import axes as ax
from jaxcnn.sharding.axes import MESH_AXES
from jaxcnn.sharding.layouts import Layout, get_layout, parse_rules

MeshShape = dict[str, int]


def layout_for(parallel: ParallelConfig) -> Layout:
    """The layout a config names: its rules table, else the named layout."""
    return parse_rules(parallel.layout_rules) if parallel.layout_rules else get_layout(parallel.layout)


def mesh_shape_for(parallel: ParallelConfig) -> tuple[Layout, MeshShape]:
    """(layout, mesh shape, a -1 still unresolved), checked against each other without devices:
    every axis the layout splits over is in the mesh; unused axes are a warning."""
    layout = layout_for(parallel)
    shape = parse_mesh(parallel.mesh or layout.default_mesh)
    for note in ParallelDims(layout, shape).notes:
        warnings.warn(note, stacklevel=2)
    return layout, shape


def simulate_devices_for(
    parallel: ParallelConfig, processes: int = 1, local_devices: tuple[int, ...] | None = None
) -> None:
    """On a CPU-only machine, give JAX the devices the mesh needs (--host-devices decides when
    given, else one per --local-devices entry; the processes of a multi-process run share the
    mesh's). Must run before JAX touches a device; on an accelerator it only shapes the
    unused CPU backend."""
    _, shape = mesh_shape_for(parallel)
    given = parallel.host_devices if parallel.host_devices is not None else local_devices and len(local_devices)
    count = host_devices_for(shape, given, DEFAULT_SIMULATED_DEVICES)
    if processes > 1 and not given:
        count = max(count // processes, 1)
    simulate_cpu_devices(count, at_least=not given)


def mesh_for(parallel: ParallelConfig, devices: Sequence | None = None) -> tuple[Layout, Mesh]:
    """The layout and the mesh a config names, over `devices` (default: every device): a -1
    fills them, a mesh of fixed sizes takes the first it needs (a --mesh that leaves some
    idle is warned about). Bad input fails here, before anything is compiled."""
    layout, shape = mesh_shape_for(parallel)
    devices = list(jax.devices() if devices is None else devices)
    count = devices_needed(shape) or len(devices)
    if count > len(devices):
        raise UserError(
            f"mesh {format_mesh(shape)} needs {count} devices but {len(devices)} exist{_more(devices, count)}"
        )
    if count < len(devices) and parallel.mesh:  # (a layout's own fixed mesh -- single's -- is no surprise)
        warnings.warn(f"mesh {format_mesh(shape)} uses {count} of the {len(devices)} devices", stacklevel=2)
    dcn = parse_mesh(parallel.dcn_mesh) if parallel.dcn_mesh else None
    return layout, build_mesh(resolve_mesh(shape, count), devices[:count], dcn)


def _more(devices: Sequence, count: int) -> str:
    """How to get `count` devices on the platform of `devices`: its own flag."""
    if devices and devices[0].platform == "cpu":
        return f"; on a CPU machine, --host-devices {count}"
    return (
        "; a process sees its host's accelerators (fewer with --local-devices or CUDA_VISIBLE_DEVICES), a "
        "multi-process run every process's: start more processes (--num-processes) or hosts"
    )


def parse_mesh(text: str) -> MeshShape:
    """Parse "data=4,model=2" into an ordered {axis: size}; one size may be -1 (fill)."""
    shape: MeshShape = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, size_text = item.partition("=")
        name = name.strip()
        if not sep:
            raise UserError(f"mesh entry {item!r} has no size; write it as AXIS=SIZE, e.g. data=4")
        if name not in MESH_AXES:
            raise UserError(f"unknown mesh axis {name!r}; use one of {', '.join(MESH_AXES)}")
        if name in shape:
            raise UserError(f"mesh axis {name!r} is given twice in {text!r}")
        try:
            size = int(size_text)
        except ValueError:
            raise UserError(f"mesh axis {name!r} has size {size_text!r}; use a positive integer or -1") from None
        if size == 0 or size < -1:
            raise UserError(f"mesh axis {name!r} has size {size}; use a positive integer or -1")
        shape[name] = size
    if not shape:
        raise UserError(f"mesh {text!r} names no axis; write e.g. data=4,model=2")
    if list(shape.values()).count(-1) > 1:
        raise UserError(f"mesh {text!r} has more than one -1; only one axis can fill the rest")
    return shape


def resolve_mesh(shape: MeshShape, num_devices: int) -> MeshShape:
    """Replace a -1 by what fills `num_devices`; the product must then equal it."""
    fixed = math.prod(size for size in shape.values() if size != -1)
    if -1 in shape.values():
        if num_devices % fixed:
            raise UserError(
                f"mesh {format_mesh(shape)} cannot fill {num_devices} devices: "
                f"{num_devices} is not a multiple of {fixed}"
            )
        shape = {name: (num_devices // fixed if size == -1 else size) for name, size in shape.items()}
    elif fixed != num_devices:
        raise UserError(
            f"mesh {format_mesh(shape)} needs {fixed} devices but {num_devices} are in use; "
            f"make the sizes multiply to {num_devices}, use -1 for one axis, or set --host-devices {fixed}"
        )
    return shape


def format_mesh(shape: MeshShape) -> str:
    return ",".join(f"{name}={size}" for name, size in shape.items())


def devices_needed(shape: MeshShape) -> int | None:
    """Devices a mesh flag asks for, or None when a -1 leaves it to the machine."""
    return None if -1 in shape.values() else math.prod(shape.values())


def build_mesh(shape: MeshShape, devices: list | None = None, dcn_mesh: MeshShape | None = None) -> Mesh:
    """A mesh over the first prod(shape) devices, ordered by `device_grid` (fast axes inside
    a host), with Auto (GSPMD) axes.

    Auto axes make sharding constraints hints that XLA propagates from, which is what
    a layout-as-a-table needs: the same model code compiles under every table. (Explicit
    axes would put shardings in the types and need `out_sharding=` at every sharded conv.)
    """
    devices = list(jax.devices() if devices is None else devices)
    count = math.prod(shape.values())
    if count > len(devices):
        raise UserError(
            f"mesh {format_mesh(shape)} needs {count} devices but only {len(devices)} exist; "
            f"use a smaller mesh{_more(devices, count).replace('; ', ' or ', 1)}"
        )
    grid = device_grid(shape, devices[:count], dcn_mesh)
    return Mesh(grid, tuple(shape), axis_types=(AxisType.Auto,) * len(shape))


# --- device order ---------------------------------------------------------------------

# Mesh axes from the one that communicates least per step to the one that communicates
# most: `data` all-reduces gradients once a step, `model` all-reduces activations in every
# layer. Devices are laid out in this order, so the last axes take neighbouring devices
# (inside one host, on its NVLink) and `data` spans hosts.
SLOW_TO_FAST = (ax.DATA, ax.FSDP, ax.STAGE, ax.SPATIAL, ax.MODEL)
FAST_AXES = (ax.SPATIAL, ax.MODEL)  # a step's many small exchanges: across hosts, warned about


def hosts_of(devices: Sequence) -> int:
    """How many processes own `devices`: the granules laid out as hosts (a process is a host,
    or one GPU of one, whose ranks run host by host as SLURM and torchrun number them)."""
    return len({d.process_index for d in devices})


def across_hosts(shape: MeshShape, hosts: int, dcn_mesh: MeshShape | None = None) -> MeshShape:
    """How many ways each axis runs across hosts: `dcn_mesh` as given (the rest inside a
    host), else the hosts spread over the slowest axes first (`data`, ...)."""
    if dcn_mesh is not None:
        for name, ways in dcn_mesh.items():
            if name not in shape or ways < 1 or shape[name] % ways:
                raise UserError(
                    f"--dcn-mesh {format_mesh(dcn_mesh)}: {name}={ways} does not divide mesh {format_mesh(shape)}; "
                    "give each axis's across-host part, a divisor of its size"
                )
        if math.prod(dcn_mesh.values()) != hosts:
            raise UserError(
                f"--dcn-mesh {format_mesh(dcn_mesh)} spans {math.prod(dcn_mesh.values())} processes but the run has "
                f"{hosts}; make its sizes multiply to {hosts} (with one process per GPU, count GPUs)"
            )
        return {name: dcn_mesh.get(name, 1) for name in shape}
    left, split = hosts, {}
    for name in sorted(shape, key=SLOW_TO_FAST.index):
        split[name] = math.gcd(left, shape[name])
        left //= split[name]
    if left != 1:
        raise UserError(
            f"mesh {format_mesh(shape)} cannot be spread over {hosts} hosts with the same devices on each; "
            f"make an axis (data) a multiple of {hosts}"
        )
    return {name: split[name] for name in shape}


def device_grid(shape: MeshShape, devices: Sequence, dcn_mesh: MeshShape | None = None) -> np.ndarray:
    """`devices` arranged as `shape` (axes in its order): laid out slowest axis first
    (`SLOW_TO_FAST`) by JAX's mesh utilities -- `create_hybrid_device_mesh` when they belong
    to several processes, the across-host part of each axis from `across_hosts` -- so fast
    axes stay inside a host whatever order `--mesh` names them in."""
    order = sorted(shape, key=SLOW_TO_FAST.index)
    hosts = hosts_of(devices)
    if hosts == 1 and dcn_mesh and math.prod(dcn_mesh.values()) > 1:
        raise UserError(f"--dcn-mesh {format_mesh(dcn_mesh)} is for a run of several processes; this is one")
    if hosts == 1:
        grid = mesh_utils.create_device_mesh([shape[a] for a in order], devices, allow_split_physical_axes=True)
    else:
        dcn = across_hosts(shape, hosts, dcn_mesh)
        spanning = [f"{a}={shape[a]}" for a in FAST_AXES if dcn.get(a, 1) > 1]
        if spanning and len(devices) > hosts:  # (one device a process -- one process a GPU -- says nothing of hosts)
            warnings.warn(
                f"mesh axis {', '.join(spanning)} spans hosts: its collectives cross the network every layer; "
                "keep it inside a host (e.g. --mesh data=<hosts>,model=<devices per host>)",
                stacklevel=3,
            )
        grid = mesh_utils.create_hybrid_device_mesh(
            [shape[a] // dcn[a] for a in order], [dcn[a] for a in order], devices,
            process_is_granule=True, allow_split_physical_axes=True,
        )  # fmt: skip
    return np.transpose(grid, [order.index(a) for a in shape])


def simulate_cpu_devices(count: int, at_least: bool = False) -> None:
    """Give the CPU backend `count` devices. Must run before JAX touches any device.

    On a GPU machine this only affects the (unused) CPU backend, so it is harmless. Once
    JAX has started, asking again for the count it already has is a no-op (with
    `at_least`, any count >= `count` is accepted: meshes take the first devices).
    """
    if count < 1:
        raise UserError(f"--host-devices must be at least 1, got {count}")
    if at_least and (jax.config.jax_num_cpu_devices or 0) >= count:
        return  # already asked for (a caller, a test harness) at least as many: keep it
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        have = len(jax.devices("cpu"))
        if have != count and not (at_least and have >= count):
            raise UserError(
                f"JAX already started with {have} CPU devices, so {count} cannot be simulated; "
                "set the count before anything touches a device"
            ) from None


def check_layout_axes(
    layout_axes: tuple[str, ...], shape: MeshShape, layout_name: str, optional: tuple[str, ...] = ()
) -> list[str]:
    """Every axis the layout splits over must be in the mesh (but `optional` ones, which
    a mesh may leave out); unused mesh axes are noted."""
    missing = [a for a in layout_axes if a not in shape and a not in optional]
    if missing:
        example = ",".join([*(f"{k}={v}" for k, v in shape.items()), *(f"{a}=2" for a in missing)])
        raise UserError(
            f"layout {layout_name} splits over mesh axis {missing[0]!r}, which mesh {format_mesh(shape)} "
            f"lacks; add it, e.g. --mesh {example}"
        )
    return [
        f"mesh axis {a}={size} is not used by layout {layout_name}: its devices hold replicas"
        for a, size in shape.items()
        if a not in layout_axes and size != 1
    ]


@dataclass(frozen=True)
class ParallelDims:
    """How a layout splits the work on a mesh, and the sizes those splits must divide: the
    one up-front check (as torchtitan's ParallelDims) that every entry point runs --
    `jaxcnn.build.build_program` and the scripts, before anything is loaded or compiled.

    Constructing it checks that the mesh has every axis the layout splits over; `notes`
    lists mesh axes the layout leaves unused (their devices hold replicas)."""

    layout: Layout
    mesh_shape: MeshShape  # the axes' names suffice for `notes`; `validate` needs the sizes resolved (no -1)

    def __post_init__(self):
        object.__setattr__(self, "notes", check_layout_axes(
            self.layout.mesh_axes, self.mesh_shape, self.layout.name, self.layout.optional_axes
        ))  # fmt: skip

    @property
    def data(self) -> int:
        """Data-parallel degree: the parts the batch is split into (inside one stage)."""
        return self.layout.degree(ax.BATCH, self.mesh_shape)

    @property
    def stages(self) -> int:
        return self.mesh_shape.get(self.layout.stage_axis, 1) if self.layout.stage_axis else 1

    def validate(
        self,
        batch_size: int,
        *,
        eval_batch_size: int | None = None,
        image_shape: tuple[int, ...] | None = None,
        grad_accum: int = 1,
        microbatches: int | None = None,
    ) -> ParallelDims:
        """Raise a UserError naming the first size that does not divide; return self."""
        d, k = self.data, grad_accum
        axes = self._axes_text(ax.BATCH)
        if k > 1 and batch_size % (d * k):
            raise UserError(
                f"global batch {batch_size} does not split into {d} data shards x {k} micro-batches; "
                f"use a batch that is a multiple of {d * k}"
            )
        for what, size in (("global batch", batch_size), ("eval batch", eval_batch_size)):
            if size is not None and size % d:
                raise UserError(f"{what} of {size} is not divisible by mesh axes {axes}; use a multiple of {d}")
        if microbatches is not None:
            if microbatches < 1 or batch_size % microbatches:
                raise UserError(
                    f"--microbatches {microbatches} must divide the global batch {batch_size}; use a divisor of {batch_size}"
                )
            if (batch_size // microbatches) % d:
                raise UserError(
                    f"a micro-batch of {batch_size // microbatches} ({batch_size}/{microbatches}) does not split over "
                    f"data={d}; use a batch that is a multiple of {microbatches * d}"
                )
        for dim, name in enumerate((ax.HEIGHT, ax.WIDTH, ax.CHANNELS)):
            ways = self.layout.degree(name, self.mesh_shape)
            if image_shape is not None and image_shape[dim] % ways:
                raise UserError(
                    f"image {name} {image_shape[dim]} is not divisible by mesh axes {self._axes_text(name)} (arrays "
                    f"entering the step must split evenly); use images whose {name} is a multiple of {ways}, or a "
                    "smaller mesh axis"
                )
        return self

    def _axes_text(self, logical: str) -> str:
        """The mesh axes `logical` is split over, as "data=4" or "data=2xspatial=2"."""
        return "x".join(
            f"{a}={self.mesh_shape[a]}" for a in self.layout.axes_for(logical) or () if a in self.mesh_shape
        )


def host_devices_for(shape: MeshShape, host_devices: int | None, default: int) -> int:
    """How many CPU devices to simulate: as asked, else what the mesh needs, else `default`."""
    if host_devices is not None:
        return host_devices
    return devices_needed(shape) or default
