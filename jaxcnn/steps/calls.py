"""Several optimizer steps in one compiled call (`--steps-per-call K`, Keras's
`steps_per_execution`): the train step K times over K batches (a `lax.scan`; on a CPU
written out K times) -- stacked [K, B, ...] from the host, or K index sets into the
training data held on the devices -- returning the K steps' metrics together (on the
devices: written into the epoch's log the calls carry). The host dispatches once per K
steps; each step inside is the single step's computation, so K calls of one step and one
call of K give the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from jaxcnn.steps.device_batch import as_pixels, augment_key, gather_rows, shift_and_flip


def over_steps(step: Callable, state, step_inputs, steps: int, unroll: bool):
    """`step` `steps` times, the state carried, each time on its slice of `step_inputs`
    ([steps, ...] leaves); the metrics stacked [steps]. One step: the step itself. `unroll`:
    the steps written out one after another instead of a loop -- XLA:CPU ran a train step
    inside a while loop several times slower than the same step outside one."""
    if steps == 1:
        state, metrics = step(state, jax.tree.map(lambda a: a[0], step_inputs))
        return state, jax.tree.map(lambda m: m[None], metrics)
    return jax.lax.scan(step, state, step_inputs, length=steps, unroll=steps if unroll else 1)


def steps_in_one_call(train_step: Callable, steps: int, unroll: bool = False) -> Callable:
    """`(state, images_KB, labels_KB) -> (state, metrics of [K])`: `steps` steps on stacked batches."""

    def call(state, images, labels):
        return over_steps(lambda st, batch: train_step(st, *batch), state, (images, labels), steps, unroll)

    return call


def steps_on_device_data(
    train_step: Callable, steps: int, mesh: Mesh, axes: tuple[str, ...], on_device,
    image_sharding: NamedSharding, label_sharding: NamedSharding, unroll: bool = False,
) -> Callable:  # fmt: skip
    """`(state, images_N, labels_N, epoch_rows, carry) -> (state, carry)`: each step gathers
    its batch from the training set on the devices (`on_device`: a
    jaxcnn.data.on_device.OnDevice) by its examples' indices, then shifts and flips it as
    drawn from its (epoch, batch index). Row r of `epoch_rows` [2S, B + 3] is the epoch's
    step r: its B indices, its epoch, its batch index and the epoch's step count (rows past
    the epoch: zeros). The `carry` (epoch_carry) is where the epoch stands: "row", the next
    row to run, and "log", each metric of the epoch's steps so far [2S]. The call runs rows
    row .. row + K -- those among them in the epoch; the others' results are dropped (an
    epoch's last call may hold fewer than K) -- writes their metrics into the log at their
    rows and hands back the carry after them. So a call needs no transfer from the host
    (the epoch's rows go once), and the host reads any number of calls' metrics from the
    latest call's log: one array a metric."""

    def call(state, images_N, labels_N, epoch_rows, carry):
        def one(st, step_row):
            idx, epoch, index = step_row[:-3], step_row[-3], step_row[-2]
            images = as_pixels(gather_rows(images_N, idx, mesh, axes), on_device.scale)
            images = shift_and_flip(images, augment_key(on_device.seed, epoch, index), on_device.shift, on_device.flip)
            images = jax.lax.with_sharding_constraint(images, image_sharding)
            labels = jax.lax.with_sharding_constraint(gather_rows(labels_N, idx, mesh, axes), label_sharding)
            return train_step(st, images, labels)

        def maybe(st, step_row):  # a row past the epoch: the step computed, its results dropped
            # (not a lax.cond: XLA:CPU ran a whole step inside a conditional ~25x slower)
            active = step_row[-2] < step_row[-1]
            new, metrics = one(st, step_row)
            kept = jax.tree.map(lambda a, b: jnp.where(active, a, b), new, st)
            return kept, jax.tree.map(lambda m: jnp.where(active, m, jnp.zeros_like(m)), metrics)

        cursor, log = carry["row"], carry["log"]
        rows = jax.lax.dynamic_slice_in_dim(epoch_rows, cursor, steps)
        state, metrics = over_steps(one if steps == 1 else maybe, state, rows, steps, unroll)
        log = {name: jax.lax.dynamic_update_slice_in_dim(log[name], metrics[name].astype(log[name].dtype), cursor, 0)
               for name in log}  # fmt: skip
        return state, {"row": cursor + steps, "log": log}

    return call


def epoch_carry(metrics: dict, epoch_rows: int, replicated: NamedSharding) -> dict:
    """The abstract carry of steps_on_device_data's calls: the next row, and a log [epoch_rows]
    of each of `metrics` (a step's metrics, abstract: the train step's eval_shape)."""
    log = {name: jax.ShapeDtypeStruct((epoch_rows,), m.dtype, sharding=replicated) for name, m in metrics.items()}
    return {"row": jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated), "log": log}
