"""Data: where images come from (sources: CSV, synthetic; datasets: standard ones by
name, read from IDX files; folders: your own images, decoded when used) and how they
become the step's batches (loader: a grain pipeline, handing them over placed)."""

from jaxcnn.data.datasets import DATASETS, load_datasets, load_named, load_source
from jaxcnn.data.feed import Batches, CallMetrics, Feed, Schedule, Step
from jaxcnn.data.folders import ImageFiles, load_image_folder, split_validation
from jaxcnn.data.loader import (
    Augment,
    EvalShare,
    Loader,
    batch_indices,
    epoch_order,
    eval_batches,
    train_batches,
)
from jaxcnn.data.sources import Dataset, image_shape_for, load_csv, parse_image_shape, synthetic_dataset

__all__ = [
    "DATASETS",
    "Augment",
    "Batches",
    "CallMetrics",
    "Dataset",
    "EvalShare",
    "Feed",
    "ImageFiles",
    "Loader",
    "Schedule",
    "Step",
    "batch_indices",
    "epoch_order",
    "eval_batches",
    "image_shape_for",
    "load_csv",
    "load_datasets",
    "load_image_folder",
    "load_named",
    "load_source",
    "parse_image_shape",
    "split_validation",
    "synthetic_dataset",
    "train_batches",
]
