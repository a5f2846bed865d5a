"""What jaxcnn's train step is measured against: the same model and optimizer as a plain
`jax.jit` step, as a user would write it, and the machine's peak FLOP/s in the step's dtype
(`jaxcnn bench`); and the batch that fills a device (`jaxcnn bench --batch fill`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxcnn import compile_cache
from jaxcnn.analysis.cost import live_bytes, step_peak_bytes
from jaxcnn.analysis.measure import TIMING_OPTIM, state_stepper, time_steps, timing_program
from jaxcnn.autobatch import BatchSearch, largest_batch
from jaxcnn.compiling import all_cached
from jaxcnn.config import ModelConfig
from jaxcnn.models import build_model, cross_entropy
from jaxcnn.run_config import ParallelConfig
from jaxcnn.sharding import mesh_for

# `--batch fill`: the share of a device's memory one step may plan for (the other variants'
# states and the allocator's slack live in the rest), the batch's granularity and its cap.
FILL_FRACTION, FILL_MULTIPLE, FILL_LIMIT = 0.7, 32, 4096


def peak_flops(dtype: str, n: int | None = None, repeats: int = 20) -> float:
    """Best FLOP/s of an n x n x n matmul on the first device (the same dtype as the step);
    n defaults to 2048 on a CPU, 8192 on an accelerator (where a 2048^3 matmul takes tens of
    microseconds and the dispatch would count as much as the arithmetic). The best of many
    repeats: on a shared host a few can all land in a slow moment, and a low peak reads as
    an MFU above 100%."""
    n = n or (2048 if jax.devices()[0].platform == "cpu" else 8192)
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)  # not constants: hardware may go faster on those
    matmul = jax.jit(lambda x: x @ x)
    jax.block_until_ready(matmul(a))
    best = min(seconds_of(lambda: matmul(a)) for _ in range(repeats))
    return 2 * n**3 / best


def seconds_of(run) -> float:
    start = time.perf_counter()
    jax.block_until_ready(run())
    return time.perf_counter() - start


def flops_of(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("flops", 0.0))


class Startup(NamedTuple):
    """What one variant cost before its steady state: the time to its first step."""

    lower_seconds: float  # tracing + lowering, every program
    compile_seconds: float  # XLA compiling (or reading the persistent cache), every program, wall clock
    cached: bool | None  # every program read from the persistent cache; None: no cache in use
    first_step_seconds: float  # init and the first train step, run and waited for
    seconds: float  # from the start of the build to the end of the first step


class Stepper(NamedTuple):
    steps: Callable[[int], list[float]]  # n -> seconds of n more warm steps
    startup: Startup
    flops: float  # per step, XLA's count
    peak_bytes: int  # the train step's compiled peak per device (memory_analysis)


def plain_jit_stepper(config: ModelConfig, image_shape, images, labels, options: dict | None = None) -> Stepper:
    """The same model and optimizer as a user would write them: nnx + optax + jax.jit
    (compiled with XLA's defaults, or `options`)."""
    began = time.perf_counter()
    tx = optax.adam(1e-3)
    graphdef, params, rest = nnx.split(build_model(config, image_shape, 0), nnx.Param, ...)
    opt_state = tx.init(params)

    def step(params, rest, opt_state, x, y):
        def loss_fn(p):
            model = nnx.merge(graphdef, p, rest, copy=True)
            logits = model(x, train=True)
            return cross_entropy(logits, y).mean(), nnx.state(model, nnx.Not(nnx.Param))

        (loss, rest), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), rest, opt_state, loss

    start = time.perf_counter()
    lowered = jax.jit(step, donate_argnums=(0, 1, 2)).lower(params, rest, opt_state, images, labels)
    lowered_at = time.perf_counter()
    with compile_cache.watch() as seen:
        compiled = lowered.compile(options)
    compiled_at = time.perf_counter()
    x, y = jnp.asarray(images), jnp.asarray(labels)
    *state, loss = compiled(params, rest, opt_state, x, y)  # warm-up; the state is donated: keep the new one
    jax.block_until_ready(loss)
    done = time.perf_counter()
    cached = seen["hit"] if compile_cache.in_use() else None
    startup = Startup(lowered_at - start, compiled_at - lowered_at, cached, done - compiled_at, done - began)

    def steps(n: int) -> list[float]:
        """n timed steps after one untimed one, as jaxcnn's stepper (measure.time_steps) does."""
        seconds = []
        for i in range(n + 1):
            start = time.perf_counter()
            *new_state, loss = compiled(*state, x, y)
            jax.block_until_ready(loss)
            if i:
                seconds.append(time.perf_counter() - start)
            state[:] = new_state
        return seconds

    return Stepper(steps, startup, flops_of(compiled), live_bytes(compiled.memory_analysis()))


def jaxcnn_stepper(config, layout: str, device, image_shape, batch, images, labels, compiler_options=None) -> Stepper:
    """jaxcnn's train step under `layout` on one device, its first step already taken
    (`compiler_options` None: the platform's, jaxcnn.platform_choices)."""
    began = time.perf_counter()
    program = timing_program(config, image_shape, batch, layout, devices=[device], compiler_options=compiler_options)
    built = time.perf_counter()
    state = program.init()
    _, state = time_steps(program, state, images, labels, 0)  # the first step (its untimed warm-up)
    done = time.perf_counter()
    cached = all_cached(program.compile_timings)
    startup = Startup(program.lower_seconds, program.compile_seconds, cached, done - built, done - began)
    stepper = state_stepper(program, state, images, labels)
    return Stepper(stepper, startup, flops_of(program.train_step), live_bytes(program.train_step.memory_analysis()))


def device_memory_bytes(device) -> int | None:
    """The memory the device's allocator may hand out (None where it reports none, e.g. CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return int(stats["bytes_limit"]) if stats and stats.get("bytes_limit") else None


def fill_batch(
    config: ModelConfig, image_shape, device, budget_bytes: float, multiple: int = FILL_MULTIPLE,
    limit: int = FILL_LIMIT,
) -> BatchSearch:  # fmt: skip
    """The batch that fills `device`: the largest multiple of `multiple` up to `limit` whose
    single-device train step (compiled, never run) needs at most `budget_bytes` by XLA's
    memory analysis -- jaxcnn.autobatch's search, about 2 log2(limit / multiple) compiles."""
    layout, mesh = mesh_for(ParallelConfig(layout="single"), [device])
    peak = step_peak_bytes(config, TIMING_OPTIM, layout, mesh, image_shape)
    return largest_batch(peak, budget_bytes, multiple, limit, flag="--batch fill")
