"""Shared fixtures for the export tests: real Fashion-MNIST inputs and a briefly trained cnn checkpoint."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from protofl.data import FASHION_MNIST_DIR

needs_fmnist = pytest.mark.skipif(
    not Path(FASHION_MNIST_DIR).is_dir(),
    reason=f"Fashion-MNIST not installed at {FASHION_MNIST_DIR} (CI installs it: dataset-fashion-mnist)",
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_torch_thread: None) -> None:
    """Exports and onnxruntime runs with torch single-threaded (tests/conftest.py says why)."""


@pytest.fixture(scope="session")
def fmnist_test() -> tuple[np.ndarray, np.ndarray]:
    """64 real test images (normalised float32) and their labels."""
    if not Path(FASHION_MNIST_DIR).is_dir():
        pytest.skip(f"Fashion-MNIST not installed at {FASHION_MNIST_DIR}")
    from protofl.data import load_images

    x, y, _ = load_images("fashion-mnist", "test", 64)
    return x, y


@pytest.fixture(scope="session")
def trained_cnn(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cnn checkpoint after 1 epoch on 10k Fashion-MNIST training images (so accuracies mean something)."""
    if not Path(FASHION_MNIST_DIR).is_dir():
        pytest.skip(f"Fashion-MNIST not installed at {FASHION_MNIST_DIR}")
    from edge_agent.techniques import Objective
    from edge_agent.training import trainer
    from edge_agent.training.models import build_model
    from export.checkpoint import save_checkpoint
    from protofl.config import FederationConfig
    from protofl.data import load_images

    x, y, ds = load_images("fashion-mnist", "train", 10000, seed=7)
    model = build_model("cnn", (1, 28, 28), 10, seed=0)
    # One thread (the session default): on a shared 2-core box two torch threads contending with other
    # processes made this step 4x slower, not 2x faster.
    trainer.train_local(
        model, torch.from_numpy(x), torch.from_numpy(y), FederationConfig(local_epochs=1), Objective(), seed=0
    )
    return save_checkpoint(model, tmp_path_factory.mktemp("ckpt") / "cnn.pt", mean=ds.mean, std=ds.std)
