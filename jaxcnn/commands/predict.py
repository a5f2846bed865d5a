"""Predict with a trained run's model: a CSV of predictions for a CSV of images (Kaggle's
ImageId,Label) or a folder of images (path,label,probability; the folder may hold the
images directly or in class subfolders). The run's config.json says the model, its input
and its classes: no training flag needs repeating. Any layout but the pipeline, any mesh
(default: dp over every device).

jaxcnn predict --run runs/NAME                                  # the run's own test data
jaxcnn predict --run runs/NAME --data test.csv --out submission.csv
jaxcnn predict --run runs/NAME --data photos/ --layout tp --mesh model=2
"""

from __future__ import annotations

import math
from pathlib import Path

from jaxcnn.commands import cli
from jaxcnn.run_config import ParallelConfig, part_from_flags

PROG = "jaxcnn predict"


def add_model_run_flags(parser: cli.FlagParser, data_help: str) -> None:
    """The flags predict and evaluate share: the run, the data, the layout to run it on."""
    g = parser.add_argument_group("model and data")
    g.add_argument("--run", required=True, metavar="DIR", help="a run directory `jaxcnn train` wrote (runs/<name>)")
    g.add_argument("--data", help=data_help)
    g.add_argument("--batch-size", type=int, help="images per step (default: the run's evaluation batch)")
    g.add_argument("--overwrite", action="store_true", help="replace existing output")
    g = parser.add_argument_group("parallelism")
    g.add_argument("--layout", default="dp", help="any layout but pipeline, or --layout-rules")
    g.add_argument("--layout-rules", help="your own rules table, e.g. batch=data,conv_out=model")
    g.add_argument("--mesh", help="mesh shape, e.g. data=4,model=2 (default: the layout's, over every device)")
    g.add_argument(
        "--host-devices", type=int,
        help=f"simulate N CPU devices (default on a CPU-only machine: what the mesh needs, else "
        f"{cli.DEFAULT_SIMULATED_DEVICES})",
    )  # fmt: skip


def parse_flags(argv=None):
    parser = cli.FlagParser(prog=PROG, description=__doc__)
    add_model_run_flags(parser, "CSV (with or without labels) or image folder (default: the run's test data)")
    parser.add_argument(
        "--out", help="the predictions CSV (default: <run>/predictions.csv, or predictions-<data name>.csv)"
    )
    return parser.parse_args(argv)


def load_model_and_data(args, need_labels: bool):
    """(the run, its data to score, the predictor, the data's name): everything checked first."""
    from jaxcnn import runs
    from jaxcnn.data import load_datasets, load_source
    from jaxcnn.errors import UserError
    from jaxcnn.inference import load_predictor
    from jaxcnn.sharding import ParallelDims, mesh_for, simulate_devices_for

    if args.batch_size is not None and args.batch_size < 1:
        raise UserError(f"--batch-size must be a positive integer, got {args.batch_size}")
    parallel = part_from_flags(ParallelConfig, vars(args))
    if parallel.named_pipeline:
        raise UserError("predict and evaluate run one SPMD program: use --layout dp (the default) or any but pipeline")
    run = runs.open_run(args.run)
    config = run.config
    image_shape = tuple(run.record["image_shape"])
    if args.data is None:  # the run's own test set, its files still named (not decoded into memory)
        dataset = load_datasets(config.data, config.model.num_classes, config.train.seed, decode_test=False)[1]
        name = None
    else:
        path = Path(args.data)
        if not path.exists():
            raise UserError(f"--data {path} not found; pass a CSV or a folder of images")
        size = f"{image_shape[0]}x{image_shape[1]}" if path.is_dir() else None  # images resized to the model's input
        fit = "centre" if config.data.augment == "imagenet" else "resize"  # a run trained on crops sees the centre
        dataset = load_source(
            path, channels=config.data.channels, num_classes=config.model.num_classes, image_size=size,
            classes=class_names(run), need_labels=need_labels, fit=fit,
        )  # fmt: skip
        name = path.stem or path.name
    if dataset.image_shape != image_shape:
        shape = "x".join(map(str, dataset.image_shape))
        raise UserError(
            f"the images of {dataset.source} are {shape}, but the run's model takes "
            f"{'x'.join(map(str, image_shape))}; pass data like the run's"
        )
    if need_labels and dataset.labels is None:
        raise UserError(f"{dataset.source} has no labels to evaluate against; use `jaxcnn predict` for it")
    simulate_devices_for(parallel)
    layout, mesh = mesh_for(parallel)
    if layout.stage_axis:
        raise UserError("predict and evaluate run one SPMD program: use a layout without a stage axis")
    data_ways = ParallelDims(layout, dict(mesh.shape)).data
    batch = args.batch_size or config.train.eval_batch_size or config.train.batch_size
    if args.batch_size is None:
        batch = math.ceil(batch / data_ways) * data_ways  # the run's batch, rounded up to split evenly
    predictor = load_predictor(
        run.model_dir, config.model, image_shape, layout, mesh, batch, image_dtype=dataset.images.dtype.name
    )
    return run, dataset, predictor, name


def class_names(run) -> list[str]:
    return run.record.get("classes") or [str(label) for label in range(run.config.model.num_classes)]


def fresh_output(path: Path | None, overwrite: bool, kind: str) -> None:
    """Output is never overwritten without --overwrite, and is the `kind` ("file" or
    "directory") it should be: checked before anything slow."""
    from jaxcnn.errors import UserError

    if path is None or not path.exists():
        return
    if path.is_dir() != (kind == "directory"):
        raise UserError(f"--out {path} is a {'directory' if path.is_dir() else 'file'}; give a {kind}")
    if not overwrite:
        raise UserError(f"{path} already exists; pass --overwrite to replace it, or another --out")


def output_for(args, run, name: str | None, stem: str, kind: str) -> Path:
    """--out, or <run>/<stem>[-<data name>] (a .csv for a "file"): new unless --overwrite,
    its directory writable."""
    from jaxcnn import results

    suffix = ".csv" if kind == "file" else ""
    out = Path(args.out) if args.out else run.directory / (f"{stem}-{name}{suffix}" if name else f"{stem}{suffix}")
    fresh_output(out, args.overwrite, kind)
    results.ensure_writable_dir(out if kind == "directory" else out.parent, "--out")
    return out


def main(argv=None):
    args = parse_flags(argv)
    import numpy as np
    import pandas as pd

    from jaxcnn import results
    from jaxcnn.inference import probabilities

    fresh_output(Path(args.out) if args.out else None, args.overwrite, "file")  # before anything slow
    run, dataset, predictor, name = load_model_and_data(args, need_labels=False)
    out = output_for(args, run, name, "predictions", "file")
    probs = probabilities(predictor.logits(dataset))
    predicted = probs.argmax(-1)
    if dataset.in_memory:  # a CSV (or the run's own test set): Kaggle's format
        frame = pd.DataFrame({"ImageId": np.arange(1, len(predicted) + 1), "Label": predicted})
    else:  # files: each named, with its class's name and how sure the model is
        names = class_names(run)
        frame = pd.DataFrame({
            "path": dataset.images.paths, "label": [names[k] for k in predicted],
            "probability": probs.max(-1).round(6),
        })  # fmt: skip
    results.write_csv(out, frame.to_dict("records"), list(frame.columns))
    print(f"{len(frame)} predictions of {run.name}'s model ({run.record['model']}) for {dataset.source}")
    if dataset.labels is not None:
        print(f"accuracy {100 * float(np.mean(predicted == dataset.labels)):.2f}% against its labels")
    print(f"wrote {out}")
    return frame
