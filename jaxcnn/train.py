"""Sharded training: state born sharded, one jitted pure step, the fit loop.

    program = build_program(...)   # abstract shapes -> shardings -> AOT-compiled steps
    state = program.init()         # jit(init, out_shardings): each device makes its part
    result = fit(program, state, train_set, test_set, ...)

The layout reaches the model only through the shardings and `activation_layout`.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from jaxcnn.compiling import compile_all, cpu_init_options
from jaxcnn.config import ModelConfig, OptimConfig, TrainConfig
from jaxcnn.data import Dataset, Prefetcher, eval_batches, to_global, train_batches
from jaxcnn.errors import UserError
from jaxcnn.models import build_model, cross_entropy
from jaxcnn.optim import make_optimizer
from jaxcnn.sharding import axes as ax
from jaxcnn.sharding.layouts import Layout
from jaxcnn.sharding.partition import (
    ParamPlacement,
    activation_layout,
    data_sharding,
    optimizer_shardings,
    place_variables,
)


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: nnx.State
    model_state: nnx.State  # BatchNorm running statistics (empty without batch norm)
    opt_state: optax.OptState
    rng: jax.Array  # uint32 key data; step k's dropout key is fold_in(rng, k)


@dataclass
class Program:
    """Everything compiled for one (model, layout, mesh, batch size)."""

    graphdef: nnx.GraphDef
    layout: Layout
    mesh: Mesh
    batch_size: int
    eval_batch_size: int
    state_shardings: TrainState
    abstract_state: TrainState  # ShapeDtypeStructs carrying their shardings
    batch_shardings: tuple[NamedSharding, NamedSharding]  # train (images, labels)
    eval_shardings: tuple[NamedSharding, NamedSharding, NamedSharding]  # (images, labels, mask)
    placements: list[ParamPlacement]  # parameters, then model state (BN statistics)
    compute_placements: list[ParamPlacement]  # parameters as used for compute (FSDP: gathered)
    num_params: int
    init: Callable[[], TrainState] | None  # compiled: () -> state, each device creating its own shards
    train_step: Any  # compiled: (state, images, labels) -> (state, metrics)
    eval_step: (
        Any  # compiled: (state, images, labels, mask) -> (loss_sum, correct_sum, predictions); None without with_eval
    )
    compile_seconds: float


def _split(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    return nnx.split(model, nnx.Param, ...)


def _train_step(graphdef, tx, layout, mesh, compute_shardings, state: TrainState, images, labels):
    key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)

    def loss_fn(params):
        if compute_shardings is not None:
            # FSDP: gather each parameter whole for compute. The constraint's transpose
            # makes its gradient arrive whole too, then be reduce-scattered to the owner
            # shards -- ZeRO-3 -- instead of letting XLA spread the kernels' split into
            # the activations.
            params = jax.lax.with_sharding_constraint(params, compute_shardings)
        model = nnx.merge(graphdef, params, state.model_state, copy=True)  # fresh Variables: BN mutates them
        with activation_layout(layout, mesh):
            logits = model(images, train=True, rngs=nnx.Rngs(dropout=key))
        _, _, model_state = _split(model)
        return cross_entropy(logits, labels).mean(), (logits, model_state)

    (loss, (logits, model_state)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": loss, "accuracy": jnp.mean(jnp.argmax(logits, -1) == labels)}
    return TrainState(state.step + 1, params, model_state, opt_state, state.rng), metrics


def _eval_step(graphdef, layout, mesh, state: TrainState, images, labels, mask):
    model = nnx.merge(graphdef, state.params, state.model_state)
    with activation_layout(layout, mesh):
        logits = model(images, train=False)
    predictions = jnp.argmax(logits, -1)
    loss_sum = jnp.sum(cross_entropy(logits, labels) * mask)
    correct_sum = jnp.sum((predictions == labels) * mask)
    return loss_sum, correct_sum, predictions


def build_program(
    model_config: ModelConfig,
    optim_config: OptimConfig,
    layout: Layout,
    mesh: Mesh,
    image_shape: tuple[int, int, int],
    batch_size: int,
    total_steps: int,
    seed: int = 0,
    eval_batch_size: int | None = None,
    with_eval: bool = True,
    with_init: bool = True,
) -> Program:
    """Shapes -> shardings -> compiled init, train and eval steps. Nothing is allocated.
    `with_eval` / `with_init` False skip compiling those (training without a test set;
    cost inspection and planning, which only read the train step)."""
    eval_batch_size = eval_batch_size or batch_size
    tx = make_optimizer(optim_config, total_steps)

    def init() -> TrainState:
        _, params, model_state = _split(build_model(model_config, image_shape, seed))
        rng = jax.random.key_data(jax.random.key(seed + 1))
        return TrainState(jnp.zeros((), jnp.int32), params, model_state, tx.init(params), rng)

    graphdef = nnx.graphdef(nnx.eval_shape(lambda: build_model(model_config, image_shape, seed)))
    abstract = jax.eval_shape(init)

    # --- shard: every array's placement, from the layout's rules ----------------------
    replicated = NamedSharding(mesh, P())
    param_shardings, placements = place_variables(abstract.params, layout, mesh)
    compute_shardings, compute_placements = None, placements
    if layout.lookup(ax.PARAMS)[0]:  # FSDP: where parameters live for compute (gathered)
        gathered = dataclasses.replace(layout, rules=tuple(r for r in layout.rules if r[0] != ax.PARAMS))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the same fallbacks were just reported
            compute_shardings, compute_placements = place_variables(abstract.params, gathered, mesh)
    stat_shardings, stat_placements = place_variables(abstract.model_state, layout, mesh)
    state_shardings = TrainState(
        step=replicated,
        params=param_shardings,
        model_state=stat_shardings,
        opt_state=optimizer_shardings(tx, abstract.opt_state, param_shardings, mesh),
        rng=replicated,
    )
    image_sharding = data_sharding(ax.IMAGE_BHWC, (batch_size, *image_shape), layout, mesh, "global batch")
    label_sharding = data_sharding((ax.BATCH,), (batch_size,), layout, mesh, "global batch")
    eval_image_sharding = data_sharding(ax.IMAGE_BHWC, (eval_batch_size, *image_shape), layout, mesh, "eval batch")
    eval_vector_sharding = data_sharding((ax.BATCH,), (eval_batch_size,), layout, mesh, "eval batch")

    # --- compile: one program per step kind, ahead of time ----------------------------
    start = time.perf_counter()
    abstract_state = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), abstract, state_shardings
    )
    images = jax.ShapeDtypeStruct((batch_size, *image_shape), jnp.float32, sharding=image_sharding)
    labels = jax.ShapeDtypeStruct((batch_size,), jnp.int32, sharding=label_sharding)
    lowered = {
        "train": jax.jit(
            lambda state, x, y: _train_step(graphdef, tx, layout, mesh, compute_shardings, state, x, y),
            in_shardings=(state_shardings, image_sharding, label_sharding),
            out_shardings=(state_shardings, replicated),
            donate_argnums=0,
        ).lower(abstract_state, images, labels)
    }
    if with_eval:
        eval_images = jax.ShapeDtypeStruct((eval_batch_size, *image_shape), jnp.float32, sharding=eval_image_sharding)
        eval_labels = jax.ShapeDtypeStruct((eval_batch_size,), jnp.int32, sharding=eval_vector_sharding)
        eval_mask = jax.ShapeDtypeStruct((eval_batch_size,), jnp.float32, sharding=eval_vector_sharding)
        lowered["eval"] = jax.jit(
            lambda state, x, y, m: _eval_step(graphdef, layout, mesh, state, x, y, m),
            in_shardings=(state_shardings, eval_image_sharding, eval_vector_sharding, eval_vector_sharding),
            out_shardings=(replicated, replicated, replicated),
        ).lower(abstract_state, eval_images, eval_labels, eval_mask)
    if with_init:
        lowered["init"] = jax.jit(init, out_shardings=state_shardings).lower()
    compiled = compile_all(lowered, {"init": cpu_init_options(mesh)})
    compile_seconds = time.perf_counter() - start

    return Program(
        graphdef=graphdef,
        layout=layout,
        mesh=mesh,
        batch_size=batch_size,
        eval_batch_size=eval_batch_size,
        state_shardings=state_shardings,
        abstract_state=abstract_state,
        batch_shardings=(image_sharding, label_sharding),
        eval_shardings=(eval_image_sharding, eval_vector_sharding, eval_vector_sharding),
        placements=placements + stat_placements,
        compute_placements=compute_placements,
        num_params=sum(math.prod(p.shape) for p in placements),
        init=compiled.get("init"),
        train_step=compiled["train"],
        eval_step=compiled.get("eval"),
        compile_seconds=compile_seconds,
    )


def plan_placements(
    model_config: ModelConfig, layout: Layout, mesh: Mesh, image_shape: tuple[int, int, int]
) -> list[ParamPlacement]:
    """Where every parameter and statistic of the model would go, without compiling."""
    _, params, model_state = _split(nnx.eval_shape(lambda: build_model(model_config, image_shape, 0)))
    return place_variables(params, layout, mesh)[1] + place_variables(model_state, layout, mesh)[1]


@dataclass
class Evaluation:
    loss: float | None  # None when the data has no labels
    accuracy: float | None
    predictions: np.ndarray


def evaluate(program: Program, state: TrainState, dataset: Dataset) -> Evaluation:
    loss_sum = correct_sum = 0.0
    predictions = []
    for batch in eval_batches(dataset, program.eval_batch_size):
        arrays = [to_global(a, s) for a, s in zip(batch, program.eval_shardings, strict=True)]
        loss, correct, predicted = program.eval_step(state, *arrays)
        loss_sum, correct_sum = loss_sum + float(loss), correct_sum + float(correct)
        predictions.append(np.asarray(predicted)[batch[2] > 0])
    predictions = np.concatenate(predictions)
    if dataset.labels is None:
        return Evaluation(None, None, predictions)
    return Evaluation(loss_sum / len(dataset), correct_sum / len(dataset), predictions)


@dataclass
class FitResult:
    state: TrainState
    loss_history: list[float]  # training loss of every optimizer step
    epochs: list[dict]  # one row per epoch: the DESIGN's CSV columns
    steps: int
    train_seconds: float  # training loop only (no compile, no eval)
    images_per_second: float  # steady state: the first step (warm-up) excluded
    input_wait_fraction: float
    final_eval: Evaluation | None = None
    extra: dict = field(default_factory=dict)


def steps_plan(train_size: int, config: TrainConfig) -> tuple[int, int]:
    """(steps per epoch, total optimizer steps)."""
    per_epoch = train_size // config.batch_size
    if per_epoch == 0:
        raise UserError(
            f"--batch-size {config.batch_size} is larger than the {train_size} training images; use a smaller batch"
        )
    total = per_epoch * config.epochs
    return per_epoch, min(total, config.max_steps or total)


def fit(
    program: Program,
    state: TrainState,
    train_set: Dataset,
    test_set: Dataset | None,
    config: TrainConfig,
    *,
    progress: bool = True,
    prefetch_depth: int = 2,
) -> FitResult:
    """Train for the planned steps, evaluating on `test_set` after every epoch."""
    per_epoch, total = steps_plan(len(train_set), config)
    batch = program.batch_size
    losses, rows = [], []
    train_seconds = wait_seconds = first_step_seconds = 0.0
    interactive = sys.stderr.isatty()  # in a log, a line every 10 s rather than a redraw per step
    bar = tqdm(
        total=total, unit="step", disable=not progress, mininterval=0.1 if interactive else 10, leave=interactive
    )
    step = 0
    for epoch in range(math.ceil(total / per_epoch)):
        count = min(per_epoch, total - step)
        batches = train_batches(train_set, batch, epoch, config.seed)

        def produce(_, batches=batches):
            images, labels = next(batches)
            return to_global(images, program.batch_shardings[0]), to_global(labels, program.batch_shardings[1])

        loader = Prefetcher(produce, count, depth=prefetch_depth)
        metrics = []
        start = time.perf_counter()
        for images, labels in loader:
            state, step_metrics = program.train_step(state, images, labels)
            metrics.append(step_metrics)
            if step == 0:  # the first run carries one-off costs: keep it out of steady state
                jax.block_until_ready(state)
                first_step_seconds = time.perf_counter() - start
            step += 1
            bar.update(1)
        jax.block_until_ready(state)
        epoch_seconds = time.perf_counter() - start
        loader.close()
        train_seconds += epoch_seconds
        wait_seconds += loader.wait_seconds
        epoch_metrics = jax.device_get(metrics)
        epoch_losses = [float(m["loss"]) for m in epoch_metrics]
        losses += epoch_losses
        result = evaluate(program, state, test_set) if test_set is not None else None
        row = {
            "epoch": epoch + 1,
            "step": step,
            "train_loss": float(np.mean(epoch_losses)),
            "train_accuracy": float(np.mean([float(m["accuracy"]) for m in epoch_metrics])),
            "test_loss": result.loss if result else None,
            "test_accuracy": result.accuracy if result else None,
            "epoch_seconds": epoch_seconds,
            "images_per_second": count * batch / epoch_seconds,
            "input_wait_fraction": loader.wait_seconds / epoch_seconds,
        }
        rows.append(row)
        postfix = {"epoch": epoch + 1, "loss": f"{row['train_loss']:.4f}"}
        if row["test_accuracy"] is not None:
            postfix["test_acc"] = f"{row['test_accuracy']:.4f}"
        bar.set_postfix(postfix)
    bar.close()
    steady_steps, steady_seconds = step - 1, train_seconds - first_step_seconds
    if steady_steps == 0:
        steady_steps, steady_seconds = 1, train_seconds
    return FitResult(
        state=state,
        loss_history=losses,
        epochs=rows,
        steps=step,
        train_seconds=train_seconds,
        images_per_second=steady_steps * batch / steady_seconds,
        input_wait_fraction=wait_seconds / train_seconds,
        final_eval=result,
    )
