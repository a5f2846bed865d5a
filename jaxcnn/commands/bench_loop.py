"""Does the training loop set the pace? `fit`'s time per step against a bare Python loop
calling the same compiled call on inputs already placed, for each way of feeding the step,
in one process, alternating round by round (jaxcnn.benchmarks.loop).

jaxcnn bench-loop                                          # both cases, digits and a folder, every mode
jaxcnn bench-loop --cases tiny --data digits --rounds 5 --out results/loop_overhead.csv

Cases: `tiny`, a 1-conv CNN (8 channels) at batch 16 on one device; `dp8`, a 1-conv CNN of
32 channels at batch 64 under dp on 8 (simulated) devices. Data: the bundled digits in
memory (`digits`), and the same images as a folder of PNG files (`folder`, written once to
~/.cache/jaxcnn/, decoded by grain workers; on the devices: decoded once and placed).
Modes: host (a batch placed per step), host-K (K steps stacked per call), device (the
training set on the devices, a call per step), device-K (both). The CSV has a row per
(case, data, mode): fit's and the bare loop's median ms per step and fit's excess; a PNG
beside it draws them.
"""

from __future__ import annotations

from pathlib import Path

from jaxcnn.commands import cli
from jaxcnn.errors import UserError

PROG = "jaxcnn bench-loop"
CASES = ("tiny", "dp8")
DATA = ("digits", "folder")
MODES = ("host", "host-K", "device", "device-K")


def parse_flags(argv=None):
    parser = cli.FlagParser(prog=PROG, description=__doc__)
    parser.add_argument("--cases", type=cli.name_list, default=CASES, help="tiny, dp8 (default both)")
    parser.add_argument("--data", type=cli.name_list, default=DATA, help="digits, folder (default both)")
    parser.add_argument("--modes", type=cli.name_list, default=MODES, help="host, host-K, device, device-K")
    parser.add_argument("--steps", type=int, default=500, help="steps timed per measurement (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=21, help="rounds, every mode in each (default %(default)s)")
    parser.add_argument("--steps-per-call", type=int, default=16, help="K of the -K modes (default %(default)s)")
    parser.add_argument("--out", help="write the rows to this CSV and a PNG beside it (default: print only)")
    return parser.parse_args(argv)


def digits_folder():
    """The bundled digits as PNG files, a folder per class (written once)."""
    import numpy as np
    from PIL import Image

    from jaxcnn.config import BUNDLED_TRAIN
    from jaxcnn.data import load_csv

    folder = Path.home() / ".cache" / "jaxcnn" / "digits-png"
    if not (folder / "done").exists():
        data = load_csv(BUNDLED_TRAIN)
        for i, (image, label) in enumerate(zip(data.images, data.labels, strict=True)):
            (folder / str(label)).mkdir(parents=True, exist_ok=True)
            Image.fromarray((image[..., 0] * 255).round().astype(np.uint8), "L").save(folder / str(label) / f"{i}.png")
        (folder / "done").touch()
    return folder


def main(argv=None) -> list[dict]:
    args = parse_flags(argv)
    bad = [n for n in (*args.cases, *args.data, *args.modes) if n not in (*CASES, *DATA, *MODES)]
    if bad or args.steps < 1 or args.rounds < 1 or args.steps_per_call < 2:
        raise UserError(
            f"--cases from {', '.join(CASES)}, --data from {', '.join(DATA)}, --modes from {', '.join(MODES)}; "
            "--steps and --rounds >= 1, --steps-per-call >= 2"
        )
    (out,) = cli.writable_outputs(args.out)
    from jaxcnn.sharding import simulate_cpu_devices

    simulate_cpu_devices(8, at_least=True)
    from jaxcnn import compile_cache, results
    from jaxcnn.benchmarks.loop import LoopCase, measure_loop
    from jaxcnn.config import BUNDLED_TRAIN, ModelConfig
    from jaxcnn.data import load_csv, load_image_folder
    from jaxcnn.plots import loop_overhead_plot

    compile_cache.enable(None)
    sources = {}
    if "digits" in args.data:
        sources["digits"] = (load_csv(BUNDLED_TRAIN), 0)
    if "folder" in args.data:
        sources["folder"] = (load_image_folder(digits_folder(), channels=1, image_size=(8, 8)), 1)
    shapes = {
        "tiny": (ModelConfig(name="cnn2d_1layer_fullconnected_1layer", conv_features=(8,), dense_features=()),
                 "single", {"data": 1}, 16),
        "dp8": (ModelConfig(name="cnn2d_1layer_fullconnected_1layer", conv_features=(32,), dense_features=()),
                "dp", {"data": 8}, 64),
    }  # fmt: skip
    rows = []
    for case in args.cases:
        model, layout, mesh, batch = shapes[case]
        for name, (data, workers) in sources.items():
            loop_case = LoopCase(case, model, layout, mesh, batch, data, name, workers)
            print(f"{PROG}: {case} on {name}, {args.rounds} rounds of {', '.join(args.modes)}", flush=True)
            for row in measure_loop(loop_case, args.modes, args.steps, args.rounds, args.steps_per_call):
                rows.append(row)
                print(f"  {row['mode']:<9} fit {row['fit_ms_per_step']:.3f} ms/step, bare loop "
                      f"{row['bare_ms_per_step']:.3f}: {100 * row['fit_over_bare']:+.1f}%", flush=True)  # fmt: skip
    if out:
        results.write_csv(out, rows)
        loop_overhead_plot(rows, out.with_suffix(".png"))
        print(f"wrote {out} and {out.with_suffix('.png')}")
    return rows
