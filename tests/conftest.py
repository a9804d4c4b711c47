"""Shared fixtures: the real MNIST images split into a small train/validation data dir, and a
real local Ray cluster for the integration tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

MNIST_ENV = "APP_MNIST_DIR"
"""Folder holding MNIST/raw/t10k-{images-idx3,labels-idx1}-ubyte.gz (the 10,000 real images)."""

NUM_TRAIN = 8_000


def pytest_collection_modifyitems(config, items):
    # Module-scoped Ray clusters must not overlap: keep each module's tests together, in order.
    items.sort(key=lambda item: item.fspath.strpath)


@pytest.fixture(scope="session")
def mnist_dir(tmp_path_factory) -> Path:
    """A data dir in torchvision's layout: the first 8,000 real images as the training split,
    the last 2,000 as the validation split."""
    from app import data

    source = os.environ.get(MNIST_ENV)
    if not source:
        pytest.skip(f"{MNIST_ENV} is not set: it names the folder with the real MNIST test split")
    raw = Path(source) / "MNIST" / "raw"
    if not (raw / "t10k-images-idx3-ubyte.gz").exists():
        pytest.skip(f"{MNIST_ENV}={source} has no MNIST/raw/t10k-images-idx3-ubyte.gz")
    images = data.read_idx(raw / "t10k-images-idx3-ubyte.gz")
    labels = data.read_idx(raw / "t10k-labels-idx1-ubyte.gz")
    root = tmp_path_factory.mktemp("mnist")
    out = root / "MNIST" / "raw"
    data.write_idx(out / "train-images-idx3-ubyte", images[:NUM_TRAIN])
    data.write_idx(out / "train-labels-idx1-ubyte", labels[:NUM_TRAIN])
    data.write_idx(out / "t10k-images-idx3-ubyte.gz", images[NUM_TRAIN:])
    data.write_idx(out / "t10k-labels-idx1-ubyte.gz", labels[NUM_TRAIN:])
    return root


@pytest.fixture(scope="module")
def ray_cluster():
    """A fresh single-node local Ray cluster with 2 CPUs, shut down after the module."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
