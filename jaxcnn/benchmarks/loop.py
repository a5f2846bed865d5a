"""What the training loop costs beyond the compiled step: `fit` against a bare Python loop
calling the same compiled call on inputs already placed, per step, for each way of
feeding the step -- batches from the host one step a call (`host`), K steps a call
(`host-K`), the training set on the devices (`device`), and that with K steps a call
(`device-K`) -- measured in one process, the variants alternating round by round.

    rows = measure_loop(case, modes=("host", "device-K"), steps=600, rounds=3, steps_per_call=16)
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcnn.build import build_program
from jaxcnn.config import ModelConfig, OptimConfig, TrainConfig
from jaxcnn.data import Augment, Dataset, Loader
from jaxcnn.data.on_device import carry_at, choose, epoch_rows, placed
from jaxcnn.fit import fit
from jaxcnn.sharding import build_mesh, get_layout
from jaxcnn.sharding.placement import StackedPlacement

MODES = ("host", "host-K", "device", "device-K")


@dataclass(frozen=True)
class LoopCase:
    """A model, layout and batch on some data: one group of the benchmark's rows."""

    name: str
    model: ModelConfig
    layout: str
    mesh: dict
    batch_size: int
    data: Dataset
    data_name: str
    input_workers: int = 0


def _program(case: LoopCase, on_device, steps_per_call: int, total_steps: int):
    layout, mesh = (
        get_layout(case.layout),
        build_mesh(case.mesh, jax.devices()[: int(np.prod(list(case.mesh.values())))]),
    )
    return build_program(
        case.model, OptimConfig(), layout, mesh, case.data.image_shape, case.batch_size, total_steps,
        with_eval=False, on_device=on_device, steps_per_call=steps_per_call,
        image_dtype=case.data.images.dtype.name,
    )  # fmt: skip


def _fit_ms(case: LoopCase, program, device_data, steps: int, per_call: int) -> float:
    """`fit`'s steady-state milliseconds per step (its first call, compiling, left out)."""
    config = TrainConfig(batch_size=case.batch_size, epochs=10**6, max_steps=steps, steps_per_call=per_call)
    loader = Loader(case.data, workers=case.input_workers)
    result = fit(program, program.init(), loader, None, config, progress=False, device_data=device_data)
    return 1e3 * case.batch_size / result.images_per_second


def _bare_ms(case: LoopCase, program, device_data, steps: int, per_call: int) -> float:
    """A Python loop making the same compiled calls on inputs placed once: ms per step."""
    batch = case.batch_size
    if device_data is not None:
        # epoch 0's rows as fit places them, walked as fit walks an epoch -- full calls, then
        # one of the steps left (compiled by measure_loop) -- each call handed the carry the
        # last one gave back (where the epoch stands, its metrics so far), as any loop over
        # this call must; nothing placed per call
        epoch = len(case.data) // batch
        full, left = divmod(epoch, per_call)
        rows = jax.device_put(
            epoch_rows(len(case.data), program.train_input, 0, 0, epoch), NamedSharding(program.mesh, P())
        )
        first = carry_at(program.calls.carry, 0)
        calls = [program.calls.get(per_call, True).run] * full + ([program.calls.get(left, True).run] if left else [])
        state = program.init()
        state, _ = calls[0](state, *device_data, rows, first)  # compiled already; the first call warms up
        jax.block_until_ready(state)
        done, carry = 0, first
        start = time.perf_counter()
        while done < steps:
            for run in calls:
                state, carry = run(state, *device_data, rows, carry)
            done += epoch
            carry = first
        jax.block_until_ready(state)
        return 1e3 * (time.perf_counter() - start) / done
    if per_call == 1:
        inputs, run = program.train_input.place(case.data.images[:batch], case.data.labels[:batch]), program.train_step
    else:
        rows = program.train_input.share.take(np.arange(batch))
        stacked = StackedPlacement(program.train_input, per_call)
        inputs = stacked.place_rows(*(np.stack([a[rows]] * per_call) for a in (case.data.images, case.data.labels)))
        run = program.calls.get(per_call, False).run
    state = program.init()
    state, _ = run(state, *inputs)  # compiled already; the first call warms up
    jax.block_until_ready(state)
    calls = max(1, steps // per_call)
    start = time.perf_counter()
    for _ in range(calls):
        state, metrics = run(state, *inputs)
    jax.block_until_ready((state, metrics))
    return 1e3 * (time.perf_counter() - start) / (calls * per_call)


def measure_loop(
    case: LoopCase, modes=MODES, steps: int = 600, rounds: int = 3, steps_per_call: int = 16
) -> list[dict]:
    """One row per mode: fit's and the bare loop's median ms per step over `rounds`, every
    round running every mode's fit and bare loop in turn, and the median of the rounds' fit
    over bare (each round's pair ran side by side, so the machine's drift between rounds
    cancels)."""
    setups = {}
    for mode in modes:
        on_device = None
        data = case.data
        if mode.startswith("device"):
            data = data.loaded()  # an image folder: decoded once, placed on the devices
            layout, mesh = (
                get_layout(case.layout),
                build_mesh(case.mesh, jax.devices()[: int(np.prod(list(case.mesh.values())))]),
            )
            on_device, _ = choose("on", data, layout, mesh, Augment(), 0)
        per_call = steps_per_call if mode.endswith("-K") else 1
        program = _program(case, on_device, per_call, steps * rounds + 10)
        device_data = placed(data, on_device, program.layout, program.mesh) if on_device else None
        epoch = len(case.data) // case.batch_size
        for remainder in {epoch % per_call, steps % epoch % per_call} - {0}:
            # an epoch's last call (fit compiles it ahead) and the run's (fit would run a full one,
            # its extra steps dropped): compiled now, so that fit runs exactly its steps, as the bare loop does
            if on_device:
                program.calls.get(remainder, True)
        setups[mode] = (program, device_data, per_call)
    times = {mode: ([], []) for mode in modes}
    for round_ in range(rounds):
        for mode, (program, device_data, per_call) in setups.items():
            fit_first = round_ % 2 == 0  # alternate which goes first: a drift in the machine's speed cancels
            for which in (0, 1) if fit_first else (1, 0):
                timed = _fit_ms if which == 0 else _bare_ms
                times[mode][which].append(timed(case, program, device_data, steps, per_call))
    rows = []
    for mode, (fits, bares) in times.items():
        fit_ms, bare_ms = statistics.median(fits), statistics.median(bares)
        rows.append({
            "case": case.name, "data": case.data_name, "layout": case.layout,
            "devices": int(np.prod(list(case.mesh.values()))), "batch_size": case.batch_size, "mode": mode,
            "steps_per_call": setups[mode][2], "fit_ms_per_step": fit_ms, "bare_ms_per_step": bare_ms,
            # each round's fit against its own bare loop, run beside it: the median of those
            "fit_over_bare": statistics.median(f / b for f, b in zip(fits, bares, strict=True)) - 1, "rounds": rounds, "steps": steps,
            "fit_ms_all": ";".join(f"{t:.4f}" for t in fits), "bare_ms_all": ";".join(f"{t:.4f}" for t in bares),
        })  # fmt: skip
    return rows
