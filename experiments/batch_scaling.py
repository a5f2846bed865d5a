"""Test accuracy against the global batch, with and without the linear scaling rule.

python experiments/batch_scaling.py                       # bundled digits, batches 16..512, one device
python experiments/batch_scaling.py --batches 32,256 --epochs 10 --layout dp --mesh data=8

Each batch trains the same number of epochs (so a larger batch takes fewer steps) twice:
with the learning rate fixed at --lr, and with `--lr-scaling linear --base-batch B0`
(lr x batch / B0, warmed up from lr; Goyal et al. 2017). Rows: batch, rule, learning
rate, steps, final training loss, test accuracy.
"""

from __future__ import annotations

from jaxcnn import plots, results
from jaxcnn.build import build_programs
from jaxcnn.commands import cli, run_flags
from jaxcnn.config import OptimConfig, TrainConfig
from jaxcnn.data import load_csv
from jaxcnn.errors import UserError
from jaxcnn.fit import fit
from jaxcnn.optim import optim_for_batch
from jaxcnn.sharding import format_mesh

PROG = "batch_scaling.py"
COLUMNS = [
    "global_batch_size", "lr_scaling", "base_batch", "learning_rate", "steps", "epochs", "final_train_loss",
    "test_accuracy", "test_loss", "warmup_steps", "layout", "mesh", "optimizer",
]  # fmt: skip


def parse_flags(argv=None):
    parser = cli.experiment_parser(PROG, __doc__)
    run_flags.add_model_flags(parser)
    g = parser.add_argument_group("experiment")
    cli.add_dataset_flags(g, test_help="a labelled CSV to measure accuracy on")
    cli.add_layout_flags(g)
    g.add_argument("--batches", type=cli.int_list, default=(16, 32, 64, 128, 256, 512))
    g.add_argument("--base-batch", type=int, default=16, help="the batch --lr is tuned for (default %(default)s)")
    g.add_argument("--epochs", type=int, default=15)
    g.add_argument("--optimizer", default="sgd", help="the rule is SGD's (default %(default)s)")
    g.add_argument("--lr", type=float, default=0.005, help="learning rate at --base-batch")
    g.add_argument(
        "--warmup-epochs",
        type=float,
        default=2.0,
        help="gradual warmup, in epochs as Goyal et al. (default %(default)s)",
    )
    g.add_argument("--seed", type=int, default=0)
    cli.add_output_flags(g, out="runs/batch_scaling.csv", plot="runs/batch_scaling.png")
    return parser.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_flags(argv)
    model_config = cli.model_from_flags(args)
    if not args.batches or min(args.batches) < 1:
        raise UserError("--batches must be positive integers, e.g. 32,64,128")
    train_set = load_csv(args.data, num_classes=model_config.num_classes)
    test_set = load_csv(args.test_data, num_classes=model_config.num_classes)
    if test_set.labels is None:
        raise UserError(f"{args.test_data} has no labels; give a labelled --test-data to measure accuracy")
    layout, mesh = cli.mesh_from_flags(args)
    out, plot = cli.writable_outputs(args.out, args.plot)

    rows, runs = [], [(b, rule) for b in args.batches for rule in ("none", "linear")]
    for i, (batch, rule) in enumerate(runs, 1):
        config = TrainConfig(
            batch_size=batch, epochs=args.epochs, seed=args.seed, lr_scaling=rule, base_batch=args.base_batch
        )
        warmup = round(args.warmup_epochs * len(train_set) / batch)
        optim = OptimConfig(name=args.optimizer, learning_rate=args.lr, schedule="cosine", warmup_steps=warmup)
        lr = optim_for_batch(optim, config, batch).learning_rate
        print(f"[{i}/{len(runs)}] batch {batch}, lr scaling {rule} (lr {lr:g}) ...", flush=True)
        programs = build_programs(model_config, optim, layout, mesh, train_set.image_shape, config, len(train_set))
        program = programs[batch]
        outcome = fit(programs, program.init(), train_set, test_set, config, progress=False)
        rows.append(
            {
                "global_batch_size": batch,
                "lr_scaling": rule,
                "base_batch": args.base_batch,
                "learning_rate": lr,
                "steps": outcome.steps,
                "epochs": args.epochs,
                "final_train_loss": outcome.epochs[-1]["train_loss"],
                "test_accuracy": outcome.final_eval.accuracy,
                "test_loss": outcome.final_eval.loss,
                "warmup_steps": warmup,
                "layout": layout.name,
                "mesh": format_mesh(dict(mesh.shape)),
                "optimizer": args.optimizer,
            }
        )
        print(f"    test accuracy {100 * rows[-1]['test_accuracy']:.2f}%  ({outcome.steps} steps)")
    results.write_csv(out, rows, COLUMNS)
    title = (
        f"{model_config.name}, {args.epochs} epochs, {args.optimizer} lr {args.lr:g} at batch {args.base_batch}, "
        f"warmup {args.warmup_epochs:g} epochs"
    )
    print("wrote", out, plots.batch_scaling_plot(rows, plot, title))
    return rows


if __name__ == "__main__":
    cli.run_main(PROG, main)
