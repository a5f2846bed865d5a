"""Prove every layout computes what one device computes, on your model: train K steps
under `single` and under each layout, and print the largest relative loss difference and
the collectives each layout compiled to.

python experiments/check_layouts.py                              # default model, 8 devices
python experiments/check_layouts.py --steps 20 --layouts dp,tp --out results/check.csv
"""

from __future__ import annotations

import warnings
from pathlib import Path

import jax
import numpy as np

from jaxcnn import cli, results
from jaxcnn.config import OptimConfig, TrainConfig
from jaxcnn.data import load_csv, parse_image_shape, synthetic_dataset
from jaxcnn.errors import UserError
from jaxcnn.sharding import LAYOUTS, build_mesh, format_mesh, get_layout, parse_mesh, resolve_mesh
from jaxcnn.sharding.inspect import KINDS
from jaxcnn.sharding.lint import lint
from jaxcnn.sharding.mesh import check_layout_axes, simulate_cpu_devices
from jaxcnn.sharding.pipeline import build_pipeline_program, stage_collectives
from jaxcnn.train import build_program, fit

PROG = "check_layouts.py"


def parse_flags(argv=None):
    parser = cli.FlagParser(prog=PROG, description=__doc__, formatter_class=cli.argparse.RawDescriptionHelpFormatter)
    cli.add_model_flags(parser)
    cli.add_data_flags(parser)
    g = parser.add_argument_group("check")
    g.add_argument("--layouts", default=",".join(n for n in LAYOUTS if n != "single"), help="comma-separated")
    g.add_argument("--devices", type=int, default=cli.DEFAULT_SIMULATED_DEVICES, help="devices per layout mesh")
    g.add_argument("--steps", type=int, default=10, help="training steps compared")
    g.add_argument("--batch-size", type=int, default=64)
    g.add_argument("--lr", type=float, default=1e-2)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--out", default="results/layout_equivalence.csv")
    return parser.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_flags(argv)
    layouts = [get_layout(name.strip()) for name in args.layouts.split(",") if name.strip()]
    if args.steps < 1:
        raise UserError(f"--steps must be at least 1, got {args.steps}")
    model_config = cli.model_from_flags(args)
    optim = OptimConfig(learning_rate=args.lr, warmup_steps=2)
    train = TrainConfig(batch_size=args.batch_size, epochs=1, max_steps=args.steps, seed=args.seed)
    out = results.ensure_writable_dir(Path(args.out).parent) / Path(args.out).name
    if args.synthetic:
        dataset = synthetic_dataset(parse_image_shape(args.synthetic), args.synthetic_size, model_config.num_classes, 0)
    else:
        dataset = load_csv(args.data, channels=args.channels, num_classes=model_config.num_classes)
    simulate_cpu_devices(args.devices, at_least=True)
    if len(jax.devices()) < args.devices:
        raise UserError(f"--devices {args.devices} but only {len(jax.devices())} devices exist")

    def run(layout, mesh_shape):
        mesh = build_mesh(mesh_shape)
        build = build_pipeline_program if layout.stage_axis else build_program
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fallbacks show in the lint's count below
            program = build(
                model_config, optim, layout, mesh, dataset.image_shape, train.batch_size, args.steps, seed=args.seed,
                with_eval=False,
            )  # fmt: skip
        outcome = fit(program, program.init(), dataset, None, train, progress=False)
        return np.asarray(outcome.loss_history), program

    reference, _ = run(get_layout("single"), {"data": 1})
    rows = []
    for layout in layouts:
        mesh_shape = resolve_mesh(parse_mesh(layout.default_mesh), args.devices)
        check_layout_axes(layout.mesh_axes, mesh_shape, layout.name, layout.optional_axes)
        losses, program = run(layout, mesh_shape)
        if layout.stage_axis:  # per-stage programs: their collectives over one step, all stages
            report = lint(layout, program.mesh, program.placements)
            report.collectives = [c for stage in stage_collectives(program) for c in stage]
        else:
            report = lint(layout, program.mesh, program.placements, program.train_step)
        row = {
            "layout": layout.name,
            "mesh": format_mesh(mesh_shape),
            "steps": args.steps,
            "max_rel_loss_diff": float(np.max(np.abs(losses - reference) / np.abs(reference))),
            "param_bytes_per_device": report.bytes_per_device,
            "lint_warnings": len(report.warnings),
        }
        seen = []
        for kind in KINDS:
            found = [c for c in report.collectives if c.kind == kind]
            column = kind.replace("-", "_")
            row[f"count_{column}"], row[f"bytes_{column}"] = len(found), sum(c.buffer_bytes for c in found)
            if found:
                seen.append(f"{kind} {len(found)}x {row[f'bytes_{column}']:,} B")
        rows.append(row)
        seen = ", ".join(seen)
        extra = f"   + {2 * program.microbatches} sends between stages" if layout.stage_axis else ""
        print(f"{layout.name:<8} {row['mesh']:<18} max rel loss diff {row['max_rel_loss_diff']:.2e}   {seen}{extra}")
    results.write_csv(out, rows)
    print("wrote", out)
    return rows


if __name__ == "__main__":
    cli.run_main(PROG, main)
