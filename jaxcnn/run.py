"""One training run, from its config: prepare the run directory, load the data, start the
devices and the mesh, compile, fit, keep the model and write the results. `jaxcnn train`
(jaxcnn.commands.train) builds the config from the flags.

    from jaxcnn.run_config import RunConfig, ParallelConfig
    record = train(RunConfig(parallel=ParallelConfig(layout="hybrid", mesh="data=4,model=2")))

Bad input fails before anything slow starts -- the config where it is built, then the
files, then the mesh against the layout and every size against its degrees -- as one
UserError line.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import time

import jax
from jax.experimental import multihost_utils

from jaxcnn import results, runs
from jaxcnn.analysis.cost import auto_batch
from jaxcnn.analysis.lint import format_report, lint_program
from jaxcnn.build import build_programs
from jaxcnn.data import Augment, Loader, load_datasets
from jaxcnn.data.crops import RandomResizedCrop
from jaxcnn.data.on_device import choose, placed
from jaxcnn.distributed import Launch, initialize, launch_from
from jaxcnn.pretrained import read_plan
from jaxcnn.recovery import PROG, fit_in_run_dir, open_checkpoints, report_stop, resolve_resume
from jaxcnn.requeue import requeue_slurm_job
from jaxcnn.run_config import RESUME_AUTO, RunConfig
from jaxcnn.run_record import run_record, write_results
from jaxcnn.saved_model import save_model
from jaxcnn.sharding import format_mesh, mesh_for, simulate_devices_for
from jaxcnn.stopping import INTERRUPTED_EXIT_CODE, STOPPED_EXIT_CODE, StopRequests, stop_requests


def train(config: RunConfig) -> dict:
    """The run `config` describes; returns its result record.

    Everything the run leaves goes to its run directory (jaxcnn.runs). A stop (SIGTERM,
    --stop-signal, Ctrl-C: jaxcnn.stopping) saves the state there (and in --checkpoint-dir)
    at a step every process agrees on, writes the results so far and exits 75 (Ctrl-C: 130).
    Under --resume auto a finished run is left as it is: its record is returned."""
    started = time.perf_counter()
    launch = launch_from(config.cluster)  # reads the launcher's variables, not JAX
    # a stop (SIGTERM, Ctrl-C) asked while the data loads or the step compiles is kept for the first step
    with stop_requests(launch.multi_process, config.checkpoint.stop_signal) as stop:
        return _train(config, launch, stop, started)


def _train(config: RunConfig, launch: Launch, stop: StopRequests, started: float) -> dict:
    data, output = config.data, config.output
    results_dir = results.ensure_writable_dir(output.results_dir)
    if output.run_name:  # the default name needs the mesh; this one can be checked before anything slow
        if _finished_under_auto(config, results_dir / output.run_name):
            return _finished_record(results_dir / output.run_name, launch)
        config = resolve_resume(config, results_dir / output.run_name)
        _check_run_dir(config, results_dir / output.run_name)
    # the test set stays on disk: each process reads (decodes) only its rows of it (fit.eval_share)
    train_set, test_set = load_datasets(data, config.model.num_classes, config.train.seed, decode_test=False)
    augment = RandomResizedCrop() if data.augment == "imagenet" else Augment(data.augment_shift, data.augment_flip)
    loader = Loader(train_set, augment=augment, workers=data.workers_for(train_set.in_memory), depth=data.prefetch)

    simulate_devices_for(config.parallel, launch.num_processes, config.cluster.local_devices)
    initialize(launch)  # jax.distributed, before any device is touched
    stop.join()
    if config.checkpoint.init_from and not config.checkpoint.resume:  # its names and shapes, before anything slow
        read_plan(config.model, train_set.image_shape, config.checkpoint.init_from)
    lead = jax.process_index() == 0
    if launch.launcher != "single" or launch.local_devices:  # every process: each chose its own devices
        print(f"{PROG}: {launch.describe()}", flush=True)
    if jax.devices()[0].platform == "cpu" and len(jax.devices()) > 1 and config.parallel.host_devices is None and lead:
        print(f"{PROG}: no accelerator found; simulating {len(jax.devices())} CPU devices (--host-devices N to change)")
    layout, mesh = mesh_for(config.parallel)
    default_name = f"{config.model.name}-{layout.name}-{format_mesh(dict(mesh.shape)).replace(',', '_')}"
    run_dir = results_dir / (output.run_name or default_name)
    if _finished_under_auto(config, run_dir):
        return _finished_record(run_dir, launch)
    config = resolve_resume(config, run_dir)
    _check_run_dir(config, run_dir)
    checkpointer = open_checkpoints(config.checkpoint, run_dir)

    train_config = _batch_chosen(config, layout, mesh, train_set)
    if data.data_on_device == "on" and not train_set.in_memory and data.augment != "imagenet":
        train_set = train_set.loaded()  # an image folder, decoded once to go on the devices
        loader = dataclasses.replace(loader, dataset=train_set)
    on_device, on_device_said = choose(data.data_on_device, train_set, layout, mesh, augment, train_config.seed)
    per_call = train_config.steps_per_call
    if on_device:  # a call holds at most an epoch's steps (the shortest's)
        per_call = min(per_call, len(train_set) // max(train_config.batch_sizes))
        train_config = dataclasses.replace(train_config, steps_per_call=per_call)
    programs = build_programs(
        config.model, config.optim, layout, mesh, train_set.image_shape, train_config, len(train_set),
        update=config.update, microbatches=config.parallel.microbatches, stage_split=config.parallel.stage_split,
        pipeline_schedule=config.parallel.pipeline_schedule, virtual_stages=config.parallel.virtual_stages,
        image_dtype=train_set.images.dtype.name, on_device=on_device,
        steps_per_call=per_call,
    )  # fmt: skip
    program = programs[train_config.batch_size]
    device_data = placed(train_set, on_device, layout, mesh) if on_device else None
    if lead:
        print(f"{PROG}: training data on the devices: {on_device_said}; steps per call: {per_call}")
    if program.description and lead:
        print(program.description)
    if output.print_shardings and lead:
        print(format_report(lint_program(program)))

    if launch.multi_process:  # every process has checked the run directory before the first makes it
        multihost_utils.sync_global_devices("jaxcnn: run directory checked")
    try:
        outcome = fit_in_run_dir(
            config, programs, train_config, loader, test_set, run_dir, checkpointer, stop, device_data=device_data,
        )  # fmt: skip
        record = run_record(config, programs, train_config, outcome.result, loader, test_set)
        finished = outcome.result.extra["first_step_finished"]
        record["time_to_first_step_seconds"] = finished - started if finished is not None else None
        record["run_dir"] = str(run_dir)
        record["interrupted_at_step"] = outcome.result.steps if outcome.interrupted else None
        record["stopped_by"] = stop.reason if outcome.interrupted else None
        record["launch"] = launch.as_record()
        record["data_on_device"] = on_device_said
        if not outcome.interrupted:
            save_model(run_dir / runs.MODEL, program.model_variables(outcome.result.state))  # a collective
    except BaseException:
        if lead and output.overwrite:  # (never with --resume: refused)
            runs.undo_overwrite(run_dir)  # the run it was to replace comes back
        raise
    record["wall_seconds"] = time.perf_counter() - started
    if lead and (outcome.saved_to or not outcome.interrupted):  # the new run finished, or can be continued
        runs.finish_overwrite(run_dir)
    if lead:
        write_results(config, record, outcome.result, test_set, run_dir, outcome.interrupted)
        if outcome.interrupted:
            report_stop(config, run_dir, outcome, stop)
        else:  # the model and results replace a stop's state, now that both are written
            shutil.rmtree(run_dir / runs.CHECKPOINTS, ignore_errors=True)
    if not outcome.interrupted and stop.requested and lead:  # agreed after the last step boundary, or never
        print(f"{PROG}: a stop ({stop.reason}) was asked, but the run reached its end before every process "
              "agreed on a step; it finished", file=sys.stderr, flush=True)  # fmt: skip
    elif outcome.interrupted and not lead:  # each process says where it stopped: the same step on every one
        print(f"{PROG}: process {jax.process_index()} stopped ({stop.reason}) at step {outcome.result.steps}",
              file=sys.stderr, flush=True)  # fmt: skip
    if outcome.interrupted:  # 75 tells a requeue the state is saved; with nothing saved, a plain failure
        code = stop.exit_code if outcome.saved_to or stop.exit_code == INTERRUPTED_EXIT_CODE else 1
        if code == STOPPED_EXIT_CODE:
            _requeue_once_saved(launch)
        sys.exit(code)
    return record


def _requeue_once_saved(launch: Launch) -> None:
    """Under SLURM, process 0 requeues the job (jaxcnn.requeue) once every process has saved
    and written: the requeue ends this instance's tasks."""
    if launch.multi_process:
        multihost_utils.sync_global_devices("jaxcnn: stopped and saved")
    if jax.process_index() == 0 and (said := requeue_slurm_job()):
        print(f"{PROG}: {said}", file=sys.stderr, flush=True)


def _finished_under_auto(config: RunConfig, run_dir) -> bool:
    return config.checkpoint.resume == RESUME_AUTO and (run_dir / runs.MODEL).is_dir()


def _finished_record(run_dir, launch: Launch) -> dict:
    """--resume auto on a run that has finished: nothing to do (a job requeued after its end)."""
    record = runs.open_run(run_dir).record
    if launch.process_id == 0:  # (JAX has not started)
        print(f"{PROG}: run {run_dir} has finished (its model is in {run_dir / runs.MODEL}); nothing to do")
    return record


def _check_run_dir(config: RunConfig, run_dir) -> None:
    resume = config.checkpoint.resume
    must_exist = not config.checkpoint.checkpoint_dir  # resuming from the run directory's own saved state
    runs.check_run_dir(run_dir, overwrite=config.output.overwrite, resume=resume, must_exist=must_exist)


def _batch_chosen(config: RunConfig, layout, mesh, train_set):
    """The training config, its batch the largest that fits with --auto-batch."""
    budget = config.train.auto_batch_bytes
    if not budget:
        return config.train
    search = auto_batch(
        config.model, config.optim, layout, mesh, train_set.image_shape, config.update, budget, len(train_set)
    )
    print(
        f"{PROG}: --auto-batch {config.train.auto_batch}: global batch {search.batch_size} "
        f"({search.peak_bytes:,} bytes per device; {len(search.probes)} compiles: "
        + ", ".join(f"{b}->{p / 2**20:.0f}MiB" for b, p in search.probes)
        + ")"
    )
    return dataclasses.replace(config.train, batch_size=search.batch_size)
