"""Compare layouts from the compiled program: memory, FLOPs and collective bytes per
device beside the analytic model, and (with --steps) measured step time and speed-up
against the single-device baseline.

jaxcnn compare                                   # bundled digits, 8 devices
jaxcnn compare --synthetic 224x224x3 --batch-size 16 --steps 3
jaxcnn compare --layouts dp,hybrid --mesh data=2,model=4 --steps 0

Byte columns are per device per optimizer step, in *buffer* bytes (the array a collective
works on; see jaxcnn/analysis/hlo.py); comm_wire_bytes[_model] give ring traffic.
(`python experiments/compare_layouts.py` is the same command.)
"""

from __future__ import annotations

from jaxcnn.commands import cli, run_flags
from jaxcnn.errors import UserError
from jaxcnn.run_config import ParallelConfig

PROG = "jaxcnn compare"


def parse_flags(argv=None):
    parser = cli.experiment_parser(PROG, __doc__)
    run_flags.add_model_flags(parser)
    run_flags.add_data_flags(parser)
    g = parser.add_argument_group("comparison")
    cli.add_layouts_flag(g)
    cli.add_devices_flag(g, help="devices for each layout")
    g.add_argument("--mesh", help="force this mesh on every layout (default: each layout's own for --devices)")
    g.add_argument("--batch-size", type=int, default=64, help="global batch")
    g.add_argument("--steps", type=int, default=10, help="steps to time per layout (0: compile only)")
    g.add_argument("--microbatches", type=int, help="pipeline rows: micro-batches (default 2 x stages)")
    cli.add_output_flags(g, out="runs/compare_layouts.csv", plot="runs/compare_layouts.png")
    return parser.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_flags(argv)
    import jax  # after the flags: --help and bad flags answer at once

    from jaxcnn import plots, results
    from jaxcnn.analysis.measure import COMPARE_COLUMNS, add_speedups, measure_layout
    from jaxcnn.sharding import get_layout, mesh_for, simulate_cpu_devices

    if args.steps < 0:
        raise UserError(f"--steps must be >= 0, got {args.steps}")
    if args.devices < 1:
        raise UserError(f"--devices must be at least 1, got {args.devices}")
    model_config = cli.model_from_flags(args)
    layouts = cli.layouts_from_flag(args.layouts, skip=("single",))
    simulate_cpu_devices(args.devices, at_least=True)
    if len(jax.devices()) < args.devices:
        raise UserError(f"--devices {args.devices}, but only {len(jax.devices())} devices exist")
    devices = jax.devices()[: args.devices]  # bad meshes fail before any compile
    meshes = [
        dict(mesh_for(ParallelConfig(layout=layout.name, mesh=args.mesh), devices)[1].shape) for layout in layouts
    ]
    out, plot = cli.writable_outputs(args.out, args.plot)
    image_shape, data = cli.data_from_flags(args, model_config.num_classes)
    if data is not None and len(data) < args.batch_size:
        raise UserError(f"--batch-size {args.batch_size} exceeds the {len(data)} images in {args.data}")
    simulated = jax.devices()[0].platform == "cpu" and args.devices > 1

    rows = []
    plan = [(get_layout("single"), {"data": 1}), *zip(layouts, meshes, strict=True)]
    for i, (layout, mesh_shape) in enumerate(plan, 1):
        print(
            f"[{i}/{len(plan)}] {layout.name} on {','.join(f'{k}={v}' for k, v in mesh_shape.items())} ...", flush=True
        )
        rows.append(measure_layout(
            model_config, layout, mesh_shape, image_shape, args.batch_size, steps=args.steps, data=data,
            microbatches=args.microbatches,
        ))  # fmt: skip
    add_speedups(rows, rows[0])
    for row in rows:
        row["comm_ratio"] = row["comm_bytes"] / row["comm_bytes_model"] if row["comm_bytes_model"] else None
        row["simulated_devices"] = simulated
    results.write_csv(out, rows, COMPARE_COLUMNS + [c for c in rows[0] if c not in COMPARE_COLUMNS])
    print(format_table(rows))
    if simulated and args.steps:
        print("note: simulated CPU devices share this machine's cores: compare ratios within this run only")
    written = [out]
    if plot:
        title = f"{model_config.name}, batch {args.batch_size}, {'x'.join(map(str, image_shape))} images"
        written.append(plots.compare_plot(rows, plot, title))
    print("wrote", ", ".join(map(str, written)))
    return rows


def format_table(rows: list[dict]) -> str:
    def mib(x):
        return f"{x / 2**20:9.2f}"

    def gflop(x):
        return "       -" if x is None else f"{x / 1e9:8.3f}"

    head = (
        f"{'layout':<8} {'mesh':<18} {'params MiB':>10} {'opt MiB':>9} {'temp MiB':>9} {'GFLOP':>8} {'XLA GFLOP':>9} "
    )
    head += f"{'comm MiB':>9} {'model MiB':>9} {'ratio':>6} {'img/s':>8} {'speedup':>7} {'compile s':>10}"
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = f"{r['comm_ratio']:6.3f}" if r["comm_ratio"] else "     -"
        ips = f"{r['images_per_second']:8.0f}" if r["images_per_second"] else "       -"
        speed = f"{r['speedup']:7.2f}" if r["speedup"] else "      -"
        lines.append(
            f"{r['layout']:<8} {r['mesh']:<18} {mib(r['param_bytes_per_device']):>10} "
            f"{mib(r['optimizer_bytes_per_device'])} {mib(r['temp_bytes_per_device'])} {gflop(r['model_flops_per_device'])} "
            f"{gflop(r['flops_per_device']):>9} "
            f"{mib(r['comm_bytes'])} {mib(r['comm_bytes_model'])} {ratio} {ips} {speed} "
            f"{r['compile_seconds']:6.1f}{' (c)' if r['compile_cached'] else '    '}"
        )
    lines.append("GFLOP: the model's count per device from the layer shapes; XLA GFLOP: cost_analysis's, which")
    lines.append("  counts a depthwise conv's kernel gradient as the full convolution on XLA:CPU")
    lines.append("compile s: XLA's compile of the step (c: read from the compile cache)")
    return "\n".join(lines)
