"""Stale gradients (`staleness=T`): the gradient is taken on the parameters of T steps ago
(a shift register of T parameter copies in the state) and applied to the current ones, as
an asynchronous parameter server applies a worker's late push."""

from __future__ import annotations

from jaxcnn.optim import apply_optimizer
from jaxcnn.steps.gradients import StepContext
from jaxcnn.steps.plain import batch_gradients
from jaxcnn.steps.rule import UpdateRule
from jaxcnn.steps.state import TrainState, step_key


def initial_history(params, staleness: int) -> tuple:
    """The shift register at step 0: the starting parameters, T times."""
    return (params,) * staleness


def make_stale_step(ctx: StepContext, rule: UpdateRule, param_shardings, grad_shardings):
    """`(state, images, labels) -> (state, metrics)`: p[k+1] = update(p[k], grad at p[k-T])."""
    gradients = batch_gradients(ctx, rule, param_shardings, grad_shardings)

    def stale(state: TrainState, images, labels):
        found = gradients(state.history[0], state.model_state, step_key(state), images, labels)
        params, opt_state = apply_optimizer(ctx.tx, found.grads, state.opt_state, state.params)
        new_state = state._replace(
            step=state.step + 1, params=params, model_state=found.model_state, opt_state=opt_state,
            history=(*state.history[1:], state.params),
        )  # fmt: skip
        return new_state, {"loss": found.loss, "accuracy": found.accuracy}

    return stale
