"""Measure one layout: compile it, read what XLA built, model what theory says, time it.

    row = measure_layout(model_config, layout, mesh_shape, image_shape, batch_size, steps=10)

gives one row of the compare CSV (COMPARE_COLUMNS) (per-device bytes and FLOPs per optimizer step --
XLA's and the model's count, jaxcnn.analysis.model_flops --
measured and modelled collective bytes, step time, images/s) for every layout, the
pipeline included: its figures are those of the stage that bounds the step (jaxcnn.analysis.cost).
`speedup` and `efficiency` are filled in against the `single` row by `add_speedups`.
"""

from __future__ import annotations

import math
import statistics
import time

import jax
import numpy as np

from jaxcnn.analysis.comm_model import modelled_comm
from jaxcnn.analysis.cost import program_cost
from jaxcnn.analysis.hlo import KINDS
from jaxcnn.build import build_program
from jaxcnn.compiling import all_cached
from jaxcnn.config import ModelConfig, OptimConfig
from jaxcnn.data import Dataset
from jaxcnn.program import Program
from jaxcnn.run_config import ParallelConfig
from jaxcnn.sharding import build_mesh, format_mesh, mesh_for
from jaxcnn.sharding.layouts import Layout
from jaxcnn.sharding.partition import quiet_fallbacks

COMPARE_COLUMNS = [
    "layout", "mesh", "num_devices", "param_bytes_per_device", "optimizer_bytes_per_device", "temp_bytes_per_device",
    "flops_per_device", "model_flops_per_device", "bytes_all_reduce", "bytes_all_gather", "bytes_reduce_scatter", "bytes_collective_permute",
    "bytes_all_to_all", "comm_bytes", "comm_bytes_model", "step_seconds", "images_per_second", "speedup", "efficiency",
    "remat", "dtype",
]  # fmt: skip

# Image shape and global batch of the sizes the benchmarks share.
SIZES = {"8": ((8, 8, 1), 64), "28": ((28, 28, 1), 128), "224": ((224, 224, 3), 8)}
# The optimizer of every timing program: no schedule, so every step does the same work.
TIMING_OPTIM = OptimConfig(learning_rate=1e-3, schedule="constant", warmup_steps=0)


def random_batch(image_shape, batch_size: int, num_classes: int = 10, seed: int = 0):
    """(images in [0, 1), integer labels) of the given shape: what benchmarks step on."""
    rng = np.random.default_rng(seed)
    images = rng.random((batch_size, *image_shape), dtype=np.float32)
    return images, rng.integers(0, num_classes, batch_size).astype(np.int32)


def timing_program(
    config: ModelConfig, image_shape, batch_size: int, layout: str = "single", mesh_shape=None, devices=None,
    compiler_options: dict | None = None,
) -> Program:  # fmt: skip
    """The train step benchmarks time: `layout` on `mesh_shape` (default one device),
    Adam at a constant rate, no eval step."""
    shape = mesh_shape or {"data": 1}
    devices = list(jax.devices() if devices is None else devices)[: math.prod(shape.values())]  # only the timed mesh's
    parallel = ParallelConfig(layout=layout, mesh=format_mesh(shape))
    with quiet_fallbacks():
        return build_program(
            config, TIMING_OPTIM, *mesh_for(parallel, devices), image_shape, batch_size, 1000, with_eval=False,
            compiler_options=compiler_options,
        )  # fmt: skip


def stage_options(layout: Layout, microbatches: int | None) -> dict:
    """build_program's `microbatches=` where `layout` has stages to split the batch over;
    nothing for the others (they have no micro-batches to set)."""
    return {"microbatches": microbatches} if layout.stage_axis and microbatches else {}


def time_steps(program: Program, state, images: np.ndarray, labels: np.ndarray, steps: int):
    """Run `steps` train steps on one fixed batch; (seconds of each, final state). The
    first (warm-up) run is not counted. Each step is waited for, so these are step times."""
    x, y = program.train_input.place(images, labels)
    state, metrics = program.train_step(state, x, y)
    jax.block_until_ready(metrics)
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = program.train_step(state, x, y)
        jax.block_until_ready(metrics)
        seconds.append(time.perf_counter() - start)
    return seconds, state


def warm_stepper(program: Program, images: np.ndarray, labels: np.ndarray):
    """`steps(n)` -> seconds of n more warm steps of `program` on one fixed batch, the state
    carried from call to call (time_steps, from a fresh `program.init()`)."""
    return state_stepper(program, program.init(), images, labels)


def state_stepper(program: Program, state, images: np.ndarray, labels: np.ndarray):
    """warm_stepper from a given state."""
    state = [state]

    def steps(n: int) -> list[float]:
        seconds, state[0] = time_steps(program, state[0], images, labels, n)
        return seconds

    return steps


def interleaved(steppers: dict, steps: int, rounds: int, after_round=None) -> dict[object, list[float]]:
    """{key: seconds of each timed step}: `steps` per stepper (rounded up to whole rounds),
    in `rounds` rounds that take turns between the steppers, so a drift in the machine's
    speed hits each alike. `after_round(i)` runs after round i (0-based)."""
    timed = {key: [] for key in steppers}
    per_round = -(-steps // rounds)
    for i in range(rounds):
        for key, stepper in steppers.items():
            timed[key] += stepper(per_round)
        if after_round:
            after_round(i)
    return timed


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
    microbatches: int | None = None,
) -> dict:
    """One compare row. `steps` > 0 also times that many steps on `data`'s first batch
    (random images when None). `microbatches` applies to a layout with stages (the others
    have none to set)."""
    mesh = build_mesh(mesh_shape, devices)
    with quiet_fallbacks():  # fallbacks are the lint's business, not the comparison's
        program = build_program(
            model_config, optim or OptimConfig(), layout, mesh, image_shape, batch_size, 1000,
            with_eval=False, with_init=steps > 0, **stage_options(layout, microbatches),
        )  # fmt: skip
    cost = program_cost(program)
    model = modelled_comm(program, model_config, image_shape)
    row = {
        "layout": layout.name,
        "mesh": format_mesh(dict(mesh.shape)),
        "num_devices": mesh.size,
        "param_bytes_per_device": cost.param_bytes,
        "optimizer_bytes_per_device": cost.optimizer_bytes,
        "temp_bytes_per_device": cost.temp_bytes,
        "peak_bytes_per_device": cost.peak_bytes,
        "flops_per_device": cost.flops,  # XLA's cost_analysis
        "model_flops_per_device": cost.model_flops,  # from the layer shapes (jaxcnn.analysis.model_flops)
        **{_column(kind): cost.kind_bytes(kind) for kind in KINDS},
        "comm_bytes": cost.comm_bytes,
        "comm_bytes_model": model["total"],
        "comm_wire_bytes": cost.wire_bytes,
        "comm_wire_bytes_model": model["wire"],
        "num_collectives": cost.num_collectives,
        **(pipeline_fields(program, cost) if layout.stage_axis else {}),
        "remat": model_config.remat,
        "dtype": model_config.dtype,
        "lower_seconds": program.lower_seconds,
        "compile_seconds": program.compile_seconds,
        "compile_cached": all_cached(program.compile_timings),
        "first_step_seconds": None,
        "step_seconds": None,
        "images_per_second": None,
        "speedup": None,
        "efficiency": None,
        "global_batch_size": batch_size,
        "image_shape": "x".join(map(str, image_shape)),
        "platform": mesh.devices.flat[0].platform,
    }
    if steps > 0:
        if data is None:
            images, labels = random_batch(image_shape, batch_size, model_config.num_classes)
        else:
            images, labels = data.images[:batch_size], data.labels[:batch_size]
        start = time.perf_counter()
        _, state = time_steps(program, program.init(), images, labels, 0)  # init and the first step
        row["first_step_seconds"] = time.perf_counter() - start
        seconds, _ = time_steps(program, state, images, labels, steps)
        row["step_seconds"] = statistics.median(seconds)
        row["images_per_second"] = batch_size / row["step_seconds"]
    return row


def pipeline_fields(program: Program, cost) -> dict:
    return {
        "bytes_between_stages": cost.transfer_bytes,
        "microbatches": program.anatomy.microbatches,
        "bubble_fraction": program.anatomy.bubble_fraction,
    }


def _column(kind: str) -> str:
    return "bytes_" + kind.replace("-", "_")


def add_speedups(rows: list[dict], baseline: dict) -> None:
    """speedup = images/s over the baseline's; efficiency = speedup / devices."""
    for row in rows:
        if row["images_per_second"] and baseline.get("images_per_second"):
            row["speedup"] = row["images_per_second"] / baseline["images_per_second"]
            row["efficiency"] = row["speedup"] / row["num_devices"] * baseline["num_devices"]
