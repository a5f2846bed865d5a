"""What a finished (or stopped) training run reports: its result record -- the fields of
jaxcnn.results' schema and more -- and the files it writes into its run directory."""

from __future__ import annotations

from pathlib import Path

import jax

from jaxcnn import compile_cache, results, runs
from jaxcnn.data import Loader
from jaxcnn.fit import FitResult
from jaxcnn.optim import optim_for_batch
from jaxcnn.plots import curves_plot
from jaxcnn.run_config import RunConfig


def run_record(config: RunConfig, programs: dict, train_config, outcome: FitResult, loader: Loader, test_set) -> dict:
    """The result JSON of a run (`train_config`: the config's, its batch chosen by --auto-batch)."""
    program = programs[train_config.batch_size]
    devices = program.mesh.devices.flat
    update = config.update
    return {
        "model": config.model.name,
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
        "learning_rates": {str(b): optim_for_batch(config.optim, train_config, b).learning_rate for b in programs},
        "grad_accum": update.grad_accum,
        "sync": update.sync,
        "sync_every": update.sync_every,
        "staleness": update.staleness,
        "remat": config.model.remat,
        "dtype": config.model.dtype,
        "checkpoint_dir": config.checkpoint.checkpoint_dir,
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
        "input_rows_per_process": len(program.train_input.share.rows),  # of each global batch
        "input_startup_seconds": outcome.extra["input_startup_seconds"],  # the first batch: workers starting
        "eval_examples_per_process": outcome.extra["eval_examples_per_process"],  # test examples process 0 reads
        "steps_per_call": outcome.extra.get("steps_per_call"),  # the K of the run's calls
        "data": loader.dataset.source,
        "test_data": test_set.source,
        "image_shape": list(loader.dataset.image_shape),
        "classes": list(loader.dataset.classes) if loader.dataset.classes else None,  # an image folder's names
        "jax_version": jax.__version__,
        "config": config.to_json(),
    }


def write_results(config: RunConfig, record: dict, outcome: FitResult, test_set, run_dir: Path, interrupted: bool):
    """The result JSON and CSV, the curves, a submission; the summary printed."""
    written = list(results.write_run(run_dir, run_dir.name, record, outcome.epochs))
    if outcome.loss_history:
        written.append(curves_plot(outcome.loss_history, outcome.epochs, run_dir / runs.CURVES, run_dir.name))
    if test_set.labels is None and not interrupted:
        submission = config.output.submission or run_dir / runs.SUBMISSION
        written.append(results.write_submission(submission, outcome.final_eval.predictions))
    print(results.summary_text(record))
    kept = [runs.TENSORBOARD] if interrupted else [runs.MODEL, runs.TENSORBOARD]
    print("wrote         ", run_dir, f"({', '.join([p.name for p in written] + [k + '/' for k in kept])})")
