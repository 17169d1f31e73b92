"""Digit image data: the embedded digits set, MNIST IDX files, and expert partitions."""

from ddm.data.datasets import (
    HELDOUT_FRACTION,
    SPLITS,
    Dataset,
    load_dataset,
    load_digits_dataset,
    split_holdout,
    subset_by_classes,
)
from ddm.data.mnist import IDXError, load_mnist
from ddm.data.partition import (
    KMeansPartition,
    LabelPartition,
    Partition,
    classes_of,
    fit_kmeans,
    parse_label_groups,
    partition_from_dict,
)
from ddm.data.resize import resize_images

__all__ = [
    "HELDOUT_FRACTION", "SPLITS", "Dataset", "load_dataset", "load_digits_dataset",
    "split_holdout", "subset_by_classes", "IDXError", "load_mnist", "KMeansPartition",
    "LabelPartition", "Partition", "classes_of", "fit_kmeans", "parse_label_groups",
    "partition_from_dict", "resize_images",
]
