"""Scaling report: the single-device baseline first, then a layout on 1, 2, 4, ... devices;
speed-up, efficiency, where step time goes, and a verdict on whether scaling out pays.

jaxcnn scale                                  # dp on 1,2,4,8 devices, bundled digits
jaxcnn scale --layout hybrid --devices 2,4,8 --steps 40
jaxcnn scale --synthetic 64x64x3 --batch-size 32 --weak   # batch grows with devices
jaxcnn scale --simulate 8,64,256 --layouts dp,fsdp,hybrid --model resnet50 \
    --synthetic 224x224x3 --num-classes 1000 --batch-size 128 --weak --out results/simulate_resnet50.csv

`--simulate N[,N...]` compiles the train step for meshes of N simulated devices and runs
nothing (jaxcnn.analysis.simulate): memory, FLOPs and every collective per device read
from each compiled program, beside the analytic model's bytes and the planner's modelled
step on `--hardware` hosts of `--devices-per-host`. It writes --out, the collectives to
the same name ending `_collectives.csv`, and --plot.

Timing uses the real input pipeline (host batches prefetched and placed with their
sharding), so `input_wait_fraction` is measured. The communication share is *modelled*
(alpha-beta model on the compiled collectives, jaxcnn.analysis.planner): on simulated CPU
devices collectives are memory copies between threads on the same cores and cannot be
timed apart from compute. (`python experiments/scaling.py` is the same command.)
"""

from __future__ import annotations

import os

from jaxcnn.analysis.hardware import get_profile
from jaxcnn.commands import cli, run_flags
from jaxcnn.config import OptimConfig, TrainConfig
from jaxcnn.errors import UserError
from jaxcnn.run_config import ParallelConfig

PROG = "jaxcnn scale"


def parse_flags(argv=None):
    parser = cli.experiment_parser(PROG, __doc__)
    run_flags.add_model_flags(parser)
    run_flags.add_data_flags(parser)
    g = parser.add_argument_group("scaling")
    g.add_argument("--layout", default="dp")
    cli.add_devices_flag(g, default=(1, 2, 4, 8), help="device counts, e.g. 1,2,4,8", type=cli.int_list)
    g.add_argument("--batch-size", type=int, default=64, help="global batch (per device with --weak)")
    g.add_argument("--weak", action="store_true", help="weak scaling: the global batch grows with the devices")
    g.add_argument("--steps", type=int, default=30, help="timed steps per size (the first is not counted)")
    g.add_argument(
        "--hardware", help="profile for the modelled communication share (default: by platform; h100 with --simulate)"
    )
    g.add_argument("--simulate", type=cli.int_list, help="compile, not run, for these device counts, e.g. 8,64,256")
    g.add_argument("--layouts", help="with --simulate: several layouts, comma-separated (default: --layout)")
    g.add_argument(
        "--devices-per-host",
        type=int,
        default=8,
        help="with --simulate: hosts of this many devices (default %(default)s)",
    )
    cli.add_output_flags(g, out="runs/scaling.csv", plot="runs/scaling.png")
    return parser.parse_args(argv)


def simulate_main(args) -> list[dict]:
    """`--simulate`: compile for each device count, run nothing (module docstring)."""
    from jaxcnn import plots, results
    from jaxcnn.analysis.simulate import simulate
    from jaxcnn.sharding import simulate_cpu_devices

    counts = sorted(set(args.simulate))
    if min(counts) < 1:
        raise UserError("--simulate needs positive device counts, e.g. 8,64,256")
    if args.devices_per_host < 1:
        raise UserError(f"--devices-per-host must be at least 1, got {args.devices_per_host}")
    layouts = cli.layouts_from_flag(args.layouts or args.layout)
    out, plot = cli.writable_outputs(args.out, args.plot)
    collectives_out = out.with_name(out.stem + "_collectives.csv") if out else None
    cli.writable_outputs(collectives_out)
    model_config = cli.model_from_flags(args)
    profile = get_profile(args.hardware or "h100")
    simulate_cpu_devices(max(counts), at_least=True)
    shape, _ = cli.data_from_flags(args, model_config.num_classes)
    rows, collective_rows = simulate(
        model_config, shape, layouts, counts, lambda n: args.batch_size * n if args.weak else args.batch_size,
        profile, args.devices_per_host, progress=lambda line: print(line, flush=True),
    )  # fmt: skip
    print(f"\n{'layout':<8} {'devices':>7} {'compile':>8} {'peak MiB':>9} {'GFLOP':>8} {'XLA GFLOP':>9} {'comm MiB':>9} "
          f"{'model/compiled':>14} {'BN fwd B':>10} {'step ms':>8} {'efficiency':>10}")  # fmt: skip
    for r in rows:
        model_flops = r["model_flops_per_device"]  # None for a custom model
        gflop = "       -" if model_flops is None else f"{model_flops / 1e9:8.3f}"
        print(f"{r['layout']:<8} {r['num_devices']:>7} {r['compile_seconds']:7.1f}s {r['peak_bytes'] / 2**20:9,.0f} "
              f"{gflop} {r['flops_per_device'] / 1e9:9.3f} "
              f"{r['comm_bytes'] / 2**20:9,.1f} {r['model_over_compiled']:14.3f} {r['forward_statistics_bytes_max']:10,} "
              f"{r['step_seconds'] * 1e3:8.2f} {r['modelled_efficiency']:10.1%}")  # fmt: skip
    print(
        f"modelled on {profile.name}, hosts of {args.devices_per_host} devices; nothing ran. GFLOP per device: the "
        "model's count (what the step time prices), XLA's cost_analysis beside it"
    )
    if out:
        results.write_csv(out, rows)
        results.write_csv(collectives_out, collective_rows)
        print("wrote", out, collectives_out)
    if plot:
        title = f"{model_config.name}, {'weak' if args.weak else 'strong'} scaling, batch {args.batch_size}{' a device' if args.weak else ''}: compiled, not run"
        print("wrote", plots.simulate_plot(rows, plot, title))
    return rows


def _profile_for(device, name):
    if name:
        return get_profile(name)
    if device.platform == "cpu":
        return get_profile("cpu-here")
    kind = device.device_kind.lower()
    return get_profile(next((p for p in ("h200", "h100", "a100") if p in kind), "h100"))


def main(argv=None) -> list[dict]:
    args = parse_flags(argv)
    if args.simulate:
        return simulate_main(args)
    import jax  # after the flags: --help and bad flags answer at once

    from jaxcnn import plots, results
    from jaxcnn.analysis.cost import program_cost
    from jaxcnn.analysis.planner import comm_seconds
    from jaxcnn.analysis.verdicts import step_verdicts, verdict
    from jaxcnn.build import build_program
    from jaxcnn.data import synthetic_dataset
    from jaxcnn.fit import fit
    from jaxcnn.sharding import format_mesh, get_layout, mesh_for, quiet_fallbacks, simulate_cpu_devices

    layout = get_layout(args.layout)
    if not args.devices or min(args.devices) < 1:
        raise UserError("--devices needs positive counts, e.g. 1,2,4,8")
    if args.steps < 2:
        raise UserError(f"--steps must be at least 2 (the first is warm-up), got {args.steps}")
    counts = sorted(set(args.devices))
    out, plot = cli.writable_outputs(args.out, args.plot)
    model_config = cli.model_from_flags(args)
    simulate_cpu_devices(max(counts), at_least=True)
    devices = jax.devices()
    if len(devices) < max(counts):
        raise UserError(f"--devices asks for {max(counts)} devices, but only {len(devices)} exist")
    meshes = {n: mesh_for(ParallelConfig(layout=layout.name), devices[:n])[1] for n in counts}
    simulated = devices[0].platform == "cpu" and max(counts) > 1
    profile = _profile_for(devices[0], args.hardware)

    def batch_for(n):
        return args.batch_size * n if args.weak else args.batch_size

    largest_batch = batch_for(max(counts))
    shape, data = cli.data_from_flags(args, model_config.num_classes)
    if data is None:
        data = synthetic_dataset(shape, largest_batch * args.steps, model_config.num_classes, 0)

    def run(run_layout, mesh, batch):
        config = TrainConfig(batch_size=batch, epochs=10**6, max_steps=args.steps)
        with quiet_fallbacks():
            program = build_program(
                model_config, OptimConfig(), run_layout, mesh, data.image_shape, batch, args.steps, with_eval=False
            )
        outcome = fit(program, program.init(), data, None, config, progress=False)
        cost = program_cost(program)
        comm = comm_seconds(cost, profile, dict(mesh.shape))
        step_seconds = batch / outcome.images_per_second
        return {
            "layout": run_layout.name,
            "mesh": format_mesh(dict(mesh.shape)),
            "num_devices": mesh.size,
            "global_batch_size": batch,
            "steps": outcome.steps,
            "step_seconds": step_seconds,
            "images_per_second": outcome.images_per_second,
            "input_wait_fraction": outcome.input_wait_fraction,
            "comm_bytes": cost.comm_bytes,
            "comm_wire_bytes": cost.wire_bytes,
            "comm_fraction_model": min(1.0, comm / step_seconds),
            "simulated_devices": simulated,
        }

    print(f"[baseline] single on 1 device, batch {batch_for(1)} ...", flush=True)
    baseline = run(*mesh_for(ParallelConfig(layout="single"), devices[:1]), batch_for(1))
    rows = []
    for n in counts:
        print(
            f"[{n} device(s)] {layout.name} on {format_mesh(dict(meshes[n].shape))}, batch {batch_for(n)} ...",
            flush=True,
        )
        rows.append(run(layout, meshes[n], batch_for(n)))
    for r in rows:
        # weak scaling compares throughput; strong scaling the same (fixed batch): images/s ratio
        r["speedup"] = r["images_per_second"] / baseline["images_per_second"]
        r["efficiency"] = r["speedup"] / r["num_devices"]
    for r, word in zip(rows, step_verdicts(rows), strict=True):
        r["verdict"] = word
    summary = verdict(rows)
    results.write_csv(
        out, [{**baseline, "speedup": 1.0, "efficiency": 1.0, "verdict": "single-device baseline"}, *rows]
    )

    print(
        f"\n{'devices':>7} {'mesh':<18} {'img/s':>8} {'speedup':>7} {'effic.':>6} {'input wait':>10} {'comm (model)':>12}  verdict"
    )
    print(f"{'single':>7} {'data=1':<18} {baseline['images_per_second']:8.0f} {1.0:7.2f} {1.0:6.2f} "
          f"{baseline['input_wait_fraction']:10.1%} {'-':>12}  baseline")  # fmt: skip
    for r in rows:
        print(f"{r['num_devices']:>7} {r['mesh']:<18} {r['images_per_second']:8.0f} {r['speedup']:7.2f} "
              f"{r['efficiency']:6.2f} {r['input_wait_fraction']:10.1%} {r['comm_fraction_model']:12.1%}  {r['verdict']}")  # fmt: skip
    print(f"verdict: {summary}")
    if simulated:
        print(
            f"note: these are simulated devices: all {max(counts)} share this machine's "
            f"{os.cpu_count()} cores, so the speed-up measures the program's overheads, "
            "not what real devices would give"
        )
    title = f"{layout.name} scaling, {model_config.name}, {'weak' if args.weak else 'strong'} (global batch {args.batch_size}{' per device' if args.weak else ''})"
    if simulated:
        title += "\nsimulated CPU devices sharing one host's cores"
    print("wrote", out, plots.scaling_plot(rows, plot, title, summary))
    return rows
