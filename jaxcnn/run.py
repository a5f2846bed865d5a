"""One training run from its flags: check them, load the data, start the devices, compile,
fit, keep the model and write the results. `jaxcnn train` (experiments/train.py) is its
command line.

    from jaxcnn.commands.train import parse_flags
    record = train(parse_flags(["--layout", "hybrid", "--mesh", "data=4,model=2"]))

Bad input fails before anything slow starts -- the flags, then the files, then the mesh
against the layout and every size against its degrees -- as one UserError line.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import sys
import time
import warnings
from pathlib import Path

import jax
from jax.experimental import multihost_utils

from jaxcnn import cli, compile_cache, results, runs
from jaxcnn.analysis.cost import step_peak_bytes
from jaxcnn.analysis.lint import format_report, lint_program
from jaxcnn.autobatch import largest_batch
from jaxcnn.build import build_programs, check_layout_options
from jaxcnn.checkpoint import Checkpointer, check_checkpoint_flags
from jaxcnn.config import BUNDLED_TEST, parse_bytes
from jaxcnn.data import (
    Augment,
    Dataset,
    Loader,
    load_named,
    load_source,
    parse_image_shape,
    split_validation,
    synthetic_dataset,
)
from jaxcnn.data.datasets import BUNDLED
from jaxcnn.data.loader import check_input_options
from jaxcnn.distributed import cluster_from, initialize
from jaxcnn.errors import UserError
from jaxcnn.fit import FitResult, Interrupted, Resume, fit, interrupt_requests
from jaxcnn.optim import learning_rates, optim_for_batch
from jaxcnn.plots import curves_plot
from jaxcnn.saved_model import save_model
from jaxcnn.sharding import ParallelDims, build_mesh, format_mesh, get_layout, parse_mesh, parse_rules, resolve_mesh
from jaxcnn.sharding.mesh import host_devices_for, simulate_cpu_devices
from jaxcnn.steps import plan_updates

PROG = "jaxcnn train"


def train(args) -> dict:
    """The run `args` (jaxcnn.commands.train.parse_flags) ask for; returns its result record.

    Everything the run leaves goes to its run directory (jaxcnn.runs). A Ctrl-C saves the
    state there (and in --checkpoint-dir), writes the results so far and exits 130."""
    started = time.perf_counter()
    configs = cli.configs_from_flags(args)
    model_config, optim_config, train_config, update_config = configs
    layout = parse_rules(args.layout_rules) if args.layout_rules else get_layout(args.layout)
    mesh_shape = parse_mesh(args.mesh or layout.default_mesh)
    cluster = cluster_from(args.coordinator, args.num_processes, args.process_id)
    augment = Augment(args.augment_shift, args.augment_flip)
    budget = parse_bytes(args.auto_batch) if args.auto_batch else None
    _check_flags(args, layout, train_config, budget)
    check_layout_options(layout, update_config, args.microbatches, args.stage_split)
    for note in ParallelDims(layout, mesh_shape).notes:  # the mesh has every axis the layout splits over
        warnings.warn(note, stacklevel=1)
    results_dir = results.ensure_writable_dir(args.results_dir)
    if args.run_name:  # the default name needs the mesh; this one can be checked before anything slow
        runs.check_run_dir(
            results_dir / args.run_name,
            overwrite=args.overwrite,
            resume=args.resume,
            must_exist=not args.checkpoint_dir,
        )
    train_set, test_set = load_data(args, model_config.num_classes)
    loader = Loader(
        train_set, augment=augment, workers=input_workers(args.input_workers, train_set), depth=args.prefetch
    )

    # --- devices, mesh and the run directory ----------------------------------------------
    host_devices = host_devices_for(mesh_shape, args.host_devices, cli.DEFAULT_SIMULATED_DEVICES)
    if cluster.num_processes > 1 and args.host_devices is None:  # the mesh's devices, shared by the processes
        host_devices = max(host_devices // cluster.num_processes, 1)
    simulate_cpu_devices(host_devices)
    initialize(cluster)  # jax.distributed, before any device is touched
    devices = jax.devices()
    simulated = devices[0].platform == "cpu" and len(devices) > 1
    lead = jax.process_index() == 0
    if simulated and args.host_devices is None and lead:
        print(f"{PROG}: no accelerator found; simulating {len(devices)} CPU devices (--host-devices N to change)")
    mesh_shape = resolve_mesh(mesh_shape, len(devices))
    mesh = build_mesh(mesh_shape, devices)
    run_name = args.run_name or f"{model_config.name}-{layout.name}-{format_mesh(mesh_shape).replace(',', '_')}"
    run_dir = results_dir / run_name
    runs.check_run_dir(run_dir, overwrite=args.overwrite, resume=args.resume, must_exist=not args.checkpoint_dir)
    if args.checkpoint_dir and Path(args.checkpoint_dir).resolve().is_relative_to(run_dir.resolve()):
        raise UserError(f"--checkpoint-dir {args.checkpoint_dir} is inside the run directory {run_dir}; give another")
    checkpointer = _open_checkpoints(args)

    # --- compile and train --------------------------------------------------------------
    if budget:
        search = auto_batch(
            model_config, optim_config, layout, mesh, train_set.image_shape, update_config, budget, len(train_set)
        )
        print(
            f"{PROG}: --auto-batch {args.auto_batch}: global batch {search.batch_size} "
            f"({search.peak_bytes:,} bytes per device; {len(search.probes)} compiles: "
            + ", ".join(f"{b}->{p / 2**20:.0f}MiB" for b, p in search.probes)
            + ")"
        )
        train_config = dataclasses.replace(train_config, batch_size=search.batch_size)
    for batch in train_config.batch_sizes:  # every size the run will use, before the first compile
        ParallelDims(layout, mesh_shape).validate(
            batch, eval_batch_size=train_config.eval_batch_size, image_shape=train_set.image_shape,
            grad_accum=update_config.grad_accum, microbatches=args.microbatches,
        )  # fmt: skip
    programs = build_programs(
        model_config, optim_config, layout, mesh, train_set.image_shape, train_config, len(train_set),
        update=update_config, microbatches=args.microbatches, stage_split=args.stage_split,
    )  # fmt: skip
    program = programs[train_config.batch_size]
    if program.description and lead:
        print(program.description)
    if args.print_shardings and lead:
        print(format_report(lint_program(program)))
    # --- train in the run directory, Ctrl-C saving ------------------------------------------
    if cluster.num_processes > 1:  # every process has checked the run directory before the first makes it
        multihost_utils.sync_global_devices("jaxcnn: run directory checked")
    with interrupt_requests(cluster.num_processes == 1) as stop_requested:  # through the model's saving
        try:
            outcome, interrupted, saved_to = _fit_in_run_dir(
                args, programs, train_config, loader, test_set, run_dir, checkpointer, stop_requested,
                learning_rates(optim_config, train_config, len(train_set)) if lead else None,
                resumable=not layout.stage_axis and cluster.num_processes == 1,
            )  # fmt: skip
            record = run_record(args, configs, programs, train_config, outcome, loader, test_set)
            finished = outcome.extra["first_step_finished"]
            record["time_to_first_step_seconds"] = finished - started if finished is not None else None
            record["run_dir"] = str(run_dir)
            record["interrupted_at_step"] = outcome.steps if interrupted else None
            if not interrupted:
                save_model(run_dir / runs.MODEL, program.model_variables(outcome.state))  # a collective
                if lead:
                    shutil.rmtree(run_dir / runs.CHECKPOINTS, ignore_errors=True)  # the model replaces a Ctrl-C's state
        except BaseException:
            if lead and args.overwrite:  # (never with --resume: refused)
                runs.undo_overwrite(run_dir)  # the run it was to replace comes back
            raise
    record["wall_seconds"] = time.perf_counter() - started
    if lead and (saved_to or not interrupted):  # the new run finished, or can be continued
        runs.finish_overwrite(run_dir)
    if lead:
        _write_results(args, record, outcome, test_set, run_dir, interrupted)
        if interrupted:
            _stopped(args, run_dir, outcome, saved_to)
    if interrupted:
        sys.exit(130)
    return record


def _fit_in_run_dir(
    args,
    programs,
    train_config,
    loader,
    test_set,
    run_dir: Path,
    checkpointer,
    stop_requested,
    learning_rates,
    resumable: bool,
) -> tuple[FitResult, bool, list]:
    """Restore (--resume), make the run directory, fit with TensorBoard logging and Ctrl-C
    saves; (outcome, interrupted?, where a Ctrl-C saved the state)."""
    program = programs[train_config.batch_size]
    lead = jax.process_index() == 0
    tensorboard = keep_on_interrupt = None
    try:
        if args.resume and (run_dir / runs.CHECKPOINTS).is_dir():  # what an earlier Ctrl-C saved there
            keep_on_interrupt = Checkpointer(run_dir / runs.CHECKPOINTS, None, keep=1)
        # resume from the newest state of the two (a Ctrl-C saves to both; a new --checkpoint-dir has none)
        sources = [c for c in (checkpointer, keep_on_interrupt) if c is not None]
        source = max(sources, key=lambda c: max(c.steps(), default=-1), default=None)
        if args.resume and source is None:
            raise UserError(
                f"nothing to resume in {run_dir}: no state was saved there (a Ctrl-C saves one; a run that failed "
                "saves none); train it again with --overwrite"
            )
        state, resume = start_state(program, source, args.resume)
        if resume is not None:
            resume.check_continues(len(loader), train_config)
        # the run directory is made (or replaces the old one, with --overwrite) once nothing is left to refuse
        runs.prepare_run_dir(args.results_dir, run_dir.name, overwrite=args.overwrite, resume=args.resume, create=lead)
        if lead:
            runs.write_config(run_dir, args)
            tensorboard = runs.TensorBoardLog(run_dir / runs.TENSORBOARD, learning_rates)
        if keep_on_interrupt is None and resumable:  # a pipeline's state lives per stage: not saved yet
            keep_on_interrupt = Checkpointer(run_dir / runs.CHECKPOINTS, None, keep=1)
        outcome = fit(
            programs, state, loader, test_set, train_config, progress=not args.quiet and lead,
            checkpointer=checkpointer, resume=resume, skip_nonfinite=program.spec.update.skip_nonfinite,
            on_epoch=tensorboard.epoch if tensorboard else None, stop_requested=stop_requested,
            interrupt_saves=[keep_on_interrupt] if keep_on_interrupt else [],
        )  # fmt: skip
        return outcome, False, []
    except Interrupted as stop:
        return stop.result, True, stop.saved_to
    finally:
        for saver in (checkpointer, keep_on_interrupt):
            if saver is not None:
                saver.close()  # saves in flight finish, even when the run stops on an error
        if tensorboard is not None:
            tensorboard.close()


def _write_results(args, record: dict, outcome: FitResult, test_set, run_dir: Path, interrupted: bool) -> None:
    """The result JSON and CSV, the curves, a submission; the summary printed."""
    written = list(results.write_run(run_dir, run_dir.name, record, outcome.epochs))
    if outcome.loss_history:
        written.append(curves_plot(outcome.loss_history, outcome.epochs, run_dir / runs.CURVES, run_dir.name))
    if test_set.labels is None and not interrupted:
        submission = args.submission or run_dir / runs.SUBMISSION
        written.append(results.write_submission(submission, outcome.final_eval.predictions))
    print(results.summary_text(record))
    kept = [runs.TENSORBOARD] if interrupted else [runs.MODEL, runs.TENSORBOARD]
    print("wrote         ", run_dir, f"({', '.join([p.name for p in written] + [k + '/' for k in kept])})")


def _stopped(args, run_dir: Path, outcome: FitResult, saved_to: list) -> None:
    """What a Ctrl-C leaves, and the command that continues the run."""
    if not saved_to:
        print(f"{PROG}: interrupted at step {outcome.steps}: results so far in {run_dir}; a pipeline run's state "
              "cannot be saved yet, so it cannot be resumed", file=sys.stderr)  # fmt: skip
        return
    again = ["jaxcnn", "train", "--resume", "--run-name", run_dir.name, "--results-dir", str(run_dir.parent)]
    if args.checkpoint_dir:
        again += ["--checkpoint-dir", args.checkpoint_dir]
    print(f"{PROG}: interrupted at step {outcome.steps}: state saved in {', '.join(map(str, saved_to))}; "
          f"continue with: {shlex.join(again)}", file=sys.stderr)  # fmt: skip


def _check_flags(args, layout, train_config, budget) -> None:
    """What the flags alone can tell is wrong (the configs check their own fields)."""
    check_input_options(args.input_workers, args.prefetch)
    if layout.stage_axis and args.checkpoint_dir:
        raise UserError("--checkpoint-dir does not apply to --layout pipeline yet: its state lives per stage")
    if layout.stage_axis and args.resume:
        raise UserError("--resume does not apply to --layout pipeline yet: its state lives per stage")
    if args.resume and not (args.run_name or args.checkpoint_dir):
        raise UserError("--resume needs --run-name NAME, the run to continue (or --checkpoint-dir)")
    if args.resume and args.overwrite:
        raise UserError("--resume continues a run and --overwrite replaces it: give one")
    if budget and train_config.batch_schedule:
        raise UserError("--auto-batch picks one batch size; drop it or --batch-schedule")
    if args.run_name:
        results.check_run_name(args.run_name)
    if args.checkpoint_dir:  # the numbers now; the directory once JAX has started (orbax uses it)
        check_checkpoint_flags(args.checkpoint_dir, args.checkpoint_every, args.keep_checkpoints)


def load_data(args, num_classes: int, decode_test: bool = True) -> tuple[Dataset, Dataset]:
    """(training set, test set): --synthetic images, a --dataset by name, or --data (a CSV or
    an image folder) with --test-data -- or, for your own --data without one, --val-split
    of it held out (never the bundled test file beside your training file)."""
    if args.synthetic:
        shape = parse_image_shape(args.synthetic)
        train_set = synthetic_dataset(shape, args.synthetic_size, num_classes, args.seed)
        return train_set, synthetic_dataset(shape, max(args.synthetic_size // 4, 1), num_classes, args.seed + 1)
    if args.dataset != BUNDLED:
        return load_named(args.dataset, args.data_dir, args.download)
    source = dict(channels=args.channels, num_classes=num_classes, image_size=args.image_size)
    train_set = load_source(args.data, **source)
    if args.test_data or not args.data:
        test_set = load_source(args.test_data or BUNDLED_TEST, **source, classes=train_set.classes, need_labels=False)
    else:
        train_set, test_set = split_validation(train_set, args.val_split, args.seed)
    if test_set.image_shape != train_set.image_shape:
        raise UserError(
            f"test images are {test_set.image_shape}, training images {train_set.image_shape}; use matching files"
        )
    return train_set, test_set.loaded() if decode_test else test_set  # evaluated every epoch: decoded once


def input_workers(flag: int | None, train_set: Dataset) -> int:
    """--input-workers, or its default: none for data already in memory (gathering rows is
    cheap), one per core this process may use for files decoded every epoch."""
    if flag is not None:
        return flag
    return 0 if train_set.in_memory else len(os.sched_getaffinity(0))


def _open_checkpoints(args) -> Checkpointer | None:
    """The checkpoint manager (before anything is compiled), refusing to mix runs."""
    if not args.checkpoint_dir:
        return None
    checkpointer = Checkpointer(args.checkpoint_dir, args.checkpoint_every, args.keep_checkpoints)
    if checkpointer.steps() and not args.resume:
        raise UserError(
            f"--checkpoint-dir {checkpointer.directory} already holds checkpoints (steps "
            f"{', '.join(map(str, checkpointer.steps()))}); pass --resume to continue them or give a new directory"
        )
    return checkpointer


def start_state(program, checkpointer, resume: bool):
    """A fresh state, or (--resume) the newest good checkpoint restored into this program's
    shardings -- which may be another layout's or mesh's than it was saved under. An empty
    --checkpoint-dir starts from step 0."""
    if checkpointer is None or not resume:
        return program.init(), None
    restored = checkpointer.restore_latest(program.abstract_state)
    if restored is None and checkpointer.every is None:  # the run directory's: only a Ctrl-C saves there
        raise UserError(f"nothing to resume in {checkpointer.directory.parent}: its saved state is unreadable")
    if restored is None:
        warnings.warn(f"no checkpoint in {checkpointer.directory} yet; starting from step 0", stacklevel=2)
        return program.init(), None
    if jax.process_index() == 0:
        print(f"{PROG}: resuming from step {restored.step} ({checkpointer.directory})")
    return restored.state, Resume.from_record(restored.record)


def auto_batch(model_config, optim_config, layout, mesh, image_shape, update_config, budget: float, train_size: int):
    """`--auto-batch`: search compiled train steps for the largest batch that fits (BatchSearch)."""
    if layout.stage_axis:
        raise UserError("--auto-batch needs a single-program layout; give the pipeline a --batch-size")
    # a batch must split over the data shards and then into the micro-batches
    multiple = plan_updates(update_config, layout, mesh).groups * update_config.grad_accum

    peak = step_peak_bytes(model_config, optim_config, layout, mesh, image_shape, update=update_config)
    return largest_batch(peak, budget, multiple, train_size)


def run_record(args, configs, programs, train_config, outcome: FitResult, loader: Loader, test_set) -> dict:
    """The result JSON: the fields of results.py's schema, and more."""
    model_config, optim_config, _, update_config = configs
    program = programs[train_config.batch_size]
    devices = program.mesh.devices.flat
    return {
        "model": model_config.name,
        "layout": program.layout.name,
        "layout_rules": [list(rule) for rule in program.layout.rules],
        "mesh": dict(program.mesh.shape),
        "num_devices": program.mesh.size,
        "num_processes": jax.process_count(),
        "device_kind": devices[0].device_kind,
        "platform": devices[0].platform,
        "simulated_devices": devices[0].platform == "cpu" and program.mesh.size > 1,
        "num_params": program.num_params,
        **program.record,  # the platform's kernel choices; a pipeline's stages
        "global_batch_size": train_config.batch_size,
        "batch_schedule": [list(pair) for pair in train_config.batch_schedule],
        "learning_rates": {str(b): optim_for_batch(optim_config, train_config, b).learning_rate for b in programs},
        "grad_accum": update_config.grad_accum,
        "sync": update_config.sync,
        "sync_every": update_config.sync_every,
        "staleness": update_config.staleness,
        "remat": model_config.remat,
        "dtype": model_config.dtype,
        "checkpoint_dir": args.checkpoint_dir,
        "resumed_from_step": outcome.extra["resumed_from_step"],
        "skipped_steps": outcome.extra["skipped_steps"],
        "diverged_at_step": outcome.extra["diverged_at_step"],  # loss first > DIVERGENCE_FACTOR x step 1's
        "epochs": len(outcome.epochs),
        "steps": outcome.steps,
        "loss_history": outcome.loss_history,
        "test_accuracy": outcome.final_eval.accuracy if outcome.final_eval else None,
        "test_loss": outcome.final_eval.loss if outcome.final_eval else None,
        "images_per_second": outcome.images_per_second,
        "lower_seconds": sum(p.lower_seconds for p in programs.values()),  # tracing and lowering
        "compile_seconds": sum(p.compile_seconds for p in programs.values()),  # XLA, or the compile cache
        "compile_cache": compile_cache.in_use(),
        # per program: lowering, compile, cache; a batch schedule's are named by their batch
        "programs": [
            {**t.as_dict(), "name": t.name if len(programs) == 1 else f"{t.name}@{batch}"}
            for batch, p in programs.items()
            for t in p.compile_timings
        ],
        "first_step_seconds": outcome.extra["first_step_seconds"],
        "train_seconds": outcome.train_seconds,
        "input_wait_fraction": outcome.input_wait_fraction,
        "input_workers": loader.workers,
        "input_rows_per_process": len(range(program.batch_size)[program.feed.rows]),  # of each global batch
        "input_startup_seconds": outcome.extra["input_startup_seconds"],  # the first batch: workers starting
        "data": loader.dataset.source,
        "test_data": test_set.source,
        "image_shape": list(loader.dataset.image_shape),
        "classes": list(loader.dataset.classes) if loader.dataset.classes else None,  # an image folder's names
        "jax_version": jax.__version__,
        "config": dict(vars(args)),
    }
