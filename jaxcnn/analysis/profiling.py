"""Where a train step's time goes: a jax.profiler trace, summed per HLO op and joined with
the compiled program's text, plus the host page faults each step takes.

    rows, summary = profile_step(program, state, images, labels, steps=5, trace_dir=...)

`rows` has one entry per op of the compiled step (fusions, dots, convolutions, copies):
its thread time per step, share of all traced op time, result shape, kind (`ynn` for
YNNPACK fusions, `loop`/`input`/... for XLA's own, the opcode otherwise) and the jax
operation it came from. XLA:CPU runs Eigen convolutions as asynchronous tasks the trace
shows only as their launch, so `summary["untraced_thread_seconds"]` -- the threads' time
in the step not covered by any op event -- is mostly convolution work.
"""

from __future__ import annotations

import collections
import re
import resource
import statistics
from pathlib import Path

import jax

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = ([^ ]+) ([\w\-]+)\(")
_KIND = re.compile(r"kind=k(\w+)")
_SOURCE = re.compile(r'op_name="([^"]*)"')
_WORKER_LINES = ("XLAEigen", "XLAExecute")  # the threads XLA:CPU runs a program on
_NOT_OPS = ("ThunkExecutor", "SlinkyThreadPool", "end: ")


def hlo_ops(hlo_text: str) -> dict[str, dict]:
    """{instruction name: shape, kind, source} for every instruction of the entry and
    called computations (a fusion's name is what the trace shows)."""
    ops = {}
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        name, shape, opcode = match.groups()
        kind = opcode
        if opcode == "fusion":
            kind = (
                "ynn" if "__ynn_fusion" in line else (_KIND.search(line)[1].lower() if _KIND.search(line) else "fusion")
            )
        source = _SOURCE.search(line)
        ops[name] = {"shape": shape.split("{")[0], "kind": kind, "source": source[1] if source else ""}
    return ops


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _step_faults(program, state, x, y):
    """One train step, waited for; (new state, the host page faults it took)."""
    before = minor_faults()
    state, metrics = program.train_step(state, x, y)
    jax.block_until_ready(metrics)
    return state, minor_faults() - before


def settle_heap(program, state, x, y, quiet_faults: int, quiet_steps: int = 10, max_steps: int = 60):
    """Warm-up steps until the host heap has settled: `quiet_steps` steps in a row that
    page-fault under `quiet_faults`. The heap reaches its working size only after a
    few steps grow it -- each a whole temp buffer of fresh pages -- and those come late and
    at varying steps, as XLA's threads allocate in varying order (seen here at 28x28: up to
    step 25, the heap settling at 490-580 MiB for an 83 MiB temp buffer). Counting them
    would charge the steady state with faults it does not take. Without jaxcnn's malloc
    settings it never settles and stops at `max_steps`. Returns (state, warm-up steps run)."""
    steps = quiet = 0
    while quiet < quiet_steps and steps < max_steps:
        state, faults = _step_faults(program, state, x, y)
        steps += 1
        quiet = quiet + 1 if faults < quiet_faults else 0
    return state, steps


def profile_step(program, state, images, labels, steps: int, trace_dir: Path):
    """Trace `steps` warm train steps; (rows, summary) as described in the module docstring."""
    x, y = program.train_input.place(images, labels)
    temp_bytes = program.train_step.memory_analysis().temp_size_in_bytes
    quiet_faults = max(64, temp_bytes // resource.getpagesize() // 100)  # fewer: the heap did not grow
    state, warmup_steps = settle_heap(program, state, x, y, quiet_faults)
    faults = []
    for _ in range(max(steps, 10)):  # the typical step's faults, and how often the heap still grew
        state, step_faults = _step_faults(program, state, x, y)
        faults.append(step_faults)

    trace_dir.mkdir(parents=True, exist_ok=True)
    with jax.profiler.trace(str(trace_dir)):
        for _ in range(steps):
            state, metrics = program.train_step(state, x, y)
            jax.block_until_ready(metrics)
    trace = sorted(trace_dir.rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)[-1]
    profile = jax.profiler.ProfileData.from_file(str(trace))

    op_ns, span_ns, threads = collections.Counter(), 0, 0
    for plane in profile.planes:
        for line in plane.lines:
            if not any(tag in line.name for tag in _WORKER_LINES):
                continue
            events = list(line.events)
            if not events:
                continue
            threads += "XLAEigen" in line.name
            first = min(e.start_ns for e in events)
            span_ns = max(span_ns, max(e.start_ns + e.duration_ns for e in events) - first)
            for event in events:
                if not event.name.startswith(_NOT_OPS):
                    op_ns[event.name] += event.duration_ns
    ops = hlo_ops(program.train_step.as_text())
    traced = sum(op_ns.values())
    rows = [
        {
            "op": name,
            "thread_ms_per_step": ns / steps / 1e6,
            "share_of_traced": ns / traced if traced else 0.0,
            **ops.get(name, {"shape": "", "kind": "", "source": ""}),
        }
        for name, ns in op_ns.most_common()
    ]
    step_seconds = span_ns / steps / 1e9
    summary = {
        "step_seconds_traced": step_seconds,
        "worker_threads": threads,
        "traced_thread_seconds": traced / steps / 1e9,
        "untraced_thread_seconds": max(0.0, threads * step_seconds - traced / steps / 1e9),
        "minor_page_faults_per_step": statistics.median(faults),  # the typical step
        "heap_growth_steps": sum(f >= quiet_faults for f in faults),  # of `fault_steps`
        "fault_steps": len(faults),
        "warmup_steps": warmup_steps,
        "temp_bytes": temp_bytes,
        "trace": str(trace),
    }
    return rows, summary
