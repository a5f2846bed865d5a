"""Measure variants of the platform choices (jaxcnn.platform_choices) on this machine: each
distinct program compiled cold in a process of its own, then read back from the cache (the
warm compile) and timed in rounds that alternate between programs.

    figures = measure(setup, [("max_pool", "select"), ("max_pool", "window")], steps=20, rounds=4)

A variant changes one choice; every other is the platform's current one, so each choice's
current variant is the program a run compiles, and variants of several choices that build
the same program share one measurement. The cold compiles go to an empty cache of this
measurement's own, with XLA's autotuning results kept out of it, so that no program reads
kernels another tuned; at the end the executables are copied into the compile cache in use,
so the runs that follow read them. A cold compile that outlasts `timeout` is recorded as
timed out and its program is not timed. The worker is this module run as a script
(`python -m jaxcnn.analysis.choices SPEC`), given one program as JSON.
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
from typing import NamedTuple

import jax

from jaxcnn import compile_cache, platform_choices
from jaxcnn.analysis.baselines import jaxcnn_stepper
from jaxcnn.analysis.measure import interleaved, random_batch
from jaxcnn.config import ModelConfig
from jaxcnn.errors import UserError
from jaxcnn.models import resolve_kernels

RESULT = "platform choices worker: "
XLA_CACHES = jax.config.jax_persistent_cache_enable_xla_caches  # JAX's default, put back after a measurement


class Setup(NamedTuple):
    """What every program of one measurement trains."""

    model: ModelConfig
    image_shape: tuple[int, int, int]
    batch: int


class Build(NamedTuple):
    """One program: its model config (kernels made concrete) and compiler options as sorted
    pairs (None: the platform's)."""

    model: ModelConfig
    options: tuple | None

    @property
    def compiler_options(self) -> dict | None:
        return None if self.options is None else dict(self.options)


def variant_build(choice: str, variant: str, platform: str, config: ModelConfig) -> Build:
    """The program of one variant on `platform`: that choice changed, every other the platform's."""
    config = resolve_kernels(config, platform)
    if choice in ("conv1x1", "max_pool"):
        return Build(dataclasses.replace(config, **{choice: variant}), None)
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
    return Build(config, None if options == platform_options else tuple(sorted(options.items())))


def measure(setup: Setup, variants: list[tuple[str, str]], steps: int, rounds: int, timeout: float) -> dict:
    """{(choice, variant): figures} for every variant, on the first device."""
    device = jax.devices()[0]
    builds = {cv: variant_build(*cv, device.platform, setup.model) for cv in variants}
    keep = compile_cache.in_use()
    with tempfile.TemporaryDirectory(prefix="jaxcnn-choices-") as cache:
        _isolated_cache(cache)
        try:
            cold = {}
            for (choice, variant), build in builds.items():
                if build not in cold:
                    print(f"{choice}={variant}: compiling cold (timeout {timeout:.0f} s)", flush=True)
                    cold[build] = _cold(setup, build, cache, timeout)
            figures = _timed(setup, device, cold, steps, rounds)
        finally:
            jax.config.update("jax_persistent_cache_enable_xla_caches", XLA_CACHES)
            compile_cache.enable(keep or compile_cache.OFF)
        if keep:
            _copy_executables(cache, keep)
    return {cv: figures[build] for cv, build in builds.items()}


def _isolated_cache(directory: str) -> None:
    """A cache of the measurement's own, without XLA's autotuning results, storing every program."""
    jax.config.update("jax_persistent_cache_enable_xla_caches", "none")
    compile_cache.enable(directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def _copy_executables(source: str, target: str) -> None:
    """The cache's entries (files; XLA's own caches are folders) into another cache: their keys
    do not depend on the directory or on XLA's caches being on."""
    for entry in Path(source).iterdir():
        if entry.is_file() and not (Path(target) / entry.name).exists():
            shutil.copy2(entry, target)


def _cold(setup: Setup, build: Build, cache: str, timeout: float) -> dict | None:
    """Compile one program in a process of its own; its startup, or None if it timed out."""
    spec = {"model": dataclasses.asdict(build.model), "options": build.options, "image_shape": setup.image_shape,
            "batch": setup.batch, "cache": cache}  # fmt: skip
    # the worker's device is held by this process too: on a GPU neither may take 75% of it up front
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    command = [sys.executable, "-m", "jaxcnn.analysis.choices", json.dumps(spec)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    except subprocess.TimeoutExpired:
        print(f"  still compiling after {timeout:.0f} s; not timed", flush=True)
        return None
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
    if done.returncode or not lines:
        raise UserError(f"compiling {_describe(build)} failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    startup = json.loads(lines[-1][len(RESULT) :])
    print(f"  cold compile {startup['compile_seconds']:.1f} s, first step {startup['seconds']:.1f} s after the start")
    return startup


def _worker(spec: dict) -> None:
    """Compile one program cold, take its first step, print its startup (the worker process)."""
    _isolated_cache(spec["cache"])
    tuples = {f.name for f in dataclasses.fields(ModelConfig) if f.type.startswith("tuple")}
    model = ModelConfig(**{k: tuple(v) if k in tuples else v for k, v in spec["model"].items()})
    options = None if spec["options"] is None else {k: v for k, v in spec["options"]}
    image_shape = tuple(spec["image_shape"])
    images, labels = random_batch(image_shape, spec["batch"], model.num_classes)
    stepper = jaxcnn_stepper(model, "single", jax.devices()[0], image_shape, spec["batch"], images, labels, options)
    print(RESULT + json.dumps(stepper.startup._asdict()), flush=True)


def _timed(setup: Setup, device, cold: dict, steps: int, rounds: int) -> dict:
    """{build: its figures}: every program read back from the cache, then timed in alternation."""
    images, labels = random_batch(setup.image_shape, setup.batch, setup.model.num_classes)
    steppers = {
        build: jaxcnn_stepper(
            build.model, "single", device, setup.image_shape, setup.batch, images, labels, build.compiler_options
        )
        for build, startup in cold.items()
        if startup is not None
    }
    timed = interleaved({i: s.steps for i, s in enumerate(steppers.values())}, steps, min(rounds, steps))
    timed = dict(zip(steppers, timed.values(), strict=True))
    figures = {}
    for build, startup in cold.items():
        stepper = steppers.get(build)
        median = statistics.median(timed[build]) if stepper else None
        figures[build] = {
            "platform": device.platform, "device_kind": device.device_kind, "model": setup.model.name,
            "image_shape": "x".join(map(str, setup.image_shape)), "global_batch_size": setup.batch,
            "dtype": setup.model.dtype,
            "cold_compile_seconds": startup["compile_seconds"] if startup else None,
            "cold_time_to_first_step_seconds": startup["seconds"] if startup else None,
            "timed_out": startup is None,
            "warm_compile_seconds": stepper.startup.compile_seconds if stepper else None,
            "median_step_seconds": median, "images_per_second": setup.batch / median if median else None,
            "compiled_peak_bytes": stepper.peak_bytes if stepper else None,
            "steps": len(timed.get(build, [])), "jax_version": jax.__version__,
            "date": datetime.date.today().isoformat(),
        }  # fmt: skip
        f = figures[build]
        speed = f"{f['images_per_second']:10,.1f} images/s" if median else "not timed (its cold compile timed out)"
        warm = f"{f['warm_compile_seconds']:.1f} s" if stepper else "-"
        cold_s = f"{f['cold_compile_seconds']:.1f} s" if startup else "timed out"
        print(f"{_describe(build)}: {speed}  compile cold {cold_s}, warm {warm}")
    return figures


def _describe(build: Build) -> str:
    choice = build.model.kernel_choice
    kernel = f"{choice}={getattr(build.model, choice)}" if choice else "no kernel choice"
    shown = "the platform's" if build.options is None else build.compiler_options or "XLA's defaults"
    return f"{kernel}, compiler options {shown}"


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]))
