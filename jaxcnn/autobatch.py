"""`--auto-batch BYTES`: the largest global batch whose compiled step fits a memory budget.

Found by search over compiled programs, not by a formula: each probe compiles the train
step (nothing is allocated or run) and reads XLA's `memory_analysis` -- arguments plus
outputs not aliased to them plus temporaries, per device. Memory grows with the batch, so
doubling brackets the answer and bisection over allowed batches (multiples of what the
mesh and micro-batches need) finds it: about 2 log2(limit / multiple) compiles.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from jaxcnn.errors import UserError


@dataclass
class BatchSearch:
    budget_bytes: float
    batch_size: int  # the answer
    peak_bytes: int  # per device, at the answer
    probes: list[tuple[int, int]] = field(default_factory=list)  # (batch, peak bytes) in the order tried


def largest_batch(
    peak_bytes: Callable[[int], int], budget_bytes: float, multiple: int, limit: int, flag: str = "--auto-batch"
) -> BatchSearch:
    """Largest multiple of `multiple` up to `limit` with `peak_bytes(batch) <= budget_bytes`;
    `flag` is what the errors name (the search answers `train --auto-batch`, `bench --batch fill`)."""
    probes: list[tuple[int, int]] = []

    def fits(units: int) -> bool:
        batch = units * multiple
        probes.append((batch, peak_bytes(batch)))
        return probes[-1][1] <= budget_bytes

    most = limit // multiple
    if most < 1:
        raise UserError(f"{flag}: the smallest batch this mesh allows, {multiple}, exceeds the {limit} images")
    if not fits(1):
        raise UserError(
            f"{flag}: even a global batch of {multiple} needs {probes[0][1]:,} bytes per device, over the "
            f"budget of {budget_bytes:,.0f}; give a larger budget, use --remat full, or a layout that splits more"
        )
    good, bad = 1, None  # in units of `multiple`
    while bad is None and good < most:
        trial = min(good * 2, most)
        if fits(trial):
            good = trial
        else:
            bad = trial
    while bad is not None and bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    best = good * multiple
    return BatchSearch(budget_bytes, best, dict(probes)[best], probes)
