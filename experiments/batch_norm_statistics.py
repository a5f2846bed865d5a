"""What per-device batch norm costs in accuracy: the global batch's statistics (one
collective each way a layer) against each device's own (none), per images per device.

python experiments/batch_norm_statistics.py                      # dp over 8 devices, bundled digits
python experiments/batch_norm_statistics.py --per-device 2,4,16 --epochs 10 --data train.csv --test-data test.csv

Each pair trains the same steps on the same data from the same initial state; the global
batch is 8 x the images per device. Test accuracy is read with the running statistics,
which both variants average over the whole batch. Writes a CSV and prints one line a run.
"""

from __future__ import annotations

from dataclasses import replace

from jaxcnn import results
from jaxcnn.analysis.hlo import collectives
from jaxcnn.build import build_program
from jaxcnn.commands import cli, run_flags
from jaxcnn.config import NORM_STATISTICS, OptimConfig, TrainConfig, total_steps
from jaxcnn.data import load_csv
from jaxcnn.fit import fit
from jaxcnn.sharding import format_mesh

PROG = "batch_norm_statistics.py"
COLUMNS = [
    "norm_statistics", "images_per_device", "batch_size", "collectives_per_step", "final_train_loss",
    "test_accuracy", "steps", "layout", "mesh", "model",
]  # fmt: skip


def parse_flags(argv=None):
    parser = cli.experiment_parser(PROG, __doc__)
    run_flags.add_model_flags(parser)
    g = parser.add_argument_group("experiment")
    cli.add_dataset_flags(g, test_help="a labelled CSV to measure accuracy on")
    cli.add_layout_flags(g, layout="dp", mesh="data=8", mesh_help=None)
    g.add_argument("--per-device", type=cli.int_list, default=(2, 4, 16), help="images per device, e.g. 2,4,16")
    g.add_argument("--epochs", type=int, default=4)
    g.add_argument("--lr", type=float, default=2e-3)
    g.add_argument("--seed", type=int, default=0)
    cli.add_output_flags(g, out="runs/batch_norm_statistics.csv")
    return parser.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_flags(argv)
    model_config = cli.model_from_flags(args)
    train_set = load_csv(args.data, num_classes=model_config.num_classes)
    test_set = load_csv(args.test_data, num_classes=model_config.num_classes)
    layout, mesh = cli.mesh_from_flags(args)
    devices = mesh.shape.get("data", 1)
    (out,) = cli.writable_outputs(args.out)
    runs = [(n, stats) for n in args.per_device for stats in NORM_STATISTICS]
    rows = []
    for i, (per_device, stats) in enumerate(runs, 1):
        batch = per_device * devices
        config = replace(model_config, norm_statistics=stats)
        train_config = TrainConfig(batch_size=batch, epochs=args.epochs, seed=args.seed)
        steps = total_steps(len(train_set), train_config)
        print(f"[{i}/{len(runs)}] {stats}, {per_device} images a device (batch {batch}) ...", flush=True)
        program = build_program(
            config, OptimConfig(learning_rate=args.lr), layout, mesh, train_set.image_shape, batch, steps,
            seed=args.seed,
        )  # fmt: skip
        outcome = fit(program, program.init(), train_set, test_set, train_config, progress=False)
        row = {
            "norm_statistics": stats,
            "images_per_device": per_device,
            "batch_size": batch,
            "collectives_per_step": sum(c.repeats for c in collectives(program.train_step.as_text(), mesh.size)),
            "final_train_loss": outcome.epochs[-1]["train_loss"],
            "test_accuracy": outcome.final_eval.accuracy,
            "steps": outcome.steps,
            "layout": layout.name,
            "mesh": format_mesh(dict(mesh.shape)),
            "model": config.name,
        }
        rows.append(row)
        print(
            f"    {row['collectives_per_step']} collectives/step, final loss {row['final_train_loss']:.4f}, "
            f"test accuracy {100 * row['test_accuracy']:.2f}%",
            flush=True,
        )
    results.write_csv(out, rows, COLUMNS)
    print("wrote", out)
    return rows


if __name__ == "__main__":
    cli.run_main(PROG, main)
