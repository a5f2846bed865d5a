"""Pipeline parallelism (GPipe): consecutive layer groups on the `stage` axis, micro-batches
streamed through them, gradients accumulated, one optimizer step.

Design: **one program per stage, on that stage's sub-mesh, driven by the host** (MPMD).
The CNN family's stages are heterogeneous -- convs of different widths and resolutions,
then dense layers -- so their parameters and activations have no common shape to stack
along a `stage` dimension, which a single SPMD program (`shard_map` + `ppermute`) needs.
Per-stage programs take each stage as it is: stage s's devices (a `data` sub-mesh of
size D) hold only its parameters and optimizer state; activations travel to the next
stage's devices with `jax.device_put`; JAX's asynchronous dispatch lets every stage's
devices run at once, and the host only issues work in the GPipe order:

    forward:  tick t = 0 .. M+S-2, stage s runs micro-batch t-s   (M+S-1 ticks)
    backward: the same ticks in reverse, each stage recomputing its forward (remat, as
              in the GPipe paper) and adding its gradient to an accumulator
    update:   one optimizer step per stage (Adam is element-wise: the same as one global step)

The schedule idles (S-1)/(M+S-1) of each stage's time (the bubble). The split into S
groups balances modelled FLOPs (forward + backward, from the layer shapes), because
equal stage times are what keep the bubble at its formula; `--stage-split` overrides it.

Semantics: with batch norm, statistics are per micro-batch (as in GPipe), and dropout
masks are drawn per micro-batch, so such models train well but do not reproduce the
single-device numbers; models without them do, to rounding (tests/test_pipeline.py).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcnn.compiling import compile_all, cpu_init_options, cpu_step_options
from jaxcnn.config import ModelConfig, OptimConfig
from jaxcnn.data import to_global
from jaxcnn.errors import UserError
from jaxcnn.models import LayerShape, build_model, cross_entropy, layer_shapes
from jaxcnn.optim import apply_optimizer, make_optimizer
from jaxcnn.sharding import axes as ax
from jaxcnn.sharding.inspect import Collective, bytes_per_device, collectives
from jaxcnn.sharding.layouts import DP, Layout
from jaxcnn.sharding.partition import (
    ParamPlacement,
    activation_layout,
    constrain,
    data_sharding,
    optimizer_shardings,
    place_variables,
)


def layer_flops(layer: LayerShape) -> float:
    """Forward FLOPs per image (x3 for forward + backward is the same for every layer)."""
    if layer.kind == "conv":
        return 2.0 * layer.height * layer.width * 9 * layer.in_features * layer.features
    return 2.0 * layer.in_features * layer.features


def balance(costs: list[float], stages: int) -> tuple[int, ...]:
    """Split points (first layer of stages 1..S-1) minimising the most expensive stage:
    the classic linear-partition dynamic programme, exact for these few layers."""
    n = len(costs)
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    best = {(0, 0): (0.0, ())}
    for s in range(1, stages + 1):
        for end in range(s, n - (stages - s) + 1):
            options = []
            for start in range(s - 1, end):
                if (s - 1, start) in best:
                    worst, cuts = best[(s - 1, start)]
                    options.append((max(worst, prefix[end] - prefix[start]), (*cuts, start)))
            best[(s, end)] = min(options)
    return best[(stages, n)][1][1:]


def stage_groups(config: ModelConfig, image_shape, stages: int, split: tuple[int, ...] | None) -> list[range]:
    layers = layer_shapes(config, image_shape)
    if stages > len(layers):
        raise UserError(
            f"a pipeline of {stages} stages needs at least {stages} layers, but {config.name} has {len(layers)}; "
            f"use --mesh stage={len(layers)} or fewer"
        )
    if split is None:
        split = balance([layer_flops(layer) for layer in layers], stages)
    elif len(split) != stages - 1 or list(split) != sorted(set(split)) or not all(0 < c < len(layers) for c in split):
        raise UserError(
            f"--stage-split {','.join(map(str, split))} must give {stages - 1} increasing layer indices "
            f"between 1 and {len(layers) - 1} (the first layer of each later stage)"
        )
    edges = (0, *split, len(layers))
    return [range(a, b) for a, b in itertools.pairwise(edges)]


# Batch-norm statistics come from one micro-batch: below ~16 images they get noisy enough
# to cost accuracy (seen here: M=8 micro-batches of 8 -> 98.1% test accuracy, M=4 of 16 -> 98.6%).
MIN_MICROBATCH = 16


def default_microbatches(batch_size: int, stages: int) -> int:
    """2 x stages (bubble (S-1)/(3S-1) < 1/3), fewer while micro-batches would be under
    `MIN_MICROBATCH` images, always a divisor of the batch."""
    for m in range(2 * stages, 0, -1):
        if batch_size % m == 0 and (batch_size // m >= MIN_MICROBATCH or m == 1):
            return m
    return 1


class Stage(nnx.Module):
    """Layers `group` of the CNN (sharing its submodules, so its initial values)."""

    def __init__(self, model, group: range):
        num_blocks, num_dense = len(model.blocks), len(model.dense)
        self.blocks = nnx.List([model.blocks[i] for i in group if i < num_blocks])
        self.dense = nnx.List([model.dense[i - num_blocks] for i in group if i >= num_blocks])
        self.dropout = model.dropout
        self.flattens = group.start <= num_blocks <= group.stop - 1  # holds dense 0
        self.hidden = tuple(i - num_blocks < num_dense - 1 for i in group if i >= num_blocks)  # ReLU + dropout after?

    def __call__(self, x, *, train: bool, rngs: nnx.Rngs | None = None):
        x = constrain(x, ax.IMAGE_BHWC if x.ndim == 4 else ax.FEATURES_BF)
        for block in self.blocks:
            x = block(x, train)
        if self.flattens:
            x = constrain(x.reshape(x.shape[0], -1), ax.FEATURES_BF)
        for layer, hidden in zip(self.dense, self.hidden, strict=True):
            x = layer(x)
            if hidden:
                x = constrain(self.dropout(nnx.relu(x), deterministic=not train, rngs=rngs), ax.FEATURES_BF)
        return x


class StageState(NamedTuple):
    params: nnx.State
    stats: nnx.State  # batch-norm running statistics of this stage's layers
    opt_state: optax.OptState


class PipelineState(NamedTuple):
    step: jax.Array  # on stage 0's devices
    stages: tuple[StageState, ...]
    rng: jax.Array


@dataclass
class PipelineProgram:
    """The pipeline's counterpart of `jaxcnn.train.Program` (what `fit` and the scripts use)."""

    layout: Layout
    mesh: Mesh
    groups: list[range]
    microbatches: int
    batch_size: int
    eval_batch_size: int
    batch_shardings: tuple[NamedSharding, NamedSharding]
    eval_shardings: tuple[NamedSharding, NamedSharding, NamedSharding]
    placements: list[ParamPlacement]  # paths prefixed "stage<s>/"
    stage_param_bytes: list[int]  # parameters + statistics per device of each stage
    stage_optimizer_bytes: list[int]
    activation_bytes: list[int]  # bytes of one micro-batch's activation sent after stage s
    num_params: int
    init: Any
    train_step: Any  # (state, images, labels) -> (state, {"loss", "accuracy"})
    eval_step: Any  # (state, images, labels, mask) -> (loss_sum, correct_sum, predictions)
    compile_seconds: float
    stage_programs: list[dict]  # per stage: its compiled programs, for inspection
    sync_every: int = 0  # local SGD does not apply: the pipeline's update is synchronous

    def place_batch(self, images, labels) -> tuple[jax.Array, jax.Array]:
        return to_global(images, self.batch_shardings[0]), to_global(labels, self.batch_shardings[1])

    @property
    def bubble_fraction(self) -> float:
        s, m = len(self.groups), self.microbatches
        return (s - 1) / (m + s - 1)


def _sub_meshes(mesh: Mesh, stage_axis: str) -> list[Mesh]:
    """Stage s's devices as a mesh of the remaining axes (data)."""
    names = list(mesh.axis_names)
    order = [names.index(stage_axis)] + [i for i, n in enumerate(names) if n != stage_axis]
    grid = np.transpose(mesh.devices, order)
    rest = tuple(n for n in names if n != stage_axis)
    sizes = [mesh.shape[n] for n in rest]
    if not rest:  # stage only: each stage is one device, a data axis of 1
        rest, sizes = (ax.DATA,), [1]
    auto = (AxisType.Auto,) * len(rest)
    return [Mesh(np.asarray(grid[s], dtype=object).reshape(sizes), rest, axis_types=auto) for s in range(grid.shape[0])]


def _with_shardings(tree, shardings):
    """ShapeDtypeStructs of an abstract tree, carrying their shardings."""
    return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), tree, shardings)


# The stage programs a training step runs once per micro-batch (update runs once, no collectives).
PER_MICROBATCH = ("forward", "backward", "last")


def stage_collectives(program: PipelineProgram) -> list[list[Collective]]:
    """Per stage, the collectives its programs run in one optimizer step."""
    data_ways = program.mesh.size // len(program.groups)
    return [
        [
            c
            for name in PER_MICROBATCH
            if name in prog
            for c in collectives(prog[name].as_text(), data_ways)
            for _ in range(program.microbatches)
        ]
        for prog in program.stage_programs
    ]


def build_pipeline_program(
    model_config: ModelConfig,
    optim_config: OptimConfig,
    layout: Layout,
    mesh: Mesh,
    image_shape: tuple[int, int, int],
    batch_size: int,
    total_steps: int,
    *,
    microbatches: int | None = None,
    stage_split: tuple[int, ...] | None = None,
    seed: int = 0,
    eval_batch_size: int | None = None,
    with_eval: bool = True,
) -> PipelineProgram:
    stage_axis = layout.stage_axis
    num_stages = mesh.shape[stage_axis]
    groups = stage_groups(model_config, image_shape, num_stages, stage_split)
    m = microbatches or default_microbatches(batch_size, num_stages)
    if m < 1 or batch_size % m:
        raise UserError(f"--microbatches {m} must divide the global batch {batch_size}; use a divisor of {batch_size}")
    micro = batch_size // m
    meshes = _sub_meshes(mesh, stage_axis)
    data_ways = math.prod(meshes[0].shape.values())
    if micro % data_ways:
        raise UserError(
            f"a micro-batch of {micro} ({batch_size}/{m}) does not split over data={data_ways}; "
            f"use a batch that is a multiple of {m * data_ways}"
        )
    eval_batch_size = eval_batch_size or batch_size
    tx = make_optimizer(optim_config, total_steps)
    start = time.perf_counter()

    def stage_module(s: int) -> Stage:
        return Stage(build_model(model_config, image_shape, seed), groups[s])

    def init_stage(s: int) -> StageState:
        _, params, stats = nnx.split(stage_module(s), nnx.Param, ...)
        return StageState(params, stats, tx.init(params))

    stages, placements, param_bytes, opt_bytes, shardings = [], [], [], [], []
    graphdefs, act_bytes = [], []
    for s, sub in enumerate(meshes):
        abstract = jax.eval_shape(lambda s=s: init_stage(s))
        graphdefs.append(nnx.graphdef(nnx.eval_shape(lambda s=s: stage_module(s))))
        p_sh, rows = place_variables(abstract.params, DP, sub)
        st_sh, st_rows = place_variables(abstract.stats, DP, sub)
        o_sh = optimizer_shardings(tx, abstract.opt_state, p_sh, sub)
        shardings.append(StageState(p_sh, st_sh, o_sh))
        placements += [
            ParamPlacement(f"stage{s}/{r.path}", r.logical, r.shape, r.dtype, r.spec, r.bytes_per_device, r.notes)
            for r in rows + st_rows
        ]
        param_bytes.append(sum(r.bytes_per_device for r in rows + st_rows))
        opt_bytes.append(bytes_per_device(_with_shardings(abstract.opt_state, o_sh)))
        stages.append(abstract)

    # activation shapes between stages: trace each stage on one micro-batch
    shape = jax.ShapeDtypeStruct((micro, *image_shape), jnp.float32)
    act_shapes = []
    for s in range(num_stages):
        gd = graphdefs[s]
        shape = jax.eval_shape(
            lambda p, st, x, gd=gd: nnx.merge(gd, p, st)(x, train=False), stages[s].params, stages[s].stats, shape
        )
        act_shapes.append(shape)
        act_bytes.append(math.prod(shape.shape) * shape.dtype.itemsize)

    def on(sub: Mesh, shape_tuple, what="micro-batch"):
        logical = ax.IMAGE_BHWC if len(shape_tuple) == 4 else ax.FEATURES_BF
        return data_sharding(logical[: len(shape_tuple)], shape_tuple, DP, sub, what)

    first, last = meshes[0], meshes[-1]
    image_sh = data_sharding(ax.IMAGE_BHWC, (batch_size, *image_shape), DP, first, "global batch")
    label_sh = data_sharding((ax.BATCH,), (batch_size,), DP, last, "global batch")
    eval_image_sh = data_sharding(ax.IMAGE_BHWC, (eval_batch_size, *image_shape), DP, first, "eval batch")
    eval_vec_sh = data_sharding((ax.BATCH,), (eval_batch_size,), DP, last, "eval batch")
    rep = [NamedSharding(sub, P()) for sub in meshes]

    # --- per-stage programs -----------------------------------------------------------
    def apply(s, params, stats, x, train, key):
        model = nnx.merge(graphdefs[s], params, stats, copy=True)
        with activation_layout(DP, meshes[s]):
            y = model(x, train=train, rngs=nnx.Rngs(dropout=key) if train else None)
        # activations cross stages in float32, so every stage program has one signature
        # whatever --dtype computes in (bfloat16 would halve the bytes sent; not done yet)
        return y.astype(jnp.float32), nnx.state(model, nnx.Not(nnx.Param))

    # The global batch arrives split over `data` in contiguous rows, so micro-batch i would
    # sit on one device. Once per step it is regrouped as [M, micro, ...] with each
    # micro-batch split over `data` (one all-to-all), so that taking micro-batch i is local.
    micro_spec = lambda n: P(None, ax.DATA, *([None] * n)) if ax.DATA in first.shape else P()  # noqa: E731
    grouped_images = NamedSharding(first, micro_spec(3))
    grouped_labels = NamedSharding(last, micro_spec(0))

    def micro_input(s, x, mb):
        """Stage 0 receives the grouped global batch and takes micro-batch `mb` itself."""
        return jax.lax.dynamic_index_in_dim(x, mb, keepdims=False) if s == 0 else x

    def forward(s, params, stats, x, mb, key):
        y, stats = apply(s, params, stats, micro_input(s, x, mb), True, jax.random.fold_in(key, mb))
        return y, stats

    def backward(s, params, stats, x, mb, key, dy, acc):
        xin = micro_input(s, x, mb)

        def f(p, xi):
            return apply(s, p, stats, xi, True, jax.random.fold_in(key, mb))[0]

        if s == 0:  # no gradient for the images
            _, vjp = jax.vjp(lambda p: f(p, xin), params)
            (dp,) = vjp(dy)
            return jax.tree.map(jnp.add, acc, dp), None
        _, vjp = jax.vjp(f, params, xin)
        dp, dx = vjp(dy)
        return jax.tree.map(jnp.add, acc, dp), dx

    def last_backward(params, stats, x, labels, mb, key, acc, totals):
        s = num_stages - 1
        xin, y = micro_input(s, x, mb), jax.lax.dynamic_index_in_dim(labels, mb, keepdims=False)

        def loss_fn(p, xi):
            logits, new_stats = apply(s, p, stats, xi, True, jax.random.fold_in(key, mb))
            return cross_entropy(logits, y).mean() / m, (logits, new_stats)

        (loss, (logits, new_stats)), grads = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(params, xin)
        correct = jnp.sum(jnp.argmax(logits, -1) == y)
        dp, dx = grads
        totals = (totals[0] + loss, totals[1] + correct)
        return jax.tree.map(jnp.add, acc, dp), (dx if s > 0 else None), new_stats, totals

    def update(params, opt_state, grads):
        return apply_optimizer(tx, grads, opt_state, params)

    programs, lowered = [], {}
    key_sds = lambda s: jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep[s])  # noqa: E731
    mb_sds = lambda s: jax.ShapeDtypeStruct((), jnp.int32, sharding=rep[s])  # noqa: E731
    for s, sub in enumerate(meshes):
        sh = shardings[s]
        params_sds, stats_sds = _with_shardings(stages[s].params, sh.params), _with_shardings(stages[s].stats, sh.stats)
        in_shape = (m, micro, *image_shape) if s == 0 else act_shapes[s - 1].shape
        x_sh = grouped_images if s == 0 else on(sub, in_shape)
        x_sds = jax.ShapeDtypeStruct(in_shape, jnp.float32, sharding=x_sh)
        y_sh = on(sub, act_shapes[s].shape)
        dy_sds = jax.ShapeDtypeStruct(act_shapes[s].shape, jnp.float32, sharding=y_sh)
        prog = {}
        if s < num_stages - 1:
            prog["forward"] = (
                jax.jit(lambda p, st, x, mb, k, s=s: forward(s, p, st, x, mb, jax.random.wrap_key_data(k)),
                        out_shardings=(y_sh, sh.stats))
                .lower(params_sds, stats_sds, x_sds, mb_sds(s), key_sds(s))
            )  # fmt: skip
            prog["backward"] = (
                jax.jit(lambda p, st, x, mb, k, dy, acc, s=s: backward(s, p, st, x, mb, jax.random.wrap_key_data(k), dy, acc),
                        out_shardings=(sh.params, x_sh if s > 0 else None), donate_argnums=(6,))
                .lower(params_sds, stats_sds, x_sds, mb_sds(s), key_sds(s), dy_sds, params_sds)
            )  # fmt: skip
        else:
            labels_sds = jax.ShapeDtypeStruct((m, micro), jnp.int32, sharding=grouped_labels)
            totals_sds = (
                jax.ShapeDtypeStruct((), jnp.float32, sharding=rep[s]),
                jax.ShapeDtypeStruct((), jnp.int32, sharding=rep[s]),
            )
            prog["last"] = (
                jax.jit(lambda p, st, x, y, mb, k, acc, t: last_backward(p, st, x, y, mb, jax.random.wrap_key_data(k), acc, t),
                        out_shardings=(sh.params, x_sh if s > 0 else None, sh.stats, (rep[s], rep[s])), donate_argnums=(6,))
                .lower(params_sds, stats_sds, x_sds, labels_sds, mb_sds(s), key_sds(s), params_sds, totals_sds)
            )  # fmt: skip
        opt_sds = _with_shardings(stages[s].opt_state, sh.opt_state)
        prog["update"] = jax.jit(update, out_shardings=(sh.params, sh.opt_state), donate_argnums=(0, 1)).lower(
            params_sds, opt_sds, params_sds
        )
        if with_eval:
            e_shape = (eval_batch_size, *image_shape) if s == 0 else (eval_batch_size, *act_shapes[s - 1].shape[1:])
            e_sh = eval_image_sh if s == 0 else on(sub, e_shape, "eval batch")
            e_out = (eval_batch_size, *act_shapes[s].shape[1:])
            prog["eval"] = jax.jit(
                lambda p, st, x, s=s: apply(s, p, st, x, False, None)[0], out_shardings=on(sub, e_out, "eval batch")
            ).lower(params_sds, stats_sds, jax.ShapeDtypeStruct(e_shape, jnp.float32, sharding=e_sh))
        prog["init"] = jax.jit(lambda s=s: init_stage(s), out_shardings=sh).lower()
        lowered.update({(s, name): low for name, low in prog.items()})
        programs.append({"x_sharding": x_sh, "y_sharding": y_sh, "eval_x_sharding": e_sh if with_eval else None})

    def eval_loss(logits, labels, mask):
        predictions = jnp.argmax(logits, -1)
        return jnp.sum(cross_entropy(logits, labels) * mask), jnp.sum((predictions == labels) * mask), predictions

    logits_sds = jax.ShapeDtypeStruct(
        (eval_batch_size, model_config.num_classes),
        jnp.float32,
        sharding=on(last, (eval_batch_size, model_config.num_classes), "eval batch"),
    )
    vec = jax.ShapeDtypeStruct((eval_batch_size,), jnp.int32, sharding=eval_vec_sh)
    fvec = jax.ShapeDtypeStruct((eval_batch_size,), jnp.float32, sharding=eval_vec_sh)
    lowered["group_images"] = jax.jit(lambda x: x.reshape(m, micro, *image_shape), out_shardings=grouped_images).lower(
        jax.ShapeDtypeStruct((batch_size, *image_shape), jnp.float32, sharding=image_sh)
    )
    lowered["group_labels"] = jax.jit(lambda y: y.reshape(m, micro), out_shardings=grouped_labels).lower(
        jax.ShapeDtypeStruct((batch_size,), jnp.int32, sharding=label_sh)
    )
    if with_eval:
        lowered["tail"] = jax.jit(eval_loss, out_shardings=(rep[-1], rep[-1], rep[-1])).lower(logits_sds, vec, fvec)
    options = {key: cpu_init_options(mesh) for key in lowered if isinstance(key, tuple) and key[1] == "init"}
    compiled = compile_all(lowered, options, default=cpu_step_options(mesh))
    for (s, name), program in ((k, v) for k, v in compiled.items() if isinstance(k, tuple)):
        programs[s][name] = program
    eval_tail, group_images, group_labels = compiled.get("tail"), compiled["group_images"], compiled["group_labels"]
    compile_seconds = time.perf_counter() - start

    # --- the host-driven schedule -------------------------------------------------------
    def init() -> PipelineState:
        rng = jax.device_put(jax.random.key_data(jax.random.key(seed + 1)), rep[0])
        return PipelineState(
            jax.device_put(jnp.zeros((), jnp.int32), rep[0]), tuple(p["init"]() for p in programs), rng
        )

    mbs = [[jax.device_put(jnp.int32(i), rep[s]) for i in range(m)] for s in range(num_stages)]  # micro-batch indices

    def train_step(state: PipelineState, images, labels):
        images, labels = group_images(images), group_labels(labels)
        step_key = jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step))
        keys = [jax.device_put(step_key, rep[s]) for s in range(num_stages)]
        stats = [st.stats for st in state.stages]
        inputs = [[None] * m for _ in range(num_stages)]  # what stage s received for micro-batch i
        for t in range(m + num_stages - 1):  # forward ticks
            for s in range(num_stages):
                i = t - s
                if not 0 <= i < m:
                    continue
                x = images if s == 0 else inputs[s][i]
                inputs[s][i] = x
                if s < num_stages - 1:
                    y, stats[s] = programs[s]["forward"](state.stages[s].params, stats[s], x, mbs[s][i], keys[s])
                    inputs[s + 1][i] = jax.device_put(y, programs[s + 1]["x_sharding"])
        grads = [jax.tree.map(jnp.zeros_like, st.params) for st in state.stages]
        totals = (jax.device_put(jnp.float32(0), rep[-1]), jax.device_put(jnp.int32(0), rep[-1]))
        douts: list[list] = [[None] * m for _ in range(num_stages)]
        for t in range(m + num_stages - 1):  # backward ticks, last stage first
            for s in reversed(range(num_stages)):
                i = m - 1 - (t - (num_stages - 1 - s))
                if not 0 <= i < m:
                    continue
                p = state.stages[s].params
                if s == num_stages - 1:
                    grads[s], dx, stats[s], totals = programs[s]["last"](
                        p, stats[s], inputs[s][i], labels, mbs[s][i], keys[s], grads[s], totals
                    )
                else:
                    grads[s], dx = programs[s]["backward"](
                        p, stats[s], inputs[s][i], mbs[s][i], keys[s], douts[s][i], grads[s]
                    )
                if s > 0:
                    douts[s - 1][i] = jax.device_put(dx, programs[s - 1]["y_sharding"])
        new_stages = []
        for s, st in enumerate(state.stages):
            params, opt_state = programs[s]["update"](st.params, st.opt_state, grads[s])
            new_stages.append(StageState(params, stats[s], opt_state))
        metrics = {"loss": totals[0], "accuracy": totals[1] / batch_size}
        return PipelineState(state.step + 1, tuple(new_stages), state.rng), metrics

    def eval_step(state: PipelineState, images, labels, mask):
        x = images
        for s, st in enumerate(state.stages):
            if s > 0:
                x = jax.device_put(x, programs[s]["eval_x_sharding"])
            x = programs[s]["eval"](st.params, st.stats, x)
        return eval_tail(x, labels, mask)

    return PipelineProgram(
        layout=layout,
        mesh=mesh,
        groups=groups,
        microbatches=m,
        batch_size=batch_size,
        eval_batch_size=eval_batch_size,
        batch_shardings=(image_sh, label_sh),
        eval_shardings=(eval_image_sh, eval_vec_sh, eval_vec_sh),
        placements=placements,
        stage_param_bytes=param_bytes,
        stage_optimizer_bytes=opt_bytes,
        activation_bytes=act_bytes,
        num_params=sum(math.prod(r.shape) for r in placements if not r.path.endswith(("mean", "var"))),
        init=init,
        train_step=train_step,
        eval_step=eval_step,
        compile_seconds=compile_seconds,
        stage_programs=programs,
    )


def pipeline_record(program: PipelineProgram) -> dict:
    """The pipeline's extra result fields."""
    return {
        "stages": [list(g) for g in program.groups],
        "microbatches": program.microbatches,
        "bubble_fraction": program.bubble_fraction,
        "stage_param_bytes_per_device": program.stage_param_bytes,
        "stage_optimizer_bytes_per_device": program.stage_optimizer_bytes,
        "bytes_between_stages_per_step": pipeline_transfer_bytes(program),
    }


def pipeline_transfer_bytes(program: PipelineProgram) -> int:
    """Bytes sent between stages per optimizer step: every micro-batch's activation
    forward and its gradient backward, across each of the S-1 boundaries (whole arrays;
    each device of a data sub-mesh sends its 1/D share)."""
    return 2 * program.microbatches * sum(program.activation_bytes[:-1])


def pipeline_summary(program: PipelineProgram) -> str:
    whole = sum(program.stage_param_bytes)
    lines = [
        f"pipeline: {len(program.groups)} stages x {program.microbatches} micro-batches of "
        f"{program.batch_size // program.microbatches}; bubble (S-1)/(M+S-1) = {program.bubble_fraction:.1%}"
    ]
    for s, (group, pb, ob) in enumerate(
        zip(program.groups, program.stage_param_bytes, program.stage_optimizer_bytes, strict=True)
    ):
        lines.append(
            f"  stage {s}: layers {group.start}-{group.stop - 1}, parameters {pb:,} B per device "
            f"({pb / whole:.0%} of the model's {whole:,} B), optimizer {ob:,} B"
        )
    lines.append(f"  between stages: {pipeline_transfer_bytes(program):,} B per step")
    return "\n".join(lines)
