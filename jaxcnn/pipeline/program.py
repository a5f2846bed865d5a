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
from jaxcnn.pipeline.schedule import (
    PipelineState,
    ScheduleRunner,
    StageState,
    bubble_fraction,
    held_in_flight,
    stage_orders,
    ticks,
    timeline_bubble,
)
from jaxcnn.pipeline.split import Stage, check_stages_within_processes, stage_groups, sub_meshes
from jaxcnn.pipeline.state import StateForms
from jaxcnn.program import Anatomy, CompiledPart, Program, ProgramSpec
from jaxcnn.saved_model import ModelVariables, flat_variables
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


def build_pipeline_program(
    spec: ProgramSpec,
    microbatches: int,
    stage_split: tuple[int, ...] | None,
    schedule: str = "gpipe",
    virtual_stages: int = 1,
) -> Program:
    """Per-chunk programs on the stages' sub-meshes (S x V chunks, chunk c on stage c mod S),
    run in `schedule`'s order (jaxcnn.pipeline.schedule; sizes validated by jaxcnn.build;
    `stage_split` None: balanced by FLOPs)."""
    # a pipeline always compiles init, and has no update rule but its micro-batches (jaxcnn.build checks)
    layout, mesh, image_shape, seed = spec.layout, spec.mesh, spec.image_shape, spec.seed
    batch_size, eval_batch_size, with_eval = spec.batch_size, spec.eval_batch_size, spec.with_eval
    platform = mesh.devices.flat[0].platform
    model_config = resolve_kernels(spec.model_config, platform)
    num_stages = mesh.shape[layout.stage_axis]
    chunks = num_stages * virtual_stages
    groups = stage_groups(model_config, image_shape, num_stages, stage_split, virtual_stages)
    m = microbatches
    micro = batch_size // m
    meshes = [sub_meshes(mesh, layout.stage_axis)[c % num_stages] for c in range(chunks)]  # chunk c's devices
    check_stages_within_processes(meshes, mesh, layout.stage_axis)
    timeline = ticks(stage_orders(schedule, num_stages, virtual_stages, m), chunks)
    data_ways = math.prod(meshes[0].shape.values())
    # activations cross stages in the compute dtype (bfloat16 halves the bytes sent)
    act_dtype = jnp.dtype(model_config.dtype)
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
    for s in range(chunks):
        gd = graphdefs[s]
        shape = jax.eval_shape(
            lambda p, st, x, gd=gd: nnx.merge(gd, p, st)(x, train=False), stages[s].params, stages[s].stats, shape
        )
        act_shapes.append(shape)
        act_bytes.append(math.prod(shape.shape) * act_dtype.itemsize)

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
        return y.astype(act_dtype), nnx.state(model, nnx.Not(nnx.Param))

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
        s = chunks - 1
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

    def update_last(params, opt_state, grads, totals):
        params, opt_state = apply_optimizer(tx, grads, opt_state, params)
        return params, opt_state, {"loss": totals[0], "accuracy": totals[1] / batch_size}

    def zeros(s):
        """The gradient accumulator (on the last chunk with the loss and correct totals)."""
        acc = jax.tree.map(jnp.zeros_like, stages[s].params)
        return (acc, (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))) if s == chunks - 1 else acc

    def step_key(rng, step):
        """This step's dropout key (every layout's: fold_in(rng, step)) and the next step."""
        return jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(rng), step)), step + 1

    programs, lowered = [], {}
    key_sds = lambda s: jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep[s])  # noqa: E731
    mb_sds = lambda s: jax.ShapeDtypeStruct((), jnp.int32, sharding=rep[s])  # noqa: E731
    for s, sub in enumerate(meshes):
        sh = shardings[s]
        params_sds, stats_sds = with_shardings(stages[s].params, sh.params), with_shardings(stages[s].stats, sh.stats)
        in_shape = (m, micro, *image_shape) if s == 0 else act_shapes[s - 1].shape
        x_sh = grouped_images if s == 0 else on(sub, in_shape)
        x_sds = jax.ShapeDtypeStruct(in_shape, pixels if s == 0 else act_dtype, sharding=x_sh)
        y_sh = on(sub, act_shapes[s].shape)
        dy_sds = jax.ShapeDtypeStruct(act_shapes[s].shape, act_dtype, sharding=y_sh)
        prog = {}
        if s < chunks - 1:
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
        if s < chunks - 1:
            prog["update"] = jax.jit(update, out_shardings=(sh.params, sh.opt_state), donate_argnums=(0, 1)).lower(
                params_sds, opt_sds, params_sds
            )
            prog["zeros"] = jax.jit(lambda s=s: zeros(s), out_shardings=sh.params).lower()
        else:
            prog["update"] = jax.jit(
                update_last, out_shardings=(sh.params, sh.opt_state, rep[s]), donate_argnums=(0, 1)
            ).lower(params_sds, opt_sds, params_sds, totals_sds)
            prog["zeros"] = jax.jit(lambda s=s: zeros(s), out_shardings=(sh.params, (rep[s], rep[s]))).lower()
        if s == 0:
            step_sds = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep[0])
            prog["step_key"] = jax.jit(step_key, out_shardings=(rep[0], rep[0])).lower(key_sds(0), step_sds)
        if with_eval:
            e_shape = (eval_batch_size, *image_shape) if s == 0 else (eval_batch_size, *act_shapes[s - 1].shape[1:])
            e_sh = eval_image_sh if s == 0 else on(sub, e_shape)
            e_sds = jax.ShapeDtypeStruct(e_shape, pixels if s == 0 else act_dtype, sharding=e_sh)
            e_out = (eval_batch_size, *act_shapes[s].shape[1:])
            prog["eval"] = jax.jit(
                lambda p, st, x, s=s: apply(s, p, st, x, False, None)[0], out_shardings=on(sub, e_out)
            ).lower(params_sds, stats_sds, e_sds)
        prog["init"] = jax.jit(lambda s=s: init_stage(s), out_shardings=sh).lower()
        lowered.update({(s, name): low for name, low in prog.items()})
        programs.append({
            "x_sharding": x_sh, "y_sharding": y_sh, "eval_x_sharding": e_sh if with_eval else None,
            "x_bytes": act_bytes[s - 1] // data_ways if s > 0 else 0, "y_bytes": act_bytes[s] // data_ways,
        })  # fmt: skip

    def eval_loss(logits, labels, mask):
        predictions = jnp.argmax(logits, -1)
        return jnp.sum(cross_entropy(logits, labels) * mask), jnp.sum((predictions == labels) * mask), predictions

    logits_sds = jax.ShapeDtypeStruct(
        (eval_batch_size, model_config.num_classes),
        act_dtype,
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
    runner = ScheduleRunner(programs, rep, m, seed, group_images, group_labels, eval_tail, timeline, serial)
    scalar = lambda dtype, shape=(): jax.ShapeDtypeStruct(shape, dtype, sharding=rep[0])  # noqa: E731
    abstract_stages = PipelineState(
        scalar(jnp.int32),
        tuple(StageState(with_shardings(st.params, sh.params), with_shardings(st.stats, sh.stats),
                         with_shardings(st.opt_state, sh.opt_state)) for st, sh in zip(stages, shardings, strict=True)),
        scalar(jnp.uint32, (2,)),
    )  # fmt: skip
    forms = StateForms.of(model_config, image_shape, groups)
    per_step = [
        [part for c in range(g, chunks, num_stages) for part in (
            *(CompiledPart(name, programs[c][name], m, data_ways, False) for name in PER_MICROBATCH if name in programs[c]),
            CompiledPart("update", programs[c]["update"], 1, data_ways))]
        for g in range(num_stages)
    ]  # fmt: skip
    per_stage = lambda per_chunk: [sum(per_chunk[g::num_stages]) for g in range(num_stages)]  # noqa: E731
    program = Program(
        spec=spec,
        init=runner.init,
        train_step=runner.train_step,
        eval_step=runner.eval_step,
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
            stage_param_bytes=per_stage(param_bytes),
            stage_optimizer_bytes=per_stage(opt_bytes),
            # per stage, what it sends a step from its chunks (activations forward, gradients back)
            boundary_bytes=per_stage([2 * m * b // data_ways for b in act_bytes[:-1]] + [0]),
            boundary_transfers=2 * m * virtual_stages if chunks > 1 else 0,
            # the schedule's own idle share: the formula's but for looped GPipe with M < S
            bubble_fraction=timeline_bubble(timeline),
            stage_held_bytes=held_in_flight(
                timeline, [p["x_bytes"] for p in programs], [p["y_bytes"] for p in programs]
            ),
            microbatches=m,
            layer_groups=groups,
        ),
        num_params=sum(math.prod(r.shape) for r in placements if not r.path.endswith(("mean", "var"))),
        compile_seconds=compilation.seconds,
        lower_seconds=lower_seconds,
        compile_timings=compilation.timings,
        abstract_state=forms.whole(abstract_stages),
        saved_form=forms.whole,
        from_saved=lambda state: forms.stages(state, like=abstract_stages),
    )
    program.record = {
        "stages": [list(g) for g in groups],  # per chunk (chunk c on stage c mod S)
        "microbatches": m,
        "pipeline_schedule": schedule,
        "virtual_stages": virtual_stages,
        "bubble_fraction": bubble_fraction(num_stages, m, virtual_stages),  # the formula's
        "timeline_bubble_fraction": program.anatomy.bubble_fraction,
        "stage_param_bytes_per_device": param_bytes,
        "stage_optimizer_bytes_per_device": opt_bytes,
        "bytes_between_stages_per_step": 2 * m * sum(act_bytes[:-1]),  # whole arrays, every boundary
        "kernels": kernel_record(model_config, step_options),
    }
    program.description = describe(program, groups, m, schedule, virtual_stages)

    def model_variables(state: PipelineState) -> ModelVariables:
        whole = forms.whole(state)
        return ModelVariables(flat_variables(whole.params), flat_variables(whole.model_state))

    program.model_variables = model_variables
    program.pipeline = runner
    return program


# The stage programs a training step runs once per micro-batch (update runs once).
PER_MICROBATCH = ("forward", "backward", "last")


def with_shardings(tree, shardings):
    """ShapeDtypeStructs of an abstract tree, carrying their shardings."""
    return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), tree, shardings)


def describe(program: Program, groups: list[range], microbatches: int, schedule: str, virtual: int) -> str:
    """The stage table printed before a pipeline run."""
    anatomy = program.anatomy
    whole = sum(anatomy.stage_param_bytes)
    stages = len(anatomy.stage_param_bytes)
    chunks = f" x {virtual} virtual" if virtual > 1 else ""
    formula = "(S-1)/(V*M+S-1)" if virtual > 1 else "(S-1)/(M+S-1)"
    bubble, expected = anatomy.bubble_fraction, program.record["bubble_fraction"]
    said = (
        f"{formula} = {bubble:.1%}" if abs(bubble - expected) < 1e-9 else f"{bubble:.1%} ({formula} = {expected:.1%})"
    )
    lines = [
        f"pipeline ({schedule}): {stages} stages{chunks} x {microbatches} micro-batches of "
        f"{program.batch_size // microbatches}; bubble {said}"
    ]
    for s, (pb, ob) in enumerate(zip(anatomy.stage_param_bytes, anatomy.stage_optimizer_bytes, strict=True)):
        layers = ", ".join(f"{g.start}-{g.stop - 1}" for g in groups[s::stages])
        lines.append(
            f"  stage {s}: layers {layers}, parameters {pb:,} B per device "
            f"({pb / whole:.0%} of the model's {whole:,} B), optimizer {ob:,} B"
        )
    lines.append(f"  between stages: {program.record['bytes_between_stages_per_step']:,} B per step")
    return "\n".join(lines)
