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
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcnn import platform_choices
from jaxcnn.compiling import Compilation, kernel_record
from jaxcnn.pipeline.schedule import (
    ChunkPrograms,
    PipelineState,
    ScheduleRunner,
    StageState,
    bubble_fraction,
    held_in_flight,
    timeline_bubble,
)
from jaxcnn.pipeline.stages import (
    ChunkFunctions,
    PipelineCut,
    PlacedChunks,
    cut_model,
    place_chunks,
    replicated,
    with_shardings,
)
from jaxcnn.pipeline.state import StateForms
from jaxcnn.program import Anatomy, CompiledPart, Program, ProgramSpec
from jaxcnn.saved_model import ModelVariables, flat_variables
from jaxcnn.sharding import axes as ax
from jaxcnn.sharding.layouts import DP
from jaxcnn.sharding.partition import data_sharding
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
    `stage_split` None: balanced by FLOPs): the model cut, the chunks placed, their
    programs lowered and compiled, then the Program and its report."""
    # a pipeline always compiles init, and has no update rule but its micro-batches (jaxcnn.build checks)
    start = time.perf_counter()
    cut = cut_model(spec, microbatches, stage_split, schedule, virtual_stages)
    placed = place_chunks(cut)
    batch = _BatchShardings.of(cut)
    lowered = _lower(cut, placed, batch)  # lowered as the stages are built: their time is in the build's total
    compiled = _compile(cut, lowered)
    compiled.lower_seconds = time.perf_counter() - start - compiled.compilation.seconds
    return _assemble(cut, placed, batch, lowered.boundaries, compiled, schedule, virtual_stages)


@dataclass(frozen=True)
class _BatchShardings:
    """Where a step's batch and an evaluation's arrive: the images on the first stage, the
    labels on the last; grouped [M, micro, ...], each micro-batch split over `data`."""

    images: NamedSharding
    labels: NamedSharding
    grouped_images: NamedSharding
    grouped_labels: NamedSharding

    @classmethod
    def of(cls, cut: PipelineCut) -> _BatchShardings:
        first, last = cut.meshes[0], cut.meshes[-1]
        micro_spec = lambda n: P(None, ax.DATA, *([None] * n)) if ax.DATA in first.shape else P()  # noqa: E731
        return cls(
            data_sharding(ax.IMAGE_BHWC, DP, first), data_sharding((ax.BATCH,), DP, last),
            NamedSharding(first, micro_spec(3)), NamedSharding(last, micro_spec(0)),
        )  # fmt: skip


@dataclass(frozen=True)
class _Boundary:
    """How chunk c's activations arrive, and what a device holds of one micro-batch's."""

    x_sharding: NamedSharding
    y_sharding: NamedSharding
    eval_x_sharding: NamedSharding | None
    x_bytes: int
    y_bytes: int


@dataclass
class _Lowered:
    chunks: list[dict[str, Any]]  # per chunk: program name -> lowered
    shared: dict[str, Any]  # "group_images", "group_labels", "tail" (with evaluation)
    boundaries: list[_Boundary]


def _lower(cut: PipelineCut, placed: PlacedChunks, batch: _BatchShardings) -> _Lowered:
    """Every chunk's programs (`ChunkPrograms`' fields) and the step's shared ones, lowered."""
    spec, fns, rep = cut.spec, ChunkFunctions(cut, placed), replicated(cut)
    chunks, boundaries = [], []
    for c, sub in enumerate(cut.meshes):
        sh = placed.shardings[c]
        in_shape = (cut.microbatches, cut.micro, *spec.image_shape) if c == 0 else placed.act_shapes[c - 1].shape
        x_sh = batch.grouped_images if c == 0 else cut.on(sub, in_shape)
        y_sh = cut.on(sub, placed.act_shapes[c].shape)
        chunks.append(_lower_chunk(cut, placed, fns, c, x_sh, y_sh, rep[c], batch.grouped_labels))
        e_sh = None
        if spec.with_eval:
            e_sh = batch.images if c == 0 else cut.on(sub, (spec.eval_batch_size, *in_shape[1:]))
            chunks[-1]["eval"] = _lower_eval(cut, placed, fns, c, e_sh)
        chunks[-1]["init"] = jax.jit(lambda c=c: cut.init_chunk(c), out_shardings=sh).lower()
        x_bytes = placed.act_bytes[c - 1] // cut.data_ways if c > 0 else 0
        boundaries.append(_Boundary(x_sh, y_sh, e_sh, x_bytes, placed.act_bytes[c] // cut.data_ways))
    return _Lowered(chunks, _lower_shared(cut, fns, batch, rep[-1]), boundaries)


def _lower_chunk(cut, placed, fns: ChunkFunctions, c: int, x_sh, y_sh, rep, labels_sh) -> dict[str, Any]:
    """Chunk c's training programs: forward and backward (the last chunk: `last`), update,
    zeros, and on chunk 0 the step's key."""
    sh, state, act = placed.shardings[c], placed.abstract[c], placed.act_shapes
    params_sds, stats_sds = with_shardings(state.params, sh.params), with_shardings(state.stats, sh.stats)
    in_shape = (cut.microbatches, cut.micro, *cut.spec.image_shape) if c == 0 else act[c - 1].shape
    x_sds = jax.ShapeDtypeStruct(in_shape, cut.pixels if c == 0 else cut.act_dtype, sharding=x_sh)
    dy_sds = jax.ShapeDtypeStruct(act[c].shape, cut.act_dtype, sharding=y_sh)
    key_sds = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep)
    mb_sds = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
    opt_sds = with_shardings(state.opt_state, sh.opt_state)
    wrap = jax.random.wrap_key_data
    prog = {}
    if c < cut.chunks - 1:
        prog["forward"] = (
            jax.jit(lambda p, st, x, mb, k: fns.forward(c, p, st, x, mb, wrap(k)), out_shardings=(y_sh, sh.stats))
            .lower(params_sds, stats_sds, x_sds, mb_sds, key_sds)
        )  # fmt: skip
        prog["backward"] = (
            jax.jit(lambda p, st, x, mb, k, dy, acc: fns.backward(c, p, st, x, mb, wrap(k), dy, acc),
                    out_shardings=(sh.params, x_sh if c > 0 else None), donate_argnums=(6,))
            .lower(params_sds, stats_sds, x_sds, mb_sds, key_sds, dy_sds, params_sds)
        )  # fmt: skip
        prog["update"] = jax.jit(
            lambda p, o, g: fns.update(c, p, o, g), out_shardings=(sh.params, sh.opt_state), donate_argnums=(0, 1)
        ).lower(params_sds, opt_sds, params_sds)
        prog["zeros"] = jax.jit(lambda: fns.zeros(c), out_shardings=sh.params).lower()
    else:
        labels_sds = jax.ShapeDtypeStruct((cut.microbatches, cut.micro), jnp.int32, sharding=labels_sh)
        totals_sds = (
            jax.ShapeDtypeStruct((), jnp.float32, sharding=rep),
            jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
        )
        prog["last"] = (
            jax.jit(lambda p, st, x, y, mb, k, acc, t: fns.last_backward(p, st, x, y, mb, wrap(k), acc, t),
                    out_shardings=(sh.params, x_sh if c > 0 else None, sh.stats, (rep, rep)), donate_argnums=(6,))
            .lower(params_sds, stats_sds, x_sds, labels_sds, mb_sds, key_sds, params_sds, totals_sds)
        )  # fmt: skip
        prog["update"] = jax.jit(
            fns.update_last, out_shardings=(sh.params, sh.opt_state, rep), donate_argnums=(0, 1)
        ).lower(params_sds, opt_sds, params_sds, totals_sds)
        prog["zeros"] = jax.jit(lambda: fns.zeros(c), out_shardings=(sh.params, (rep, rep))).lower()
    if c == 0:
        step_sds = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
        prog["step_key"] = jax.jit(fns.step_key, out_shardings=(rep, rep)).lower(key_sds, step_sds)
    return prog


def _lower_eval(cut: PipelineCut, placed: PlacedChunks, fns: ChunkFunctions, c: int, e_sh) -> Any:
    """Chunk c's evaluation: its forward on an evaluation batch, whole."""
    spec, sh, state = cut.spec, placed.shardings[c], placed.abstract[c]
    e_shape = (spec.eval_batch_size, *(spec.image_shape if c == 0 else placed.act_shapes[c - 1].shape[1:]))
    e_sds = jax.ShapeDtypeStruct(e_shape, cut.pixels if c == 0 else cut.act_dtype, sharding=e_sh)
    e_out = (spec.eval_batch_size, *placed.act_shapes[c].shape[1:])
    return jax.jit(
        lambda p, st, x: fns.apply(c, p, st, x, False, None)[0], out_shardings=cut.on(cut.meshes[c], e_out)
    ).lower(with_shardings(state.params, sh.params), with_shardings(state.stats, sh.stats), e_sds)


def _lower_shared(cut: PipelineCut, fns: ChunkFunctions, batch: _BatchShardings, rep_last) -> dict[str, Any]:
    """The step's regrouping of its batch, and the evaluation's loss on the last stage."""
    spec, m, micro = cut.spec, cut.microbatches, cut.micro
    shared = {
        "group_images": jax.jit(lambda x: x.reshape(m, micro, *spec.image_shape), out_shardings=batch.grouped_images)
        .lower(jax.ShapeDtypeStruct((spec.batch_size, *spec.image_shape), cut.pixels, sharding=batch.images)),
        "group_labels": jax.jit(lambda y: y.reshape(m, micro), out_shardings=batch.grouped_labels)
        .lower(jax.ShapeDtypeStruct((spec.batch_size,), jnp.int32, sharding=batch.labels)),
    }  # fmt: skip
    if spec.with_eval:
        eval_size, classes = spec.eval_batch_size, cut.model_config.num_classes
        logits_sds = jax.ShapeDtypeStruct(
            (eval_size, classes), cut.act_dtype, sharding=cut.on(cut.meshes[-1], (eval_size, classes))
        )
        vec, fvec = _eval_vectors(cut, batch)
        shared["tail"] = jax.jit(fns.eval_loss, out_shardings=(rep_last,) * 3).lower(logits_sds, vec, fvec)
    return shared


def _eval_vectors(cut: PipelineCut, batch: _BatchShardings):
    """An evaluation batch's labels and mask, on the last stage."""
    size = cut.spec.eval_batch_size
    return (jax.ShapeDtypeStruct((size,), jnp.int32, sharding=batch.labels),
            jax.ShapeDtypeStruct((size,), jnp.float32, sharding=batch.labels))  # fmt: skip


@dataclass
class _Compiled:
    chunks: list[dict[str, Any]]  # per chunk: program name -> compiled
    shared: dict[str, Any]
    compilation: Compilation
    step_options: dict
    lower_seconds: float = 0.0


def _compile(cut: PipelineCut, lowered: _Lowered) -> _Compiled:
    """Every program compiled together (init with the platform's init options)."""
    platform, spec = cut.platform, cut.spec
    init_options = platform_choices.init_compiler_options(platform)
    step_options = (
        platform_choices.step_compiler_options(platform) if spec.compiler_options is None else spec.compiler_options
    )
    compilation = Compilation(platform)
    options = {}
    for c, programs in enumerate(lowered.chunks):
        for name, low in programs.items():
            compilation.add((c, name), low)
            if name == "init":
                options[(c, name)] = init_options
    for name, low in lowered.shared.items():
        compilation.add(name, low)
    compiled = compilation.compile(options, default=step_options)
    chunks = [{} for _ in lowered.chunks]
    for key, program in compiled.items():
        if isinstance(key, tuple):
            chunks[key[0]][key[1]] = program
    shared = {name: compiled[name] for name in lowered.shared}
    return _Compiled(chunks, shared, compilation, step_options)


def _assemble(cut, placed, batch, boundaries, compiled: _Compiled, schedule: str, virtual_stages: int) -> Program:
    """The Program: the schedule's runner over the compiled chunks, the state's forms, what
    analysis reads (Anatomy), the run record's stage table and the printed description."""
    spec, m, num_stages, chunks = cut.spec, cut.microbatches, cut.num_stages, cut.chunks
    rep = replicated(cut)
    programs = [ChunkPrograms(**compiled.chunks[c], **vars(boundaries[c])) for c in range(chunks)]
    serial = cut.platform == "cpu" and jax.process_count() > 1
    shared = compiled.shared
    runner = ScheduleRunner(
        programs, rep, m, spec.seed, shared["group_images"], shared["group_labels"], shared.get("tail"), cut.timeline,
        serial,
    )  # fmt: skip
    scalar = lambda dtype, shape=(): jax.ShapeDtypeStruct(shape, dtype, sharding=rep[0])  # noqa: E731
    abstract_stages = PipelineState(
        scalar(jnp.int32),
        tuple(StageState(with_shardings(st.params, sh.params), with_shardings(st.stats, sh.stats),
                         with_shardings(st.opt_state, sh.opt_state))
              for st, sh in zip(placed.abstract, placed.shardings, strict=True)),
        scalar(jnp.uint32, (2,)),
    )  # fmt: skip
    forms = StateForms.of(cut.model_config, spec.image_shape, cut.groups)
    data_ways, act_bytes = cut.data_ways, placed.act_bytes
    per_step = [
        [part for c in range(g, chunks, num_stages) for part in (
            *(CompiledPart(name, programs[c][name], m, data_ways, False) for name in PER_MICROBATCH
              if programs[c][name] is not None),
            CompiledPart("update", programs[c].update, 1, data_ways))]
        for g in range(num_stages)
    ]  # fmt: skip
    per_stage = lambda per_chunk: [sum(per_chunk[g::num_stages]) for g in range(num_stages)]  # noqa: E731
    vec, fvec = _eval_vectors(cut, batch)
    program = Program(
        spec=spec,
        init=runner.init,
        train_step=runner.train_step,
        eval_step=runner.eval_step,
        train_input=BatchPlacement(
            images=jax.ShapeDtypeStruct((spec.batch_size, *spec.image_shape), cut.pixels, sharding=batch.images),
            labels=jax.ShapeDtypeStruct((spec.batch_size,), jnp.int32, sharding=batch.labels),
        ),
        eval_input=BatchPlacement(
            images=jax.ShapeDtypeStruct((spec.eval_batch_size, *spec.image_shape), cut.pixels, sharding=batch.images),
            labels=vec,
            mask=fvec,
        ),
        anatomy=Anatomy(
            stages=per_step,
            placements=placed.placements,
            compute_placements=placed.placements,
            stage_param_bytes=per_stage(placed.param_bytes),
            stage_optimizer_bytes=per_stage(placed.opt_bytes),
            # per stage, what it sends a step from its chunks (activations forward, gradients back)
            boundary_bytes=per_stage([2 * m * b // data_ways for b in act_bytes[:-1]] + [0]),
            boundary_transfers=2 * m * virtual_stages if chunks > 1 else 0,
            # the schedule's own idle share: the formula's but for looped GPipe with M < S
            bubble_fraction=timeline_bubble(cut.timeline),
            stage_held_bytes=held_in_flight(cut.timeline, [p.x_bytes for p in programs], [p.y_bytes for p in programs]),
            microbatches=m,
            layer_groups=cut.groups,
        ),
        num_params=sum(math.prod(r.shape) for r in placed.placements if not r.path.endswith(("mean", "var"))),
        compile_seconds=compiled.compilation.seconds,
        lower_seconds=compiled.lower_seconds,
        compile_timings=compiled.compilation.timings,
        abstract_state=forms.whole(abstract_stages),
        saved_form=forms.whole,
        from_saved=lambda state: forms.stages(state, like=abstract_stages),
    )
    program.record = {
        "stages": [list(g) for g in cut.groups],  # per chunk (chunk c on stage c mod S)
        "microbatches": m,
        "pipeline_schedule": schedule,
        "virtual_stages": virtual_stages,
        "bubble_fraction": bubble_fraction(num_stages, m, virtual_stages),  # the formula's
        "timeline_bubble_fraction": program.anatomy.bubble_fraction,
        "stage_param_bytes_per_device": placed.param_bytes,
        "stage_optimizer_bytes_per_device": placed.opt_bytes,
        "bytes_between_stages_per_step": 2 * m * sum(act_bytes[:-1]),  # whole arrays, every boundary
        "kernels": kernel_record(cut.model_config, compiled.step_options),
    }
    program.description = describe(program, cut.groups, m, schedule, virtual_stages)

    def model_variables(state: PipelineState) -> ModelVariables:
        whole = forms.whole(state)
        return ModelVariables(flat_variables(whole.params), flat_variables(whole.model_state))

    program.model_variables = model_variables
    program.pipeline = runner
    return program


# The stage programs a training step runs once per micro-batch (update runs once).
PER_MICROBATCH = ("forward", "backward", "last")


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
