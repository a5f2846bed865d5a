"""SPMD programs: one jitted program over the whole mesh for every layout but the pipeline.

Abstract shapes -> shardings from the layout's table -> AOT-compiled init, train and eval
steps; nothing is allocated. `init` is `jit(init, out_shardings)`: each device creates
its own shards, the model is never built on one device and scattered. The layout reaches
the model only through these shardings and `activation_layout` (jaxcnn.steps.gradients).
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcnn import platform_choices
from jaxcnn.compiling import Compilation, compile_with, kernel_record
from jaxcnn.data.on_device import batch_axes
from jaxcnn.errors import UserError
from jaxcnn.models import build_model, resolve_kernels
from jaxcnn.optim import make_optimizer, optimizer_shardings
from jaxcnn.program import (
    Anatomy,
    CompiledPart,
    LazyCompiled,
    Program,
    ProgramSpec,
    StepCall,
    StepCalls,
    call_name,
)
from jaxcnn.saved_model import ModelVariables, flat_variables
from jaxcnn.sharding import axes as ax
from jaxcnn.sharding.partition import (
    bytes_per_device,
    data_sharding,
    place_variables,
    quiet_fallbacks,
)
from jaxcnn.sharding.placement import BatchPlacement
from jaxcnn.steps import (
    ReplicaAveraging,
    StepContext,
    TrainState,
    average_replicas,
    eval_step,
    evaluated_variables,
    initial_history,
    make_train_step,
    replica_shardings,
    replicate,
    split_model,
    update_rule,
)
from jaxcnn.steps.calls import epoch_carry, steps_in_one_call, steps_on_device_data


def build_spmd_program(spec: ProgramSpec) -> Program:
    """Shapes -> shardings -> compiled init, train and eval steps."""
    layout, mesh, image_shape, seed, update = spec.layout, spec.mesh, spec.image_shape, spec.seed, spec.update
    batch_size, eval_batch_size = spec.batch_size, spec.eval_batch_size
    platform = mesh.devices.flat[0].platform
    model_config = resolve_kernels(spec.model_config, platform)
    tx = make_optimizer(spec.optim_config, spec.total_steps, model_config)
    rule = update_rule(update, layout, mesh)
    replicas = rule.groups if update.local else 0

    def init() -> TrainState:
        _, params, model_state = split_model(build_model(model_config, image_shape, seed))
        rng = jax.random.key_data(jax.random.key(seed + 1))
        opt_state = tx.init(params)
        if replicas:  # local SGD: every replica starts from the same parameters
            params, model_state, opt_state = replicate((params, model_state, opt_state), replicas)
        history = initial_history(params, update.staleness)
        return TrainState(jnp.zeros((), jnp.int32), params, model_state, opt_state, rng, history)

    graphdef, abstract_params, abstract_stats = split_model(
        nnx.eval_shape(lambda: build_model(model_config, image_shape, seed))
    )
    abstract = jax.eval_shape(init)

    # --- shard: every array's placement, from the layout's rules ----------------------
    replicated = NamedSharding(mesh, P())
    param_shardings, placements = place_variables(abstract_params, layout, mesh)
    compute_shardings, compute_placements = None, placements
    if layout.fsdp:  # FSDP: where parameters live for compute (gathered)
        with quiet_fallbacks():  # the same fallbacks were just reported
            compute_shardings, compute_placements = place_variables(abstract_params, layout.compute_layout(), mesh)
    stat_shardings, stat_placements = place_variables(abstract_stats, layout, mesh)
    opt_shardings = optimizer_shardings(tx, jax.eval_shape(tx.init, abstract_params), param_shardings, mesh)
    grad_shardings = compute_shardings if compute_shardings is not None else param_shardings
    if replicas:  # each leaf gains a leading replica dim, split over the replica axes
        param_shardings, stat_shardings, opt_shardings = replica_shardings(
            (param_shardings, stat_shardings, opt_shardings), rule.groups_axes
        )
    state_shardings = TrainState(
        step=replicated,
        params=param_shardings,
        model_state=stat_shardings,
        opt_state=opt_shardings,
        rng=replicated,
        history=(param_shardings,) * update.staleness,
    )
    image_sharding = data_sharding(ax.IMAGE_BHWC, layout, mesh)  # train and eval batches alike
    vector_sharding = data_sharding((ax.BATCH,), layout, mesh)  # labels, the eval mask

    # --- compile: one program per step kind, ahead of time ----------------------------
    start = time.perf_counter()
    abstract_state = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), abstract, state_shardings
    )
    pixels = jnp.dtype(spec.image_dtype)  # uint8: scaled in the step (jaxcnn.models.call)
    images = jax.ShapeDtypeStruct((batch_size, *image_shape), pixels, sharding=image_sharding)
    labels = jax.ShapeDtypeStruct((batch_size,), jnp.int32, sharding=vector_sharding)
    eval_input = BatchPlacement(
        images=jax.ShapeDtypeStruct((eval_batch_size, *image_shape), pixels, sharding=image_sharding),
        labels=jax.ShapeDtypeStruct((eval_batch_size,), jnp.int32, sharding=vector_sharding),
        mask=jax.ShapeDtypeStruct((eval_batch_size,), jnp.float32, sharding=vector_sharding),
    )
    context = StepContext(graphdef, tx, mesh, layout, compute_shardings)
    train_step = make_train_step(context, rule, param_shardings, grad_shardings)
    # --- several steps per call; batches gathered from data on the devices ---------------
    unroll = platform == "cpu"  # jaxcnn.steps.calls.over_steps: XLA:CPU's loops run a step slower
    carry = None  # the on-device calls' carry: the next row, the epoch's metrics so far
    if spec.on_device is not None:
        epoch_rows = 2 * (spec.on_device.size // batch_size)
        carry = epoch_carry(jax.eval_shape(train_step, abstract_state, images, labels)[1], epoch_rows, replicated)

    def lower_call(steps: int, on_device: bool):
        if on_device:
            stored = spec.on_device
            held = NamedSharding(mesh, P(batch_axes(layout, mesh) or None))
            inputs = (
                jax.ShapeDtypeStruct((stored.rows, *stored.image_shape), jnp.dtype(stored.dtype), sharding=held),
                jax.ShapeDtypeStruct((stored.rows,), jnp.int32, sharding=held),
                jax.ShapeDtypeStruct((epoch_rows, batch_size + 3), jnp.int32, sharding=replicated),
                carry,
            )
            call = steps_on_device_data(
                train_step, steps, mesh, batch_axes(layout, mesh), stored, image_sharding, vector_sharding, unroll
            )
        else:
            inputs = tuple(
                jax.ShapeDtypeStruct(
                    (steps, *a.shape), a.dtype, sharding=NamedSharding(mesh, P(None, *a.sharding.spec))
                )
                for a in (images, labels)
            )
            call = steps_in_one_call(train_step, steps, unroll)
        jitted = jax.jit(
            call, in_shardings=(state_shardings, *jax.tree.map(lambda a: a.sharding, inputs)),
            out_shardings=(state_shardings, replicated), donate_argnums=0,
        )  # fmt: skip
        return jitted.lower(abstract_state, *inputs)

    compilation = Compilation(platform)  # the step first: on a GPU the others reuse its tuned kernels
    host_train = jax.jit(
        train_step,
        in_shardings=(state_shardings, image_sharding, vector_sharding),
        out_shardings=(state_shardings, replicated),
        donate_argnums=0,
    )
    step_options = (
        platform_choices.step_compiler_options(platform) if spec.compiler_options is None else spec.compiler_options
    )
    if spec.on_device is None:
        compilation.lower("train", host_train, abstract_state, images, labels)
    else:  # the loop gathers its batches on the devices: the host-fed step compiles only if it is called
        compilation.add(call_name(1, True), lower_call(1, True))
    if replicas:
        compilation.lower(
            "average",
            jax.jit(average_replicas, in_shardings=(state_shardings,), out_shardings=state_shardings, donate_argnums=0),
            abstract_state,
        )
    if spec.with_eval:
        compilation.lower(
            "eval",
            jax.jit(
                lambda state, x, y, m: eval_step(graphdef, layout, mesh, bool(replicas), state, x, y, m),
                in_shardings=(state_shardings, image_sharding, vector_sharding, vector_sharding),
                out_shardings=(replicated, replicated, replicated),
            ),
            abstract_state, *eval_input.arrays,
        )  # fmt: skip
    if spec.with_init:
        compilation.lower("init", jax.jit(init, out_shardings=state_shardings))

    if replicas and (spec.steps_per_call > 1):
        raise UserError("--steps-per-call applies to every update rule but local SGD (its replicas meet between steps)")
    ahead = [(1, True)] if spec.on_device else []
    if spec.steps_per_call > 1:
        ahead.append((spec.steps_per_call, bool(spec.on_device)))
        compilation.add(call_name(*ahead[-1]), lower_call(*ahead[-1]))
    compiled = compilation.compile({"init": platform_choices.init_compiler_options(platform)}, default=step_options)
    lower_seconds = time.perf_counter() - start - compilation.seconds
    calls = StepCalls(
        lower_call, step_options, {key: StepCall(compiled[call_name(*key)], *key) for key in ahead}, carry
    )  # fmt: skip

    def model_variables(state: TrainState) -> ModelVariables:
        params, stats = evaluated_variables(state, bool(replicas))  # local SGD: the replicas' average, as evaluated
        return ModelVariables(flat_variables(params), flat_variables(stats))

    program = Program(
        spec=spec,
        init=compiled.get("init"),
        train_step=compiled["train"] if "train" in compiled else LazyCompiled(
            lambda: compile_with(host_train.lower(abstract_state, images, labels), step_options)
        ),
        eval_step=compiled.get("eval"),
        train_input=BatchPlacement(images=images, labels=labels, order=rule.batch_order(batch_size)),
        eval_input=eval_input,
        anatomy=Anatomy(
            # what runs each step: with the data on the devices, the step that gathers its batch
            stages=[[CompiledPart("train", compiled.get("train") or compiled[call_name(1, True)], 1, mesh.size)]],
            placements=placements + stat_placements,
            compute_placements=compute_placements,
            stage_param_bytes=[bytes_per_device((abstract_state.params, abstract_state.model_state))],
            stage_optimizer_bytes=[bytes_per_device(abstract_state.opt_state)],
        ),
        num_params=sum(math.prod(p.shape) for p in placements),
        compile_seconds=compilation.seconds,
        lower_seconds=lower_seconds,
        abstract_state=abstract_state,
        state_shardings=state_shardings,
        averaging=ReplicaAveraging(compiled["average"], update.sync_every) if replicas else None,
        calls=calls,
        model_variables=model_variables,
        compile_timings=compilation.timings,
    )
    program.record["kernels"] = kernel_record(model_config, step_options)
    return program
