"""Shared fixtures: the real MNIST images split into a small train/validation data dir, and a
real local Ray cluster for the integration tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from localray import local_ray

MNIST_ENV = "APP_MNIST_DIR"
"""Folder holding MNIST/raw/t10k-{images-idx3,labels-idx1}-ubyte.gz (the 10,000 real images)."""

NUM_TRAIN = 8_000


def pytest_configure(config):
    # The book's network applies Dropout2d to a 2-D tensor, as the book does (app.model).
    config.addinivalue_line("filterwarnings", "ignore:dropout2d. Received a 2-D input")


def pytest_collection_modifyitems(config, items):
    # Module-scoped Ray clusters must not overlap: keep each module's tests together, in order.
    items.sort(key=lambda item: item.fspath.strpath)


def _real_mnist():
    from app import data

    # In CI the images are always there: a missing set is a broken CI, not a reason to skip.
    missing = pytest.fail if os.environ.get("CI") else pytest.skip
    source = os.environ.get(MNIST_ENV)
    if not source:
        missing(f"{MNIST_ENV} is not set: it names the folder with the real MNIST test split")
    raw = Path(source) / "MNIST" / "raw"
    if not (raw / "t10k-images-idx3-ubyte.gz").exists():
        missing(f"{MNIST_ENV}={source} has no MNIST/raw/t10k-images-idx3-ubyte.gz")
    return data.read_idx(raw / "t10k-images-idx3-ubyte.gz"), data.read_idx(
        raw / "t10k-labels-idx1-ubyte.gz"
    )


def _write_split(root: Path, num_train: int, num_val: int) -> Path:
    """A data dir in torchvision's layout: the first ``num_train`` real images as the training
    split, the last ``num_val`` as the validation split (gzip, to cover both file forms)."""
    from app import data

    images, labels = _real_mnist()
    out = root / "MNIST" / "raw"
    data.write_idx(out / "train-images-idx3-ubyte", images[:num_train])
    data.write_idx(out / "train-labels-idx1-ubyte", labels[:num_train])
    data.write_idx(out / "t10k-images-idx3-ubyte.gz", images[-num_val:])
    data.write_idx(out / "t10k-labels-idx1-ubyte.gz", labels[-num_val:])
    return root


@pytest.fixture(scope="session")
def mnist_dir(tmp_path_factory) -> Path:
    """The 10,000 real images: 8,000 to train on, 2,000 to validate on."""
    return _write_split(tmp_path_factory.mktemp("mnist"), NUM_TRAIN, 10_000 - NUM_TRAIN)


@pytest.fixture(scope="session")
def small_mnist_dir(tmp_path_factory) -> Path:
    """2,000 real images to train on and 500 to validate on, for sweeps of many short runs."""
    return _write_split(tmp_path_factory.mktemp("small-mnist"), 2_000, 500)


@pytest.fixture(scope="module")
def ray_cluster():
    """A fresh single-node local Ray cluster with 2 CPUs (the embedded cluster's lean head),
    shut down after the module."""
    with local_ray():
        yield


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real MLflow tracking server on 127.0.0.1 (sqlite backend, artifacts proxied to a
    folder), for the tests that log to one; its URI. Stopped after the session."""
    import signal
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    root = tmp_path_factory.mktemp("mlflow")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    uri = f"http://127.0.0.1:{port}"
    log = open(root / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
         "--artifacts-destination", str(root / "artifacts")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        # Its job runner (several busy processes) is for features the tests do not use.
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
    )
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(f"{uri}/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(
                        f"mlflow server did not start: {(root / 'server.log').read_text()[-2000:]}")
                time.sleep(0.5)
        yield uri
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()
