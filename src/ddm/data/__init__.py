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
from ddm.data.features import FEATURE_NAMES, features_spec
from ddm.data.mnist import IDXError, load_mnist
from ddm.data.partition import (
    KMeansPartition,
    LabelPartition,
    Partition,
    PartitionMismatchError,
    check_partition_hash,
    classes_of,
    fit_kmeans,
    parse_label_groups,
    partition_from_dict,
    partition_sha256,
)
from ddm.data.partition_file import load_partition, partition_from_spec, read_partition_file
from ddm.data.resize import resize_images

__all__ = [
    "HELDOUT_FRACTION", "SPLITS", "Dataset", "load_dataset", "load_digits_dataset",
    "split_holdout", "subset_by_classes", "FEATURE_NAMES", "features_spec", "IDXError",
    "load_mnist", "KMeansPartition", "LabelPartition", "Partition", "PartitionMismatchError",
    "check_partition_hash", "classes_of", "fit_kmeans", "parse_label_groups",
    "partition_from_dict", "partition_sha256", "load_partition", "partition_from_spec",
    "read_partition_file", "resize_images",
]
