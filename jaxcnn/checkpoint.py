"""Orbax checkpoints that survive a kill: every N steps, the last K kept, saved in the background.

A checkpoint holds the whole TrainState (parameters, batch-norm statistics, optimizer
state, the step and the RNG key data; local SGD's replicas, stale parameter copies) and a
JSON record: the data position follows from the step, and the loss history so far makes a
resumed run's results the same as an uninterrupted one's.

Restoring reads into the *current* program's shardings, so a state saved under one layout
or mesh resumes under another (orbax reshards). Orbax writes each step to a temporary
directory and renames it when complete, so a kill mid-save leaves the previous step as the
latest; a step that is complete on disk but unreadable (a damaged file) is skipped with a
warning and the one before it used.
"""

from __future__ import annotations

import functools
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxcnn.errors import UserError


@functools.cache
def save_replicas_whole_on_cpu() -> None:
    """Orbax splits the copy of a replicated array to the host among its replicas, so that
    several accelerators copy in parallel: each takes a slice, an op compiled eagerly per
    shape and slice. CPU devices share the host's memory, so there is nothing to parallelize,
    and those compiles cost seconds at every save of a small model. On CPU devices the first
    replica is written whole (orbax's own choice on GPUs); elsewhere orbax's default stands.
    Call before saving; restoring is unaffected."""
    if jax.devices()[0].platform != "cpu":
        return
    try:  # the default handler's ArrayMetadata store (typed PRNG keys read back as keys) is kept
        from orbax.checkpoint._src.metadata.array_metadata_store import Store
    except ImportError:  # a later orbax moved it: saves stay correct, only slower on CPU devices
        return
    handler = ocp.type_handlers.ArrayHandler(use_replica_parallel=False, array_metadata_store=Store())
    absl = logging.getLogger("absl")  # orbax warns of the override on every run, as if it were a mistake
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)
    finally:
        absl.setLevel(level)


def state_fingerprint(abstract_state) -> list[list]:
    """What a checkpoint must match to restore into a program: every leaf's path, global
    shape and dtype (not its sharding -- that may change)."""
    leaves = jax.tree_util.tree_flatten_with_path(abstract_state)[0]
    return [[jax.tree_util.keystr(path), list(leaf.shape), str(leaf.dtype)] for path, leaf in leaves]


@dataclass
class Restored:
    step: int
    state: object
    record: dict  # what `save` was given


def check_checkpoint_flags(directory: str | Path, every: int, keep: int) -> None:
    """The flags alone, without touching JAX (callable before jax.distributed starts)."""
    if every < 1:
        raise UserError(f"--checkpoint-every must be a positive integer, got {every}")
    if keep < 1:
        raise UserError(f"--keep-checkpoints must be a positive integer, got {keep}")
    if Path(directory).exists() and not Path(directory).is_dir():
        raise UserError(f"--checkpoint-dir {directory} is a file; give a directory")


class _Manager(ocp.CheckpointManager):
    """Orbax's manager with its own preemption check turned off. Orbax asks JAX's preemption
    sync point with the training step at every save, in the caller's thread and again in the
    thread that finalizes an asynchronous save; jaxcnn.stopping asks it with its own count of
    step boundaries. JAX's sync service keeps whichever number came last and fires only when
    a later call passes exactly the agreed max + 1, so two counters can agree on a point that
    neither reaches: one process stops while the other runs on into a collective and both
    hang. One owner of the sync point: the stop (jaxcnn.stopping), which also decides when
    to save for it."""

    def reached_preemption(self, step: int) -> bool:
        return False


class Checkpointer:
    """`every` N steps and at the run's end; `every` None: only when asked (a Ctrl-C save)."""

    def __init__(self, directory: str | Path, every: int | None, keep: int = 3, asynchronous: bool = True):
        check_checkpoint_flags(directory, every or 1, keep)
        self.directory = Path(directory).absolute()
        self.every = every
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=asynchronous, create=True, cleanup_tmp_directories=True
        )
        try:
            self.manager = _Manager(self.directory, item_names=("state", "record"), options=options)
        except OSError as err:
            raise UserError(f"cannot use --checkpoint-dir {directory}: {err.strerror or err}") from None

    def due(self, step: int, last: bool = False, since: int | None = None) -> bool:
        """Whether to save at `step` (`last`: the run's final step): a multiple of `every`,
        or -- the loop arriving from step `since`, several steps a call -- one passed since."""
        if not self.every:
            return False
        since = step - 1 if since is None else since
        return last or step // self.every > since // self.every

    def save(self, step: int, state, record: dict) -> None:
        """Start saving (returns once the arrays are copied off the devices)."""
        save_replicas_whole_on_cpu()
        self.manager.save(
            step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), record=ocp.args.JsonSave(record))
        )

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def restore_latest(self, abstract_state) -> Restored | None:
        """The newest readable checkpoint, restored into `abstract_state`'s shardings; None
        if the directory has none. A checkpoint of a different model or state is an error."""
        fingerprint = state_fingerprint(abstract_state)
        for step in reversed(self.steps()):
            try:
                record = self.manager.restore(step, args=ocp.args.Composite(record=ocp.args.JsonRestore()))["record"]
            except Exception as err:  # any unreadable record is a damaged step
                warnings.warn(f"checkpoint step {step} in {self.directory} is unreadable ({_short(err)}); "
                              "trying the one before", stacklevel=2)  # fmt: skip
                continue
            if record.get("fingerprint") != fingerprint:
                raise UserError(
                    f"the checkpoint at {self.directory} (step {step}) holds a different model or training state "
                    f"({_difference(record.get('fingerprint'), fingerprint)}); resume with the flags it was saved "
                    "with, or give a new --checkpoint-dir"
                )
            try:
                restored = self.manager.restore(
                    step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
                )["state"]
                jax.block_until_ready(restored)
            except Exception as err:  # damaged array files
                warnings.warn(f"checkpoint step {step} in {self.directory} is damaged ({_short(err)}); "
                              "using the one before", stacklevel=2)  # fmt: skip
                continue
            return Restored(step, restored, record)
        return None

    def close(self) -> None:
        """Wait for saves in flight, then release the manager."""
        self.manager.wait_until_finished()
        self.manager.close()


def _short(err: Exception) -> str:
    text = str(err).strip().splitlines()[0].split(". See")[0] if str(err).strip() else type(err).__name__
    return text[:160]


def _difference(saved, wanted) -> str:
    if not saved:
        return "no fingerprint recorded"
    saved_map, wanted_map = {p: (s, d) for p, s, d in saved}, {p: (s, d) for p, s, d in wanted}
    for path, spec in wanted_map.items():
        if path not in saved_map:
            return f"it has no {path}"
        if saved_map[path] != spec:
            return f"{path} is {saved_map[path][0]} {saved_map[path][1]} there, {spec[0]} {spec[1]} here"
    extra = sorted(set(saved_map) - set(wanted_map))
    return f"it also has {extra[0]}" if extra else "the tree structure differs"


def arrays_equal(a, b) -> bool:
    """Every leaf of two states equal (for checks and tests)."""
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(leaves_a) == len(leaves_b) and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(leaves_a, leaves_b, strict=True)
    )
