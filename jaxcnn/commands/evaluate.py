"""Evaluate a trained run's model on labelled data: accuracy, loss, per-class accuracy and
the confusion matrix (CSV and PNG). The run's config.json says the model, its input and
its classes; with no --data it scores the run's own test set, reproducing its test
accuracy. Any layout but the pipeline, any mesh (default: dp over every device).

jaxcnn evaluate --run runs/NAME
jaxcnn evaluate --run runs/NAME --data val/ --layout fsdp
"""

from __future__ import annotations

from pathlib import Path

from jaxcnn.commands import cli
from jaxcnn.commands.predict import add_model_run_flags, class_names, fresh_output, load_model_and_data, output_for

PROG = "jaxcnn evaluate"


def parse_flags(argv=None):
    parser = cli.FlagParser(prog=PROG, description=__doc__)
    add_model_run_flags(parser, "labelled CSV or image folder of class subfolders (default: the run's test data)")
    parser.add_argument(
        "--out", metavar="DIR", help="where the reports go (default: <run>/evaluation, or evaluation-<data name>)"
    )
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_flags(argv)
    import pandas as pd

    from jaxcnn import results
    from jaxcnn.inference import evaluation
    from jaxcnn.plots import confusion_plot

    fresh_output(Path(args.out) if args.out else None, args.overwrite, "directory")  # before anything slow
    run, dataset, predictor, name = load_model_and_data(args, need_labels=True)
    out = output_for(args, run, name, "evaluation", "directory")
    names = class_names(run)
    report = evaluation(predictor.logits(dataset), dataset.labels, names)
    summary = {
        "run": str(run.directory), "model": run.record["model"], "data": dataset.source,
        "examples": report.examples, "accuracy": report.accuracy, "loss": report.loss,
        "layout": predictor_layout(args), "mesh": dict(predictor.image_sharding.mesh.shape),
        "batch_size": predictor.batch_size,
    }  # fmt: skip
    results.write_json(out / "metrics.json", summary)
    results.write_csv(out / "per_class.csv", report.per_class, ["class", "label", "examples", "correct", "accuracy"])
    confusion = pd.DataFrame(report.confusion, index=pd.Index(names, name="true"), columns=names)
    results.write_csv(out / "confusion.csv", confusion.reset_index().to_dict("records"), ["true", *names])
    confusion_plot(report.confusion, names, out / "confusion.png", f"{run.name} on {Path(dataset.source).name}")
    print(f"{run.name}'s model ({run.record['model']}) on {dataset.source}: {report.examples} examples")
    print(f"accuracy {100 * report.accuracy:.2f}%   loss {report.loss:.4f}")
    worst = sorted((c for c in report.per_class if c["accuracy"] is not None), key=lambda c: c["accuracy"])[:3]
    print("lowest class accuracy: " + ", ".join(f"{c['class']} {100 * c['accuracy']:.1f}%" for c in worst))
    print(f"wrote {out} (metrics.json, per_class.csv, confusion.csv, confusion.png)")
    return summary


def predictor_layout(args) -> str:
    return args.layout_rules or args.layout
