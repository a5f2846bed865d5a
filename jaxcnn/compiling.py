"""Lower and compile the programs of one run, timing each, with each platform's XLA options.

    compilation = Compilation("gpu")
    compilation.lower("train", jax.jit(step, ...), state, images, labels)
    compilation.lower("eval", jax.jit(evaluate, ...), state, images, labels, mask)
    compiled = compilation.compile(options={"init": ...}, default=...)
    compilation.timings                  # per program: lowering s, compile s, read from the cache?

On a CPU the programs compile side by side on the host's cores (XLA's compilation does not
hold the Python interpreter). On an accelerator they compile one after another, in the order
lowered: XLA:GPU times candidate kernels on the device while it compiles, and two programs
autotuning at once would share the device and both time wrongly; in turn the eval step finds
the train step's convolutions already tuned (XLA keeps tuned kernels for the process). A
compile on an accelerator still running after NOTICE_AFTER seconds -- one the cache did not
answer -- prints one line saying what is happening and that the next run will not pay it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import jax

from jaxcnn import compile_cache


@dataclass(frozen=True)
class ProgramTiming:
    name: str
    lower_seconds: float | None  # tracing + lowering to StableHLO (Python); None: not timed apart
    compile_seconds: float  # XLA: compiling, or reading the persistent cache
    cached: bool | None  # read from the persistent cache; None: no cache in use

    def as_dict(self) -> dict:
        return asdict(self)


def compile_with(lowered: jax.stages.Lowered, options: dict | None):
    """`lowered.compile(options)`; an option this jaxlib does not know is dropped with a
    warning (XLA's debug options change between releases), not a failed run."""
    try:
        return lowered.compile(options)
    except Exception as error:  # XLA raises its own error type: INVALID_ARGUMENT for an unknown option
        unknown = [key for key in options or {} if key in str(error)]
        if not unknown:
            raise
        warnings.warn(
            f"this jaxlib rejects compiler option(s) {', '.join(unknown)}; compiling without them", stacklevel=2
        )
        return lowered.compile({k: v for k, v in options.items() if k not in unknown} or None)


class Compilation:
    """The programs of one build: lowered (timed) one by one, then compiled (timed)."""

    def __init__(self, platform: str):
        self.platform = platform
        self.lowered: dict[Any, jax.stages.Lowered] = {}
        self.lower_seconds: dict[Any, float | None] = {}
        self.timings: list[ProgramTiming] = []
        self.seconds = 0.0  # the compile phase, wall clock (on a CPU the programs overlap)

    def lower(self, key, jitted, *args) -> None:
        start = time.perf_counter()
        self.lowered[key] = jitted.lower(*args)
        self.lower_seconds[key] = time.perf_counter() - start

    def add(self, key, lowered: jax.stages.Lowered) -> None:
        """A program lowered elsewhere (its lowering not timed apart)."""
        self.lowered[key], self.lower_seconds[key] = lowered, None

    def compile(self, options: dict | None = None, default: dict | None = None) -> dict:
        """{key: compiled}; `options` gives per-program compiler options, `default` those of
        every program `options` does not name."""
        options = options or {}
        cached = compile_cache.in_use() is not None

        def one(key):
            with compile_cache.watch() as seen:
                start = time.perf_counter()
                compiled = compile_with(self.lowered[key], options.get(key, default))
                seconds = time.perf_counter() - start
            hit = seen["hit"] if cached else None
            return compiled, ProgramTiming(_name(key), self.lower_seconds[key], seconds, hit)

        keys = list(self.lowered)
        start = time.perf_counter()
        if self.platform == "cpu":
            workers = max(1, min(len(keys), os.cpu_count() or 1))
            with ThreadPoolExecutor(workers) as pool:
                done = list(pool.map(one, keys))
        else:
            notice = threading.Timer(NOTICE_AFTER, _announce, (self.platform, [_name(k) for k in keys]))
            notice.daemon = True
            notice.start()
            try:
                done = [one(key) for key in keys]
            finally:
                notice.cancel()
        self.seconds = time.perf_counter() - start
        self.timings = [timing for _, timing in done]
        return {key: compiled for key, (compiled, _) in zip(keys, done, strict=True)}


def _name(key) -> str:
    """A program's name in timings: "train", or "stage1/forward" for a pipeline's (stage, kind)."""
    return f"stage{key[0]}/{key[1]}" if isinstance(key, tuple) else str(key)


def kernel_record(model_config, step_options: dict | None) -> dict:
    """What a build chose for its platform (jaxcnn.platform_choices), for the run record."""
    if not hasattr(model_config, "conv1x1"):  # a model of your own (jaxcnn.models.CustomModel)
        return {"step_compiler_options": step_options or {}}
    choice = model_config.kernel_choice  # None: the family has no platform-dependent kernel (ConvNeXt)
    own = {choice: getattr(model_config, choice)} if choice else {}
    return {**own, "step_compiler_options": step_options or {}}


def all_cached(timings: list[ProgramTiming]) -> bool | None:
    """Every program read from the persistent cache (None: no cache in use)."""
    flags = [t.cached for t in timings]
    return None if None in flags else all(flags)


NOTICE_AFTER = 10.0  # seconds: a program read from the cache, or a small one, is done by then


def _announce(platform: str, names: list[str]) -> None:
    """One line while a long compile runs on an accelerator (it tunes every new kernel there)."""
    if jax.process_index() != 0:
        return
    where = compile_cache.in_use()
    later = f"the next run reads it from {where}" if where else "no compile cache (--compile-cache off)"
    print(
        f"jaxcnn: compiling {', '.join(names)} for {platform}: XLA is timing candidate kernels on the device, "
        f"which can take minutes the first time; {later}",
        file=sys.stderr,
        flush=True,
    )
