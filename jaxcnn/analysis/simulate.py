"""A layout's train step compiled for meshes of N simulated devices and read, never run.

XLA compiles the SPMD step for a mesh of any size from abstract inputs (nothing is
allocated), so memory per device, FLOPs and every collective at 64 or 256 devices can be
read on one host; the analytic communication model (jaxcnn.analysis.comm_model) and the
planner's cluster clock (jaxcnn.analysis.cluster_clock) are set beside them. `jaxcnn scale
--simulate` writes what `simulate` returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from jaxcnn.analysis.comm_model import modelled_comm
from jaxcnn.analysis.hardware import HardwareProfile
from jaxcnn.analysis.hlo import spanned_axes
from jaxcnn.analysis.planner import compile_candidate, price
from jaxcnn.config import ModelConfig
from jaxcnn.errors import UserError
from jaxcnn.run_config import ParallelConfig
from jaxcnn.sharding.layouts import Layout
from jaxcnn.sharding.mesh import format_mesh, mesh_shape_for


def mesh_at(layout: Layout, num_devices: int) -> dict[str, int]:
    """The layout's default mesh filled to `num_devices` (its -1 axis takes the rest)."""
    _, shape = mesh_shape_for(ParallelConfig(layout=layout.name))
    fixed = 1
    for size in shape.values():
        fixed *= size if size > 0 else 1
    if num_devices % fixed:
        raise UserError(f"{layout.name}'s mesh {format_mesh(shape)} does not fit {num_devices} devices")
    return {axis: (num_devices // fixed if size < 0 else size) for axis, size in shape.items()}


def simulate(
    model_config: ModelConfig,
    image_shape: tuple[int, int, int],
    layouts: list[Layout],
    counts: list[int],
    batch_for: Callable[[int], int],
    profile: HardwareProfile,
    devices_per_host: int,
    dtype: str = "float32",
    progress: Callable[[str], None] | None = None,
) -> tuple[list[dict], list[dict]]:
    """`(rows, collective_rows)`: per layout and device count, what the compiled step costs
    each device beside the analytic model and the modelled step on `profile`'s hosts of
    `devices_per_host`; and every collective of every compiled step."""
    rows, collective_rows = [], []
    for layout in layouts:
        if layout.stage_axis:
            raise UserError("--simulate reads one SPMD program; the pipeline's stages are per-stage programs")
        first = None
        for n in counts:
            mesh_shape = mesh_at(layout, n)
            if progress:
                progress(f"[{layout.name} on {n}] compiling on {format_mesh(mesh_shape)}, batch {batch_for(n)} ...")
            started = time.perf_counter()
            candidate, program = compile_candidate(model_config, image_shape, batch_for(n), layout, mesh_shape)
            seconds = time.perf_counter() - started
            if program is None:
                raise UserError(f"{layout.name} on {format_mesh(mesh_shape)}: {candidate.error}")
            hosts = max(1, n // devices_per_host)
            (priced,) = price([candidate], profile, n, dtype, hosts)
            memory = program.train_step.memory_analysis()
            model = modelled_comm(program, model_config, image_shape)
            found, roles = candidate.cost.stage_collectives[0], candidate.roles[0]
            # batch norm's forward statistics (the backward sums may ride in a fused reduction)
            statistics = [
                c.buffer_bytes for c, role in zip(found, roles, strict=True)
                if role == "statistics" and "transpose(" not in c.line
            ]  # fmt: skip
            row = {
                "layout": layout.name,
                "mesh": format_mesh(mesh_shape),
                "num_devices": n,
                "hosts": hosts,
                "global_batch_size": batch_for(n),
                "compile_seconds": seconds,
                "argument_bytes": memory.argument_size_in_bytes,
                "temp_bytes": memory.temp_size_in_bytes,
                "peak_bytes": candidate.peak_bytes,
                "param_bytes": candidate.param_bytes,
                "optimizer_bytes": candidate.optimizer_bytes,
                "flops_per_device": candidate.flops,  # XLA's cost_analysis
                "model_flops_per_device": candidate.model_flops,  # what the planner prices (model_flops)
                "collectives": candidate.num_collectives,
                "comm_bytes": candidate.cost.comm_bytes,
                "comm_wire_bytes": candidate.cost.wire_bytes,
                "model_comm_bytes": model["total"],
                "model_wire_bytes": model["wire"],
                "model_over_compiled": model["total"] / candidate.cost.comm_bytes if candidate.cost.comm_bytes else 1.0,
                "forward_statistics_collectives": len(statistics),
                "forward_statistics_bytes_max": max(statistics, default=0),
                "hardware": profile.name,
                "compute_seconds": priced.compute_seconds,
                "comm_seconds": priced.comm_seconds,
                "step_seconds": priced.step_seconds,
            }
            first = first or row
            # throughput per device against the smallest count's (weak or strong scaling alike)
            throughput = row["global_batch_size"] / row["step_seconds"] / n
            row["modelled_efficiency"] = throughput / (
                first["global_batch_size"] / first["step_seconds"] / first["num_devices"]
            )
            rows.append(row)
            for c, role in zip(found, roles, strict=True):
                collective_rows.append({
                    "layout": layout.name, "num_devices": n, "kind": c.kind, "role": role,
                    "group_size": c.group_size, "axes": ",".join(spanned_axes(c, mesh_shape)),
                    "buffer_bytes": c.buffer_bytes, "repeats": c.repeats, "wire_bytes": c.wire_bytes,
                    "dtype": c.dtype, "shapes": " ".join("x".join(map(str, s)) for s in c.shapes),
                })  # fmt: skip
            if progress:
                progress(
                    f"    {seconds:.1f} s: peak {row['peak_bytes'] / 2**20:,.0f} MiB a device, "
                    f"{row['comm_bytes'] / 2**20:,.1f} MiB of collectives (model {row['model_over_compiled']:.3f}x), "
                    f"step {row['step_seconds'] * 1e3:.2f} ms modelled on {profile.name}"
                )
    return rows, collective_rows
