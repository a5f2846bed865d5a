"""When does the input pipeline, not the devices, set the pace? A dataset written as a
folder of JPEGs (real files to decode and resize), trained on with 1, 2, 4 ... grain
worker processes.

python experiments/input_bound.py                                  # Fashion-MNIST, 6,000 images
python experiments/input_bound.py --out results/input_bound.csv --plot results/input_bound.png

The images are written once, as --stored-size JPEGs (far larger than the training size,
as photographs are), into --folder; each batch decodes and resizes them to --image-size
on the workers: decoding costs per stored pixel, the step per training pixel. For each
worker count it measures the pipeline alone (images/s decoded, no training) and training
through it: images/s, the input stall (the share of the time the devices sat idle for
want of a batch), and the verdict -- input-bound while the stall exceeds 25%
(jaxcnn.analysis.verdicts), compute-bound once the workers keep up. The last row is the
same model on the same shape of images already in memory: the compute bound, against
which `share_of_in_memory` reads each row's images/s.

On a CPU-only machine the workers and the "devices" share the same cores: once the
workers keep the devices fed, more of them take cores from the step itself, so the
stall keeps falling while images/s can fall too. On an accelerator the step does not
share the host's cores, and the stall is the throughput lost.
"""

from __future__ import annotations

import time
from pathlib import Path

from jaxcnn import plots, results
from jaxcnn.analysis.verdicts import INPUT_BOUND
from jaxcnn.build import build_program
from jaxcnn.commands import cli, run_flags
from jaxcnn.config import OptimConfig, TrainConfig
from jaxcnn.data import Loader, load_image_folder, load_named, synthetic_dataset
from jaxcnn.data.folders import parse_image_size, write_image_folder
from jaxcnn.errors import UserError
from jaxcnn.fit import fit
from jaxcnn.sharding import quiet_fallbacks
from jaxcnn.sharding.placement import BatchPlacement

PROG = "input_bound.py"
COLUMNS = [
    "input", "workers", "decode_images_per_second", "images_per_second", "share_of_in_memory",
    "input_wait_fraction", "verdict",
    "steps", "global_batch_size", "image_size", "stored_size", "layout", "mesh",
]  # fmt: skip


def parse_flags(argv=None):
    parser = cli.experiment_parser(PROG, __doc__)
    run_flags.add_model_flags(parser)
    g = parser.add_argument_group("input bound")
    g.add_argument("--dataset", default="fashion-mnist", help="the dataset to write as JPEGs (default %(default)s)")
    g.add_argument("--data-dir", help="where --dataset's files are")
    g.add_argument("--download", action="store_true", help="fetch --dataset's files when not found")
    g.add_argument(
        "--folder", help="where the JPEGs go (default: ~/.cache/jaxcnn/<dataset>-jpeg-<stored size>-<images>)"
    )
    g.add_argument("--images", type=int, default=6000, help="training images written (default %(default)s)")
    g.add_argument("--stored-size", default="768x768", help="the JPEG files' HxW (default %(default)s)")
    g.add_argument("--image-size", default="32x32", help="HxW the model trains at (default %(default)s)")
    g.add_argument("--workers", type=cli.int_list, default=(1, 2, 4), help="worker counts (default 1,2,4)")
    g.add_argument("--batch-size", type=int, default=64, help="global batch (default %(default)s)")
    g.add_argument("--steps", type=int, default=40, help="training steps per worker count (default %(default)s)")
    cli.add_layout_flags(g, mesh_help="default: the layout's, over every device")
    g.add_argument("--host-devices", type=int, help="simulated CPU devices")
    cli.add_output_flags(g, plot="", out_help="write the rows to this CSV (default: print only)")
    return parser.parse_args(argv)


def jpeg_folder(args) -> Path:
    """The dataset's first --images training images as JPEGs: written once, then reused."""
    stored = parse_image_size(args.stored_size)
    folder = Path(args.folder) if args.folder else (
        Path.home() / ".cache" / "jaxcnn" / f"{args.dataset}-jpeg-{args.stored_size}-{args.images}"
    )  # fmt: skip
    if folder.is_dir() and not args.folder:  # written whole by an earlier run (write_image_folder is atomic)
        return folder
    train, _ = load_named(args.dataset, args.data_dir, args.download)
    print(f"{PROG}: writing {args.images:,} of {args.dataset}'s images as {args.stored_size} JPEGs into {folder}")
    started = time.perf_counter()
    write_image_folder(train.subset(slice(0, args.images)), folder, size=stored, channels=3)
    print(f"{PROG}: written in {time.perf_counter() - started:.0f} s")
    return folder


def decode_rate(loader: Loader, placement: BatchPlacement, steps: int) -> float:
    """Images/s through the pipeline alone (read, decoded, placed; no training), after its
    first batch."""
    batches = loader.batches([steps], [placement], seed=0)
    try:
        batches.next()  # the workers starting
        start = time.perf_counter()
        for _ in range(steps - 1):
            batches.next()
        seconds = time.perf_counter() - start
    finally:
        batches.close()
    return (steps - 1) * placement.batch_size / seconds


def main(argv=None) -> list[dict]:
    args = parse_flags(argv)
    if args.steps < 3 or args.batch_size < 1 or args.images < args.batch_size or min(args.workers, default=-1) < 0:
        raise UserError("--steps must be >= 3, --images >= --batch-size and --workers non-negative")
    out, plot = cli.writable_outputs(args.out, args.plot or None)
    size = parse_image_size(args.image_size)
    files = load_image_folder(jpeg_folder(args), channels=3, image_size=size)
    layout, mesh = cli.mesh_from_flags(args)
    model_config = cli.model_from_flags(args)
    shape = (*size, 3)
    with quiet_fallbacks():
        program = build_program(
            model_config, OptimConfig(), layout, mesh, shape, args.batch_size, args.steps, with_eval=False
        )
    config = TrainConfig(batch_size=args.batch_size, epochs=1, max_steps=args.steps)
    mesh_text = ",".join(f"{k}={v}" for k, v in mesh.shape.items())
    print(f"{PROG}: {len(files):,} JPEGs of {args.stored_size} -> {args.image_size}, {layout.name} on {mesh_text}, "
          f"batch {args.batch_size}, {args.steps} steps each")  # fmt: skip
    in_memory = synthetic_dataset(shape, args.batch_size * args.steps, model_config.num_classes, 0)
    rows = []
    for name, data, workers in [*(("jpeg folder", files, w) for w in args.workers), ("in memory", in_memory, 0)]:
        loader = Loader(data, workers=workers)
        decoded = decode_rate(loader, program.train_input, min(args.steps, 12)) if name == "jpeg folder" else None
        outcome = fit(program, program.init(), loader, None, config, progress=False)
        stall = outcome.input_wait_fraction
        rows.append({
            "input": name, "workers": workers, "decode_images_per_second": decoded,
            "images_per_second": outcome.images_per_second, "input_wait_fraction": stall,
            "verdict": "input-bound" if stall > INPUT_BOUND else "compute-bound", "steps": outcome.steps,
            "global_batch_size": args.batch_size, "image_size": args.image_size, "stored_size": args.stored_size,
            "layout": layout.name, "mesh": mesh_text,
        })  # fmt: skip
        r = rows[-1]
        print(f"{name:>12} {workers:2d} workers: decode {decoded or 0:7.0f} img/s   train {r['images_per_second']:7.0f} "
              f"img/s   stall {stall:6.1%}   {r['verdict']}", flush=True)  # fmt: skip
    for r in rows:
        r["share_of_in_memory"] = r["images_per_second"] / rows[-1]["images_per_second"]
    if out:
        print("wrote", results.write_csv(out, rows, COLUMNS))
    if plot:
        title = f"{model_config.name}, {args.image_size} from {args.stored_size} JPEGs, batch {args.batch_size}"
        print("wrote", plots.input_bound_plot(rows, plot, title, INPUT_BOUND))
    return rows


if __name__ == "__main__":
    cli.run_main(PROG, main)
