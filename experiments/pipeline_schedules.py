"""Memory per stage, bubble and step time of the pipeline's schedules: GPipe, 1F1B, interleaved 1F1B.

python experiments/pipeline_schedules.py                # the default CNN and ResNet-18, ~2 min on 2 cores
python experiments/pipeline_schedules.py --models resnet18:32x32x3:2 --microbatches 4,8

For each model (NAME:HxWxC:STAGES, random images of that shape), each schedule (gpipe;
1f1b; interleaved: 1f1b with --virtual-stages V) and each M in --microbatches: the pipeline
program on STAGES simulated CPU devices, one a stage, a global batch of M x
--micro-batch-size images (the micro-batch stays the same size as M grows, as the GPipe and
PipeDream papers compare), --steps train steps on it. Per stage: the most bytes of
micro-batch inputs and output gradients held in flight during the last step
(ScheduleRunner.peak_held_bytes), the most micro-batches it held anything of at once (the
same bookkeeping, counted), the bytes over one micro-batch's input and output gradient at
each of the stage's chunks, the compiled programs' largest temp bytes,
parameters (+ batch-norm statistics) and optimizer state, their sum ("memory per stage";
the gradient accumulator, one more copy of the parameters, is not in it), the bubble read
from the schedule's timeline beside the formula (S-1)/(V*M+S-1), and the median step time
of the steps after the first (simulated devices share the machine's cores: times compare
within one run only).

--timeline-plot draws the schedules' timelines at --timeline-stages and
--timeline-microbatches (stages as rows, ticks as columns), from the schedule alone: nothing
compiles.
"""

from __future__ import annotations

import os
import platform
import statistics
import time

from jaxcnn import plots, results
from jaxcnn.commands import cli
from jaxcnn.config import DEFAULT_MODEL, ModelConfig
from jaxcnn.data import parse_image_shape
from jaxcnn.errors import UserError

PROG = "pipeline_schedules.py"
SCHEDULES = ("gpipe", "1f1b", "interleaved")
COLUMNS = [
    "model", "image_shape", "stages", "schedule", "virtual_stages", "microbatches", "micro_batch_size",
    "global_batch_size", "stage", "held_bytes", "held_microbatches", "microbatch_bytes", "held_over_microbatch_bytes",
    "temp_bytes", "param_bytes", "optimizer_bytes", "memory_bytes", "timeline_bubble", "formula_bubble", "ticks",
    "step_seconds", "steps", "machine",
]  # fmt: skip


def parse_flags(argv=None):
    parser = cli.experiment_parser(PROG, __doc__)
    g = parser.add_argument_group("experiment")
    g.add_argument(
        "--models", default=f"{DEFAULT_MODEL}:8x8x1:2,resnet18:32x32x3:4", help="comma-separated NAME:HxWxC:STAGES"
    )
    g.add_argument("--schedules", default=",".join(SCHEDULES), help="some of " + ", ".join(SCHEDULES))
    g.add_argument("--virtual-stages", type=int, default=2, help="chunks a stage under interleaved")
    g.add_argument("--microbatches", type=cli.int_list, default=(4, 8, 16), help="M values")
    g.add_argument("--micro-batch-size", type=int, default=8, help="images a micro-batch (global batch: M x this)")
    g.add_argument("--steps", type=int, default=3, help="train steps per point; the first is not timed")
    g.add_argument("--timeline-stages", type=int, default=4)
    g.add_argument("--timeline-microbatches", type=int, default=8)
    cli.add_output_flags(g, out="runs/pipeline_schedules.csv", plot="runs/pipeline_schedules.png")
    g.add_argument("--timeline-plot", default="runs/pipeline_timeline.png")
    return parser.parse_args(argv)


def parse_models(text: str) -> list[tuple[ModelConfig, tuple[int, int, int], int]]:
    models = []
    for item in cli.name_list(text):
        try:
            name, shape, stages = item.split(":")
            stages = int(stages)
        except ValueError:
            raise UserError(f"--models entry {item!r} is not NAME:HxWxC:STAGES, e.g. resnet18:32x32x3:4") from None
        models.append((ModelConfig(name=name), parse_image_shape(shape), stages))
    return models


def machine() -> str:
    """The CPU's name and core count (the simulated devices all share them)."""
    name = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {os.cpu_count()} cores"


def schedule_settings(schedule: str, virtual: int) -> tuple[str, int]:
    """(--pipeline-schedule, --virtual-stages) of a schedule this script names."""
    return ("1f1b", virtual) if schedule == "interleaved" else (schedule, 1)


def timelines(schedules: list[str], stages: int, virtual: int, microbatches: int) -> dict[str, list]:
    from jaxcnn.pipeline.schedule import stage_orders, ticks

    out = {}
    for schedule in schedules:
        name, v = schedule_settings(schedule, virtual)
        out[f"{schedule} (V={v})" if v > 1 else schedule] = ticks(
            stage_orders(name, stages, v, microbatches), stages * v
        )
    return out


def microbatches_in_flight(timeline: list, chunks: int) -> list[int]:
    """Per stage, the most micro-batches it held anything of at once (an input or an output
    gradient, at any of its chunks): the runner's bookkeeping replayed on the dispatch order,
    counting micro-batches instead of bytes."""
    stages, last = len(timeline[0]), chunks - 1
    held, peak = [set() for _ in range(stages)], [0] * stages

    def add(c, i, what):
        held[c % stages].add((c, i, what))
        peak[c % stages] = max(peak[c % stages], len({j for _, j, _ in held[c % stages]}))

    for a in (a for tick in timeline for a in tick if a is not None):
        if a.kind == "F" and a.chunk < last:
            add(a.chunk + 1, a.microbatch, "x")
        elif a.kind == "B":
            held[a.chunk % stages] -= {(a.chunk, a.microbatch, "x"), (a.chunk, a.microbatch, "y")}
            if a.chunk > 0:
                add(a.chunk - 1, a.microbatch, "y")
    return peak


def measure(config, image_shape, stages, schedule, virtual, m, micro, steps, devices) -> list[dict]:
    """One (model, schedule, M): build, run `steps` steps, one row per stage."""
    import jax

    from jaxcnn.analysis.measure import TIMING_OPTIM, random_batch
    from jaxcnn.build import build_program
    from jaxcnn.run_config import ParallelConfig
    from jaxcnn.sharding import mesh_for
    from jaxcnn.sharding.partition import quiet_fallbacks

    name, v = schedule_settings(schedule, virtual)
    batch = m * micro
    layout, mesh = mesh_for(ParallelConfig(layout="pipeline", mesh=f"stage={stages}"), devices[:stages])
    with quiet_fallbacks():
        program = build_program(
            config, TIMING_OPTIM, layout, mesh, image_shape, batch, 1000, microbatches=m, with_eval=False,
            pipeline_schedule=name, virtual_stages=v,
        )  # fmt: skip
    images, labels = program.train_input.place(*random_batch(image_shape, batch, config.num_classes))
    state, seconds = program.init(), []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = program.train_step(state, images, labels)
        jax.block_until_ready(metrics)
        seconds.append(time.perf_counter() - start)
    runner, anatomy, record = program.pipeline, program.anatomy, program.record
    last = len(runner.programs) - 1
    in_flight = microbatches_in_flight(runner.timeline, len(runner.programs))
    rows = []
    for g in range(stages):
        chunks = range(g, len(runner.programs), stages)
        one = sum(runner.programs[c]["x_bytes"] + (runner.programs[c]["y_bytes"] if c < last else 0) for c in chunks)
        temp = max(part.compiled.memory_analysis().temp_size_in_bytes for part in anatomy.stages[g])
        held = runner.peak_held_bytes[g]
        param, opt = anatomy.stage_param_bytes[g], anatomy.stage_optimizer_bytes[g]
        rows.append({
            "model": config.name, "image_shape": "x".join(map(str, image_shape)), "stages": stages,
            "schedule": schedule, "virtual_stages": v, "microbatches": m, "micro_batch_size": micro,
            "global_batch_size": batch, "stage": g, "held_bytes": held, "held_microbatches": in_flight[g],
            "microbatch_bytes": one, "held_over_microbatch_bytes": held / one, "temp_bytes": temp,
            "param_bytes": param, "optimizer_bytes": opt, "memory_bytes": held + temp + param + opt,
            "timeline_bubble": record["timeline_bubble_fraction"], "formula_bubble": record["bubble_fraction"],
            "ticks": len(runner.timeline), "step_seconds": statistics.median(seconds[1:]), "steps": steps,
        })  # fmt: skip
    return rows


def main(argv=None) -> list[dict]:
    args = parse_flags(argv)
    schedules = cli.some_of(args.schedules, SCHEDULES, "--schedules")
    models = parse_models(args.models)
    if args.steps < 2 or args.micro_batch_size < 1 or args.virtual_stages < 2 or min(args.microbatches, default=0) < 1:
        raise UserError("use --steps >= 2 (the first is not timed), --virtual-stages >= 2, and a --micro-batch-size "
                        "and every --microbatches >= 1")  # fmt: skip
    out, plot, timeline_plot = cli.writable_outputs(args.out, args.plot, args.timeline_plot)

    from jaxcnn.pipeline.split import stage_groups
    from jaxcnn.sharding import simulate_cpu_devices

    for config, shape, stages in models:  # too few layers, or M not a multiple of S: refused before compiling
        stage_groups(config, shape, stages, None, args.virtual_stages if "interleaved" in schedules else 1)
        bad = [m for m in args.microbatches if m % stages] if "interleaved" in schedules else []
        if bad:
            raise UserError(
                f"interleaved runs micro-batches in groups of {stages} stages: M={bad[0]} is not a multiple"
            )
    if timeline_plot:
        shown = timelines(schedules, args.timeline_stages, args.virtual_stages, args.timeline_microbatches)
        title = f"{args.timeline_stages} stages, {args.timeline_microbatches} micro-batches"
        print("wrote", plots.pipeline_timeline_plot(shown, timeline_plot, title), flush=True)

    simulate_cpu_devices(max(stages for _, _, stages in models), at_least=True)
    import jax

    host = machine()
    print(f"{PROG}: {host}, {len(jax.devices())} simulated CPU devices (one a stage), jax {jax.__version__}; "
          f"step times compare within this run only", flush=True)  # fmt: skip
    points = [(model, m, s) for model in models for m in args.microbatches for s in schedules]
    rows = []
    for i, ((config, shape, stages), m, schedule) in enumerate(points, 1):
        print(f"[{i}/{len(points)}] {config.name} {'x'.join(map(str, shape))} S={stages} {schedule} M={m} ...",
              end=" ", flush=True)  # fmt: skip
        start = time.perf_counter()
        point = measure(config, shape, stages, schedule, args.virtual_stages, m, args.micro_batch_size, args.steps,
                        jax.devices())  # fmt: skip
        for row in point:
            row["machine"] = host
        rows += point
        held = "/".join(str(r["held_microbatches"]) for r in point)
        print(f"held {held} micro-batches, step {point[0]['step_seconds']:.3f} s "
              f"({time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
    print(format_table(rows))
    if out:
        print("wrote", results.write_csv(out, rows, COLUMNS))
    if plot:
        title = f"micro-batches of {args.micro_batch_size} images, simulated CPU devices"
        print("wrote", plots.pipeline_memory_plot(rows, plot, title))
    return rows


def format_table(rows: list[dict]) -> str:
    """One line per (model, schedule, M): per stage held micro-batches and memory, bubble, step."""
    head = (f"{'model':<34} {'schedule':<11} {'M':>3} {'held (micro-batches)':<21} {'held MiB':<21} "
            f"{'memory MiB':<23} {'bubble':>6} {'formula':>7} {'step s':>7}")  # fmt: skip
    lines, mib = [head, "-" * len(head)], 2**20
    keys = dict.fromkeys((r["model"], r["schedule"], r["microbatches"]) for r in rows)
    for key in keys:
        stage = [r for r in rows if (r["model"], r["schedule"], r["microbatches"]) == key]
        held = "/".join(str(r["held_microbatches"]) for r in stage)
        held_mib = "/".join(f"{r['held_bytes'] / mib:.2f}" for r in stage)
        memory = "/".join(f"{r['memory_bytes'] / mib:.1f}" for r in stage)
        r = stage[0]
        lines.append(
            f"{key[0]:<34} {key[1]:<11} {key[2]:>3} {held:<21} {held_mib:<21} {memory:<23} "
            f"{r['timeline_bubble']:6.1%} {r['formula_bubble']:7.1%} {r['step_seconds']:7.3f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    cli.run_main(PROG, main)
