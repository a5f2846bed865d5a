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
before JAX starts its thread pools. Set JAXCNN_KEEP_HOST_MEMORY=0 to leave malloc alone;
a MALLOC_ARENA_MAX / MALLOC_MMAP_MAX_ / MALLOC_TRIM_THRESHOLD_ set in the environment wins.
"""

from __future__ import annotations

import ctypes
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
    """Apply the settings above on glibc Linux; True when they were applied."""
    if not sys.platform.startswith("linux") or os.environ.get(OPT_OUT, "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # the parameters above are glibc's (not musl's)
        return False
    return all(libc.mallopt(param, value) == 1 for param, value, env in _SETTINGS if env not in os.environ)
