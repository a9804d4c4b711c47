"""The default task, recording in each training worker whether torch's compiler was already
imported when the worker built its model (tests/test_lean.py): it is by then, if the worker's
early import of it (``app.lean.ImportTorchEarly``) ran."""

import dataclasses
import os
import sys

from ray.experimental import internal_kv

from app.builtin_tasks import mnist_convnet


def _build_model():
    if "RANK" in os.environ:  # a training worker (the driver checks the task too)
        internal_kv._internal_kv_put(
            f"dynamo-at-build-{os.environ['RANK']}".encode(),
            str("torch._dynamo" in sys.modules).encode(), namespace="test-lean",
        )
    return mnist_convnet.build_model()


task = dataclasses.replace(mnist_convnet, build_model=_build_model)
