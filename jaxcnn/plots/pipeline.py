"""The pipeline schedules' figures: memory held in flight, and timelines."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxcnn.plots.figure import plt, save


def pipeline_memory_plot(rows: list[dict], path: Path, title: str) -> Path:
    """Per model (columns): against M, the most any stage holds in flight (micro-batch inputs
    and output gradients), in micro-batches and in MiB, and the most memory a stage needs,
    one line per schedule (experiments/pipeline_schedules.py's rows, one per stage)."""
    models = list(dict.fromkeys(r["model"] for r in rows))
    schedules = list(dict.fromkeys(r["schedule"] for r in rows))
    fig, axes = plt.subplots(3, len(models), figsize=(5.5 * len(models), 10), squeeze=False)
    for col, model in enumerate(models):
        mine = [r for r in rows if r["model"] == model]
        ms = sorted({r["microbatches"] for r in mine})
        for ax, key, name, scale in [
            (axes[0][col], "held_microbatches", "held in flight, most of any stage (micro-batches)", 1),
            (axes[1][col], "held_bytes", "held in flight, most of any stage (MiB)", 2**20),
            (axes[2][col], "memory_bytes", "memory per stage, most of any stage (MiB)", 2**20),
        ]:
            for schedule, marker in zip(schedules, "osd^v", strict=False):
                points = [max(r[key] for r in mine if r["schedule"] == schedule and r["microbatches"] == m) for m in ms]
                ax.plot(ms, [p / scale for p in points], marker=marker, label=schedule)
            ax.set_xscale("log", base=2)
            ax.set_xticks(ms, [str(m) for m in ms])
            ax.set_ylim(bottom=0)
            ax.set_xlabel("micro-batches M (micro-batch size fixed)")
            ax.set_title(f"{model} {mine[0]['image_shape']}, S={mine[0]['stages']}\n{name}", fontsize=9)
            ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save(fig, path)


def pipeline_timeline_plot(timelines: dict[str, list], path: Path, title: str) -> Path:
    """Schedule figures as in the GPipe / PipeDream / Megatron papers: per schedule, stages as
    rows and ticks as columns, each cell the action a stage runs (a forward light, a backward
    dark, coloured by micro-batch; hatched: a stage's second and later chunk). With V chunks a
    stage, a tick runs 1/V of the stage's layers and is drawn 1/V wide, so the schedules share
    one time axis. `timelines`: name -> jaxcnn.pipeline.schedule.ticks' list of ticks (each a
    list per stage of an Action or None)."""
    from matplotlib.patches import Patch, Rectangle

    def chunks_a_stage(timeline) -> int:
        return 1 + max(a.chunk for tick in timeline for a in tick if a) // len(timeline[0])

    longest = max(len(t) / chunks_a_stage(t) for t in timelines.values())
    fig, axes = plt.subplots(
        len(timelines), 1, figsize=(max(6.0, 0.6 * longest + 1.5), 1.4 + 0.45 * 4 * len(timelines))
    )
    axes = np.atleast_1d(axes)
    colours = plt.get_cmap(
        "tab20" if max(a.microbatch for t in timelines.values() for k in t for a in k if a) >= 10 else "tab10"
    )
    for ax, (name, timeline) in zip(axes, timelines.items(), strict=True):
        stages, width = len(timeline[0]), 1 / chunks_a_stage(timeline)
        for t, tick in enumerate(timeline):
            for g, a in enumerate(tick):
                if a is None:
                    continue
                colour = colours(a.microbatch % colours.N)
                ax.add_patch(Rectangle(
                    (t * width, g), width, 1, facecolor=colour, alpha=0.45 if a.kind == "F" else 1.0, edgecolor="white",
                    hatch="///" if a.chunk >= stages else None,
                ))  # fmt: skip
                ax.text((t + 0.5) * width, g + 0.5, str(a.microbatch), ha="center", va="center", fontsize=6)
        busy = sum(a is not None for tick in timeline for a in tick)
        ax.set_xlim(0, longest)
        ax.set_ylim(stages, 0)
        ax.set_yticks([g + 0.5 for g in range(stages)], [f"stage {g}" for g in range(stages)], fontsize=8)
        ax.set_xlabel("time, in ticks of a whole stage (a chunk's tick: 1/V of one)", fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
        ax.set_title(f"{name}: {len(timeline)} ticks, bubble {1 - busy / (len(timeline) * stages):.1%}", fontsize=9)
    axes[0].legend(
        handles=[Patch(facecolor="grey", alpha=0.45, label="forward"), Patch(facecolor="grey", label="backward"),
                 Patch(facecolor="white", edgecolor="grey", hatch="///", label="later chunk (V > 1)")],
        fontsize=7, loc="upper right", ncol=3, bbox_to_anchor=(1, 1.45),
    )  # fmt: skip
    fig.suptitle(f"{title}; cells: micro-batch index, a tick per action", fontsize=10)
    fig.tight_layout()
    return save(fig, path)
