"""PNG figures for the reports: layouts, scaling, remat, batch scaling, sync vs async, input
bound, cost against size, pipeline schedules (memory, timelines); a run's curves and an
evaluation's confusion matrix (matplotlib, Agg: figure.py)."""

from jaxcnn.plots.pipeline import pipeline_memory_plot, pipeline_timeline_plot
from jaxcnn.plots.run import confusion_plot, curves_plot
from jaxcnn.plots.studies import (
    batch_scaling_plot,
    compare_plot,
    cost_vs_size_plot,
    input_bound_plot,
    loop_overhead_plot,
    overhead_fit_text,
    remat_plot,
    scaling_plot,
    simulate_plot,
    sync_plot,
)

__all__ = [
    "batch_scaling_plot",
    "compare_plot",
    "confusion_plot",
    "cost_vs_size_plot",
    "curves_plot",
    "input_bound_plot",
    "loop_overhead_plot",
    "overhead_fit_text",
    "pipeline_memory_plot",
    "pipeline_timeline_plot",
    "remat_plot",
    "scaling_plot",
    "simulate_plot",
    "sync_plot",
]
