"""Optimisers and learning-rate schedules (optax)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcnn.config import ModelConfig, OptimConfig, TrainConfig, epoch_steps
from jaxcnn.errors import UserError
from jaxcnn.models.model_parts import BACKBONE, HEAD, part_names, part_of


def make_schedule(config: OptimConfig, total_steps: int) -> optax.Schedule:
    warmup = min(config.warmup_steps, max(total_steps - 1, 0))
    if config.schedule == "constant":
        if warmup == 0:
            return optax.constant_schedule(config.learning_rate)
        return optax.join_schedules(
            [
                optax.linear_schedule(config.warmup_from, config.learning_rate, warmup),
                optax.constant_schedule(config.learning_rate),
            ],
            [warmup],
        )
    return optax.warmup_cosine_decay_schedule(
        init_value=config.warmup_from,
        peak_value=config.learning_rate,
        warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=0.0,
    )


def make_optimizer(
    config: OptimConfig, total_steps: int, model: ModelConfig | None = None, rename: dict[str, str] | None = None
) -> optax.GradientTransformation:
    """The optimizer; with --freeze or --backbone-lr, its updates then scaled per part of the
    `model` (jaxcnn.models.model_parts), each parameter's part read from its path -- the
    model's, or `rename`d to it (a pipeline chunk's "units/0/conv/kernel")."""
    tx = _optimizer(config, total_steps)
    if not config.freeze and config.backbone_lr is None:
        return tx
    if not isinstance(model, ModelConfig):
        raise UserError("--freeze and --backbone-lr name the parts of jaxcnn's model families, not your own model's")
    parts = part_names(model)
    unknown = [p for p in config.freeze if p not in (BACKBONE, *parts)]
    if unknown:
        raise UserError(f"--freeze {unknown[0]!r}: {model.name}'s parts are {', '.join(parts)} (or 'backbone')")
    part, rename = part_of(model), rename or {}
    return optax.chain(tx, _scale_by_part(config, lambda path: part(rename.get(path, path))))


def _scale_by_part(config: OptimConfig, part_of_path: Callable[[str], str]) -> optax.GradientTransformation:
    """The final updates scaled per part: 0 where frozen (no step, no weight decay), the
    --backbone-lr / --learning-rate ratio on the backbone. The updates of sgd, adam and adamw
    are the learning rate times a direction, so the ratio gives the backbone the same
    schedule peaking at --backbone-lr, and the optimizer state keeps its one structure
    (optax.multi_transform's masked states would not: optax.tree_map_params, which places
    the optimizer state like the parameters, cannot see through them)."""
    ratio = 1.0 if config.backbone_lr is None else config.backbone_lr / config.learning_rate

    def factor(part: str) -> float:
        if part in config.freeze or (BACKBONE in config.freeze and part != HEAD):
            return 0.0
        return 1.0 if part == HEAD else ratio

    def scale(path, update):
        f = factor(part_of_path(_path(path)))
        return update if f == 1.0 else (jnp.zeros_like(update) if f == 0.0 else update * jnp.asarray(f, update.dtype))

    def update_fn(updates, state, params=None):
        return jax.tree_util.tree_map_with_path(scale, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def _path(path) -> str:
    """A key path to an array of an nnx.State (through its Variable's `value`) -> "blocks/0/conv1/kernel"."""
    return "/".join(str(k.key if hasattr(k, "key") else k.idx) for k in path if not hasattr(k, "name"))


def _optimizer(config: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    schedule = make_schedule(config, total_steps)
    if config.name == "adam":
        return optax.adam(schedule)
    if config.name == "adamw":
        return optax.adamw(schedule, weight_decay=config.weight_decay)
    return optax.sgd(schedule, momentum=config.momentum or None)


def apply_optimizer(tx: optax.GradientTransformation, grads, opt_state, params):
    """One optimizer update: (new params, new optimizer state).

    The barrier makes every gradient -- so every use of the old parameters in the forward
    and backward passes -- come before any parameter is overwritten. Without it nothing
    orders a kernel's last readers (the input-gradient dots and convolutions) before its
    in-place update, and XLA copies each donated kernel to keep the old value: at 224x224
    the 100352 x 256 dense kernel (103 MB) each step, about 4% of the step on CPU.
    """
    grads, params = jax.lax.optimization_barrier((grads, params))
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def optim_for_batch(config: OptimConfig, train: TrainConfig, batch_size: int) -> OptimConfig:
    """The optimizer settings for a global batch of `batch_size`.

    Linear scaling (Goyal et al. 2017, "Accurate, Large Minibatch SGD"): the learning rate
    grows with the batch, lr x batch / base_batch, and the warmup climbs from the base
    rate to it. A batch schedule without it scales the rate against the schedule's first
    batch, so a growing batch keeps lr / batch -- the noise scale -- as it was.
    """
    reference = train.base_batch if train.lr_scaling == "linear" else train.batch_sizes[0]
    factor = batch_size / reference
    if factor == 1 and train.lr_scaling == "none":
        return config
    warmup_from = min(config.learning_rate, config.learning_rate * factor) if train.lr_scaling == "linear" else 0.0
    return dataclasses.replace(config, learning_rate=config.learning_rate * factor, warmup_from=warmup_from)


def learning_rates(config: OptimConfig, train: TrainConfig, train_size: int) -> Callable[[np.ndarray], np.ndarray]:
    """steps (0-based) -> the learning rate each trains with, batch schedule included. The
    run's steps are evaluated together at the first call (optax's schedules are jnp: each
    evaluation is a string of eager ops) and looked up after that."""
    plan = epoch_steps(train_size, train)
    ends = np.cumsum(plan)
    steps_total = int(ends[-1]) if len(ends) else 0
    schedules = {b: make_schedule(optim_for_batch(config, train, b), steps_total) for b in train.batch_sizes}
    batch_of_epoch = np.array([train.batch_for_epoch(epoch) for epoch in range(len(plan))])

    def evaluated(steps: np.ndarray) -> np.ndarray:
        batches = batch_of_epoch[np.minimum(np.searchsorted(ends, steps, side="right"), len(plan) - 1)]
        out = np.zeros(len(steps))
        for batch, schedule in schedules.items():
            if (here := batches == batch).any():
                out[here] = np.asarray(schedule(steps[here]))
        return out

    @functools.cache
    def table() -> np.ndarray:
        return evaluated(np.arange(steps_total))

    def rates(steps: np.ndarray) -> np.ndarray:
        steps = np.asarray(steps, dtype=np.int64)
        if len(steps) and (steps.min() < 0 or steps.max() >= steps_total):
            return evaluated(steps)
        return table()[steps]

    return rates


def optimizer_shardings(tx: optax.GradientTransformation, abstract_opt_state, param_shardings, mesh: Mesh):
    """Optimizer state is placed like the parameters it mirrors; its scalars are replicated."""
    replicated = NamedSharding(mesh, P())
    return optax.tree_map_params(
        tx,
        lambda _, sharding: sharding,
        abstract_opt_state,
        param_shardings,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
