"""The train step's update rules, one module per family -- plain and gradient accumulation
(plain), stale gradients (stale), local SGD (local_sgd) -- each a pure function
`(state, images, labels) -> (state, metrics)` that `jaxcnn.spmd` jits with the layout's
shardings, so each works under every layout unchanged; the skip of non-finite steps
(guard), the eval step (evaluate). Where a family maps over device groups by hand, its
`shard_map`'s specs are NamedTuples named for the arguments and results."""

from jaxcnn.steps.evaluate import eval_step
from jaxcnn.steps.gradients import Gradients, StepContext, accumulate, loss_and_grads
from jaxcnn.steps.local_sgd import (
    ReplicaAveraging,
    average_replicas,
    evaluated_variables,
    replica_shardings,
    replicate,
)
from jaxcnn.steps.rule import UpdateRule, update_rule
from jaxcnn.steps.stale import initial_history
from jaxcnn.steps.state import TrainState, split_model
from jaxcnn.steps.train import make_train_step

__all__ = [
    "Gradients",
    "ReplicaAveraging",
    "StepContext",
    "TrainState",
    "UpdateRule",
    "accumulate",
    "average_replicas",
    "eval_step",
    "evaluated_variables",
    "initial_history",
    "loss_and_grads",
    "make_train_step",
    "replica_shardings",
    "replicate",
    "split_model",
    "update_rule",
]
