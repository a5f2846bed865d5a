"""The persistent compilation cache: compiled programs kept on disk across processes.

A GPU compile of ResNet-50's train step spends minutes autotuning convolutions and matrix
products; the same program compiled again in the next run, `predict` or `bench` reads the
executable back in seconds. This is JAX's own cache (`jax_compilation_cache_dir`) with
XLA:GPU's per-fusion autotuning results kept beside it (`jax_persistent_cache_enable_xla_caches`,
on by default once a directory is set), so a program that misses -- a new batch size, say --
still skips autotuning the kernels it shares with one compiled before.

    enable("~/.cache/jaxcnn")       # every command does this from --compile-cache (default_dir())
    with watch() as hits:           # which compiles the cache answered, by program name
        ...

Several processes may share one directory: JAX writes an entry only from process 0 (the
others read), and each entry is written whole under a new name, so a reader never sees a
partial one.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from jaxcnn.errors import UserError

ENV = "JAXCNN_CACHE"
OFF = "off"
# Programs that compile faster than this are not stored: every eager jnp operation compiles a
# tiny program, and thousands of those entries would cost more to read than to rebuild. A
# default CNN's init compiles in about 0.3 s on CPU, so JAX's 1 s default would leave it out.
MIN_COMPILE_SECONDS = 0.2
_HIT = "/jax/compilation_cache/cache_hits"
_ASKED = "/jax/compilation_cache/compile_requests_use_cache"


def default_dir() -> str:
    """$JAXCNN_CACHE, else ~/.cache/jaxcnn (XDG_CACHE_HOME respected); "off" disables."""
    if os.environ.get(ENV):
        return os.environ[ENV]
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return str(Path(base) / "jaxcnn")


def enable(directory: str | None) -> str | None:
    """Cache compiled programs in `directory` (None: default_dir(); "off": no cache).
    Returns the directory in use, or None when off. Call before the first compile; calling
    again with another directory switches to it."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    directory = default_dir() if directory is None else directory
    if directory == OFF:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    path = Path(directory).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(
            f"--compile-cache {directory}: cannot create it ({error.strerror}); give a writable directory or off"
        ) from None
    if not os.access(path, os.W_OK):
        raise UserError(f"--compile-cache {directory} is not writable; give a writable directory or off")
    if jax.config.jax_compilation_cache_dir != str(path):
        compilation_cache.reset_cache()  # the cache object binds its directory on first use
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    _listen()
    return str(path)


def in_use() -> str | None:
    """The directory programs are cached in now, or None."""
    import jax

    if not jax.config.jax_enable_compilation_cache:
        return None
    return jax.config.jax_compilation_cache_dir


# --- which compile the cache answered -------------------------------------------------------
# JAX reports a cache lookup and a hit as monitoring events from the thread that compiles;
# jaxcnn.compiling compiles each program in a thread of its own and names it here first.
_local = threading.local()
_lock = threading.Lock()
_listening = False


def _listen() -> None:
    global _listening
    import jax

    with _lock:
        if _listening:
            return
        jax.monitoring.register_event_listener(_on_event)
        _listening = True


def _on_event(event: str, **_) -> None:
    record = getattr(_local, "record", None)
    if record is None:
        return
    if event == _ASKED:
        record["asked"] = True
    elif event == _HIT:
        record["hit"] = True


@contextlib.contextmanager
def watch() -> Iterator[dict]:
    """Within this thread: yields a dict whose "hit" becomes True if a compile was read from
    the cache and "asked" True if the cache was consulted at all."""
    previous = getattr(_local, "record", None)
    _local.record = record = {"hit": False, "asked": False}
    try:
        yield record
    finally:
        _local.record = previous
