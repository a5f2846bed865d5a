"""Does scaling out pay? The verdict the scaling report prints, from measured rows.

Rows are ordered by device count, each with `num_devices`, `speedup` (vs the one-device
baseline) and `input_wait_fraction`. The rules, in order:

1. input-bound: at the largest size the devices sit idle for want of input more than
   `INPUT_BOUND` of the training time (`input_wait_fraction`: the wait for the next batch
   left after the devices have run every dispatched step -- host waiting that overlaps a
   step still computing is not counted) -- more devices only wait faster; fix the data
   pipeline first;
2. a doubling of devices that gains less than `PAYS_PER_DOUBLING` (1.5x, the usual rule
   of thumb) means: don't scale out beyond the smaller size;
3. otherwise scaling pays.
"""

from __future__ import annotations

INPUT_BOUND = 0.25
PAYS_PER_DOUBLING = 1.5


def step_verdicts(rows: list[dict]) -> list[str]:
    """One word per row: how it did against the row with half its devices."""
    by_devices = {r["num_devices"]: r for r in rows}
    out = []
    for r in rows:
        half = by_devices.get(r["num_devices"] // 2) if r["num_devices"] > 1 else None
        if r["input_wait_fraction"] > INPUT_BOUND:
            out.append("input-bound")
        elif half is None or not half["speedup"]:
            out.append("baseline" if r["num_devices"] == 1 else "-")
        else:
            gain = r["speedup"] / half["speedup"]
            out.append(f"{gain:.2f}x for 2x devices: " + ("pays" if gain >= PAYS_PER_DOUBLING else "does not pay"))
    return out


def verdict(rows: list[dict]) -> str:
    largest = rows[-1]
    if largest["input_wait_fraction"] > INPUT_BOUND:
        return (
            f"input-bound: fix the data pipeline first (on {largest['num_devices']} devices they sit idle for "
            f"input {largest['input_wait_fraction']:.0%} of the time)"
        )
    by_devices = {r["num_devices"]: r for r in rows}
    for r in rows:
        half = by_devices.get(r["num_devices"] // 2)
        if r["num_devices"] > 1 and half is not None and half["speedup"]:
            gain = r["speedup"] / half["speedup"]
            if gain < PAYS_PER_DOUBLING:
                return (
                    f"under {PAYS_PER_DOUBLING}x for 2x devices ({half['num_devices']} -> {r['num_devices']}: "
                    f"{gain:.2f}x): don't scale out beyond {half['num_devices']} device(s)"
                )
    return f"scaling pays: {largest['speedup']:.2f}x on {largest['num_devices']} devices"
