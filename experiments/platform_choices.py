"""The evidence behind jaxcnn.platform_choices: each variant of some choices, measured on
this machine -- compile time cold and from the cache, and step time, alternating.

python experiments/platform_choices.py --choices conv1x1 --model resnet50 --image 224x224x3 --batch 8
python experiments/platform_choices.py --choices max_pool,cpu_convs --image 28x28x1 --batch 128
python experiments/platform_choices.py --choices conv1x1,autotune --variants dot,conv,4,0 \\
    --model resnet50 --image 224x224x3 --batch 256 --dtype bfloat16 --timeout 150    # on a GPU

How (jaxcnn.analysis.choices): a variant changes one choice, every other is the platform's
current one, so each choice's current variant is the program a run compiles, and variants
of several choices that build the same program (conv1x1=conv and autotune=4 on a GPU today)
share one measurement. Each program is compiled cold in a process of its own, as `jaxcnn
bench` compiles it (--timeout caps it; one that times out is recorded and not timed), then
read back from the cache here (the warm compile: what a second run pays) and timed in rounds
that alternate between programs. The executables end up in the --compile-cache (default
~/.cache/jaxcnn), so the runs that follow read them.

Rows (one per choice and variant) are merged into --out (default results/platform_choices.csv),
replacing earlier rows of the same platform, device kind, choice and configuration; `picked`
is what `jaxcnn.platform_choices.pick` makes of this run's rows of that choice, `chosen` what
the table holds now (tests/test_platform_choices.py holds the two together).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from jaxcnn import platform_choices, results
from jaxcnn.commands import cli
from jaxcnn.config import DEFAULT_MODEL, DTYPES, ModelConfig
from jaxcnn.data import parse_image_shape
from jaxcnn.errors import UserError

PROG = "platform_choices.py"
COLUMNS = [
    "platform", "device_kind", "choice", "variant", "model", "image_shape", "global_batch_size", "dtype",
    "cold_compile_seconds", "cold_time_to_first_step_seconds", "timed_out", "warm_compile_seconds",
    "median_step_seconds", "images_per_second", "compiled_peak_bytes", "steps", "picked", "chosen", "jax_version",
    "date",
]  # fmt: skip
KEY = ["platform", "device_kind", "choice", "model", "image_shape", "global_batch_size", "dtype"]


def parse_flags(argv=None):
    parser = cli.experiment_parser(PROG, __doc__)
    parser.add_argument("--choices", required=True, help=f"some of {', '.join(platform_choices.CHOICES)}")
    parser.add_argument("--variants", help="only these variants of the choices (default: every one)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--image", default="28x28x1", help="HxWxC")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per program")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=600, help="seconds a cold compile may take")
    cli.add_output_flags(parser, out="results/platform_choices.csv")
    return parser.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_flags(argv)
    names = cli.some_of(args.choices, platform_choices.CHOICES, "--choices")
    wanted = cli.name_list(args.variants) if args.variants else None
    variants = [(c, v) for c in names for v in platform_choices.CHOICES[c].variants if not wanted or v in wanted]
    unknown = set(wanted or ()) - {v for _, v in variants}
    if unknown:
        raise UserError(f"--variants {', '.join(sorted(unknown))}: not a variant of {', '.join(names)}")
    if min(args.steps, args.rounds, args.batch) < 1:
        raise UserError("--steps, --rounds and --batch must be positive")
    model = ModelConfig(name=args.model, dtype=args.dtype)
    (out,) = cli.writable_outputs(args.out)
    import jax  # after the flags: --help and bad flags answer at once

    from jaxcnn.analysis.choices import Setup, measure

    device = jax.devices()[0]
    for name in names:
        applies = platform_choices.PLATFORMS[name]
        if applies and applies != device.platform:
            raise UserError(f"--choices {name} is a {applies} choice; this machine computes on {device.platform}")
    setup = Setup(model, parse_image_shape(args.image), args.batch)
    figures = measure(setup, variants, args.steps, args.rounds, args.timeout)
    rows = []
    for name in names:
        mine = [(v, figures[c, v]) for c, v in variants if c == name]
        measured = {v: (f["median_step_seconds"], f["cold_compile_seconds"]) for v, f in mine if not f["timed_out"]}
        picked = platform_choices.pick(measured) if measured else None
        chosen = platform_choices.variant(name, device.platform)
        rows += [{"choice": name, "variant": v, **f, "picked": picked, "chosen": chosen} for v, f in mine]
        print(f"{name} on {device.platform} ({device.device_kind}): picked {picked}; the table holds {chosen}")
    merge(out, rows)
    print("wrote", out)
    return rows


def merge(out: Path, rows: list[dict]) -> None:
    """Replace the rows of this measurement's key in `out`, keep the others."""
    new = pd.DataFrame(rows, columns=COLUMNS)
    if out.exists():
        old = pd.read_csv(out)
        same = old[KEY].astype(str).apply(tuple, axis=1).isin(set(new[KEY].astype(str).apply(tuple, axis=1)))
        new = pd.concat([old[~same], new], ignore_index=True)
    results.write_csv(out, new.to_dict("records"), COLUMNS)


if __name__ == "__main__":
    cli.run_main(PROG, main)
