"""Measure one layout: compile it, read what XLA built, model what theory says, time it.

    row = measure_layout(model_config, layout, mesh_shape, image_shape, batch_size, steps=10)

gives one row of the DESIGN's compare CSV (per-device bytes and FLOPs per optimizer step,
measured and modelled collective bytes, step time, images/s). `speedup` and `efficiency`
are filled in against the `single` row by `add_speedups`.
"""

from __future__ import annotations

import statistics
import time
import warnings

import jax
import numpy as np

from jaxcnn.config import ModelConfig, OptimConfig
from jaxcnn.data import Dataset
from jaxcnn.sharding import build_mesh, format_mesh
from jaxcnn.sharding.comm_model import comm_terms, summarise
from jaxcnn.sharding.inspect import KINDS, step_cost
from jaxcnn.sharding.layouts import Layout
from jaxcnn.train import Program, TrainState, build_program

COMPARE_COLUMNS = [
    "layout", "mesh", "num_devices", "param_bytes_per_device", "optimizer_bytes_per_device", "temp_bytes_per_device",
    "flops_per_device", "bytes_all_reduce", "bytes_all_gather", "bytes_reduce_scatter", "bytes_collective_permute",
    "bytes_all_to_all", "comm_bytes", "comm_bytes_model", "step_seconds", "images_per_second", "speedup", "efficiency",
    "remat", "dtype",
]  # fmt: skip


def _column(kind: str) -> str:
    return "bytes_" + kind.replace("-", "_")


def time_steps(program: Program, state: TrainState, images: np.ndarray, labels: np.ndarray, steps: int):
    """Run `steps` train steps on one fixed batch; (seconds of each, final state). The
    first (warm-up) run is not counted. Each step is waited for, so these are step times."""
    x, y = program.place_batch(images, labels)
    state, metrics = program.train_step(state, x, y)
    jax.block_until_ready(metrics)
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = program.train_step(state, x, y)
        jax.block_until_ready(metrics)
        seconds.append(time.perf_counter() - start)
    return seconds, state


def measure_layout(
    model_config: ModelConfig,
    layout: Layout,
    mesh_shape: dict[str, int],
    image_shape: tuple[int, int, int],
    batch_size: int,
    *,
    steps: int = 0,
    data: Dataset | None = None,
    optim: OptimConfig | None = None,
    devices: list | None = None,
) -> dict:
    """One compare row. `steps` > 0 also times that many steps on `data`'s first batch
    (random images when None)."""
    mesh = build_mesh(mesh_shape, devices)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fallbacks are the lint's business, not the comparison's
        program = build_program(
            model_config,
            optim or OptimConfig(),
            layout,
            mesh,
            image_shape,
            batch_size,
            1000,
            with_eval=False,
            with_init=steps > 0,
        )
    cost = step_cost(program.train_step, program.abstract_state, mesh.size)
    compute_bytes = {p.path: p.bytes_per_device for p in program.compute_placements}
    model = summarise(
        comm_terms(model_config, image_shape, batch_size, layout, dict(mesh.shape), program.placements, compute_bytes)
    )
    row = {
        "layout": layout.name,
        "mesh": format_mesh(dict(mesh.shape)),
        "num_devices": mesh.size,
        "param_bytes_per_device": cost.param_bytes,
        "optimizer_bytes_per_device": cost.optimizer_bytes,
        "temp_bytes_per_device": cost.temp_bytes,
        "peak_bytes_per_device": cost.peak_bytes,
        "flops_per_device": cost.flops,
        **{_column(kind): cost.comm_bytes(kind) for kind in KINDS},
        "comm_bytes": cost.comm_bytes(),
        "comm_bytes_model": model["total"],
        "comm_wire_bytes": cost.wire_bytes(),
        "comm_wire_bytes_model": model["wire"],
        "num_collectives": len(cost.collectives),
        **_run_fields(program, mesh, batch_size, image_shape, model_config),
    }
    return _timed(row, program, model_config, image_shape, batch_size, steps, data)


def _timed(row, program, model_config, image_shape, batch_size, steps, data) -> dict:
    """Fill the row's step time and images/s from `steps` timed steps (none if 0)."""
    if steps > 0:
        if data is None:
            rng = np.random.default_rng(0)
            images = rng.random((batch_size, *image_shape), dtype=np.float32)
            labels = rng.integers(0, model_config.num_classes, batch_size).astype(np.int32)
        else:
            images, labels = data.images[:batch_size], data.labels[:batch_size]
        seconds, _ = time_steps(program, program.init(), images, labels, steps)
        row["step_seconds"] = statistics.median(seconds)
        row["images_per_second"] = batch_size / row["step_seconds"]
    return row


def _run_fields(program, mesh, batch_size, image_shape, model_config: ModelConfig) -> dict:
    """The row's fields every layout fills the same way (timings come later)."""
    return {
        "remat": model_config.remat,
        "dtype": model_config.dtype,
        "compile_seconds": program.compile_seconds,
        "step_seconds": None,
        "images_per_second": None,
        "speedup": None,
        "efficiency": None,
        "global_batch_size": batch_size,
        "image_shape": "x".join(map(str, image_shape)),
        "platform": mesh.devices.flat[0].platform,
    }


def add_speedups(rows: list[dict], baseline: dict) -> None:
    """speedup = images/s over the baseline's; efficiency = speedup / devices."""
    for row in rows:
        if row["images_per_second"] and baseline.get("images_per_second"):
            row["speedup"] = row["images_per_second"] / baseline["images_per_second"]
            row["efficiency"] = row["speedup"] / row["num_devices"] * baseline["num_devices"]


def measure_pipeline(
    model_config: ModelConfig,
    layout: Layout,
    mesh_shape: dict[str, int],
    image_shape: tuple[int, int, int],
    batch_size: int,
    *,
    steps: int = 0,
    microbatches: int | None = None,
    data: Dataset | None = None,
) -> dict:
    """The pipeline's compare row, for its busiest stage (the one that bounds the step).

    Per device per step: parameter / optimizer bytes and temp bytes of the stage holding
    the most; FLOPs of the stage doing the most (M micro-batches x forward + backward);
    collectives inside the stage programs (with a data axis, each backward all-reduces
    its micro-batch's gradient: M times per step) plus the activations and gradients sent
    between stages (`bytes_between_stages`: point-to-point `device_put`s, not HLO
    collectives). The model column recomputes both from the layer shapes.
    """
    from jaxcnn.models import layer_shapes
    from jaxcnn.sharding.pipeline import PER_MICROBATCH, build_pipeline_program, stage_collectives

    mesh = build_mesh(mesh_shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = build_pipeline_program(
            model_config, OptimConfig(), layout, mesh, image_shape, batch_size, 1000, microbatches=microbatches,
            with_eval=False,
        )  # fmt: skip
    m, groups = program.microbatches, program.groups
    data_ways = mesh.size // len(groups)
    per_stage = []
    for prog, found in zip(program.stage_programs, stage_collectives(program), strict=True):
        calls = [prog[name] for name in PER_MICROBATCH if name in prog]  # each runs M times per step
        costs = [c.cost_analysis() for c in calls]
        costs = [c[0] if isinstance(c, (list, tuple)) else c for c in costs]  # older jax: one dict per device
        per_stage.append(
            {
                "flops": m * sum(float(c.get("flops", 0.0)) for c in costs),
                "temp": max(c.memory_analysis().temp_size_in_bytes for c in calls),
                "collective_bytes": sum(c.buffer_bytes for c in found),
                "found": found,
            }
        )
    sent = [2 * m * b // data_ways for b in program.activation_bytes[:-1]]  # per device, forward + backward
    # model: the activation leaving each stage's last layer, from the layer shapes alone
    layers, micro = layer_shapes(model_config, image_shape), batch_size // m
    modelled_sent = []
    for group in groups[:-1]:
        last = layers[group.stop - 1]
        size = -(-last.height // 2) * -(-last.width // 2) * last.features if last.kind == "conv" else last.features
        modelled_sent.append(2 * m * micro * size * 4 // data_ways)
    busiest = max(range(len(groups)), key=lambda s: per_stage[s]["flops"])
    stage_params = [
        sum(p.bytes_per_device for p in program.placements if p.path.startswith(f"stage{s}/"))
        for s in range(len(groups))
    ]
    grads_model = [m * b for b in stage_params] if data_ways > 1 else [0] * len(groups)
    row = {
        "layout": layout.name,
        "mesh": format_mesh(dict(mesh.shape)),
        "num_devices": mesh.size,
        "param_bytes_per_device": max(program.stage_param_bytes),
        "optimizer_bytes_per_device": max(program.stage_optimizer_bytes),
        "temp_bytes_per_device": max(st["temp"] for st in per_stage),
        "peak_bytes_per_device": None,
        "flops_per_device": per_stage[busiest]["flops"],
        **{
            _column(kind): sum(c.buffer_bytes for st in per_stage for c in st["found"] if c.kind == kind) // len(groups)
            for kind in KINDS
        },
        "bytes_between_stages": max(sent, default=0),
        "comm_bytes": max(st["collective_bytes"] for st in per_stage) + max(sent, default=0),
        "comm_bytes_model": max(grads_model) + max(modelled_sent, default=0),
        "microbatches": m,
        "bubble_fraction": program.bubble_fraction,
        **_run_fields(program, mesh, batch_size, image_shape, model_config),
    }
    return _timed(row, program, model_config, image_shape, batch_size, steps, data)
