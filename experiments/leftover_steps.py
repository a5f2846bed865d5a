"""An epoch's leftover steps with the data on the devices, K steps a call: the steps after
its last full call of K run as one call of exactly those steps, compiled on a thread while
the run goes on (until it is ready the call holds K and drops the idle steps' results) --
`exact` -- or one step a call, Keras's way for a partial last execution: `single`, which
needs no other compiled call. The two alternate run by run in one process.

python experiments/leftover_steps.py --rounds 5 --out results/leftover_steps.csv

Each round runs both variants on a fresh program (`cold`: the leftover call not compiled,
as in a run's first epochs) and then again on the round-0 program of each (`warm`: for
`exact` the leftover call compiled once, in round 0). Cases as jaxcnn bench-loop's: `tiny`
(1 device, batch 16, 6 epochs of 89 steps: 5 calls of 16 and 9 left) and `dp8` (dp over 8
simulated devices, batch 64, 24 epochs of 22: one call of 16 and 6 left); the bundled
digits on the devices, no test set; whole epochs (no run cut short mid-epoch). The CSV has a row per (round, case, program, variant): fit's
wall seconds, its training seconds and steady images/s, and the 1-minute load average
when it started. The persistent compile cache is off: a cold leftover call compiles.
"""

from __future__ import annotations

import os
import platform
import statistics
import time

import jax
import numpy as np

import jaxcnn.fit.loop
from jaxcnn import compile_cache, results
from jaxcnn.build import build_program
from jaxcnn.commands import cli
from jaxcnn.config import BUNDLED_TRAIN, ModelConfig, OptimConfig, TrainConfig
from jaxcnn.data import Augment, Loader, load_csv
from jaxcnn.data.on_device import DeviceFeed, choose, placed
from jaxcnn.errors import UserError
from jaxcnn.fit import fit
from jaxcnn.sharding import build_mesh, get_layout, simulate_cpu_devices

PROG = "leftover_steps.py"
VARIANTS = ("exact", "single")
CASES = {  # (conv width, layout, mesh, batch, epochs a run): bench-loop's cases, ~530 steps a run
    "tiny": (8, "single", {"data": 1}, 16, 6),
    "dp8": (32, "dp", {"data": 8}, 64, 24),
}
COLUMNS = ["round", "case", "program", "variant", "steps", "steps_per_call", "epoch_steps", "wall_seconds",
           "train_seconds", "images_per_second", "load_1min", "machine"]  # fmt: skip


class OneStepLeftovers(DeviceFeed):
    """The device feed with an epoch's leftover steps run one step a call (no other call compiled)."""

    def start_epoch(self, program, steps: int, last: bool) -> None:
        pass

    def next_call(self):
        steps, held, inputs = super().next_call()
        if steps < held:  # a leftover: this call runs its first step alone
            self._next_step -= steps - 1
            self._call = (1, self._call[1])
            return 1, 1, inputs
        return steps, held, inputs


def parse_flags(argv=None):
    parser = cli.experiment_parser(PROG, __doc__)
    parser.add_argument("--cases", type=cli.name_list, default=tuple(CASES), help=", ".join(CASES))
    parser.add_argument("--rounds", type=int, default=5, help="(default %(default)s)")
    parser.add_argument("--steps-per-call", type=int, default=16, help="K (default %(default)s)")
    cli.add_output_flags(parser, out="runs/leftover_steps.csv")
    return parser.parse_args(argv)


def _program(case: str, steps: int, per_call: int, data):
    width, layout_name, mesh_shape, batch, _ = CASES[case]
    layout = get_layout(layout_name)
    mesh = build_mesh(mesh_shape, jax.devices()[: int(np.prod(list(mesh_shape.values())))])
    on, _ = choose("on", data, layout, mesh, Augment(), 0)
    model = ModelConfig(name="cnn2d_1layer_fullconnected_1layer", conv_features=(width,), dense_features=())
    program = build_program(model, OptimConfig(), layout, mesh, data.image_shape, batch, steps, with_eval=False,
                            on_device=on, steps_per_call=per_call)  # fmt: skip
    return program, placed(data, on, layout, mesh)


def _fit(variant: str, program, device_data, data, epochs: int, per_call: int) -> dict:
    jaxcnn.fit.loop.DeviceFeed = OneStepLeftovers if variant == "single" else DeviceFeed
    try:
        config = TrainConfig(batch_size=program.batch_size, epochs=epochs, steps_per_call=per_call)
        load = os.getloadavg()[0]
        start = time.perf_counter()
        result = fit(program, program.init(), Loader(data), None, config, progress=False, device_data=device_data)
        wall = time.perf_counter() - start
    finally:
        jaxcnn.fit.loop.DeviceFeed = DeviceFeed
    assert result.steps == epochs * (len(data) // program.batch_size)
    return {"wall_seconds": wall, "train_seconds": result.train_seconds,
            "images_per_second": result.images_per_second, "load_1min": load}  # fmt: skip


def main(argv=None) -> list[dict]:
    args = parse_flags(argv)
    if any(c not in CASES for c in args.cases) or args.rounds < 1 or args.steps_per_call < 2:
        raise UserError(f"--cases from {', '.join(CASES)}; --rounds >= 1; --steps-per-call >= 2")
    (out,) = cli.writable_outputs(args.out)
    simulate_cpu_devices(8, at_least=True)
    compile_cache.enable("off")
    data = load_csv(BUNDLED_TRAIN)
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    rows, warm = [], {}
    for round_ in range(args.rounds):
        for case in args.cases:
            order = VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]
            for program_kind in ("cold", "warm"):
                for variant in order:
                    if program_kind == "cold" or (case, variant) not in warm:
                        epochs = CASES[case][4]
                        setup = _program(case, epochs * (len(data) // CASES[case][3]), args.steps_per_call, data)
                        warm.setdefault((case, variant), setup)
                    if program_kind == "warm":
                        setup = warm[(case, variant)]
                    epochs, epoch_steps = CASES[case][4], len(data) // CASES[case][3]
                    row = _fit(variant, *setup, data, epochs, args.steps_per_call)
                    rows.append({"round": round_, "case": case, "program": program_kind, "variant": variant,
                                 "steps": epochs * epoch_steps, "steps_per_call": args.steps_per_call,
                                 "epoch_steps": epoch_steps, **row, "machine": machine})  # fmt: skip
                    print(f"{PROG}: round {round_} {case:<4} {program_kind} {variant:<6} {row['wall_seconds']:6.2f} s "
                          f"wall, {row['images_per_second']:8,.0f} images/s (load {row['load_1min']:.1f})",
                          flush=True)  # fmt: skip
                    if out:
                        results.write_csv(out, rows, COLUMNS)
    by = {(r["round"], r["case"], r["program"], r["variant"]): r for r in rows}
    for case in args.cases:
        for program_kind in ("cold", "warm"):
            # each round's single against its own exact, run beside it: the machine's drift cancels
            pairs = [(by[n, case, program_kind, "single"], by[n, case, program_kind, "exact"]) for n in range(args.rounds)]
            ratios = {what: [single[what] / exact[what] for single, exact in pairs]
                      for what in ("wall_seconds", "images_per_second")}  # fmt: skip
            print(f"{PROG}: {case} {program_kind}, single over exact, median of the rounds' pairs: wall "
                  f"{statistics.median(ratios['wall_seconds']):.2f}x, images/s "
                  f"{statistics.median(ratios['images_per_second']):.2f}x")  # fmt: skip
    if out:
        print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    cli.run_main(PROG, main)
