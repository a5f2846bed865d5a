"""Pipeline parallelism (GPipe): consecutive layer groups on the `stage` axis, micro-batches
streamed through them, gradients accumulated, one optimizer step.

Design: **one program per stage, on that stage's sub-mesh, driven by the host** (MPMD).
The CNN family's stages are heterogeneous -- convs of different widths and resolutions,
then dense layers -- so their parameters and activations have no common shape to stack
along a `stage` dimension, which a single SPMD program (`shard_map` + `ppermute`) needs.
Per-stage programs take each stage as it is: stage s's devices (a `data` sub-mesh of
size D) hold only its parameters and optimizer state. Where the model is cut:
jaxcnn.pipeline.split; the order the host runs the programs in: jaxcnn.pipeline.schedule.

Semantics: with batch norm, statistics are per micro-batch (as in GPipe), and dropout
masks are drawn per micro-batch, so such models train well but do not reproduce the
single-device numbers; models without them do, to rounding (tests/test_pipeline.py).
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcnn import platform_choices
from jaxcnn.compiling import Compilation, kernel_record
from jaxcnn.models import build_model, cross_entropy, resolve_kernels, unit_pixels
from jaxcnn.optim import apply_optimizer, make_optimizer, optimizer_shardings
from jaxcnn.pipeline.schedule import GPipe, StageState, bubble_fraction
from jaxcnn.pipeline.split import Stage, check_stages_within_processes, stage_groups, sub_meshes
from jaxcnn.program import Anatomy, CompiledPart, Program, ProgramSpec
from jaxcnn.saved_model import ModelVariables, flat_variables, path_key
from jaxcnn.sharding import axes as ax
from jaxcnn.sharding.layouts import DP
from jaxcnn.sharding.partition import (
    ParamPlacement,
    activation_layout,
    bytes_per_device,
    data_sharding,
    place_variables,
)
from jaxcnn.sharding.placement import BatchPlacement


def build_pipeline_program(spec: ProgramSpec, microbatches: int, stage_split: tuple[int, ...] | None) -> Program:
    """Per-stage programs on the stages' sub-meshes, run by the GPipe schedule (sizes
    validated by jaxcnn.build; `stage_split` None: balanced by FLOPs)."""
    # a pipeline always compiles init, and has no update rule but its micro-batches (jaxcnn.build checks)
    layout, mesh, image_shape, seed = spec.layout, spec.mesh, spec.image_shape, spec.seed
    batch_size, eval_batch_size, with_eval = spec.batch_size, spec.eval_batch_size, spec.with_eval
    platform = mesh.devices.flat[0].platform
    model_config = resolve_kernels(spec.model_config, platform)
    num_stages = mesh.shape[layout.stage_axis]
    groups = stage_groups(model_config, image_shape, num_stages, stage_split)
    m = microbatches
    micro = batch_size // m
    meshes = sub_meshes(mesh, layout.stage_axis)
    check_stages_within_processes(meshes, mesh, layout.stage_axis)
    data_ways = math.prod(meshes[0].shape.values())
    tx = make_optimizer(spec.optim_config, spec.total_steps)
    pixels = jnp.dtype(spec.image_dtype)  # stage 0's input; uint8 is scaled in its programs (unit_pixels)
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
        opt_bytes.append(bytes_per_device(with_shardings(abstract.opt_state, o_sh)))
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

    def on(sub: Mesh, shape_tuple):
        logical = ax.IMAGE_BHWC if len(shape_tuple) == 4 else ax.FEATURES_BF
        return data_sharding(logical[: len(shape_tuple)], DP, sub)

    first, last = meshes[0], meshes[-1]
    image_sh = eval_image_sh = data_sharding(ax.IMAGE_BHWC, DP, first)
    label_sh = eval_vec_sh = data_sharding((ax.BATCH,), DP, last)
    rep = [NamedSharding(sub, P()) for sub in meshes]

    # --- per-stage programs -----------------------------------------------------------
    def apply(s, params, stats, x, train, key):
        model = nnx.merge(graphdefs[s], params, stats, copy=True)
        x = unit_pixels(x) if s == 0 else x
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

        wrt = (0, 1) if s > 0 else (0,)  # a single stage's input is the images: no gradient for them
        (loss, (logits, new_stats)), grads = jax.value_and_grad(loss_fn, argnums=wrt, has_aux=True)(params, xin)
        correct = jnp.sum(jnp.argmax(logits, -1) == y)
        dp, dx = grads if s > 0 else (grads[0], None)
        totals = (totals[0] + loss, totals[1] + correct)
        return jax.tree.map(jnp.add, acc, dp), (dx if s > 0 else None), new_stats, totals

    def update(params, opt_state, grads):
        return apply_optimizer(tx, grads, opt_state, params)

    programs, lowered = [], {}
    key_sds = lambda s: jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep[s])  # noqa: E731
    mb_sds = lambda s: jax.ShapeDtypeStruct((), jnp.int32, sharding=rep[s])  # noqa: E731
    for s, sub in enumerate(meshes):
        sh = shardings[s]
        params_sds, stats_sds = with_shardings(stages[s].params, sh.params), with_shardings(stages[s].stats, sh.stats)
        in_shape = (m, micro, *image_shape) if s == 0 else act_shapes[s - 1].shape
        x_sh = grouped_images if s == 0 else on(sub, in_shape)
        x_sds = jax.ShapeDtypeStruct(in_shape, pixels if s == 0 else jnp.float32, sharding=x_sh)
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
        opt_sds = with_shardings(stages[s].opt_state, sh.opt_state)
        prog["update"] = jax.jit(update, out_shardings=(sh.params, sh.opt_state), donate_argnums=(0, 1)).lower(
            params_sds, opt_sds, params_sds
        )
        if with_eval:
            e_shape = (eval_batch_size, *image_shape) if s == 0 else (eval_batch_size, *act_shapes[s - 1].shape[1:])
            e_sh = eval_image_sh if s == 0 else on(sub, e_shape)
            e_sds = jax.ShapeDtypeStruct(e_shape, pixels if s == 0 else jnp.float32, sharding=e_sh)
            e_out = (eval_batch_size, *act_shapes[s].shape[1:])
            prog["eval"] = jax.jit(
                lambda p, st, x, s=s: apply(s, p, st, x, False, None)[0], out_shardings=on(sub, e_out)
            ).lower(params_sds, stats_sds, e_sds)
        prog["init"] = jax.jit(lambda s=s: init_stage(s), out_shardings=sh).lower()
        lowered.update({(s, name): low for name, low in prog.items()})
        programs.append({"x_sharding": x_sh, "y_sharding": y_sh, "eval_x_sharding": e_sh if with_eval else None})

    def eval_loss(logits, labels, mask):
        predictions = jnp.argmax(logits, -1)
        return jnp.sum(cross_entropy(logits, labels) * mask), jnp.sum((predictions == labels) * mask), predictions

    logits_sds = jax.ShapeDtypeStruct(
        (eval_batch_size, model_config.num_classes),
        jnp.float32,
        sharding=on(last, (eval_batch_size, model_config.num_classes)),
    )
    vec = jax.ShapeDtypeStruct((eval_batch_size,), jnp.int32, sharding=eval_vec_sh)
    fvec = jax.ShapeDtypeStruct((eval_batch_size,), jnp.float32, sharding=eval_vec_sh)
    lowered["group_images"] = jax.jit(lambda x: x.reshape(m, micro, *image_shape), out_shardings=grouped_images).lower(
        jax.ShapeDtypeStruct((batch_size, *image_shape), pixels, sharding=image_sh)
    )
    lowered["group_labels"] = jax.jit(lambda y: y.reshape(m, micro), out_shardings=grouped_labels).lower(
        jax.ShapeDtypeStruct((batch_size,), jnp.int32, sharding=label_sh)
    )
    if with_eval:
        lowered["tail"] = jax.jit(eval_loss, out_shardings=(rep[-1], rep[-1], rep[-1])).lower(logits_sds, vec, fvec)
    init_options = platform_choices.init_compiler_options(platform)
    options = {key: init_options for key in lowered if isinstance(key, tuple) and key[1] == "init"}
    step_options = (
        platform_choices.step_compiler_options(platform) if spec.compiler_options is None else spec.compiler_options
    )
    compilation = Compilation(platform)
    for key, low in lowered.items():  # lowered as the stages were built: their time is in the build's total
        compilation.add(key, low)
    compiled = compilation.compile(options, default=step_options)
    for (s, name), program in ((k, v) for k, v in compiled.items() if isinstance(k, tuple)):
        programs[s][name] = program
    eval_tail, group_images, group_labels = compiled.get("tail"), compiled["group_images"], compiled["group_labels"]
    lower_seconds = time.perf_counter() - start - compilation.seconds  # building the stages and lowering

    serial = platform == "cpu" and jax.process_count() > 1
    schedule = GPipe(programs, rep, m, batch_size, seed, group_images, group_labels, eval_tail, serial)
    per_step = [[*(CompiledPart(name, prog[name], m, data_ways, False) for name in PER_MICROBATCH if name in prog),
                 CompiledPart("update", prog["update"], 1, data_ways)] for prog in programs]  # fmt: skip
    program = Program(
        spec=spec,
        init=schedule.init,
        train_step=schedule.train_step,
        eval_step=schedule.eval_step,
        train_input=BatchPlacement(
            images=jax.ShapeDtypeStruct((batch_size, *image_shape), pixels, sharding=image_sh),
            labels=jax.ShapeDtypeStruct((batch_size,), jnp.int32, sharding=label_sh),
        ),
        eval_input=BatchPlacement(
            images=jax.ShapeDtypeStruct((eval_batch_size, *image_shape), pixels, sharding=eval_image_sh),
            labels=vec,
            mask=fvec,
        ),
        anatomy=Anatomy(
            stages=per_step,
            placements=placements,
            compute_placements=placements,
            stage_param_bytes=param_bytes,
            stage_optimizer_bytes=opt_bytes,
            boundary_bytes=[2 * m * b // data_ways for b in act_bytes[:-1]],  # activations forward, gradients back
            boundary_transfers=2 * m if num_stages > 1 else 0,
            bubble_fraction=bubble_fraction(num_stages, m),
            microbatches=m,
            layer_groups=groups,
        ),
        num_params=sum(math.prod(r.shape) for r in placements if not r.path.endswith(("mean", "var"))),
        compile_seconds=compilation.seconds,
        lower_seconds=lower_seconds,
        compile_timings=compilation.timings,
    )
    program.record = {
        "stages": [list(g) for g in groups],
        "microbatches": m,
        "bubble_fraction": program.anatomy.bubble_fraction,
        "stage_param_bytes_per_device": param_bytes,
        "stage_optimizer_bytes_per_device": opt_bytes,
        "bytes_between_stages_per_step": 2 * m * sum(act_bytes[:-1]),  # whole arrays, every boundary
        "kernels": kernel_record(model_config, step_options),
    }
    program.description = describe(program, groups, m)
    program.model_variables = stage_paths_to_model(model_config, image_shape, groups)
    return program


def stage_paths_to_model(model_config, image_shape, groups: list[range]):
    """(PipelineState) -> the whole model's arrays by the model's own paths: stage s names a
    layer "units/0/conv/kernel", the model "blocks/3/conv/kernel". The names are matched by
    the Variable objects a Stage shares with the model it is cut from."""
    model = nnx.eval_shape(lambda: build_model(model_config, image_shape, 0))
    model_path = {id(v): path_key(p) for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)}
    renames = [
        {path_key(p): model_path[id(v)] for p, v in nnx.iter_graph(Stage(model, group)) if isinstance(v, nnx.Variable)}
        for group in groups
    ]

    def model_variables(state) -> ModelVariables:
        params, stats = {}, {}
        for rename, stage in zip(renames, state.stages, strict=True):
            params.update({rename[k]: v for k, v in flat_variables(stage.params).items()})
            stats.update({rename[k]: v for k, v in flat_variables(stage.stats).items()})
        return ModelVariables(params, stats)

    return model_variables


# The stage programs a training step runs once per micro-batch (update runs once).
PER_MICROBATCH = ("forward", "backward", "last")


def with_shardings(tree, shardings):
    """ShapeDtypeStructs of an abstract tree, carrying their shardings."""
    return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), tree, shardings)


def describe(program: Program, groups: list[range], microbatches: int) -> str:
    """The stage table printed before a pipeline run."""
    anatomy = program.anatomy
    whole = sum(anatomy.stage_param_bytes)
    lines = [
        f"pipeline: {len(groups)} stages x {microbatches} micro-batches of "
        f"{program.batch_size // microbatches}; bubble (S-1)/(M+S-1) = {anatomy.bubble_fraction:.1%}"
    ]
    for s, (group, pb, ob) in enumerate(
        zip(groups, anatomy.stage_param_bytes, anatomy.stage_optimizer_bytes, strict=True)
    ):
        lines.append(
            f"  stage {s}: layers {group.start}-{group.stop - 1}, parameters {pb:,} B per device "
            f"({pb / whole:.0%} of the model's {whole:,} B), optimizer {ob:,} B"
        )
    lines.append(f"  between stages: {program.record['bytes_between_stages_per_step']:,} B per step")
    return "\n".join(lines)
