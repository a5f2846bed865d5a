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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from jaxcnn.checkpoint import state_fingerprint
from jaxcnn.compiling import compile_all, cpu_init_options, cpu_step_options
from jaxcnn.config import DIVERGENCE_FACTOR, ModelConfig, OptimConfig, TrainConfig, UpdateConfig
from jaxcnn.data import Augment, Dataset, Prefetcher, batch_indices, eval_batches, to_global
from jaxcnn.errors import UserError
from jaxcnn.models import build_model
from jaxcnn.optim import make_optimizer, optim_for_batch
from jaxcnn.sharding import axes as ax
from jaxcnn.sharding.layouts import Layout
from jaxcnn.sharding.partition import (
    ParamPlacement,
    data_sharding,
    optimizer_shardings,
    place_variables,
)
from jaxcnn.steps import (
    StepContext,
    TrainState,
    UpdatePlan,
    average_replicas,
    eval_step,
    make_train_step,
    plan_updates,
    replica_sharding,
    replicate,
    split_model,
)


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
    update_plan: UpdatePlan
    num_params: int
    init: Callable[[], TrainState] | None  # compiled: () -> state, each device creating its own shards
    train_step: Any  # compiled: (state, images, labels) -> (state, metrics)
    eval_step: (
        Any  # compiled: (state, images, labels, mask) -> (loss_sum, correct_sum, predictions); None without with_eval
    )
    compile_seconds: float
    average_step: Any = None  # local SGD: compiled (state) -> state, replicas averaged
    batch_order: np.ndarray | None = None  # gradient accumulation: see UpdatePlan.batch_order

    def place_batch(self, images: np.ndarray, labels: np.ndarray) -> tuple[jax.Array, jax.Array]:
        """A host batch as the train step's global arrays (each process gives its rows)."""
        if self.batch_order is not None:
            images, labels = images[self.batch_order], labels[self.batch_order]
        return to_global(images, self.batch_shardings[0]), to_global(labels, self.batch_shardings[1])

    @property
    def sync_every(self) -> int:
        return self.update_plan.config.sync_every if self.average_step is not None else 0


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
    update: UpdateConfig | None = None,
) -> Program:
    """Shapes -> shardings -> compiled init, train and eval steps. Nothing is allocated.
    `with_eval` / `with_init` False skip compiling those (training without a test set;
    cost inspection and planning, which only read the train step). `update` picks the
    step's update rule (jaxcnn.steps): accumulation, local SGD, stale gradients."""
    eval_batch_size = eval_batch_size or batch_size
    update = update or UpdateConfig()
    tx = make_optimizer(optim_config, total_steps)
    plan = plan_updates(update, layout, mesh, batch_size)
    replicas = plan.groups if update.local else 0

    def init() -> TrainState:
        _, params, model_state = split_model(build_model(model_config, image_shape, seed))
        rng = jax.random.key_data(jax.random.key(seed + 1))
        opt_state = tx.init(params)
        if replicas:  # local SGD: every replica starts from the same parameters
            params, model_state, opt_state = replicate((params, model_state, opt_state), replicas)
        history = (params,) * update.staleness
        return TrainState(jnp.zeros((), jnp.int32), params, model_state, opt_state, rng, history)

    graphdef, abstract_params, abstract_stats = split_model(
        nnx.eval_shape(lambda: build_model(model_config, image_shape, seed))
    )
    abstract = jax.eval_shape(init)

    # --- shard: every array's placement, from the layout's rules ----------------------
    replicated = NamedSharding(mesh, P())
    param_shardings, placements = place_variables(abstract_params, layout, mesh)
    compute_shardings, compute_placements = None, placements
    if layout.lookup(ax.PARAMS)[0]:  # FSDP: where parameters live for compute (gathered)
        gathered = dataclasses.replace(layout, rules=tuple(r for r in layout.rules if r[0] != ax.PARAMS))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the same fallbacks were just reported
            compute_shardings, compute_placements = place_variables(abstract_params, gathered, mesh)
    stat_shardings, stat_placements = place_variables(abstract_stats, layout, mesh)
    opt_shardings = optimizer_shardings(tx, jax.eval_shape(tx.init, abstract_params), param_shardings, mesh)
    grad_shardings = compute_shardings if compute_shardings is not None else param_shardings
    if replicas:  # each leaf gains a leading replica dim, split over the replica axes
        param_shardings, stat_shardings, opt_shardings = jax.tree.map(
            lambda s: replica_sharding(s, plan.groups_axes), (param_shardings, stat_shardings, opt_shardings)
        )
    state_shardings = TrainState(
        step=replicated,
        params=param_shardings,
        model_state=stat_shardings,
        opt_state=opt_shardings,
        rng=replicated,
        history=(param_shardings,) * update.staleness,
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
    context = StepContext(graphdef, tx, mesh, layout, compute_shardings)
    train_step = make_train_step(context, plan, param_shardings, grad_shardings)
    lowered = {
        "train": jax.jit(
            train_step,
            in_shardings=(state_shardings, image_sharding, label_sharding),
            out_shardings=(state_shardings, replicated),
            donate_argnums=0,
        ).lower(abstract_state, images, labels)
    }
    if replicas:
        lowered["average"] = jax.jit(
            average_replicas, in_shardings=(state_shardings,), out_shardings=state_shardings, donate_argnums=0
        ).lower(abstract_state)
    if with_eval:
        eval_images = jax.ShapeDtypeStruct((eval_batch_size, *image_shape), jnp.float32, sharding=eval_image_sharding)
        eval_labels = jax.ShapeDtypeStruct((eval_batch_size,), jnp.int32, sharding=eval_vector_sharding)
        eval_mask = jax.ShapeDtypeStruct((eval_batch_size,), jnp.float32, sharding=eval_vector_sharding)
        lowered["eval"] = jax.jit(
            lambda state, x, y, m: eval_step(graphdef, layout, mesh, bool(replicas), state, x, y, m),
            in_shardings=(state_shardings, eval_image_sharding, eval_vector_sharding, eval_vector_sharding),
            out_shardings=(replicated, replicated, replicated),
        ).lower(abstract_state, eval_images, eval_labels, eval_mask)
    if with_init:
        lowered["init"] = jax.jit(init, out_shardings=state_shardings).lower()
    compiled = compile_all(lowered, {"init": cpu_init_options(mesh)}, default=cpu_step_options(mesh))
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
        update_plan=plan,
        num_params=sum(math.prod(p.shape) for p in placements),
        init=compiled.get("init"),
        train_step=compiled["train"],
        eval_step=compiled.get("eval"),
        compile_seconds=compile_seconds,
        average_step=compiled.get("average"),
        batch_order=plan.batch_order(batch_size),
    )


def build_programs(
    model_config: ModelConfig,
    optim_config: OptimConfig,
    layout: Layout,
    mesh: Mesh,
    image_shape: tuple[int, int, int],
    train_config: TrainConfig,
    train_size: int,
    update: UpdateConfig | None = None,
    with_eval: bool = True,
) -> dict[int, Program]:
    """One program per global batch the run uses (a batch schedule has several), each
    with its learning rate scaled for its batch (jaxcnn.optim.optim_for_batch)."""
    steps = total_steps(train_size, train_config)
    return {
        batch: build_program(
            model_config,
            optim_for_batch(optim_config, train_config, batch),
            layout,
            mesh,
            image_shape,
            batch,
            steps,
            seed=train_config.seed,
            eval_batch_size=train_config.eval_batch_size,
            with_eval=with_eval,
            update=update,
        )
        for batch in train_config.batch_sizes
    }


def plan_placements(
    model_config: ModelConfig, layout: Layout, mesh: Mesh, image_shape: tuple[int, int, int]
) -> list[ParamPlacement]:
    """Where every parameter and statistic of the model would go, without compiling."""
    _, params, model_state = split_model(nnx.eval_shape(lambda: build_model(model_config, image_shape, 0)))
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
    images_per_second: float | None  # steady state: the first step (warm-up) excluded; None: no step ran
    input_wait_fraction: float | None  # share of train_seconds the devices idled for input; None: no step ran
    final_eval: Evaluation | None = None
    extra: dict = field(default_factory=dict)


def epoch_steps(train_size: int, config: TrainConfig) -> list[int]:
    """Optimizer steps in each epoch that runs (a batch schedule changes them; `max_steps` cuts them)."""
    steps, left = [], config.max_steps
    for epoch in range(config.epochs):
        batch = config.batch_for_epoch(epoch)
        per_epoch = train_size // batch
        if per_epoch == 0:
            raise UserError(
                f"--batch-size {batch} is larger than the {train_size} training images; use a smaller batch"
            )
        if left is not None:
            per_epoch = min(per_epoch, left)
            left -= per_epoch
        if per_epoch == 0:
            break
        steps.append(per_epoch)
    return steps


def total_steps(train_size: int, config: TrainConfig) -> int:
    return sum(epoch_steps(train_size, config))


def diverged_at(losses: list[float], factor: float = DIVERGENCE_FACTOR) -> int | None:
    """The first step (1-based) whose finite training loss exceeds `factor` x step 1's loss;
    None if none. (Non-finite losses stop the run or, with --skip-nonfinite, are skipped.)"""
    if not losses or not (math.isfinite(losses[0]) and losses[0] > 0):
        return None
    return next((k for k, v in enumerate(losses, 1) if math.isfinite(v) and v > factor * losses[0]), None)


def _restored_rows(plan: list[int], resume: Resume, config: TrainConfig) -> list[dict]:
    """The epoch rows of a restored run, one for every epoch it had finished. Checkpoints
    saved at an epoch's last step by jaxcnn before the fix of issue 15 lack that epoch's
    row: it is rebuilt from the loss and accuracy histories (test figures and timings,
    which cannot be rebuilt, are None)."""
    rows, recorded, first = [], {r["epoch"]: r for r in resume.epochs}, 0
    for epoch, count in enumerate(plan):
        if first + count > resume.step:
            break
        rows.append(recorded.get(epoch + 1) or {
            "epoch": epoch + 1, "step": first + count, "global_batch_size": config.batch_for_epoch(epoch),
            "train_loss": float(np.mean(resume.loss_history[first : first + count])),
            "train_accuracy": float(np.mean(resume.accuracy_history[first : first + count])),
            "test_loss": None, "test_accuracy": None, "epoch_seconds": None, "images_per_second": None,
            "input_wait_fraction": None,
        })  # fmt: skip
        first += count
    return rows


class NonFiniteLoss(UserError):
    """The training loss became NaN or infinite (the run stops; checkpoints stay good)."""


@dataclass
class Resume:
    """Where a restored run continues: its step and what it had recorded so far."""

    step: int
    loss_history: list[float]
    accuracy_history: list[float]
    epochs: list[dict]
    skipped_steps: int = 0

    @classmethod
    def from_record(cls, record: dict) -> Resume:
        return cls(
            record["step"], record["loss_history"], record["accuracy_history"], record["epochs"],
            record.get("skipped_steps", 0),
        )  # fmt: skip


def fit(
    programs: Program | dict[int, Program],
    state: TrainState,
    train_set: Dataset,
    test_set: Dataset | None,
    config: TrainConfig,
    *,
    progress: bool = True,
    prefetch_depth: int = 2,
    input_workers: int = 2,
    augment: Augment | None = None,
    checkpointer=None,
    resume: Resume | None = None,
    skip_nonfinite: bool = False,
) -> FitResult:
    """Train for the planned steps, evaluating on `test_set` after every epoch.

    `programs` maps each global batch of `config.batch_sizes` to its program (one compile
    per size); a single program is a run of one batch size. With a `checkpointer`
    (jaxcnn.checkpoint) the state is saved every N steps and at the end; `resume`
    continues a restored run at its step, on the same data position. A non-finite loss
    stops the run (NonFiniteLoss, naming the step) before anything non-finite is saved --
    unless `skip_nonfinite`, where the compiled step has already skipped it.
    """
    if not isinstance(programs, dict):
        programs = {programs.batch_size: programs}
    resume = resume or Resume(0, [], [], [])
    plan = epoch_steps(len(train_set), config)
    total = sum(plan)
    losses, accuracies = list(resume.loss_history), list(resume.accuracy_history)
    rows = _restored_rows(plan, resume, config)
    skipped, images_seen, step = resume.skipped_steps, 0, resume.step
    train_seconds = stall_seconds = first_step_seconds = 0.0
    interactive = sys.stderr.isatty()  # in a log, a line every 10 s rather than a redraw per step
    bar = tqdm(
        total=total, initial=step, unit="step", disable=not progress, mininterval=0.1 if interactive else 10,
        leave=interactive,
    )  # fmt: skip
    result, fingerprint, saved_at = None, None, resume.step

    def collect(metrics: list) -> None:
        """Move pending step metrics to the host and check them (a sync point)."""
        nonlocal skipped
        start = len(losses)
        for m in jax.device_get(metrics):
            losses.append(float(m["loss"]))
            accuracies.append(float(m["accuracy"]))
            skipped += int(m.get("skipped", 0))
        metrics.clear()
        bad = [k for k, v in enumerate(losses[start:], start + 1) if not math.isfinite(v)]
        if bad and not skip_nonfinite:
            where = ""
            if checkpointer is not None:
                where = (
                    f"; the last good checkpoint is step {saved_at} in {checkpointer.directory}"
                    if saved_at
                    else "; no checkpoint was saved before it"
                )
            raise NonFiniteLoss(
                f"training loss is {losses[bad[0] - 1]} at step {bad[0]}; stopped{where}. "
                "Lower --lr, or pass --skip-nonfinite to skip such steps"
            )

    def save(state) -> None:
        nonlocal fingerprint, saved_at
        fingerprint = fingerprint or state_fingerprint(state)
        record = {
            "step": step, "loss_history": losses, "accuracy_history": accuracies, "epochs": rows,
            "skipped_steps": skipped, "fingerprint": fingerprint,
        }  # fmt: skip
        checkpointer.save(step, state, record)
        saved_at = step

    def devices_idle() -> None:
        """Block until the devices have run every step dispatched so far (the loader calls
        this only when the next batch is not built yet; see Prefetcher)."""
        jax.block_until_ready(state)

    first_in_epoch = 0
    for epoch, count in enumerate(plan):
        first_in_epoch, done_before = first_in_epoch + (plan[epoch - 1] if epoch else 0), step
        if first_in_epoch + count <= step:
            continue  # finished before the checkpoint this run resumed from
        batch = config.batch_for_epoch(epoch)
        program = programs[batch]
        indices = batch_indices(len(train_set), batch, epoch, config.seed)
        skip = step - first_in_epoch  # the data position of a resumed epoch

        def produce(i, indices=indices, program=program, epoch=epoch, skip=skip):
            # on an input worker thread: gather, augment, place with the batch's sharding
            idx = indices[skip + i]
            images = train_set.images[idx]
            if augment is not None:
                images = augment(images, config.seed, epoch, skip + i)
            return program.place_batch(images, train_set.labels[idx])

        todo, epoch_end = first_in_epoch + count - step, first_in_epoch + count
        loader = Prefetcher(produce, todo, depth=prefetch_depth, workers=input_workers, idle=devices_idle)
        pending = []
        start = time.perf_counter()
        for images, labels in loader:
            state, step_metrics = program.train_step(state, images, labels)
            if program.sync_every and ((step + 1) % program.sync_every == 0 or step + 1 == total):
                state = program.average_step(state)  # local SGD: replicas meet (and at the end)
            pending.append(step_metrics)
            if step == done_before and images_seen == 0:  # one-off costs: keep them out of steady state
                jax.block_until_ready(state)
                first_step_seconds = time.perf_counter() - start
            step += 1
            images_seen += batch
            bar.update(1)
            if checkpointer is not None and checkpointer.due(step) and step < epoch_end:
                collect(pending)  # never save a state that followed a non-finite loss
                save(state)
        jax.block_until_ready(state)
        epoch_seconds = time.perf_counter() - start
        loader.close()
        train_seconds += epoch_seconds
        stall_seconds += loader.stall_seconds
        collect(pending)
        result = evaluate(program, state, test_set) if test_set is not None else None
        epoch_losses = losses[first_in_epoch : first_in_epoch + count]
        row = {
            "epoch": epoch + 1,
            "step": step,
            "global_batch_size": batch,
            "train_loss": float(np.mean(epoch_losses)),
            "train_accuracy": float(np.mean(accuracies[first_in_epoch : first_in_epoch + count])),
            "test_loss": result.loss if result else None,
            "test_accuracy": result.accuracy if result else None,
            "epoch_seconds": epoch_seconds,
            "images_per_second": todo * batch / epoch_seconds,
            "input_wait_fraction": loader.stall_seconds / epoch_seconds,
        }
        rows.append(row)
        if checkpointer is not None and (checkpointer.due(step) or step == total):
            save(state)  # at an epoch's end: after its row, so a resumed run's results hold every epoch
        postfix = {"epoch": epoch + 1, "loss": f"{row['train_loss']:.4f}"}
        if row["test_accuracy"] is not None:
            postfix["test_acc"] = f"{row['test_accuracy']:.4f}"
        bar.set_postfix(postfix)
    bar.close()
    if result is None and test_set is not None:  # resumed at the very end: nothing left to train
        result = evaluate(programs[config.batch_for_epoch(len(plan) - 1)], state, test_set)
    images_per_second = wait_fraction = None
    if images_seen:  # else resumed with nothing left to train: no throughput to report
        first_batch = config.batch_for_epoch(0)
        steady_images, steady_seconds = images_seen - first_batch, train_seconds - first_step_seconds
        if steady_images <= 0 or steady_seconds <= 0:  # one step only: warm-up included
            steady_images, steady_seconds = images_seen, train_seconds
        images_per_second = steady_images / steady_seconds
        wait_fraction = stall_seconds / train_seconds
    diverged = diverged_at(losses)
    if diverged is not None:
        warnings.warn(
            f"training diverged: the loss first exceeded {DIVERGENCE_FACTOR:g}x step 1's ({losses[0]:.4g}) at step "
            f"{diverged} ({losses[diverged - 1]:.4g}) and ends at {losses[-1]:.4g}; lower --lr",
            stacklevel=2,
        )
    return FitResult(
        state=state,
        loss_history=losses,
        epochs=rows,
        steps=step,
        train_seconds=train_seconds,
        images_per_second=images_per_second,
        input_wait_fraction=wait_fraction,
        final_eval=result,
        extra={"skipped_steps": skipped, "resumed_from_step": resume.step or None, "diverged_at_step": diverged},
    )
