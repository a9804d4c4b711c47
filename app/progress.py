"""The channel from the workers and Ray Train's controller to the driver's console."""

from __future__ import annotations

from typing import Any


def send(progress, event: dict[str, Any]) -> None:
    """Put ``event`` on the driver's progress queue (None: no console listens). Best effort:
    never a reason to stop training (the driver may be gone; its checkpoints are not)."""
    if progress is None:
        return
    try:
        progress.put(event, timeout=5)
    except Exception:  # noqa: BLE001 - see the docstring
        pass
