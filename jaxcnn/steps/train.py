"""The train step for an update rule: its family's step, guarded when asked."""

from __future__ import annotations

from jaxcnn.steps.gradients import StepContext
from jaxcnn.steps.guard import skipping_nonfinite
from jaxcnn.steps.local_sgd import make_local_step
from jaxcnn.steps.plain import make_plain_step
from jaxcnn.steps.rule import UpdateRule
from jaxcnn.steps.stale import make_stale_step


def make_train_step(ctx: StepContext, rule: UpdateRule, param_shardings, grad_shardings):
    """The pure `(state, images, labels) -> (state, metrics)` for `rule`. `param_shardings`
    are the parameters' own placements; `grad_shardings` where a gradient lives as
    computed (FSDP: gathered)."""
    config = rule.config
    if config.local:
        step = make_local_step(ctx, rule, grad_shardings)
    elif config.staleness:
        step = make_stale_step(ctx, rule, param_shardings, grad_shardings)
    else:
        step = make_plain_step(ctx, rule, param_shardings, grad_shardings)
    return skipping_nonfinite(step) if config.skip_nonfinite else step
