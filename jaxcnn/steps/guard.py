"""`skip_nonfinite`: a step whose loss or new parameters are NaN or infinite changes nothing."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcnn.steps.state import TrainState


def skipping_nonfinite(step):
    """`step`, keeping the old state (the step counter and data position still advance)
    when the loss or any new parameter is not finite; its metrics gain "skipped" (0 or 1).
    Costs holding both states during the step."""

    def guarded(state: TrainState, images, labels):
        new_state, metrics = step(state, images, labels)
        ok = jnp.isfinite(metrics["loss"])
        for leaf in jax.tree.leaves(new_state.params):
            ok &= jnp.all(jnp.isfinite(leaf))
        kept = jax.tree.map(lambda new, old: jnp.where(ok, new, old), new_state, state)
        return kept._replace(step=new_state.step), {**metrics, "skipped": (~ok).astype(jnp.int32)}

    return guarded
