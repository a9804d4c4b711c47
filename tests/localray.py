"""The tests' own single-node Ray cluster on this machine."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def local_ray() -> Iterator[str]:
    """A fresh 2-CPU local cluster with the embedded cluster's lean head; yields its GCS
    address and shuts it down after."""
    import ray

    from app.cluster import lean_head

    with lean_head(log_monitor=False):
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
