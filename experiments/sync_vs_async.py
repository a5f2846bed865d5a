"""Synchronous all-reduce against local SGD and stale (asynchronous) gradients.

python experiments/sync_vs_async.py                        # dp over 8 devices, bundled digits
python experiments/sync_vs_async.py --layout hybrid --mesh data=4,model=2 --epochs 5

Rules: allreduce; local SGD averaging every H in {2, 8} steps; staleness T in {1, 4}.
Each trains the same steps on the same data. Bytes per step are read from the compiled
programs: the train step's collectives plus, for local SGD, the averaging program's
divided by H. Stale gradients move as many bytes as allreduce -- what an asynchronous
parameter server saves is waiting, not traffic; the curve shows what the delay costs.
Writes the summary CSV, the per-step loss curves (<out>_curves.csv) and a PNG.
"""

from __future__ import annotations

from jaxcnn import plots, results
from jaxcnn.analysis.hlo import collectives
from jaxcnn.build import build_program
from jaxcnn.commands import cli, run_flags
from jaxcnn.config import OptimConfig, TrainConfig, UpdateConfig, total_steps
from jaxcnn.data import load_csv
from jaxcnn.fit import fit
from jaxcnn.sharding import format_mesh

PROG = "sync_vs_async.py"
RULES = {
    "allreduce": UpdateConfig(),
    "local-sgd H=2": UpdateConfig(sync="local-sgd", sync_every=2),
    "local-sgd H=8": UpdateConfig(sync="local-sgd", sync_every=8),
    "staleness T=1": UpdateConfig(staleness=1),
    "staleness T=4": UpdateConfig(staleness=4),
}
COLUMNS = [
    "rule", "sync", "sync_every", "staleness", "comm_bytes_per_step", "comm_bytes_train_step", "comm_bytes_average",
    "final_train_loss", "test_accuracy", "steps", "images_per_second", "layout", "mesh", "optimizer", "momentum",
]  # fmt: skip


def parse_flags(argv=None):
    parser = cli.experiment_parser(PROG, __doc__)
    run_flags.add_model_flags(parser)
    g = parser.add_argument_group("experiment")
    cli.add_dataset_flags(g, test_help="a labelled CSV to measure accuracy on")
    cli.add_layout_flags(g, layout="dp", mesh="data=8", mesh_help=None)
    g.add_argument("--batch-size", type=int, default=64)
    g.add_argument("--epochs", type=int, default=10)
    g.add_argument("--optimizer", default="sgd")
    g.add_argument("--lr", type=float, default=0.1)
    g.add_argument(
        "--momentum", type=float, default=0.0, help="sgd momentum; a delay acts like more of it (default %(default)s)"
    )
    g.add_argument("--seed", type=int, default=0)
    cli.add_output_flags(g, out="runs/sync_vs_async.csv", plot="runs/sync_vs_async.png")
    return parser.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_flags(argv)
    model_config = cli.model_from_flags(args)
    optim = OptimConfig(name=args.optimizer, learning_rate=args.lr, schedule="cosine", momentum=args.momentum)
    train_config = TrainConfig(batch_size=args.batch_size, epochs=args.epochs, seed=args.seed)
    train_set = load_csv(args.data, num_classes=model_config.num_classes)
    test_set = load_csv(args.test_data, num_classes=model_config.num_classes, need_labels=False)
    layout, mesh = cli.mesh_from_flags(args)
    out, plot = cli.writable_outputs(args.out, args.plot)
    curves_path = out.with_name(out.stem + "_curves.csv")
    steps = total_steps(len(train_set), train_config)

    rows, curves = [], {}
    for i, (name, update) in enumerate(RULES.items(), 1):
        print(f"[{i}/{len(RULES)}] {name} ...", flush=True)
        program = build_program(
            model_config, optim, layout, mesh, train_set.image_shape, args.batch_size, steps,
            seed=args.seed, update=update,
        )  # fmt: skip
        outcome = fit(program, program.init(), train_set, test_set, train_config, progress=False)
        step_bytes = sum(c.step_bytes for c in collectives(program.train_step.as_text(), mesh.size))
        average_bytes = (
            sum(c.step_bytes for c in collectives(program.averaging.average.as_text(), mesh.size))
            if program.averaging is not None
            else 0
        )
        rows.append(
            {
                "rule": name,
                "sync": update.sync,
                "sync_every": update.sync_every,
                "staleness": update.staleness,
                "comm_bytes_per_step": step_bytes + average_bytes / update.sync_every,
                "comm_bytes_train_step": step_bytes,
                "comm_bytes_average": average_bytes,
                "final_train_loss": outcome.epochs[-1]["train_loss"],
                "test_accuracy": outcome.final_eval.accuracy,
                "steps": outcome.steps,
                "images_per_second": outcome.images_per_second,
                "layout": layout.name,
                "mesh": format_mesh(dict(mesh.shape)),
                "optimizer": args.optimizer,
                "momentum": args.momentum,
            }
        )
        curves[name] = outcome.loss_history
        accuracy = rows[-1]["test_accuracy"]
        print(
            f"    {rows[-1]['comm_bytes_per_step']:,.0f} bytes/step, final loss {rows[-1]['final_train_loss']:.4f}"
            + (f", test accuracy {100 * accuracy:.2f}%" if accuracy is not None else "")
        )
    results.write_csv(out, rows, COLUMNS)
    curve_rows = [{"rule": n, "step": k + 1, "loss": v} for n, losses in curves.items() for k, v in enumerate(losses)]
    results.write_csv(curves_path, curve_rows, ["rule", "step", "loss"])
    title = (
        f"{model_config.name}, {layout.name} {format_mesh(dict(mesh.shape))}, batch {args.batch_size}, "
        f"{args.optimizer} lr {args.lr:g} momentum {args.momentum:g}"
    )
    print("wrote", out, curves_path, plots.sync_plot(curves, rows, plot, title))
    return rows


if __name__ == "__main__":
    cli.run_main(PROG, main)
