"""Plan a layout before renting the cluster: compile every layout x mesh factorisation for
N devices ahead of time, drop what does not fit the per-device memory budget, rank the
rest by modelled step time on a hardware profile, and say why.

jaxcnn plan --devices 8 --budget 16GiB --hardware tpu-v5e --synthetic 224x224x3 --batch-size 256
jaxcnn plan --devices 8 --budget 4MiB                # bundled digits, this machine
jaxcnn plan --model resnet50 --synthetic 224x224x3 --num-classes 1000 --batch-size 256 \
    --devices 8 --budget 80GB --hardware h100,tpu-v5e --out results/plan_resnet50.csv

`--hardware` takes several profiles: every layout is compiled once and ranked on each.
(`python experiments/plan.py` is the same command.)
"""

from __future__ import annotations

from jaxcnn.analysis.hardware import PROFILES, get_profile
from jaxcnn.commands import cli, run_flags
from jaxcnn.config import parse_bytes
from jaxcnn.errors import UserError

PROG = "jaxcnn plan"


def parse_flags(argv=None):
    parser = cli.experiment_parser(PROG, __doc__)
    run_flags.add_model_flags(parser)
    run_flags.add_data_flags(parser)
    g = parser.add_argument_group("plan")
    cli.add_devices_flag(g)
    g.add_argument(
        "--hosts", type=int, default=1,
        help="the devices spread over this many hosts: collectives across them priced at the network's "
        "bandwidth and latency (default %(default)s)",
    )  # fmt: skip
    g.add_argument("--budget", default="16GiB", help="memory per device, e.g. 16GiB, 80GB, 512MiB")
    g.add_argument(
        "--hardware",
        default="h100",
        help=f"one or more of {', '.join(PROFILES)}, comma-separated (default %(default)s)",
    )
    g.add_argument("--batch-size", type=int, default=64, help="global batch")
    cli.add_layouts_flag(g, default="", help="only these layouts, comma-separated (default: all, pipeline included)")
    g.add_argument("--top", type=int, default=3)
    cli.add_output_flags(g, out_help="CSV of every candidate (optional)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_flags(argv)
    from jaxcnn import results  # after the flags (these start JAX): --help and bad flags answer at once
    from jaxcnn.analysis.planner import FSDP_TP, compile_candidates, explain, price, rank
    from jaxcnn.sharding import format_mesh, simulate_cpu_devices

    if args.devices < 1:
        raise UserError(f"--devices must be at least 1, got {args.devices}")
    if args.hosts < 1 or args.devices % args.hosts:
        raise UserError(f"--hosts {args.hosts} must divide --devices {args.devices} (the same devices on each host)")
    budget = parse_bytes(args.budget)
    profiles = [get_profile(name) for name in dict.fromkeys(cli.name_list(args.hardware))]
    if not profiles:
        raise UserError(f"--hardware names no profile; use one or more of {', '.join(PROFILES)}")
    model_config = cli.model_from_flags(args)
    (out,) = cli.writable_outputs(args.out)
    cli.layouts_from_flag(args.layouts, skip=(FSDP_TP.name,))  # an unknown name fails here, naming the known ones
    layouts = list(cli.name_list(args.layouts)) or None
    image_shape, _ = cli.data_from_flags(args, model_config.num_classes)
    simulate_cpu_devices(args.devices, at_least=True)  # compile for N devices; nothing runs on them

    def progress(i, total, layout, mesh_shape, schedule=None):
        how = f" ({schedule[0]}{f', {schedule[1]} virtual stages' if schedule[1] > 1 else ''})" if schedule else ""
        print(f"[{i + 1}/{total}] compiling {layout.name}{how} on {format_mesh(mesh_shape)}", flush=True)

    compiled = compile_candidates(
        model_config, image_shape, args.batch_size, args.devices, layouts=layouts, progress=progress
    )
    rows, plans = [], {}
    for profile in profiles:
        candidates = rank(price(compiled, profile, args.devices, args.dtype, args.hosts), budget)
        plans[profile.name] = candidates
        print(
            f"\n{model_config.name}, batch {args.batch_size}, {'x'.join(map(str, image_shape))} images, "
            f"{args.devices} x {profile.name}{f' on {args.hosts} hosts' if args.hosts > 1 else ''}, {args.dtype}:"
        )
        print(explain(candidates, budget, args.top))
        rows += [
            {"hardware": profile.name, "rank": i + 1, "layout": c.layout.name,
             "pipeline_schedule": c.schedule[0] if c.schedule else None,
             "virtual_stages": c.schedule[1] if c.schedule else None, "mesh": c.mesh,
             "fits": c.error is None and c.peak_bytes <= budget, "peak_bytes_per_device": c.peak_bytes,
             "param_bytes_per_device": c.param_bytes, "optimizer_bytes_per_device": c.optimizer_bytes,
             "devices": c.devices, "flops_per_device": c.flops, "model_flops_per_device": c.model_flops,
             "redundancy": c.redundancy,
             "wire_bytes": c.wire_bytes, "num_collectives": c.num_collectives, "num_kernels": c.num_kernels,
             "compute_seconds": c.compute_seconds, "comm_seconds": c.comm_seconds,
             "step_seconds_model": c.step_seconds, "error": c.error}
            for i, c in enumerate(candidates)
        ]  # fmt: skip
    if out:
        print("wrote", results.write_csv(out, rows))
    return plans if len(profiles) > 1 else plans[profiles[0].name]
