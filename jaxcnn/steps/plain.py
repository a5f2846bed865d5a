"""The plain step and gradient accumulation: the batch's gradients, reduced over the batch
axes once per step, then one optimizer update.

- plain (`grad_accum=1`): one forward/backward; XLA all-reduces the gradients once.
- gradient accumulation (`grad_accum=K`): a `lax.scan` over K micro-batches. Written
  naively, GSPMD reduces each micro-batch's gradient inside the loop (K all-reduces; seen
  on XLA:CPU). Instead it is a `shard_map` over the batch's mesh axes only: each device
  sums its own shard's gradients over the K micro-batches, and one `pmean` after the loop
  is the step's only gradient reduction. Batch norm takes those axes as its `axis_name`,
  so its statistics are those of the whole micro-batch (`UpdateRule.batch_order` makes
  micro-batch k the same images on every layout).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax.sharding import PartitionSpec as P

from jaxcnn.optim import apply_optimizer
from jaxcnn.sharding.partition import constrain_sharding
from jaxcnn.steps.gradients import Gradients, StepContext, accumulate, loss_and_grads
from jaxcnn.steps.rule import UpdateRule, over_groups
from jaxcnn.steps.state import TrainState, step_key


class ShardBatch(NamedTuple):
    """What each data shard's accumulation takes."""

    params: Any
    model_state: Any
    key: Any
    images: Any
    labels: Any


def batch_gradients(ctx: StepContext, rule: UpdateRule, param_shardings, grad_shardings) -> Callable[..., Gradients]:
    """`(params, model_state, key, images, labels) -> Gradients` of the global batch, reduced
    over the batch axes: plain, or accumulated per data shard (module docstring)."""
    microbatches, axes = rule.config.grad_accum, rule.groups_axes
    if microbatches == 1:
        return functools.partial(loss_and_grads, ctx)
    shard_ctx = dataclasses.replace(ctx, layout=rule.inner_layout, norm_axis=axes, compute_shardings=None)
    whole, split = P(), P(axes or None)
    in_specs = ShardBatch(params=whole, model_state=whole, key=whole, images=split, labels=split)
    out_specs = Gradients(loss=whole, accuracy=whole, model_state=whole, grads=whole)

    def per_shard(shard: ShardBatch) -> Gradients:
        key = jax.random.fold_in(shard.key, jax.lax.axis_index(axes)) if axes else shard.key
        found = accumulate(
            shard_ctx, shard.params, shard.model_state, key, shard.images, shard.labels, microbatches, grad_shardings
        )
        if not axes:
            return found
        loss, accuracy, grads = jax.lax.pmean((found.loss, found.accuracy, found.grads), axes)  # the one reduction
        return found._replace(loss=loss, accuracy=accuracy, grads=grads)

    accumulated = over_groups(per_shard, ctx.mesh, axes, in_specs, out_specs)

    def gradients(params, model_state, key, images, labels) -> Gradients:
        if ctx.compute_shardings is not None:  # FSDP: gather once, outside the loop
            params = constrain_sharding(params, ctx.compute_shardings)
        found = accumulated(ShardBatch(params, model_state, key, images, labels))
        return found._replace(grads=constrain_sharding(found.grads, param_shardings))  # FSDP: back to the owners

    return gradients


def make_plain_step(ctx: StepContext, rule: UpdateRule, param_shardings, grad_shardings):
    """`(state, images, labels) -> (state, metrics)`: the batch's gradients, one update."""
    gradients = batch_gradients(ctx, rule, param_shardings, grad_shardings)

    def plain(state: TrainState, images, labels):
        found = gradients(state.params, state.model_state, step_key(state), images, labels)
        params, opt_state = apply_optimizer(ctx.tx, found.grads, state.opt_state, state.params)
        new_state = state._replace(
            step=state.step + 1, params=params, model_state=found.model_state, opt_state=opt_state
        )
        return new_state, {"loss": found.loss, "accuracy": found.accuracy}

    return plain
