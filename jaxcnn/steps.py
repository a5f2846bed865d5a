"""The train step's update rules: plain, gradient accumulation, local SGD, stale gradients.

Every variant is one pure function `(state, images, labels) -> (state, metrics)` that
`jaxcnn.spmd.build_spmd_program` jits with the layout's shardings, so each works under every
layout unchanged. What differs is where the gradient reduction over the batch axes sits:

- plain (`grad_accum=1`, `sync="allreduce"`): XLA all-reduces the gradients once.
- gradient accumulation (`grad_accum=K`): a `lax.scan` over K micro-batches. Written
  naively, GSPMD reduces each micro-batch's gradient inside the loop (K all-reduces; seen
  on XLA:CPU). Instead the step is a `shard_map` over the batch's mesh axes only (the
  layout's other axes -- model, spatial -- stay XLA's): each device sums its own shard's
  gradients over the K micro-batches, and one `pmean` after the loop is the step's only
  gradient reduction. Batch norm takes those axes as its `axis_name`, so its statistics
  are those of the whole micro-batch.
- local SGD (`sync="local-sgd"`): the same `shard_map`, over the replica axes, but each
  replica keeps its own parameters and optimizer state (a leading replica dim) and
  updates alone -- no reduction at all; `average_replicas`, a separate compiled program
  run every H steps, is the only communication over those axes.
- stale gradients (`staleness=T`): the gradient is taken on the parameters of T steps ago
  (a shift register of T parameter copies in the state) and applied to the current ones,
  as an asynchronous parameter server applies a worker's late push.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcnn.config import UpdateConfig
from jaxcnn.errors import UserError
from jaxcnn.models import call, cross_entropy
from jaxcnn.optim import apply_optimizer
from jaxcnn.sharding import axes as ax
from jaxcnn.sharding.layouts import Layout
from jaxcnn.sharding.partition import activation_layout, constrain_sharding


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: nnx.State  # local SGD: every leaf has a leading replica dim
    model_state: nnx.State  # BatchNorm running statistics (empty without batch norm)
    opt_state: optax.OptState
    rng: jax.Array  # uint32 key data; step k's dropout key is fold_in(rng, k)
    history: tuple = ()  # staleness T: the parameters of steps k-T .. k-1, oldest first


def split_model(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    return nnx.split(model, nnx.Param, ...)


@dataclass(frozen=True)
class UpdatePlan:
    """How the configured update rule maps onto this layout and mesh."""

    config: UpdateConfig
    groups_axes: tuple[str, ...]  # the axes the step shard_maps over (data shards or replicas)
    groups: int  # D (accumulation) or R (local SGD): the product of those axes
    inner_layout: Layout  # the layout inside the shard_map: its batch rule less those axes

    def batch_order(self, batch_size: int) -> np.ndarray | None:
        """Host-side order of a global batch for gradient accumulation, or None.

        Each device takes its K micro-batches from its own block of the batch, so micro-
        batch k would be the k-th slice of every block: a different set of images for
        every data-axis size. Ordered by this permutation first, micro-batch k is global
        images [k*B/K, (k+1)*B/K) under every layout -- which batch norm's statistics
        see -- and no image crosses devices."""
        k, d = self.config.grad_accum, self.groups
        if k == 1 or d == 1 or self.config.local:
            return None
        return np.arange(batch_size).reshape(k, d, batch_size // (k * d)).transpose(1, 0, 2).reshape(-1)


def plan_updates(config: UpdateConfig, layout: Layout, mesh: Mesh) -> UpdatePlan:
    """Check that the update rule fits the layout and mesh; say how it maps. (The batch's
    divisibility is `jaxcnn.sharding.mesh.ParallelDims.validate`'s.)"""
    batch_axes = layout.axes_for(ax.BATCH) or ()
    live = [a for a in batch_axes if mesh.shape.get(a, 1) > 1]
    param_axes = {a for _, axes in layout.params for a in axes} | set(layout.fsdp)
    if config.local:
        # a replica is a group of devices holding whole parameters: axes the batch is split
        # over but no parameter is (FSDP's axis holds shards of one replica, not replicas)
        groups_axes = tuple(a for a in live if a not in param_axes)
        if not groups_axes:
            raise UserError(
                f"--sync local-sgd needs a mesh axis of 2+ devices that splits the batch but not the parameters "
                f"(layout {layout.name} on mesh {dict(mesh.shape)} has none); use dp or hybrid with data=2 or more"
            )
    else:
        groups_axes = tuple(live)
    groups = math.prod(mesh.shape[a] for a in groups_axes)
    inner = layout.with_batch_axes(tuple(a for a in batch_axes if a not in groups_axes))
    return UpdatePlan(config, groups_axes, groups, inner)


# --- one forward/backward -----------------------------------------------------------------


@dataclass(frozen=True)
class StepContext:
    graphdef: nnx.GraphDef
    tx: optax.GradientTransformation
    mesh: Mesh
    layout: Layout  # the activations' layout inside this computation
    compute_shardings: Any  # FSDP: where parameters live for compute (gathered); else None
    norm_axis: tuple[str, ...] = ()  # batch norm's axis_name: statistics over the shard_map's shards


def loss_and_grads(ctx: StepContext, params, model_state, key, images, labels):
    """(mean loss, accuracy, new model state, gradients) of one batch."""

    def loss_fn(params):
        if ctx.compute_shardings is not None:
            # FSDP: gather each parameter whole for compute. The constraint's transpose
            # makes its gradient arrive whole too, then be reduce-scattered to the owner
            # shards -- ZeRO-3 -- instead of letting XLA spread the kernels' split into
            # the activations.
            params = constrain_sharding(params, ctx.compute_shardings)
        model = nnx.merge(ctx.graphdef, params, model_state, copy=True)  # fresh Variables: BN mutates them
        if ctx.norm_axis:
            for _, module in nnx.iter_modules(model):
                if isinstance(module, nnx.BatchNorm):
                    module.axis_name = ctx.norm_axis
        with activation_layout(ctx.layout, ctx.mesh):
            logits = call(model, images, train=True, rngs=nnx.Rngs(dropout=key))
        _, _, new_model_state = split_model(model)
        return cross_entropy(logits, labels).mean(), (logits, new_model_state)

    (loss, (logits, model_state)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    accuracy = jnp.mean(jnp.argmax(logits, -1) == labels)
    return loss, accuracy, model_state, grads


def accumulate(ctx: StepContext, params, model_state, key, images, labels, microbatches: int, grad_shardings):
    """Sum of `microbatches` micro-batches' gradients (lax.scan); mean loss and accuracy.
    `grad_shardings` pins the accumulator where the gradients are computed."""
    if microbatches == 1:
        return loss_and_grads(ctx, params, model_state, key, images, labels)
    xs = images.reshape(microbatches, -1, *images.shape[1:])
    ys = labels.reshape(microbatches, -1)

    def body(carry, micro):
        total, model_state, loss_sum, accuracy_sum = carry
        k, x, y = micro
        loss, accuracy, model_state, grads = loss_and_grads(ctx, params, model_state, jax.random.fold_in(key, k), x, y)
        total = constrain_sharding(jax.tree.map(jnp.add, total, grads), grad_shardings)
        return (total, model_state, loss_sum + loss, accuracy_sum + accuracy), None

    zeros = constrain_sharding(jax.tree.map(jnp.zeros_like, params), grad_shardings)
    init = (zeros, model_state, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
    (total, model_state, loss_sum, accuracy_sum), _ = jax.lax.scan(body, init, (jnp.arange(microbatches), xs, ys))
    grads = jax.tree.map(lambda g: g / microbatches, total)
    return loss_sum / microbatches, accuracy_sum / microbatches, model_state, grads


# --- the step variants ----------------------------------------------------------------------


def make_train_step(ctx: StepContext, plan: UpdatePlan, param_shardings, grad_shardings):
    """The pure train step for `plan`. `param_shardings` are the parameters' own
    placements; `grad_shardings` where a gradient lives as computed (FSDP: gathered)."""
    config = plan.config
    inner = dataclasses.replace(ctx, layout=plan.inner_layout)
    manual = plan.groups_axes  # the shard_map's axes: inside it, each device group sees its own shard
    whole, split = P(), P(manual or None)

    def over_groups(f, in_specs, out_specs):
        if not manual:  # one group: nothing to map over
            return f
        return jax.shard_map(
            f, mesh=ctx.mesh, in_specs=in_specs, out_specs=out_specs, axis_names=set(manual), check_vma=False
        )

    def plain(state: TrainState, images, labels):
        key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        at = state.history[0] if config.staleness else state.params  # stale: T steps old
        if config.grad_accum == 1:
            loss, accuracy, model_state, grads = loss_and_grads(ctx, at, state.model_state, key, images, labels)
        else:
            # per data shard: each device sums its own shard's gradients over the K
            # micro-batches; the pmean after the loop is the step's one reduction
            if ctx.compute_shardings is not None:  # FSDP: gather once, outside the loop
                at = constrain_sharding(at, ctx.compute_shardings)

            def shard(params, model_state, key, x, y):
                shard_ctx = dataclasses.replace(inner, norm_axis=manual, compute_shardings=None)
                key = jax.random.fold_in(key, jax.lax.axis_index(manual)) if manual else key
                loss, accuracy, model_state, grads = accumulate(
                    shard_ctx, params, model_state, key, x, y, config.grad_accum, grad_shardings
                )
                if manual:
                    loss, accuracy, grads = jax.lax.pmean((loss, accuracy, grads), manual)
                return loss, accuracy, model_state, grads

            loss, accuracy, model_state, grads = over_groups(shard, (whole, whole, whole, split, split), (whole,) * 4)(
                at, state.model_state, key, images, labels
            )
            grads = constrain_sharding(grads, param_shardings)  # FSDP: back to the owners
        params, opt_state = apply_optimizer(ctx.tx, grads, state.opt_state, state.params)
        history = (*state.history[1:], state.params) if config.staleness else ()
        new_state = TrainState(state.step + 1, params, model_state, opt_state, state.rng, history)
        return new_state, {"loss": loss, "accuracy": accuracy}

    def local(state: TrainState, images, labels):
        key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)

        def replica(params, model_state, opt_state, key, x, y):
            # this device group's replica: its leading replica dim is 1 here
            params, model_state, opt_state = jax.tree.map(lambda a: a[0], (params, model_state, opt_state))
            key = jax.random.fold_in(key, jax.lax.axis_index(manual))
            loss, accuracy, model_state, grads = accumulate(
                inner, params, model_state, key, x, y, config.grad_accum, grad_shardings
            )
            params, opt_state = apply_optimizer(ctx.tx, grads, opt_state, params)
            params, model_state, opt_state = jax.tree.map(lambda a: a[None], (params, model_state, opt_state))
            return params, model_state, opt_state, *jax.lax.pmean((loss, accuracy), manual)

        params, model_state, opt_state, loss, accuracy = over_groups(
            replica, (split, split, split, whole, split, split), (split, split, split, whole, whole)
        )(state.params, state.model_state, state.opt_state, key, images, labels)
        new_state = TrainState(state.step + 1, params, model_state, opt_state, state.rng)
        return new_state, {"loss": loss, "accuracy": accuracy}

    step = local if config.local else plain
    if not config.skip_nonfinite:
        return step

    def guarded(state: TrainState, images, labels):
        # keep the old state (the step counter and data position still advance) when the
        # loss or any new parameter is NaN/inf; costs holding both states during the step
        new_state, metrics = step(state, images, labels)
        ok = jnp.isfinite(metrics["loss"])
        for leaf in jax.tree.leaves(new_state.params):
            ok &= jnp.all(jnp.isfinite(leaf))
        kept = jax.tree.map(lambda new, old: jnp.where(ok, new, old), new_state, state)
        return kept._replace(step=new_state.step), {**metrics, "skipped": (~ok).astype(jnp.int32)}

    return guarded


# --- local SGD: replicated state and its averaging ---------------------------------------


def replica_sharding(sharding: NamedSharding, axes: tuple[str, ...]) -> NamedSharding:
    """A leaf with a new leading replica dim, split over `axes`, the rest as before."""
    return NamedSharding(sharding.mesh, P(axes, *sharding.spec))


def replicate(tree, replicas: int):
    """Every leaf stacked `replicas` times along a new leading dim (identical replicas)."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (replicas, *x.shape)), tree)


def average_replicas(state: TrainState) -> TrainState:
    """Parameters and batch-norm statistics averaged over the replicas (one all-reduce
    over the replica axes); each replica's optimizer state stays its own."""

    def mean(x):
        return jnp.broadcast_to(x.mean(0, keepdims=True, dtype=x.dtype), x.shape)

    return state._replace(params=jax.tree.map(mean, state.params), model_state=jax.tree.map(mean, state.model_state))


def evaluated_variables(state: TrainState, local: bool) -> tuple[nnx.State, nnx.State]:
    """The parameters and statistics to evaluate: local SGD's replicas averaged."""
    if not local:
        return state.params, state.model_state
    return jax.tree.map(lambda x: x.mean(0), state.params), jax.tree.map(lambda x: x.mean(0), state.model_state)


def eval_step(graphdef, layout: Layout, mesh: Mesh, local: bool, state: TrainState, images, labels, mask):
    params, model_state = evaluated_variables(state, local)
    model = nnx.merge(graphdef, params, model_state)
    with activation_layout(layout, mesh):
        logits = call(model, images, train=False)
    predictions = jnp.argmax(logits, -1)
    loss_sum = jnp.sum(cross_entropy(logits, labels) * mask)
    correct_sum = jnp.sum((predictions == labels) * mask)
    return loss_sum, correct_sum, predictions
