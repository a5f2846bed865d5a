"""Data: where images come from (sources) and how they become the step's sharded
batches (loader)."""

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
    "Augment",
    "Dataset",
    "Loader",
    "Prefetcher",
    "batch_indices",
    "epoch_order",
    "eval_batches",
    "image_shape_for",
    "load_csv",
    "parse_image_shape",
    "synthetic_dataset",
    "to_global",
    "train_batches",
]
