"""Data loading and federated partitioning (numpy only: nothing under protofl/ imports torch)."""

from protofl.data import own
from protofl.data.dataset import Dataset
from protofl.data.images import load_images
from protofl.data.loaders import (
    DATASET_SPECS,
    FASHION_MNIST_DIR,
    FASHION_MNIST_MEAN,
    FASHION_MNIST_STD,
    load_dataset,
    load_fashion_mnist,
    load_idx_dir,
    load_npz,
    load_source,
    read_idx,
)
from protofl.data.partition import (
    ClientSplit,
    FederatedSplit,
    build_federation,
    carve_public,
    dirichlet_partition,
    split_client,
)
from protofl.data.synthetic import make_synthetic

__all__ = [
    "DATASET_SPECS",
    "FASHION_MNIST_DIR",
    "FASHION_MNIST_MEAN",
    "FASHION_MNIST_STD",
    "ClientSplit",
    "Dataset",
    "FederatedSplit",
    "build_federation",
    "carve_public",
    "dirichlet_partition",
    "load_dataset",
    "load_fashion_mnist",
    "load_idx_dir",
    "load_images",
    "load_npz",
    "load_source",
    "make_synthetic",
    "own",
    "read_idx",
    "split_client",
]
