"""Placement groups: releasing the ones Ray Train leaves behind, and saying who holds what.

Ray Train reserves its workers' resources in one placement group per worker group. Some paths
leave that group reserved after its workers are gone (ray-project/ray#54305): a worker group
torn down after a worker died, or a finished run inside a Ray Tune trial. The reservation then
blocks every later worker group that needs those resources, and the run (or the next trial)
waits forever. ``PlacementGroupReaper`` runs inside Ray Train's controller and removes every
placement group an earlier worker group of the same run held, before the next group starts and
when the run ends. A controller runs one worker group at a time, so no live group is touched.
"""

from __future__ import annotations

import logging

import ray
from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback
from ray.util.placement_group import PlacementGroup, remove_placement_group

logger = logging.getLogger(__name__)


def _is_reserved(group: PlacementGroup) -> bool:
    state = ray.util.placement_group_table(group).get("state")
    return state not in (None, "REMOVED")


class PlacementGroupReaper(WorkerGroupCallback, ControllerCallback):
    """Removes the placement groups of this run's earlier worker groups (see the module)."""

    def __init__(self):
        self._groups: list[PlacementGroup] = []

    def after_worker_group_start(self, worker_group) -> None:
        handle = worker_group.get_worker_group_state().placement_group_handle
        self._groups.append(handle.placement_group)

    def before_worker_group_start(self, worker_group_context) -> None:
        self.release()

    def after_controller_finish(self, result) -> None:
        self.release()

    def before_controller_abort(self) -> None:
        self.release()

    def release(self) -> int:
        """Removes every recorded placement group still reserved; returns how many."""
        released = 0
        for group in self._groups:
            try:
                if _is_reserved(group):
                    remove_placement_group(group)
                    released += 1
                    logger.warning("Released placement group %s of a finished worker group "
                                   "(ray-project/ray#54305).", group.id.hex())
            except Exception:  # noqa: BLE001 - best effort: Ray may have removed it meanwhile
                logger.debug("Could not release placement group %s", group.id.hex(),
                             exc_info=True)
        self._groups.clear()
        return released


def _bundles(entry: dict) -> str:
    shapes = [dict(bundle) for bundle in entry.get("bundles", {}).values()]
    if not shapes:
        return "nothing"
    first = ", ".join(f"{key}: {value:g}" for key, value in sorted(shapes[0].items()))
    same = all(shape == shapes[0] for shape in shapes)
    return f"{{{first}}} x {len(shapes)}" if same else f"{len(shapes)} bundles"


def describe_reservations() -> str:
    """What the cluster's placement groups hold and wait for, in a line: the reason a worker
    group cannot be placed, usually."""
    own_job = ray.get_runtime_context().get_job_id()
    held, waiting = [], []
    for group_id, entry in ray.util.placement_group_table().items():
        # A placement group's ID ends with the ID of the job that created it.
        owner = "this run's job" if group_id.endswith(own_job) else f"job {group_id[-8:]}"
        text = f"{_bundles(entry)} by {owner} (placement group {group_id[:8]})"
        if entry.get("state") == "CREATED":
            held.append(text)
        elif entry.get("state") in ("PENDING", "RESCHEDULING"):
            waiting.append(text)
    available = ray.available_resources()
    parts = [
        f"free now: {available.get('CPU', 0):g} CPUs, {available.get('GPU', 0):g} GPUs",
        "reserved: " + ("; ".join(held) if held else "nothing"),
    ]
    if waiting:
        parts.append("waiting: " + "; ".join(waiting))
    return ", ".join(parts)
