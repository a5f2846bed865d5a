"""The plain step and gradient accumulation: the batch's gradients, reduced over the batch
axes once per step, then one optimizer update.

- plain (`grad_accum=1`): one forward/backward; XLA all-reduces the gradients once.
- gradient accumulation (`grad_accum=K`): a `lax.scan` over K micro-batches. Written
  naively, GSPMD reduces each micro-batch's gradient inside the loop (K all-reduces; seen
  on XLA:CPU). Instead it is a `shard_map` over the batch's mesh axes only: each device
  sums its own shard's gradients over the K micro-batches, and one `pmean` after the loop
  is the step's only gradient reduction -- but for FSDP's split parameters, gathered and
  reduce-scattered a micro-batch at a time so that they and their accumulator stay
  shards (below). Batch norm takes those axes as its `axis_name`,
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
    owned = jax.tree.map(lambda s: _manual_spec(s.spec, axes), param_shardings)  # FSDP's shards, else P()
    inner_shardings = jax.tree.map(lambda s: _without(s, axes), grad_shardings)
    shard_ctx = dataclasses.replace(
        ctx,
        layout=rule.inner_layout,
        norm_axis=axes,
        compute_shardings=None,
        gather_params=(lambda params: jax.tree.map(_gather, params, owned)) if _splits(owned) else None,
    )
    whole, split = P(), P(axes or None)
    in_specs = ShardBatch(params=owned, model_state=whole, key=whole, images=split, labels=split)
    out_specs = Gradients(loss=whole, accuracy=whole, model_state=whole, grads=owned)
    group = rule.groups

    def reduce(grad, spec):
        """The batch's mean gradient: a shard's arrives summed over the devices that own its
        pieces (the gather's transpose, a reduce-scatter); the rest is summed here."""
        rest = tuple(a for a in axes if a not in _named(spec))
        return (jax.lax.psum(grad, rest) if rest else grad) / group

    def per_shard(shard: ShardBatch) -> Gradients:
        key = jax.random.fold_in(shard.key, jax.lax.axis_index(axes)) if axes else shard.key
        found = accumulate(
            shard_ctx, shard.params, shard.model_state, key, shard.images, shard.labels, microbatches, inner_shardings
        )
        if not axes:
            return found
        loss, accuracy = jax.lax.pmean((found.loss, found.accuracy), axes)
        grads = jax.tree.map(reduce, found.grads, owned)  # the one reduction of the whole-parameter gradients
        return found._replace(loss=loss, accuracy=accuracy, grads=grads)

    accumulated = over_groups(per_shard, ctx.mesh, axes, in_specs, out_specs)

    def gradients(params, model_state, key, images, labels) -> Gradients:
        if ctx.compute_shardings is not None:  # gathered whole but over the shard_map's axes
            params = constrain_sharding(params, jax.tree.map(_compute_sharding, ctx.compute_shardings, owned))
        found = accumulated(ShardBatch(params, model_state, key, images, labels))
        return found._replace(grads=constrain_sharding(found.grads, param_shardings))

    return gradients


# FSDP under accumulation: a parameter split over the shard_map's axes enters as its own
# shard, is gathered whole for each micro-batch's forward and backward, and its gradient
# comes back reduce-scattered to the shard (the gather's transpose), so the accumulator is
# a shard too: what ZeRO-3 and torch FSDP do, at one gather and one reduce-scatter a
# micro-batch.


def _named(spec: P) -> set[str]:
    return {a for entry in spec for a in _axes(entry)}


def _manual_spec(spec: P, axes: tuple[str, ...]) -> P:
    """`spec` keeping only the shard_map's axes: how the shard_map takes the array in."""
    return P(*(_entry(tuple(a for a in _axes(e) if a in axes)) for e in spec))


def _without(sharding, axes: tuple[str, ...]):
    """A NamedSharding less the shard_map's axes: what is left to XLA inside it."""
    return sharding.update(spec=P(*(_entry(tuple(a for a in _axes(e) if a not in axes)) for e in sharding.spec)))


def _entry(axes: tuple[str, ...]):
    return axes if len(axes) > 1 else (axes[0] if axes else None)


def _axes(entry) -> tuple[str, ...]:
    return () if not entry else (entry if isinstance(entry, tuple) else (entry,))


def _compute_sharding(compute, owned: P):
    """Where a parameter enters the shard_map: split over its axes as it is owned (`owned`),
    over the others as compute wants it."""
    rank = max(len(owned), len(compute.spec))
    pad = lambda spec: (*spec, *[None] * (rank - len(spec)))  # noqa: E731
    kept = [_axes(own) + tuple(a for a in _axes(want) if a not in _named(owned))
            for own, want in zip(pad(owned), pad(compute.spec), strict=True)]  # fmt: skip
    return compute.update(spec=P(*map(_entry, kept)))


def _splits(specs) -> bool:
    return any(_named(s) for s in jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)))


def _gather(param, spec: P):
    for dim, entry in enumerate(spec):
        if entry:
            param = jax.lax.all_gather(param, entry, axis=dim, tiled=True)
    return param


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
