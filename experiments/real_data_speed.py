"""Is the input pipeline the bottleneck on real data? A real dataset through the real
loader, against the same model stepping on an in-memory batch of the same shape.

python experiments/real_data_speed.py                        # Fashion-MNIST, whole epochs
python experiments/real_data_speed.py --max-steps 100 --rounds 1 --out runs/real_data_speed.csv

Each round trains one epoch (or --max-steps) on the dataset as `jaxcnn train` does: the
same Loader at the same worker count (the toolkit's default unless --input-workers: none
for data in memory, one per core for files), every batch drawn, gathered and placed on
the devices while the step before computes. Then as many steps with no loader at all, on
one batch of random images already on the devices: the compute bound. Both start from a
fresh state and leave the first (warm-up) step out. Rounds alternate the two, so drifts in
the machine's speed hit both alike. `share_of_synthetic` is the real data's images/s over
the in-memory images/s of the same round: the share of the compute bound the input
pipeline lets through (the issue's bar: 0.95). For decoded image files (JPEG folders) see
input_bound.py.
"""

from __future__ import annotations

import statistics

from jaxcnn import results
from jaxcnn.analysis.measure import random_batch, time_steps
from jaxcnn.build import build_program
from jaxcnn.commands import cli, run_flags
from jaxcnn.config import OptimConfig, TrainConfig, epoch_steps
from jaxcnn.data import Loader, load_named
from jaxcnn.errors import UserError
from jaxcnn.fit import fit
from jaxcnn.run_config import DataConfig
from jaxcnn.sharding import quiet_fallbacks

PROG = "real_data_speed.py"
COLUMNS = [
    "round", "input", "workers", "steps", "images_per_second", "input_wait_fraction", "share_of_synthetic",
    "global_batch_size", "image_shape", "model", "layout", "mesh",
]  # fmt: skip


def parse_flags(argv=None):
    parser = cli.experiment_parser(PROG, __doc__)
    run_flags.add_model_flags(parser)
    g = parser.add_argument_group("experiment")
    g.add_argument("--dataset", default="fashion-mnist", help="a named dataset (default %(default)s)")
    g.add_argument("--data-dir", help="where --dataset's files are")
    g.add_argument("--download", action="store_true", help="fetch --dataset's files when not found")
    g.add_argument("--batch-size", type=int, default=128, help="global batch (default %(default)s)")
    g.add_argument("--max-steps", type=int, help="steps per run (default: one epoch)")
    g.add_argument("--rounds", type=int, default=2, help="real/synthetic pairs (default %(default)s)")
    g.add_argument("--input-workers", type=int, help="grain worker processes (default: the toolkit's)")
    cli.add_layout_flags(g)
    g.add_argument("--host-devices", type=int, help="simulated CPU devices")
    cli.add_output_flags(g, out="runs/real_data_speed.csv")
    return parser.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_flags(argv)
    if args.batch_size < 1 or args.rounds < 1 or (args.max_steps is not None and args.max_steps < 3):
        raise UserError("--batch-size and --rounds must be positive and --max-steps at least 3")
    (out,) = cli.writable_outputs(args.out)
    real, _ = load_named(args.dataset, args.data_dir, args.download)
    workers = DataConfig(input_workers=args.input_workers).workers_for(real.in_memory)
    train = TrainConfig(batch_size=args.batch_size, epochs=1, max_steps=args.max_steps)
    steps = sum(epoch_steps(len(real), train))
    model = cli.model_from_flags(args)
    images, labels = random_batch(real.image_shape, args.batch_size, model.num_classes)
    layout, mesh = cli.mesh_from_flags(args)
    with quiet_fallbacks():
        program = build_program(
            model, OptimConfig(), layout, mesh, real.image_shape, args.batch_size, steps, with_eval=False
        )  # fmt: skip
    shape, mesh_text = "x".join(map(str, real.image_shape)), ",".join(f"{k}={v}" for k, v in mesh.shape.items())
    print(f"{PROG}: {args.dataset} ({len(real):,} images {shape}) against an in-memory batch; {model.name}, "
          f"{layout.name} on {mesh_text}, batch {args.batch_size}, {steps} steps a run, {workers} input workers")  # fmt: skip
    rows = []
    for round_ in range(1, args.rounds + 1):
        outcome = fit(program, program.init(), Loader(real, workers=workers), None, train, progress=False)
        seconds, _ = time_steps(program, program.init(), images, labels, steps - 1)  # + 1 untimed warm-up step
        measured = {
            args.dataset: (workers, outcome.steps, outcome.images_per_second, outcome.input_wait_fraction),
            "synthetic in memory": (None, len(seconds) + 1, args.batch_size * len(seconds) / sum(seconds), 0.0),
        }
        for name, (loader_workers, taken, images_per_second, wait) in measured.items():
            rows.append({
                "round": round_, "input": name, "workers": loader_workers, "steps": taken,
                "images_per_second": images_per_second, "input_wait_fraction": wait,
                "global_batch_size": args.batch_size, "image_shape": shape, "model": model.name,
                "layout": layout.name, "mesh": mesh_text,
            })  # fmt: skip
            print(f"round {round_}/{args.rounds} {name:>20}: {images_per_second:8,.0f} images/s, "
                  f"devices idle for input {wait:6.1%}", flush=True)  # fmt: skip
        real_row, synthetic_row = rows[-2:]
        real_row["share_of_synthetic"] = real_row["images_per_second"] / synthetic_row["images_per_second"]
        synthetic_row["share_of_synthetic"] = 1.0
    share = statistics.median(r["share_of_synthetic"] for r in rows if r["input"] == args.dataset)
    print(f"{args.dataset} through the loader ({workers} workers): {share:.1%} of the synthetic images/s "
          f"(median over {args.rounds} round(s))")  # fmt: skip
    results.write_csv(out, rows, COLUMNS)
    print("wrote", out)
    return rows


if __name__ == "__main__":
    cli.run_main(PROG, main)
