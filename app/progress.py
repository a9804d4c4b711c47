"""The channel from the workers and Ray Train's controller to the driver's console."""

from __future__ import annotations

from typing import Any

import ray
from ray.train.v2._internal.execution.callback import ControllerCallback

CONTROLLER_EVENT = "controller"
"""The event that carries Ray Train's controller's handle to the driver (which keeps it; the
console never sees it)."""


def send(progress, event: dict[str, Any]) -> None:
    """Put ``event`` on the driver's progress queue (None: no console listens). Best effort:
    never a reason to stop training (the driver may be gone; its checkpoints are not)."""
    if progress is None:
        return
    try:
        progress.put(event, timeout=5)
    except Exception:  # noqa: BLE001 - see the docstring
        pass


class AnnounceController(ControllerCallback):
    """Runs in Ray Train's controller: sends the driver the controller's own handle, which
    ``fit()`` keeps to itself, so that the driver can end a run it gives up on
    (``app.launcher``)."""

    def __init__(self, progress):
        self.progress = progress

    def after_controller_start(self, train_run_context) -> None:
        send(self.progress, {"event": CONTROLLER_EVENT,
                             "controller": ray.get_runtime_context().current_actor})
