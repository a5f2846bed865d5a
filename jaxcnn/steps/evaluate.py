"""The eval step: sums of the loss and of the correct predictions over a padded batch."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxcnn.models import call, cross_entropy
from jaxcnn.sharding.layouts import Layout
from jaxcnn.sharding.partition import activation_layout
from jaxcnn.steps.local_sgd import evaluated_variables
from jaxcnn.steps.state import TrainState


def eval_step(graphdef, layout: Layout, mesh: Mesh, local: bool, state: TrainState, images, labels, mask):
    """(loss sum, correct sum, predictions) of the examples `mask` marks (the rest is padding)."""
    params, model_state = evaluated_variables(state, local)
    model = nnx.merge(graphdef, params, model_state)
    with activation_layout(layout, mesh):
        logits = call(model, images, train=False)
    predictions = jnp.argmax(logits, -1)
    loss_sum = jnp.sum(cross_entropy(logits, labels) * mask)
    correct_sum = jnp.sum((predictions == labels) * mask)
    return loss_sum, correct_sum, predictions
