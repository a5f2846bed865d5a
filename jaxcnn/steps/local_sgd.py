"""Local SGD (`sync="local-sgd"`), all of it: R replicas, each a group of devices holding
whole parameters (`UpdateRule.groups_axes`), step alone and meet every H steps.

The state gains a leading replica dim on every parameter, statistic and optimizer leaf,
split over the replica axes (`replicate`, `replica_shardings`). The step is a `shard_map`
over those axes in which each replica updates on its own shard of the batch -- no
reduction at all but the loss and accuracy scalars; `average_replicas`, a separate
compiled program run as `ReplicaAveraging` says, is the only communication over them.
Evaluation and the saved model read the replicas' average (`evaluated_variables`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcnn.optim import apply_optimizer
from jaxcnn.steps.gradients import StepContext, accumulate
from jaxcnn.steps.rule import UpdateRule, over_groups
from jaxcnn.steps.state import TrainState, step_key


class ReplicaInputs(NamedTuple):
    """What each replica's step takes: its own variables, the step's key, its batch shard."""

    params: Any
    model_state: Any
    opt_state: Any
    key: Any
    images: Any
    labels: Any


class ReplicaOutputs(NamedTuple):
    """What each replica's step gives back: its variables, and the replicas' mean metrics."""

    params: Any
    model_state: Any
    opt_state: Any
    loss: Any
    accuracy: Any


def make_local_step(ctx: StepContext, rule: UpdateRule, grad_shardings):
    """`(state, images, labels) -> (state, metrics)`: every replica one update of its own."""
    axes = rule.groups_axes
    inner = dataclasses.replace(ctx, layout=rule.inner_layout)
    whole, split = P(), P(axes)
    in_specs = ReplicaInputs(params=split, model_state=split, opt_state=split, key=whole, images=split, labels=split)
    out_specs = ReplicaOutputs(params=split, model_state=split, opt_state=split, loss=whole, accuracy=whole)

    def replica(inputs: ReplicaInputs) -> ReplicaOutputs:
        # this device group's replica: its leading replica dim is 1 here
        params, model_state, opt_state = jax.tree.map(
            lambda a: a[0], (inputs.params, inputs.model_state, inputs.opt_state)
        )
        key = jax.random.fold_in(inputs.key, jax.lax.axis_index(axes))
        found = accumulate(
            inner, params, model_state, key, inputs.images, inputs.labels, rule.config.grad_accum, grad_shardings
        )
        params, opt_state = apply_optimizer(ctx.tx, found.grads, opt_state, params)
        params, model_state, opt_state = jax.tree.map(lambda a: a[None], (params, found.model_state, opt_state))
        return ReplicaOutputs(params, model_state, opt_state, *jax.lax.pmean((found.loss, found.accuracy), axes))

    replicas_step = over_groups(replica, ctx.mesh, axes, in_specs, out_specs)

    def local(state: TrainState, images, labels):
        out = replicas_step(
            ReplicaInputs(state.params, state.model_state, state.opt_state, step_key(state), images, labels)
        )
        new_state = state._replace(
            step=state.step + 1, params=out.params, model_state=out.model_state, opt_state=out.opt_state
        )
        return new_state, {"loss": out.loss, "accuracy": out.accuracy}

    return local


def replicate(tree, replicas: int):
    """Every leaf stacked `replicas` times along a new leading dim (identical replicas)."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (replicas, *x.shape)), tree)


def replica_shardings(shardings, axes: tuple[str, ...]):
    """A tree of shardings for leaves with a new leading replica dim, split over `axes`, the
    rest as before."""
    return jax.tree.map(lambda s: NamedSharding(s.mesh, P(axes, *s.spec)), shardings)


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


@dataclass(frozen=True)
class ReplicaAveraging:
    """When the replicas meet: `average` (average_replicas, compiled) after every `every`
    steps, and after the run's last step."""

    average: Any  # jax.stages.Compiled: (state) -> state
    every: int

    def after_step(self, state: TrainState, steps_taken: int, total_steps: int) -> TrainState:
        """The state after `steps_taken` of the run's `total_steps`: averaged when due."""
        if steps_taken % self.every == 0 or steps_taken == total_steps:
            return self.average(state)
        return state
