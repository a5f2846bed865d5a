"""What every train step carries from step to step, and the model split into it."""

from __future__ import annotations

from typing import NamedTuple

import jax
import optax
from flax import nnx


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: nnx.State  # local SGD: every leaf has a leading replica dim
    model_state: nnx.State  # BatchNorm running statistics (empty without batch norm)
    opt_state: optax.OptState
    rng: jax.Array  # uint32 key data; step k's dropout key is fold_in(rng, k)
    history: tuple = ()  # staleness T: the parameters of steps k-T .. k-1, oldest first


def split_model(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    return nnx.split(model, nnx.Param, ...)


def step_key(state: TrainState) -> jax.Array:
    """This step's dropout key: the same for a step whatever the layout."""
    return jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
