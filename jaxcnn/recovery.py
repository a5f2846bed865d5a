"""What lets a training run stop and go on: its checkpoints, the state it starts from, the
fit inside its run directory with a stop (SIGTERM, Ctrl-C: jaxcnn.stopping) saving the
state there, `--resume auto`'s choice, and the command that continues it.

    config = resolve_resume(config, run_dir)                 # --resume auto: resume or start
    checkpointer = open_checkpoints(config.checkpoint, run_dir)
    outcome = fit_in_run_dir(config, programs, train_config, loader, test_set, run_dir, checkpointer, ...)
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import jax

from jaxcnn import runs
from jaxcnn.checkpoint import Checkpointer
from jaxcnn.errors import UserError
from jaxcnn.fit import FitResult, Interrupted, fit
from jaxcnn.optim import learning_rates
from jaxcnn.pretrained import load_pretrained, read_plan
from jaxcnn.resume import Resume
from jaxcnn.run_config import RESUME_AUTO, CheckpointConfig, RunConfig
from jaxcnn.stopping import StopRequests

PROG = "jaxcnn train"


@dataclass
class Outcome:
    """How the fit ended: finished, or stopped (Ctrl-C, SIGTERM) with the state saved to `saved_to`."""

    result: FitResult
    interrupted: bool = False
    saved_to: list = field(default_factory=list)


def saved_steps(directory: Path) -> bool:
    """Whether an Orbax checkpoint directory holds a finished step (a folder named by its
    number; one still being written has a temporary name). Read without Orbax or JAX."""
    return directory.is_dir() and any(p.name.isdigit() and p.is_dir() for p in directory.iterdir())


def resolve_resume(config: RunConfig, run_dir: Path) -> RunConfig:
    """`--resume auto` made a decision, the same in every process (none has written yet):
    resume when the run directory or --checkpoint-dir holds a saved state; else start --
    replacing a run directory that saved none (a run that failed early) -- so a requeued
    job reruns its own command line. A finished run is left alone (`runs.check_run_dir`
    says so). Any other --resume comes back as it is."""
    checkpoint = config.checkpoint
    if checkpoint.resume != RESUME_AUTO:
        return config
    sources = [run_dir / runs.CHECKPOINTS, *([Path(checkpoint.checkpoint_dir)] if checkpoint.checkpoint_dir else [])]
    if any(saved_steps(source) for source in sources) or (run_dir / runs.MODEL).exists():
        return dataclasses.replace(config, checkpoint=dataclasses.replace(checkpoint, resume=True))
    overwrite = (run_dir / runs.CONFIG).is_file()  # jaxcnn's own run that saved nothing: start it again
    return dataclasses.replace(
        config,
        checkpoint=dataclasses.replace(checkpoint, resume=False),
        output=dataclasses.replace(config.output, overwrite=config.output.overwrite or overwrite),
    )


def open_checkpoints(config: CheckpointConfig, run_dir: Path) -> Checkpointer | None:
    """--checkpoint-dir's manager (before anything is compiled), refusing to mix runs."""
    if not config.checkpoint_dir:
        return None
    if Path(config.checkpoint_dir).resolve().is_relative_to(run_dir.resolve()):
        raise UserError(f"--checkpoint-dir {config.checkpoint_dir} is inside the run directory {run_dir}; give another")
    checkpointer = Checkpointer(config.checkpoint_dir, config.checkpoint_every, config.keep_checkpoints)
    if checkpointer.steps() and not config.resume:
        raise UserError(
            f"--checkpoint-dir {checkpointer.directory} already holds checkpoints (steps "
            f"{', '.join(map(str, checkpointer.steps()))}); pass --resume to continue them or give a new directory"
        )
    return checkpointer


def fresh_state(program, init_from: str | None):
    """The program's initial state, or (--init-from) that with the file's weights in it."""
    state = program.init()
    if not init_from:
        return state
    plan = read_plan(program.spec.model_config, program.spec.image_shape, init_from)
    if jax.process_index() == 0:
        for note in plan.notes:  # a re-initialised classifier
            print(f"{PROG}: {note}")
        print(f"{PROG}: starting from {init_from} ({len(plan.keys) - len(plan.head_reinit)} tensors, "
              f"{plan.scheme} names)")  # fmt: skip
    return load_pretrained(program, state, plan)


def start_state(program, checkpointer, resume: bool, init_from: str | None = None):
    """A fresh state (from --init-from's file, if given), or (--resume) the newest good
    checkpoint restored into this program's shardings -- which may be another layout's or
    mesh's than it was saved under: a resumed run never reads --init-from's file again.
    An empty --checkpoint-dir starts from step 0."""
    if checkpointer is None or not resume:
        return fresh_state(program, init_from), None
    restored = checkpointer.restore_latest(program.abstract_state)
    if restored is None and checkpointer.every is None:  # the run directory's: only a Ctrl-C saves there
        raise UserError(f"nothing to resume in {checkpointer.directory.parent}: its saved state is unreadable")
    if restored is None:
        warnings.warn(f"no checkpoint in {checkpointer.directory} yet; starting from step 0", stacklevel=2)
        return fresh_state(program, init_from), None
    if jax.process_index() == 0:
        print(f"{PROG}: resuming from step {restored.step} ({checkpointer.directory})")
    return program.from_saved(restored.state), Resume.from_record(restored.record)


def fit_in_run_dir(
    config: RunConfig,
    programs: dict,
    train_config,
    loader,
    test_set,
    run_dir: Path,
    checkpointer: Checkpointer | None,
    stop: StopRequests,
    device_data: tuple | None = None,
) -> Outcome:
    """Restore (--resume), make the run directory, fit with TensorBoard logging and saves
    when stopped."""
    program = programs[train_config.batch_size]
    lead = jax.process_index() == 0
    resume_flag = config.checkpoint.resume
    tensorboard = keep_on_interrupt = None
    try:
        if resume_flag and (run_dir / runs.CHECKPOINTS).is_dir():  # what an earlier stop saved there
            keep_on_interrupt = Checkpointer(run_dir / runs.CHECKPOINTS, None, keep=1)
        # resume from the newest state of the two (a stop saves in --checkpoint-dir when given, else in the run directory)
        sources = [c for c in (checkpointer, keep_on_interrupt) if c is not None]
        source = max(sources, key=lambda c: max(c.steps(), default=-1), default=None)
        if resume_flag and source is None:
            raise UserError(
                f"nothing to resume in {run_dir}: no state was saved there (a stop saves one; a run that failed "
                "saves none); train it again with --overwrite, or pass --resume auto"
            )
        state, resume = start_state(program, source, resume_flag, config.checkpoint.init_from)
        if resume is not None:
            resume.check_continues(len(loader), train_config)
        # the run directory is made (or replaces the old one, with --overwrite) once nothing is left to refuse
        runs.prepare_run_dir(
            run_dir.parent, run_dir.name, overwrite=config.output.overwrite, resume=resume_flag, create=lead
        )
        if lead:
            runs.write_config(run_dir, config)
            rates = learning_rates(config.optim, train_config, len(loader.dataset))
            tensorboard = runs.TensorBoardLog(run_dir / runs.TENSORBOARD, rates)
        if keep_on_interrupt is None and checkpointer is None:  # a stop saves in --checkpoint-dir when given
            keep_on_interrupt = Checkpointer(run_dir / runs.CHECKPOINTS, None, keep=1)
        result = fit(
            programs, state, loader, test_set, train_config, progress=not config.output.quiet and lead,
            checkpointer=checkpointer, resume=resume, skip_nonfinite=config.update.skip_nonfinite,
            on_epoch=tensorboard.epoch if tensorboard else None, stop=stop,
            interrupt_saves=[keep_on_interrupt] if keep_on_interrupt else [], device_data=device_data,
        )  # fmt: skip
        return Outcome(result)
    except Interrupted as stop:
        return Outcome(stop.result, interrupted=True, saved_to=stop.saved_to)
    finally:
        for saver in (checkpointer, keep_on_interrupt):
            if saver is not None:
                saver.close()  # saves in flight finish, even when the run stops on an error
        if tensorboard is not None:
            tensorboard.close()


def report_stop(config: RunConfig, run_dir: Path, outcome: Outcome, stop: StopRequests) -> None:
    """What a stop leaves, and the command that continues the run."""
    steps = outcome.result.steps
    if not outcome.saved_to:
        print(f"{PROG}: stopped ({stop.reason}) at step {steps}: results so far in {run_dir}; nothing was "
              "saved, so it cannot be resumed; exit 1", file=sys.stderr)  # fmt: skip
        return
    again = ["jaxcnn", "train", "--resume", "--run-name", run_dir.name, "--results-dir", str(run_dir.parent)]
    if config.checkpoint.checkpoint_dir:
        again += ["--checkpoint-dir", config.checkpoint.checkpoint_dir]
    print(f"{PROG}: stopped ({stop.reason}) at step {steps}: state saved in {', '.join(map(str, outcome.saved_to))}; "
          f"continue with: {shlex.join(again)} (or the same command with --resume auto); exit {stop.exit_code}",
          file=sys.stderr)  # fmt: skip
