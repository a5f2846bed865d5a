"""Train a CNN under a layout and mesh; write results/<run>.json and results/<run>.csv.

python experiments/train.py                                  # dp over all devices
python experiments/train.py --layout single                  # the one-device baseline
python experiments/train.py --mesh data=4 --host-devices 4   # 4 simulated CPU devices
python experiments/train.py --layout hybrid --mesh data=4,model=2 --print-shardings
"""

from __future__ import annotations

import time
import warnings

import jax

from jaxcnn import cli, results
from jaxcnn.data import load_csv, parse_image_shape, synthetic_dataset
from jaxcnn.errors import UserError
from jaxcnn.sharding import build_mesh, format_mesh, get_layout, parse_mesh, parse_rules, resolve_mesh
from jaxcnn.sharding.lint import format_report, lint
from jaxcnn.sharding.mesh import check_layout_axes, host_devices_for, simulate_cpu_devices
from jaxcnn.sharding.pipeline import build_pipeline_program, pipeline_record, pipeline_summary
from jaxcnn.train import build_program, fit, steps_plan

PROG = "train.py"


def parse_flags(argv=None):
    parser = cli.FlagParser(prog=PROG, description=__doc__, formatter_class=cli.argparse.RawDescriptionHelpFormatter)
    cli.add_model_flags(parser)
    cli.add_data_flags(parser)
    cli.add_mesh_flags(parser)
    cli.add_train_flags(parser)
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
    layout = parse_rules(args.layout_rules) if args.layout_rules else get_layout(args.layout)
    mesh_shape = parse_mesh(args.mesh or layout.default_mesh)
    for note in check_layout_axes(layout.mesh_axes, mesh_shape, layout.name, layout.optional_axes):
        warnings.warn(note, stacklevel=1)
    if args.run_name:
        results.check_run_name(args.run_name)
    results_dir = results.ensure_writable_dir(args.results_dir)

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
    simulate_cpu_devices(host_devices)
    devices = jax.devices()
    simulated = devices[0].platform == "cpu" and len(devices) > 1
    if simulated and args.host_devices is None:
        print(f"{PROG}: no accelerator found; simulating {len(devices)} CPU devices (--host-devices N to change)")
    mesh_shape = resolve_mesh(mesh_shape, len(devices))
    mesh = build_mesh(mesh_shape, devices)
    run_name = args.run_name or f"{model_config.name}-{layout.name}-{format_mesh(mesh_shape).replace(',', '_')}"

    # --- compile and train ------------------------------------------------------------
    _, total_steps = steps_plan(len(train_set), train_config)
    common = dict(seed=train_config.seed, eval_batch_size=train_config.eval_batch_size)
    shape, batch = train_set.image_shape, train_config.batch_size
    if layout.stage_axis:
        program = build_pipeline_program(
            model_config, optim_config, layout, mesh, shape, batch, total_steps,
            microbatches=args.microbatches, stage_split=args.stage_split, **common,
        )  # fmt: skip
        print(pipeline_summary(program))
    else:
        if args.microbatches or args.stage_split:
            raise UserError("--microbatches and --stage-split apply to --layout pipeline only")
        program = build_program(model_config, optim_config, layout, mesh, shape, batch, total_steps, **common)
    if args.print_shardings and jax.process_index() == 0:
        compiled = None if layout.stage_axis else program.train_step  # pipeline: per-stage programs
        print(format_report(lint(layout, mesh, program.placements, compiled)))
    state = program.init()
    outcome = fit(program, state, train_set, test_set, train_config, progress=not args.quiet)

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


if __name__ == "__main__":
    cli.run_main(PROG, main)
