"""The studies' figures: layouts compared, scaling, simulated meshes, remat, batch
scaling, sync vs async, input bound, cost against size, the loop's overhead."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from matplotlib.ticker import FormatStrFormatter

from jaxcnn.plots.figure import plt, save


def compare_plot(rows: list[dict], path: Path, title: str) -> Path:
    """Three panels: memory per device, bytes moved (measured vs model), images/s."""
    labels = [r["layout"] + "\n" + r["mesh"].replace(",", "\n") for r in rows]
    x = range(len(rows))
    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    mib = 2**20

    ax = axes[0]
    bottom = [0.0] * len(rows)
    for key, name in [
        ("param_bytes_per_device", "parameters"),
        ("optimizer_bytes_per_device", "optimizer"),
        ("temp_bytes_per_device", "activations + scratch"),
    ]:
        values = [r[key] / mib for r in rows]
        ax.bar(x, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_title("memory per device (MiB)")
    ax.legend(fontsize=8)

    ax = axes[1]
    width = 0.4
    ax.bar([i - width / 2 for i in x], [r["comm_bytes"] / mib for r in rows], width, label="measured (HLO)")
    ax.bar([i + width / 2 for i in x], [r["comm_bytes_model"] / mib for r in rows], width, label="analytic model")
    ax.set_title("collective buffer bytes per device per step (MiB)")
    ax.legend(fontsize=8)

    ax = axes[2]
    speeds = [r["images_per_second"] or 0 for r in rows]
    bars = ax.bar(x, speeds, color="tab:green")
    for bar, r in zip(bars, rows, strict=True):
        if r.get("speedup"):
            ax.annotate(
                f"{r['speedup']:.2f}x",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
            )
    ax.set_title("training images/s (speed-up vs single)")
    if not any(speeds):
        ax.text(0.5, 0.5, "not timed (--steps 0)", ha="center", va="center", transform=ax.transAxes)
        ax.set_yticks([])

    for ax in axes:
        ax.set_xticks(list(x), labels, fontsize=7)
    simulated = " -- simulated CPU devices share 2 cores" if rows and rows[-1].get("simulated_devices") else ""
    fig.suptitle(title + simulated, y=1.02)
    return save(fig, path)


def scaling_plot(rows: list[dict], path: Path, title: str, verdict: str = "") -> Path:
    """Speed-up vs devices against the ideal line, and where step time goes."""
    devices = [r["num_devices"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    ax = axes[0]
    ax.plot(devices, [r["speedup"] for r in rows], "o-", label="measured")
    ax.plot(devices, devices, "--", color="gray", label="ideal (linear)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xticks(devices, [str(d) for d in devices])
    ticks = sorted({*devices, *(2.0**k for k in range(-3, 1))})
    ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ax.set_xlabel("devices")
    ax.set_ylabel("speed-up vs single device")
    ax.legend(fontsize=8)
    ax.set_title("speed-up")

    ax = axes[1]
    x = range(len(rows))
    wait = [r["input_wait_fraction"] for r in rows]
    comm = [r["comm_fraction_model"] for r in rows]
    compute = [max(0.0, 1 - w - c) for w, c in zip(wait, comm, strict=True)]
    ax.bar(x, compute, label="compute (rest)")
    ax.bar(x, comm, bottom=compute, label="communication (modelled)")
    ax.bar(x, wait, bottom=[a + b for a, b in zip(compute, comm, strict=True)], label="waiting for input")
    ax.set_xticks(list(x), [str(d) for d in devices])
    ax.set_xlabel("devices")
    ax.set_ylabel("share of step time")
    ax.legend(fontsize=8)
    ax.set_title("where a step's time goes")
    fig.suptitle(title, y=1.04)
    if verdict:
        fig.text(0.5, -0.04, "verdict: " + verdict, ha="center", fontsize=10, weight="bold")
    return save(fig, path)


def simulate_plot(rows: list[dict], path: Path, title: str) -> Path:
    """Per layout against the device count: collective bytes per device (compiled, and the
    analytic model's), peak memory per device, and the modelled scaling efficiency."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    for i, name in enumerate(layouts):
        mine = [r for r in rows if r["layout"] == name]
        n = [r["num_devices"] for r in mine]
        color = f"C{i}"
        axes[0].plot(n, [r["comm_bytes"] / 2**20 for r in mine], "o-", color=color, label=f"{name} compiled")
        axes[0].plot(n, [r["model_comm_bytes"] / 2**20 for r in mine], "x--", color=color, label=f"{name} model")
        axes[1].plot(n, [r["peak_bytes"] / 2**30 for r in mine], "o-", color=color, label=name)
        axes[2].plot(n, [100 * r["modelled_efficiency"] for r in mine], "o-", color=color, label=name)
    labels = [("collective bytes per device per step (MiB)", "communication"),
              ("peak memory per device (GiB)", "memory"),
              (f"modelled efficiency on {rows[0]['hardware']} (%)", "scaling")]  # fmt: skip
    ticks = sorted({r["num_devices"] for r in rows})
    for ax, (ylabel, name) in zip(axes, labels, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel("devices (simulated)")
        ax.set_ylabel(ylabel)
        ax.set_title(name)
        ax.legend(fontsize=7)
    axes[0].set_yscale("log")
    axes[2].axhline(80, color="gray", linestyle=":")
    axes[2].set_ylim(0, 105)
    fig.suptitle(title, y=1.02)
    return save(fig, path)


def remat_plot(rows: list[dict], path: Path, title: str) -> Path:
    """Temp memory and FLOPs per remat policy: what each saves and what it costs."""
    labels = [r["remat"] + (f"\n({r['remat_names']})" if r.get("remat_names") else "") for r in rows]
    x = range(len(rows))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, change, name, scale in [
        (axes[0], "temp_bytes_per_device", "temp_change", "temp bytes per device (MiB)", 2**20),
        (axes[1], "flops_per_device", "flops_change", "FLOPs per device per step (GFLOP)", 1e9),
    ]:
        bars = ax.bar(x, [r[key] / scale for r in rows], color="tab:blue" if ax is axes[0] else "tab:orange")
        for bar, r in zip(bars, rows, strict=True):
            ax.annotate(
                f"{r[change]:+.0%}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom"
            )
        ax.set_xticks(list(x), labels, fontsize=8)
        ax.set_title(name)
    fig.suptitle(title, y=1.02)
    return save(fig, path)


def batch_scaling_plot(rows: list[dict], path: Path, title: str) -> Path:
    """Test accuracy against the global batch, with and without the learning-rate rule."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for rule, style in (("none", "o--"), ("linear", "s-")):
        points = sorted((r["global_batch_size"], 100 * r["test_accuracy"]) for r in rows if r["lr_scaling"] == rule)
        if points:
            label = "fixed learning rate" if rule == "none" else "linear scaling + warmup (Goyal et al.)"
            ax.plot(*zip(*points, strict=True), style, label=label)
    ax.set_xscale("log", base=2)
    batches = sorted({r["global_batch_size"] for r in rows})
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("global batch")
    ax.set_ylabel("test accuracy (%)")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    return save(fig, path)


def sync_plot(curves: dict[str, list[float]], rows: list[dict], path: Path, title: str) -> Path:
    """Loss per step for each update rule, and the bytes each moves per step."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, losses in curves.items():
        axes[0].plot(range(1, len(losses) + 1), losses, label=name, linewidth=1)
    axes[0].set_yscale("log")
    axes[0].set_xlabel("optimizer step")
    axes[0].set_ylabel("training loss")
    axes[0].legend(fontsize=8)
    axes[0].set_title("loss curves")
    x = range(len(rows))
    axes[1].bar(x, [r["comm_bytes_per_step"] / 2**20 for r in rows], color="tab:purple")
    axes[1].set_xticks(list(x), [r["rule"] for r in rows], fontsize=8, rotation=20)
    axes[1].set_ylabel("MiB per device per step")
    axes[1].set_title("collective bytes per step (compiled HLO)")
    fig.suptitle(title, y=1.02)
    return save(fig, path)


def input_bound_plot(rows: list[dict], path: Path, title: str, threshold: float) -> Path:
    """Training images/s per worker count beside the pipeline's own decode rate, and the
    input stall against the input-bound `threshold`."""
    labels = [f"{r['workers']} workers" if r["input"] != "in memory" else "in memory" for r in rows]
    x = list(range(len(rows)))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(x, [r["images_per_second"] for r in rows], color="tab:blue", label="training")
    decode = [(i, r["decode_images_per_second"]) for i, r in zip(x, rows, strict=True) if r["decode_images_per_second"]]
    left.plot(
        [i for i, _ in decode], [v for _, v in decode], "o--", color="tab:orange", label="pipeline alone (decode)"
    )
    left.set_xticks(x, labels)
    left.set_ylabel("images/s")
    left.legend()
    colors = ["tab:red" if r["verdict"] == "input-bound" else "tab:green" for r in rows]
    right.bar(x, [100 * r["input_wait_fraction"] for r in rows], color=colors)
    right.axhline(100 * threshold, color="grey", linestyle=":", label=f"input-bound above {threshold:.0%}")
    right.set_xticks(x, labels)
    right.set_ylabel("devices idle for input (% of training time)")
    right.legend()
    fig.suptitle(title, y=1.02)
    return save(fig, path)


def overhead_fit_text(t0: float, rate: float) -> str:
    """The fit step_seconds = t0 + flops / rate in words (experiments/cost_vs_size.py)."""
    if math.isnan(t0):
        return "no fit"
    if math.isinf(rate):
        return f"t0 {t0 * 1e3:.2f} ms; the step time does not grow with FLOPs"
    return f"t0 {t0 * 1e3:.2f} ms, rate {rate / 1e9:.1f} GFLOP/s"


def cost_vs_size_plot(rows: list[dict], path: Path, title: str) -> Path:
    """Per model (rows) and sweep (columns): step time against FLOPs per step, log-log, each
    point labelled, the fit t0 + flops / rate drawn, t0 dashed, compute = overhead dotted."""
    models = list(dict.fromkeys(r["model"] for r in rows))
    sweeps = [s for s in ("size", "batch") if any(r["sweep"] == s for r in rows)]
    fig, axes = plt.subplots(
        len(models), len(sweeps), figsize=(6 * len(sweeps), 4.2 * len(models)), squeeze=False, layout="constrained"
    )
    for ax_row, model in zip(axes, models, strict=True):
        for ax, sweep in zip(ax_row, sweeps, strict=True):
            points = [r for r in rows if r["model"] == model and r["sweep"] == sweep]
            if not points:
                ax.set_axis_off()
                continue
            x = np.array([r["flops_per_step"] for r in points])
            y = np.array([r["median_step_seconds"] for r in points])
            colors = ["tab:orange" if r["verdict"] == "overhead-bound" else "tab:blue" for r in points]
            ax.scatter(x, y * 1e3, c=colors, zorder=3)
            for r, xi, yi in zip(points, x, y, strict=True):
                label = f"{r['image_size']}px" if sweep == "size" else f"b{r['global_batch_size']}"
                ax.annotate(label, (xi, yi * 1e3), textcoords="offset points", xytext=(4, -10), fontsize=7)
            t0, rate = points[0]["fit_t0_seconds"], points[0]["fit_flops_per_second"]
            if not math.isnan(t0):
                grid = np.geomspace(x.min() / 1.5, x.max() * 1.5, 100)
                ax.plot(grid, (t0 + grid / rate) * 1e3, "k-", lw=1, label="t0 + flops / rate")
                if t0 > 0:
                    ax.axhline(t0 * 1e3, color="tab:orange", ls="--", lw=1, label=f"t0 = {t0 * 1e3:.2f} ms")
                if 0 < t0 * rate < math.inf and grid[0] <= t0 * rate <= grid[-1]:
                    ax.axvline(t0 * rate, color="grey", ls=":", lw=1, label="compute = overhead")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
            ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
            ax.set_xlabel("FLOPs per step")
            ax.set_ylabel("step time (ms)")
            fixed = f"batch {points[0]['global_batch_size']}" if sweep == "size" else f"{points[0]['image_size']}px"
            ax.set_title(f"{model}: {sweep} sweep at {fixed}\n{overhead_fit_text(t0, rate)}", fontsize=9)
            ax.legend(fontsize=7, loc="best")
    fig.suptitle(title + "  (orange: overhead-bound, blue: compute-bound)", fontsize=10)
    return save(fig, path)


def loop_overhead_plot(rows: list[dict], path: Path) -> Path:
    """Per (case, data): fit's ms per step beside the bare loop's, for each way of feeding the
    step (jaxcnn bench-loop)."""
    groups = list(dict.fromkeys((r["case"], r["data"]) for r in rows))
    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 4), squeeze=False)
    for ax, (case, data) in zip(axes[0], groups, strict=True):
        mine = [r for r in rows if (r["case"], r["data"]) == (case, data)]
        x = np.arange(len(mine))
        ax.bar(x - 0.2, [r["bare_ms_per_step"] for r in mine], 0.4, color="tab:grey", label="bare loop")
        ax.bar(x + 0.2, [r["fit_ms_per_step"] for r in mine], 0.4, color="tab:blue", label="fit")
        for i, r in enumerate(mine):
            ax.annotate(f"{100 * r['fit_over_bare']:+.0f}%", (i + 0.2, r["fit_ms_per_step"]), ha="center",
                        va="bottom", fontsize=8)  # fmt: skip
        ax.set_xticks(
            x, [r["mode"] if r["steps_per_call"] == 1 else f"{r['mode']}={r['steps_per_call']}" for r in mine]
        )
        ax.set_ylabel("ms per step")
        ax.set_title(f"{case}, {data} ({mine[0]['devices']} device(s), batch {mine[0]['batch_size']})")
        ax.set_ylim(0, 1.3 * max(max(r["fit_ms_per_step"], r["bare_ms_per_step"]) for r in mine))  # room for the legend
        ax.legend(loc="upper right", fontsize=8)
    return save(fig, path)
