"""The evidence behind jaxcnn.platform_choices: each variant of some choices, measured on
this machine -- compile time cold and from the cache, and step time, alternating.

python experiments/platform_choices.py --choices conv1x1 --model resnet50 --image 224x224x3 --batch 8
python experiments/platform_choices.py --choices max_pool,cpu_convs --image 28x28x1 --batch 128
python experiments/platform_choices.py --choices conv1x1,autotune --variants dot,conv,4,0 \\
    --model resnet50 --image 224x224x3 --batch 256 --dtype bfloat16 --timeout 150    # on a GPU

A variant changes one choice; every other is the platform's current one, so each choice's
current variant is the program a run compiles, and variants of several choices that build
the same program (conv1x1=conv and autotune=4 on a GPU today) share one measurement. Each
program is first compiled cold in a process of its own (--timeout caps it; one that times
out is recorded as such and not timed), with an empty compile cache of this run's own and
XLA's autotuning results kept out of it, so that no program reads kernels another tuned.
That process compiles the train step and init as `jaxcnn bench` does, takes one step, and
leaves the executables in the cache. This process then builds every program again, reading
the cache (the warm compile: what a second run pays), and times their steps in rounds that
alternate between them. At the end the executables are copied into the --compile-cache
(default ~/.cache/jaxcnn), so that the runs that follow read them.

Rows (one per choice and variant) are merged into --out (default results/platform_choices.csv),
replacing earlier rows of the same platform, device kind, choice and configuration; `picked`
is what `jaxcnn.platform_choices.pick` makes of this run's rows of that choice, `chosen` what
the table holds now (tests/test_platform_choices.py holds the two together).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

from jaxcnn import cli, platform_choices, results
from jaxcnn.config import DEFAULT_MODEL, DTYPES, ModelConfig
from jaxcnn.data import parse_image_shape
from jaxcnn.errors import UserError
from jaxcnn.models import resolve_kernels

PROG = "platform_choices.py"
COLUMNS = [
    "platform", "device_kind", "choice", "variant", "model", "image_shape", "global_batch_size", "dtype",
    "cold_compile_seconds", "cold_time_to_first_step_seconds", "timed_out", "warm_compile_seconds",
    "median_step_seconds", "images_per_second", "compiled_peak_bytes", "steps", "picked", "chosen", "jax_version",
    "date",
]  # fmt: skip
KEY = ["platform", "device_kind", "choice", "model", "image_shape", "global_batch_size", "dtype"]
RESULT = "platform_choices result: "


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
    parser.add_argument("--worker", help=cli.argparse.SUPPRESS)  # CHOICE=VARIANT: compile it cold, print its startup
    return parser.parse_args(argv)


def variant_build(choice: str, variant: str, platform: str, config: ModelConfig) -> tuple[ModelConfig, dict | None]:
    """(model config, compiler options; None: the platform's) of one variant; all else is
    the platform's choice, so the platform's own variant builds the program a run builds."""
    config = resolve_kernels(config, platform)
    if choice in ("conv1x1", "max_pool"):
        return dataclasses.replace(config, **{choice: variant}), None
    platform_options = platform_choices.step_compiler_options(platform) or {}
    options = dict(platform_options)
    if choice == "cpu_convs":
        options.pop(platform_choices.YNN_FUSION_TYPES, None)
        if variant == "eigen":
            options.update(platform_choices.CPU_WITHOUT_YNN_CONVS)
    else:  # autotune: XLA's default level is no option at all
        options.pop(platform_choices.AUTOTUNE_LEVEL, None)
        if variant != platform_choices.CHOICES[choice].default:
            options[platform_choices.AUTOTUNE_LEVEL] = int(variant)
    return config, None if options == platform_options else options


def main(argv=None) -> list[dict]:
    args = parse_flags(argv)
    names = cli.some_of(args.choices, platform_choices.CHOICES, "--choices")
    wanted = cli.name_list(args.variants) if args.variants else None
    variants = [(c, v) for c in names for v in platform_choices.CHOICES[c].variants if not wanted or v in wanted]
    unknown = set(wanted or ()) - {v for _, v in variants}
    if unknown:
        raise UserError(f"--variants {', '.join(sorted(unknown))}: not a variant of {', '.join(names)}")
    image_shape = parse_image_shape(args.image)
    config = ModelConfig(name=args.model, dtype=args.dtype)
    if min(args.steps, args.rounds, args.batch) < 1:
        raise UserError("--steps, --rounds and --batch must be positive")
    if args.worker:
        return _worker(args, config, image_shape)
    argv = list(sys.argv[1:] if argv is None else argv)
    (out,) = cli.writable_outputs(args.out)
    # this process holds the device while each program compiles in a process of its own: on a GPU
    # neither may take 75% of its memory up front (JAX's default), for itself or for its workers
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    from jaxcnn import compile_cache

    device = jax.devices()[0]
    for name in names:
        applies = platform_choices.PLATFORMS[name]
        if applies and applies != device.platform:
            raise UserError(f"--choices {name} is a {applies} choice; this machine computes on {device.platform}")
    # one program per distinct build: variants of several choices may build the same one
    builds = {cv: _hashable(*variant_build(*cv, device.platform, config)) for cv in variants}
    programs = list(dict.fromkeys(builds.values()))
    keep = compile_cache.in_use()
    with tempfile.TemporaryDirectory(prefix="jaxcnn-choices-") as cache:
        _isolated_cache(cache)
        first = {build: next(cv for cv in variants if builds[cv] == build) for build in programs}
        cold = {build: _cold(args, argv, first[build], cache) for build in programs}
        figures = _timed(args, config, image_shape, device, cold)
        if keep:
            _copy_executables(cache, keep)
    rows = []
    for name in names:
        mine = [(v, figures[builds[c, v]]) for c, v in variants if c == name]
        measured = {v: (f["median_step_seconds"], f["cold_compile_seconds"]) for v, f in mine if not f["timed_out"]}
        picked = platform_choices.pick(measured) if measured else None
        chosen = platform_choices.variant(name, device.platform)
        rows += [{"choice": name, "variant": v, **f, "picked": picked, "chosen": chosen} for v, f in mine]
        print(f"{name} on {device.platform} ({device.device_kind}): picked {picked}; the table holds {chosen}")
    _merge(out, rows)
    print("wrote", out)
    return rows


def _isolated_cache(directory: str) -> None:
    """This run's own compile cache, without XLA's autotuning results (a program must not
    read the kernels another tuned)."""
    import jax

    from jaxcnn import compile_cache

    jax.config.update("jax_persistent_cache_enable_xla_caches", "none")
    compile_cache.enable(directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def _copy_executables(source: str, target: str) -> None:
    """The cache's entries (files; XLA's own caches are folders) into another cache: their keys
    do not depend on the directory or on XLA's caches being on."""
    for entry in Path(source).iterdir():
        if entry.is_file() and not (Path(target) / entry.name).exists():
            shutil.copy2(entry, target)


def _cold(args, argv: list[str], choice_variant: tuple[str, str], cache: str) -> dict | None:
    """Compile one program in a process of its own; its startup, or None if it timed out."""
    label = "=".join(choice_variant)
    command = [sys.executable, __file__, *argv, "--worker", label, "--compile-cache", cache]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    print(f"{label}: compiling cold (timeout {args.timeout:.0f} s)", flush=True)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, env=env, check=False)
    except subprocess.TimeoutExpired:
        print(f"{label}: still compiling after {args.timeout:.0f} s; not timed", flush=True)
        return None
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode or not lines:
        raise UserError(f"compiling {label} failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    startup = json.loads(lines[-1][len(RESULT) :])
    print(f"{label}: cold compile {startup['compile_seconds']:.1f} s, first step "
          f"{startup['seconds']:.1f} s after the start", flush=True)  # fmt: skip
    return startup


def _worker(args, config: ModelConfig, image_shape) -> list:
    import jax

    from jaxcnn.analysis.baselines import jaxcnn_stepper
    from jaxcnn.analysis.measure import random_batch

    _isolated_cache(args.compile_cache)
    device = jax.devices()[0]
    choice, variant = args.worker.split("=")
    model, options = variant_build(choice, variant, device.platform, config)
    images, labels = random_batch(image_shape, args.batch, config.num_classes)
    stepper = jaxcnn_stepper(model, "single", device, image_shape, args.batch, images, labels, options)
    print(RESULT + json.dumps(stepper.startup._asdict()), flush=True)
    return []


def _timed(args, config: ModelConfig, image_shape, device, cold: dict) -> dict:
    """{build: its figures}: every program read back from the cache (its warm compile), then
    timed in alternation."""
    import jax

    from jaxcnn.analysis.baselines import jaxcnn_stepper
    from jaxcnn.analysis.measure import interleaved, random_batch

    images, labels = random_batch(image_shape, args.batch, config.num_classes)
    steppers = {
        build: jaxcnn_stepper(build[0], "single", device, image_shape, args.batch, images, labels, _options(build))
        for build, startup in cold.items()
        if startup is not None
    }
    timed = interleaved({i: s.steps for i, s in enumerate(steppers.values())}, args.steps, min(args.rounds, args.steps))
    timed = dict(zip(steppers, timed.values(), strict=True))
    figures = {}
    for build, startup in cold.items():
        stepper = steppers.get(build)
        median = statistics.median(timed[build]) if stepper else None
        figures[build] = {
            "platform": device.platform, "device_kind": device.device_kind, "model": config.name,
            "image_shape": args.image, "global_batch_size": args.batch, "dtype": args.dtype,
            "cold_compile_seconds": startup["compile_seconds"] if startup else None,
            "cold_time_to_first_step_seconds": startup["seconds"] if startup else None,
            "timed_out": startup is None,
            "warm_compile_seconds": stepper.startup.compile_seconds if stepper else None,
            "median_step_seconds": median, "images_per_second": args.batch / median if median else None,
            "compiled_peak_bytes": stepper.peak_bytes if stepper else None,
            "steps": len(timed.get(build, [])), "jax_version": jax.__version__,
            "date": datetime.date.today().isoformat(),
        }  # fmt: skip
        f = figures[build]
        speed = f"{f['images_per_second']:10,.1f} images/s" if median else "not timed (cold compile timed out)"
        warm = f"{f['warm_compile_seconds']:.1f} s" if stepper else "-"
        cold_s = f"{f['cold_compile_seconds']:.1f} s" if startup else f"> {args.timeout:.0f} s"
        print(f"{_describe(build)}: {speed}  compile cold {cold_s}, warm {warm}")
    return figures


def _hashable(config: ModelConfig, options: dict | None) -> tuple:
    return config, None if options is None else tuple(sorted(options.items()))


def _options(build: tuple) -> dict | None:
    return None if build[1] is None else dict(build[1])


def _describe(build) -> str:
    config, options = build
    shown = "the platform's" if options is None else dict(options) or "XLA's defaults"
    return f"conv1x1={config.conv1x1} max_pool={config.max_pool} compiler options {shown}"


def _merge(out: Path, rows: list[dict]) -> None:
    """Replace the rows of this measurement's key in `out`, keep the others."""
    new = pd.DataFrame(rows, columns=COLUMNS)
    if out.exists():
        old = pd.read_csv(out)
        same = old[KEY].astype(str).apply(tuple, axis=1).isin(set(new[KEY].astype(str).apply(tuple, axis=1)))
        new = pd.concat([old[~same], new], ignore_index=True)
    results.write_csv(out, new.to_dict("records"), COLUMNS)


if __name__ == "__main__":
    cli.run_main(PROG, main)
