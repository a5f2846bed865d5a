"""How much of training do the devices sit idle for want of input? A loader made slow on
purpose (a fixed delay per batch, one loader thread) against a measured step time.

python experiments/input_wait.py                           # 30 and 100 ms loaders
python experiments/input_wait.py --delays-ms 0,30,60,100 --out results/input_wait.csv

For each delay d and the measured step time s it prints the steady-state expectation,
max(d - s, 0) / max(d, s) -- a loader faster than the step idles nothing, a slower one
idles the devices d - s of every d -- next to `input_wait_fraction` (the wait left after
the devices have run every dispatched step: jaxcnn.data.Batches), and the throughput
next to its bound, batch / max(d, s). The wait for the run's first batch is the pipeline
starting and is not counted; a step that starts from idle devices also pays the dispatch
(~1 ms here), which is not counted as waiting for input.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from jaxcnn import results
from jaxcnn.analysis.measure import time_steps
from jaxcnn.build import build_program
from jaxcnn.commands import cli, run_flags
from jaxcnn.config import OptimConfig, TrainConfig
from jaxcnn.data import Loader, parse_image_shape, synthetic_dataset
from jaxcnn.errors import UserError
from jaxcnn.fit import fit
from jaxcnn.sharding import quiet_fallbacks

PROG = "input_wait.py"
COLUMNS = [
    "delay_ms", "step_ms", "expected_wait_fraction", "input_wait_fraction", "images_per_second",
    "expected_images_per_second", "steps", "global_batch_size", "layout", "mesh",
]  # fmt: skip


class DelayedLoader:
    """The loader's per-batch work, made to take `seconds` (in the Loader's augmentation hook)."""

    active = True

    def __init__(self, seconds: float):
        self.seconds = seconds

    def draws(self, seed, epoch, index, size):
        return np.zeros((size, 1))

    def apply(self, images, draws):
        time.sleep(self.seconds)
        return images


def parse_flags(argv=None):
    parser = cli.experiment_parser(PROG, __doc__)
    run_flags.add_model_flags(parser)
    g = parser.add_argument_group("input wait")
    g.add_argument("--delays-ms", type=cli.int_list, default=(30, 100), help="loader delays per batch (ms)")
    g.add_argument("--synthetic", default="28x28x1", help="image shape HxWxC (default %(default)s)")
    g.add_argument("--batch-size", type=int, default=128, help="global batch (default %(default)s)")
    g.add_argument("--steps", type=int, default=40, help="training steps per delay (default %(default)s)")
    cli.add_layout_flags(g, mesh_help="default: the layout's, over every device")
    g.add_argument("--host-devices", type=int, help="simulated CPU devices")
    cli.add_output_flags(g, out_help="write the rows to this CSV (default: print only)")
    return parser.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_flags(argv)
    if args.steps < 2 or args.batch_size < 1 or min(args.delays_ms, default=-1) < 0:
        raise UserError("--steps must be >= 2, --batch-size >= 1 and --delays-ms non-negative")
    cli.writable_outputs(args.out)
    layout, mesh = cli.mesh_from_flags(args)
    model_config = cli.model_from_flags(args)
    shape = parse_image_shape(args.synthetic)
    data = synthetic_dataset(shape, args.batch_size * args.steps, model_config.num_classes, 0)
    with quiet_fallbacks():
        program = build_program(
            model_config, OptimConfig(), layout, mesh, shape, args.batch_size, args.steps, with_eval=False
        )
    x, y = data.images[: args.batch_size], data.labels[: args.batch_size]

    def step_seconds() -> float:  # the median of 10 steps, each waited for
        return statistics.median(time_steps(program, program.init(), x, y, 10)[0])

    print(f"{PROG}: {layout.name} on {dict(mesh.shape)}, batch {args.batch_size}, {shape}")
    config = TrainConfig(batch_size=args.batch_size, epochs=1, max_steps=args.steps)
    rows = []
    for delay_ms in args.delays_ms:
        delay, before = delay_ms / 1e3, step_seconds()
        loader = Loader(data, augment=DelayedLoader(delay), workers=0, depth=2)
        outcome = fit(program, program.init(), loader, None, config, progress=False)
        step = (before + step_seconds()) / 2  # measured around the run: other work on the machine moves it
        rows.append({
            "delay_ms": delay_ms, "step_ms": step * 1e3, "expected_wait_fraction": max(delay - step, 0) / max(delay, step),
            "input_wait_fraction": outcome.input_wait_fraction,
            "images_per_second": outcome.images_per_second,
            "expected_images_per_second": args.batch_size / max(delay, step),
            "steps": outcome.steps, "global_batch_size": args.batch_size, "layout": layout.name,
            "mesh": ",".join(f"{k}={v}" for k, v in mesh.shape.items()),
        })  # fmt: skip
    print(f"{'loader':>8} {'step':>8} {'expected':>9} {'devices idle':>13} {'images/s':>9} {'bound':>9}")
    for r in rows:
        print(f"{r['delay_ms']:6d}ms {r['step_ms']:6.1f}ms {r['expected_wait_fraction']:9.1%} {r['input_wait_fraction']:13.1%} "
              f"{r['images_per_second']:9.0f} {r['expected_images_per_second']:9.0f}")  # fmt: skip
    if args.out:
        print("wrote", results.write_csv(args.out, rows, COLUMNS))
    return rows


if __name__ == "__main__":
    cli.run_main(PROG, main)
