"""Keep freed host memory in the process, so XLA:CPU does not page-fault its buffers back in.

XLA:CPU allocates every execution's temporary buffer afresh (`posix_memalign`) and frees it
when the step ends. A train step's temp buffer is tens to hundreds of MB; glibc hands
anything that large out with `mmap` -- always, from the per-thread arenas XLA's worker
threads use, whose heaps stop at 64 MB -- and `munmap`s it on free. Every step then
page-faults its whole temp buffer back in and the kernel zeroes each page: on this
project's 2-core machine, 21,000 faults (83 MB) per step of the default model at 28x28,
batch 128, about a quarter of the step time (see experiments/profile_step.py).

Three glibc settings make the freed buffer come back without faults: one arena for every
thread (the main one, which grows with `brk` and has no size limit), no `mmap` for large
blocks, and no trimming, so that free memory stays mapped. The cost: the process keeps
its largest heap until it exits instead of returning freed memory -- for a training
process that is its steady-state working set anyway -- and threads share one allocator
lock (negligible next to a train step). (A 1 GiB trim threshold, the setting before, was
crossed by ResNet-50's 1.1 GiB temp buffer at 224x224, batch 8: 283,000 faults a step.)

`keep_freed_memory()` runs when `jaxcnn` is imported: settings reach only threads that
start afterwards, and importing jaxcnn is the earliest point a user's program gives us
before JAX starts its thread pools. They apply where they were measured: a process whose
JAX computes on the CPU -- not where a GPU or TPU plugin is installed (JAX_PLATFORMS=cpu
overrides that), and not in worker processes (grain's decoders, which run no XLA).
JAXCNN_KEEP_HOST_MEMORY=1 applies them anywhere, =0 nowhere; a MALLOC_ARENA_MAX /
MALLOC_MMAP_MAX_ / MALLOC_TRIM_THRESHOLD_ set in the environment wins.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import multiprocessing
import os
import sys

# mallopt parameter numbers, from glibc's malloc.h
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
NEVER_TRIM = -1  # mallopt(3): "-1 disables trimming completely"
OPT_OUT = "JAXCNN_KEEP_HOST_MEMORY"

_SETTINGS = (  # (mallopt parameter, value, the environment variable that overrides it)
    (M_ARENA_MAX, 1, "MALLOC_ARENA_MAX"),
    (M_MMAP_MAX, 0, "MALLOC_MMAP_MAX_"),
    (M_TRIM_THRESHOLD, NEVER_TRIM, "MALLOC_TRIM_THRESHOLD_"),
)


def keep_freed_memory() -> bool:
    """Apply the settings above on glibc Linux where they pay; True when they were applied."""
    wanted = os.environ.get(OPT_OUT)
    if wanted == "0" or not sys.platform.startswith("linux"):
        return False
    if wanted != "1" and (multiprocessing.parent_process() is not None or not computes_on_cpu()):
        return False
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # the parameters above are glibc's (not musl's)
        return False
    return all(libc.mallopt(param, value) == 1 for param, value, env in _SETTINGS if env not in os.environ)


def computes_on_cpu() -> bool:
    """Will JAX compute on the CPU in this process? Told without starting JAX: JAX_PLATFORMS
    if set, else whether an accelerator plugin (jax_cuda12_plugin, libtpu, ...) is installed."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    if importlib.metadata.entry_points(group="jax_plugins") or importlib.util.find_spec("jax_plugins"):
        return False  # JAX finds plugins by this entry point group or in this namespace package
    return not _has_libtpu()


def _has_libtpu() -> bool:
    try:
        importlib.metadata.distribution("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
