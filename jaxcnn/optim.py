"""Optimisers and learning-rate schedules (optax)."""

from __future__ import annotations

import optax

from jaxcnn.config import OptimConfig


def make_schedule(config: OptimConfig, total_steps: int) -> optax.Schedule:
    warmup = min(config.warmup_steps, max(total_steps - 1, 0))
    if config.schedule == "constant":
        if warmup == 0:
            return optax.constant_schedule(config.learning_rate)
        return optax.join_schedules(
            [optax.linear_schedule(0.0, config.learning_rate, warmup), optax.constant_schedule(config.learning_rate)],
            [warmup],
        )
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.learning_rate,
        warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=0.0,
    )


def make_optimizer(config: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    schedule = make_schedule(config, total_steps)
    if config.name == "adam":
        return optax.adam(schedule)
    if config.name == "adamw":
        return optax.adamw(schedule, weight_decay=config.weight_decay)
    return optax.sgd(schedule, momentum=config.momentum or None)
