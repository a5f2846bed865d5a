"""Data: where images come from (sources: CSV, synthetic; datasets: standard ones by
name, read from IDX files) and how they become the step's sharded batches (loader)."""

from jaxcnn.data.datasets import DATASETS, load_named
from jaxcnn.data.loader import (
    Augment,
    Loader,
    Prefetcher,
    batch_indices,
    epoch_order,
    eval_batches,
    to_global,
    train_batches,
)
from jaxcnn.data.sources import Dataset, image_shape_for, load_csv, parse_image_shape, synthetic_dataset

__all__ = [
    "DATASETS",
    "Augment",
    "Dataset",
    "Loader",
    "Prefetcher",
    "batch_indices",
    "epoch_order",
    "eval_batches",
    "image_shape_for",
    "load_csv",
    "load_named",
    "parse_image_shape",
    "synthetic_dataset",
    "to_global",
    "train_batches",
]
