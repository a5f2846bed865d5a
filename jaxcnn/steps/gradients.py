"""One batch's loss and gradients: a forward/backward (`loss_and_grads`), or a sum over
micro-batches in a `lax.scan` (`accumulate`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from jaxcnn.models import call, cross_entropy
from jaxcnn.sharding.layouts import Layout
from jaxcnn.sharding.partition import activation_layout, constrain_sharding
from jaxcnn.steps.state import split_model


@dataclass(frozen=True)
class StepContext:
    graphdef: nnx.GraphDef
    tx: optax.GradientTransformation
    mesh: Mesh
    layout: Layout  # the activations' layout inside this computation
    compute_shardings: Any  # FSDP: where parameters live for compute (gathered); else None
    norm_axis: tuple[str, ...] = ()  # batch norm's axis_name: statistics over the shard_map's shards
    gather_params: Any = None  # inside a shard_map: params -> params gathered whole over its axes (FSDP)


class Gradients(NamedTuple):
    """One batch's mean loss and accuracy, the model state after it, and the gradients."""

    loss: Any
    accuracy: Any
    model_state: Any
    grads: Any


def loss_and_grads(ctx: StepContext, params, model_state, key, images, labels) -> Gradients:
    """One forward/backward of the batch."""

    def loss_fn(params):
        if ctx.gather_params is not None:  # autodiff reduce-scatters the gradient back to the shards
            params = ctx.gather_params(params)
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
    return Gradients(loss, accuracy, model_state, grads)


def accumulate(
    ctx: StepContext, params, model_state, key, images, labels, microbatches: int, grad_shardings
) -> Gradients:
    """Sum of `microbatches` micro-batches' gradients (lax.scan), divided by their number;
    mean loss and accuracy. `grad_shardings` pins the accumulator where the gradients are
    computed."""
    if microbatches == 1:
        return loss_and_grads(ctx, params, model_state, key, images, labels)
    xs = images.reshape(microbatches, -1, *images.shape[1:])
    ys = labels.reshape(microbatches, -1)

    def body(carry, micro):
        total, model_state, loss_sum, accuracy_sum = carry
        k, x, y = micro
        own = params
        if ctx.gather_params is not None:
            # tied to the micro-batch, so XLA cannot hoist the gather out of the loop and keep
            # the whole parameters for every micro-batch: each gathers its own
            own, x = jax.lax.optimization_barrier((params, x))
        loss, accuracy, model_state, grads = loss_and_grads(ctx, own, model_state, jax.random.fold_in(key, k), x, y)
        total = constrain_sharding(jax.tree.map(jnp.add, total, grads), grad_shardings)
        return (total, model_state, loss_sum + loss, accuracy_sum + accuracy), None

    zeros = constrain_sharding(jax.tree.map(jnp.zeros_like, params), grad_shardings)
    init = (zeros, model_state, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))
    (total, model_state, loss_sum, accuracy_sum), _ = jax.lax.scan(body, init, (jnp.arange(microbatches), xs, ys))
    grads = jax.tree.map(lambda g: g / microbatches, total)
    return Gradients(loss_sum / microbatches, accuracy_sum / microbatches, model_state, grads)
