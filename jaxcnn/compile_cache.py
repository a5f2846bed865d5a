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

In a multi-process job (jax.distributed) only process 0 writes entries and the others read
them, so the directory must be one every host sees; separate runs that share a directory
each write what they compile. JAX writes an entry in place: one cut short (a process killed
while writing) reads as a miss, with a warning each time, until it is deleted -- deleting
the directory is always safe.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

from jaxcnn.errors import UserError

ENV = "JAXCNN_CACHE"
OFF = "off"
# Programs that compile faster than this are not stored: every eager jnp operation compiles a
# tiny program (tens of milliseconds), and thousands of those entries would cost more to read
# than to rebuild. A small model's init or eval step compiles in a few tenths of a second on a
# CPU, so JAX's 1 s default would leave them out.
MIN_COMPILE_SECONDS = 0.1
_HIT = "/jax/compilation_cache/cache_hits"


def default_dir() -> str:
    """$JAXCNN_CACHE, else ~/.cache/jaxcnn (XDG_CACHE_HOME respected); "off" disables."""
    if os.environ.get(ENV):
        return os.environ[ENV]
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return str(Path(base) / "jaxcnn")


def enable(directory: str | None) -> str | None:
    """Cache compiled programs in `directory` (None: default_dir(); "off": no cache).
    Returns the directory in use, or None when off. Call before the first compile; calling
    again switches. A directory that cannot be written is an error when asked for by name;
    the default one is then left off with a warning (a read-only home must not stop a run)."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    asked = directory
    directory = default_dir() if directory is None else directory
    compilation_cache.reset_cache()  # JAX decides once whether to use the cache; this makes it decide again
    if directory == OFF:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    problem = _unwritable(directory)
    if problem:
        if asked is not None or os.environ.get(ENV):
            raise UserError(f"--compile-cache {directory!r}: {problem}; give a writable directory or off")
        warnings.warn(f"no compile cache: {directory} {problem} (--compile-cache DIR to give another)", stacklevel=2)
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    path = str(Path(directory).expanduser().resolve())
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    _listen()
    return path


def _unwritable(directory: str) -> str | None:
    """Why programs cannot be cached in `directory` (made if missing), or None."""
    if not directory.strip():
        return "is empty"
    path = Path(directory).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return f"cannot be created ({error.strerror})"
    return None if os.access(path, os.W_OK) else "is not writable"


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
    if event == _HIT:
        record["hit"] = True


@contextlib.contextmanager
def watch() -> Iterator[dict]:
    """Within this thread: yields a dict whose "hit" becomes True if a compile was read from
    the persistent cache (a program JAX still holds in memory never asks it)."""
    previous = getattr(_local, "record", None)
    _local.record = record = {"hit": False}
    try:
        yield record
    finally:
        _local.record = previous
