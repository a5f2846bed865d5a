"""Train a CNN under a layout and mesh; write results/<run>.json and results/<run>.csv.

python experiments/train.py                                  # dp over all devices
python experiments/train.py --layout single                  # the one-device baseline
python experiments/train.py --mesh data=4 --host-devices 4   # 4 simulated CPU devices
python experiments/train.py --layout hybrid --mesh data=4,model=2 --print-shardings
python experiments/train.py --grad-accum 4 --remat full --dtype bfloat16
python experiments/train.py --sync local-sgd --sync-every 8 --optimizer sgd --lr 0.05
python experiments/train.py --batch-schedule 0:32,10:64,20:128 --lr-scaling linear --base-batch 32
"""

from __future__ import annotations

import dataclasses
import time
import warnings

import jax

from jaxcnn import cli, results
from jaxcnn.autobatch import largest_batch
from jaxcnn.checkpoint import Checkpointer, check_checkpoint_flags
from jaxcnn.config import UpdateConfig
from jaxcnn.data import Augment, load_csv, parse_image_shape, synthetic_dataset
from jaxcnn.distributed import cluster_from, initialize
from jaxcnn.errors import UserError
from jaxcnn.optim import optim_for_batch
from jaxcnn.sharding import build_mesh, format_mesh, get_layout, parse_mesh, parse_rules, resolve_mesh
from jaxcnn.sharding.hardware import parse_bytes
from jaxcnn.sharding.inspect import step_cost
from jaxcnn.sharding.lint import format_report, lint
from jaxcnn.sharding.mesh import check_layout_axes, host_devices_for, simulate_cpu_devices
from jaxcnn.sharding.pipeline import build_pipeline_program, pipeline_record, pipeline_summary
from jaxcnn.steps import plan_updates
from jaxcnn.train import Resume, build_program, build_programs, fit, total_steps

PROG = "train.py"


def parse_flags(argv=None):
    parser = cli.FlagParser(prog=PROG, description=__doc__, formatter_class=cli.argparse.RawDescriptionHelpFormatter)
    cli.add_model_flags(parser)
    cli.add_data_flags(parser)
    cli.add_mesh_flags(parser)
    cli.add_train_flags(parser)
    cli.add_run_flags(parser)
    g = parser.add_argument_group("output")
    g.add_argument("--results-dir", default="results")
    g.add_argument("--run-name", help="default: <model>-<layout>-<mesh>")
    g.add_argument(
        "--submission", help="where predictions for a label-free test file go (default: <results-dir>/submission.csv)"
    )
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    started = time.perf_counter()
    args = parse_flags(argv)
    model_config = cli.model_from_flags(args)
    optim_config = cli.optim_from_flags(args)
    train_config = cli.train_from_flags(args)
    update_config = cli.update_from_flags(args)
    budget = parse_bytes(args.auto_batch) if args.auto_batch else None
    cluster = cluster_from(args.coordinator, args.num_processes, args.process_id)
    augment = Augment(args.augment_shift, args.augment_flip)
    if args.input_workers < 1 or args.prefetch < 1:
        raise UserError(f"--input-workers and --prefetch must be >= 1, got {args.input_workers} and {args.prefetch}")
    if args.resume and not args.checkpoint_dir:
        raise UserError("--resume needs --checkpoint-dir: where the checkpoints are")
    if budget and train_config.batch_schedule:
        raise UserError("--auto-batch picks one batch size; drop it or --batch-schedule")
    layout = parse_rules(args.layout_rules) if args.layout_rules else get_layout(args.layout)
    mesh_shape = parse_mesh(args.mesh or layout.default_mesh)
    for note in check_layout_axes(layout.mesh_axes, mesh_shape, layout.name, layout.optional_axes):
        warnings.warn(note, stacklevel=1)
    if args.run_name:
        results.check_run_name(args.run_name)
    results_dir = results.ensure_writable_dir(args.results_dir)
    if args.checkpoint_dir:  # the numbers now; the directory once JAX has started (orbax uses it)
        check_checkpoint_flags(args.checkpoint_dir, args.checkpoint_every, args.keep_checkpoints)

    # --- data -------------------------------------------------------------------------
    if args.synthetic:
        shape = parse_image_shape(args.synthetic)
        train_set = synthetic_dataset(shape, args.synthetic_size, model_config.num_classes, args.seed)
        test_set = synthetic_dataset(shape, max(args.synthetic_size // 4, 1), model_config.num_classes, args.seed + 1)
    else:
        train_set = load_csv(args.data, channels=args.channels, num_classes=model_config.num_classes)
        test_set = load_csv(
            args.test_data, channels=args.channels, num_classes=model_config.num_classes, need_labels=False
        )
        if test_set.image_shape != train_set.image_shape:
            raise UserError(
                f"test images are {test_set.image_shape}, training images {train_set.image_shape}; use matching files"
            )

    # --- devices and mesh -------------------------------------------------------------
    host_devices = host_devices_for(mesh_shape, args.host_devices, cli.DEFAULT_SIMULATED_DEVICES)
    if cluster.num_processes > 1 and args.host_devices is None:  # the mesh's devices, shared by the processes
        host_devices = max(host_devices // cluster.num_processes, 1)
    simulate_cpu_devices(host_devices)
    initialize(cluster)  # jax.distributed, before any device is touched
    checkpointer = None
    if args.checkpoint_dir:  # before anything is compiled
        checkpointer = Checkpointer(args.checkpoint_dir, args.checkpoint_every, args.keep_checkpoints)
        if checkpointer.steps() and not args.resume:
            raise UserError(
                f"--checkpoint-dir {checkpointer.directory} already holds checkpoints (steps "
                f"{', '.join(map(str, checkpointer.steps()))}); pass --resume to continue them or give a new directory"
            )
    devices = jax.devices()
    simulated = devices[0].platform == "cpu" and len(devices) > 1
    if simulated and args.host_devices is None and jax.process_index() == 0:
        print(f"{PROG}: no accelerator found; simulating {len(devices)} CPU devices (--host-devices N to change)")
    mesh_shape = resolve_mesh(mesh_shape, len(devices))
    mesh = build_mesh(mesh_shape, devices)
    run_name = args.run_name or f"{model_config.name}-{layout.name}-{format_mesh(mesh_shape).replace(',', '_')}"

    # --- compile and train ------------------------------------------------------------
    common = dict(seed=train_config.seed, eval_batch_size=train_config.eval_batch_size)
    shape = train_set.image_shape
    if budget:
        search = auto_batch(model_config, optim_config, layout, mesh, shape, update_config, budget, len(train_set))
        train_config = dataclasses.replace(train_config, batch_size=search.batch_size)
        print(
            f"{PROG}: --auto-batch {args.auto_batch}: global batch {search.batch_size} "
            f"({search.peak_bytes:,} bytes per device; {len(search.probes)} compiles: "
            + ", ".join(f"{b}->{p / 2**20:.0f}MiB" for b, p in search.probes)
            + ")"
        )
    steps = total_steps(len(train_set), train_config)
    if layout.stage_axis:
        if update_config != UpdateConfig() or train_config.batch_schedule:
            raise UserError(
                "--grad-accum, --sync, --staleness and --batch-schedule do not apply to --layout pipeline "
                "(its micro-batches already accumulate: use --microbatches)"
            )
        batch = train_config.batch_size
        program = build_pipeline_program(
            model_config, optim_for_batch(optim_config, train_config, batch), layout, mesh, shape, batch, steps,
            microbatches=args.microbatches, stage_split=args.stage_split, **common,
        )  # fmt: skip
        print(pipeline_summary(program))
        programs = {batch: program}
    else:
        if args.microbatches or args.stage_split:
            raise UserError("--microbatches and --stage-split apply to --layout pipeline only")
        programs = build_programs(  # one compile per batch size of the schedule
            model_config, optim_config, layout, mesh, shape, train_config, len(train_set), update_config
        )
        program = programs[train_config.batch_size]
    if args.print_shardings and jax.process_index() == 0:
        compiled = None if layout.stage_axis else program.train_step  # pipeline: per-stage programs
        print(format_report(lint(layout, mesh, program.placements, compiled)))
    try:
        state, resume = start_state(program, checkpointer, args.resume)
        outcome = fit(
            programs, state, train_set, test_set, train_config, progress=not args.quiet and jax.process_index() == 0,
            checkpointer=checkpointer, resume=resume, skip_nonfinite=update_config.skip_nonfinite,
            augment=augment, input_workers=args.input_workers, prefetch_depth=args.prefetch,
        )  # fmt: skip
    finally:
        if checkpointer is not None:
            checkpointer.close()  # saves in flight finish, even when the run stops on an error

    # --- results ----------------------------------------------------------------------
    final = outcome.final_eval
    record = {
        "model": model_config.name,
        "layout": layout.name,
        "layout_rules": [list(rule) for rule in layout.rules],
        "mesh": dict(mesh_shape),
        "num_devices": mesh.size,
        "num_processes": jax.process_count(),
        "device_kind": devices[0].device_kind,
        "platform": devices[0].platform,
        "simulated_devices": simulated,
        "num_params": program.num_params,
        **(pipeline_record(program) if layout.stage_axis else {}),
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
        "test_accuracy": final.accuracy,
        "test_loss": final.loss,
        "images_per_second": outcome.images_per_second,
        "compile_seconds": program.compile_seconds,
        "train_seconds": outcome.train_seconds,
        "input_wait_fraction": outcome.input_wait_fraction,
        "data": train_set.source,
        "test_data": test_set.source,
        "jax_version": jax.__version__,
        "config": {k: v for k, v in vars(args).items()},
    }
    record["wall_seconds"] = time.perf_counter() - started
    if jax.process_index() == 0:
        json_path, csv_path = results.write_run(results_dir, run_name, record, outcome.epochs)
        written = [json_path, csv_path]
        if test_set.labels is None:
            written.append(
                results.write_submission(args.submission or results_dir / "submission.csv", final.predictions)
            )
        print(results.summary_text(record))
        print("wrote         ", ", ".join(map(str, written)))
    return record


def start_state(program, checkpointer, resume: bool):
    """A fresh state, or (--resume) the newest good checkpoint restored into this program's
    shardings -- which may be another layout's or mesh's than it was saved under."""
    if checkpointer is None or not resume:
        return program.init(), None
    restored = checkpointer.restore_latest(program.abstract_state)
    if restored is None:
        warnings.warn(f"no checkpoint in {checkpointer.directory} yet; starting from step 0", stacklevel=2)
        return program.init(), None
    if jax.process_index() == 0:
        print(f"{PROG}: resuming from step {restored.step} ({checkpointer.directory})")
    return restored.state, Resume.from_record(restored.record)


def auto_batch(model_config, optim_config, layout, mesh, image_shape, update_config, budget, train_size):
    """`--auto-batch`: search compiled train steps for the largest batch that fits."""
    if layout.stage_axis:
        raise UserError("--auto-batch needs a single-program layout; give the pipeline a --batch-size")
    # a batch must split over the data shards and then into the micro-batches
    multiple = plan_updates(update_config, layout, mesh, 1 << 30).groups * update_config.grad_accum

    def peak(batch: int) -> int:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # placements are the same for every probe
            program = build_program(
                model_config, optim_config, layout, mesh, image_shape, batch, 1000,
                with_eval=False, with_init=False, update=update_config,
            )  # fmt: skip
        return step_cost(program.train_step, program.abstract_state, mesh.size).peak_bytes

    return largest_batch(peak, budget, multiple, train_size)


if __name__ == "__main__":
    cli.run_main(PROG, main)
