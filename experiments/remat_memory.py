"""Memory and FLOPs per rematerialisation policy, read from the compiled train step.

python experiments/remat_memory.py                                 # 224x224x3, batch 16, one device
python experiments/remat_memory.py --layout dp --mesh data=8 --steps 0

For each `--remat` policy (none, full, dots, names): per-device temp bytes (activations
kept for the backward pass + scratch, from `memory_analysis`), peak bytes, FLOPs per step
(`cost_analysis`: recomputation shows up here), their change against `none`, and with
--steps the median step time. Losses are unchanged by construction (tests check it).
"""

from __future__ import annotations

import dataclasses

from jaxcnn import plots, results
from jaxcnn.analysis.measure import measure_layout
from jaxcnn.commands import cli, run_flags
from jaxcnn.config import REMAT_POLICIES
from jaxcnn.data import parse_image_shape
from jaxcnn.errors import UserError
from jaxcnn.sharding import format_mesh

PROG = "remat_memory.py"
COLUMNS = [
    "remat", "remat_names", "layout", "mesh", "image_shape", "global_batch_size", "temp_bytes_per_device",
    "peak_bytes_per_device", "flops_per_device", "temp_change", "flops_change", "step_seconds", "images_per_second",
]  # fmt: skip


def parse_flags(argv=None):
    parser = cli.experiment_parser(PROG, __doc__)
    run_flags.add_model_flags(parser)
    g = parser.add_argument_group("experiment")
    g.add_argument("--synthetic", default="224x224x3", metavar="HxWxC", help="image shape (default %(default)s)")
    cli.add_layout_flags(g)
    g.add_argument("--batch-size", type=int, default=16, help="global batch (default %(default)s)")
    g.add_argument("--policies", default=",".join(REMAT_POLICIES), help="comma-separated --remat policies")
    g.add_argument("--steps", type=int, default=3, help="steps to time per policy (0: compile only)")
    cli.add_output_flags(g, out="runs/remat_memory.csv", plot="runs/remat_memory.png")
    return parser.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_flags(argv)
    if args.steps < 0:
        raise UserError(f"--steps must be >= 0, got {args.steps}")
    base = cli.model_from_flags(args)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    configs = [dataclasses.replace(base, remat=p) for p in policies]  # bad names fail here, before compiling
    image_shape = parse_image_shape(args.synthetic)
    layout, mesh = cli.mesh_from_flags(args)
    mesh_shape = dict(mesh.shape)
    out, plot = cli.writable_outputs(args.out, args.plot)

    rows = []
    for i, config in enumerate(configs, 1):
        print(f"[{i}/{len(configs)}] --remat {config.remat} ...", flush=True)
        row = measure_layout(config, layout, mesh_shape, image_shape, args.batch_size, steps=args.steps)
        row["remat_names"] = ",".join(config.remat_names) if config.remat == "names" else ""
        rows.append(row)
    baseline = next((r for r in rows if r["remat"] == "none"), rows[0])
    for row in rows:
        row["temp_change"] = row["temp_bytes_per_device"] / baseline["temp_bytes_per_device"] - 1
        row["flops_change"] = row["flops_per_device"] / baseline["flops_per_device"] - 1
    results.write_csv(out, rows, COLUMNS)
    print(format_table(rows))
    title = f"{base.name}, {args.synthetic} images, batch {args.batch_size}, {layout.name} {format_mesh(mesh_shape)}"
    print("wrote", out, plots.remat_plot(rows, plot, title))
    return rows


def format_table(rows: list[dict]) -> str:
    head = f"{'remat':<7} {'temp MiB':>9} {'change':>7} {'peak MiB':>9} {'GFLOP':>8} {'change':>7} {'step s':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        step = f"{r['step_seconds']:7.3f}" if r["step_seconds"] else "      -"
        lines.append(
            f"{r['remat']:<7} {r['temp_bytes_per_device'] / 2**20:9.1f} {r['temp_change']:+7.1%} "
            f"{r['peak_bytes_per_device'] / 2**20:9.1f} {r['flops_per_device'] / 1e9:8.2f} {r['flops_change']:+7.1%} {step}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    cli.run_main(PROG, main)
