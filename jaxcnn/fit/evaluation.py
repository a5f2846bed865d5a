"""An epoch's evaluation: each process evaluates its own rows of the test set with the
epoch's program, batches dispatched ahead of their results."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from jaxcnn.data import Dataset, EvalShare
from jaxcnn.program import Program


@dataclass
class Evaluation:
    loss: float | None  # None when the data has no labels
    accuracy: float | None
    predictions: np.ndarray


EVAL_IN_FLIGHT = 4  # evaluation batches dispatched ahead of the first one not yet finished


def eval_share(program: Program, dataset: Dataset | EvalShare) -> EvalShare:
    """The part of `dataset` this process evaluates with `program` (read and decoded now)."""
    if isinstance(dataset, EvalShare):
        return dataset
    return EvalShare(dataset, program.eval_input.batch_size, program.eval_input.share.rows)


def eval_shares(programs: dict[int, Program], test_set: Dataset | None) -> dict[int, EvalShare]:
    """Each program's share of the test set (by id(program)), read (decoded) once, before
    training. Programs of a batch schedule that evaluate the same rows share one; where they
    differ, the set is decoded once, whole, and each takes its rows from memory."""
    if test_set is None:
        return {}
    key = {id(p): (p.eval_input.batch_size, p.eval_input.share.rows.tobytes()) for p in programs.values()}
    if len(set(key.values())) > 1 and not test_set.in_memory:
        test_set = test_set.loaded()
    shares: dict = {}
    for p in programs.values():
        if key[id(p)] not in shares:
            shares[key[id(p)]] = eval_share(p, test_set)
    return {id(p): shares[key[id(p)]] for p in programs.values()}


def evaluate(program: Program, state, dataset: Dataset | EvalShare) -> Evaluation:
    """Every process evaluates its own rows of each batch (`EvalShare`). Batches dispatched
    ahead of their results (at most EVAL_IN_FLIGHT unfinished, so the placed inputs stay
    few): the devices do not wait on the host between evaluation batches; the sums and
    predictions come back in one transfer at the end."""
    share = eval_share(program, dataset)
    outputs = []
    for images, labels, mask in share.batches():
        outputs.append(program.eval_step(state, *program.eval_input.place_rows(images, labels, mask)))
        if len(outputs) > EVAL_IN_FLIGHT:
            jax.block_until_ready(outputs[-EVAL_IN_FLIGHT - 1])
    outputs = jax.device_get(outputs)
    loss_sum = sum(float(loss) for loss, _, _ in outputs)
    correct_sum = sum(float(correct) for _, correct, _ in outputs)
    predictions = share.predictions([np.asarray(p) for _, _, p in outputs])
    if not share.labelled:
        return Evaluation(None, None, predictions)
    return Evaluation(loss_sum / len(share), correct_sum / len(share), predictions)
