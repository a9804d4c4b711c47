"""Placement groups: releasing the ones Ray Train leaves behind, and saying who holds what.

Ray Train reserves its workers' resources in one placement group per worker group. Some paths
leave that group reserved after its workers are gone (ray-project/ray#54305): a worker group
torn down after a worker died, or a finished run inside a Ray Tune trial. The reservation then
blocks every later worker group that needs those resources, and the run (or the next trial)
waits forever. ``PlacementGroupReaper`` runs inside Ray Train's controller and removes every
placement group an earlier worker group of the same run held, before the next group starts and
when the run ends. A controller runs one worker group at a time, so no live group is touched.

A worker that dies while the group runs its start callbacks (``after_worker_group_start``:
the process group's setup, for one) fails the start after Ray has marked the group started, so
Ray neither shuts it down nor hands it to the controller: its placement group, and the surviving
workers in it, stay until the run ends, and every later start times out waiting for those
resources. The reaper therefore records a group as the first of those callbacks
(``reaper_first``), before any other can fail.

Inside a Ray Tune trial the controller can also die before it ends its run: Tune kills a trial
the moment its scheduler stops it, and the controller (owned by the trial) goes with it. Its
placement group belongs to the sweep's job and outlives it; Ray Train's own cleaner would remove
it but needs the dashboard's state API, which the embedded cluster does not start, and it is
left out of every run (``app.lean``). With
``guard=True`` the reaper starts a small detached actor that removes the groups once the
controller is gone.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import ray
from ray.train.v2._internal.execution.callback import ControllerCallback, WorkerGroupCallback
from ray.util.placement_group import PlacementGroup, remove_placement_group

logger = logging.getLogger(__name__)


def _is_reserved(group: PlacementGroup) -> bool:
    state = ray.util.placement_group_table(group).get("state")
    return state not in (None, "REMOVED")


def _remove_reserved(groups: list[PlacementGroup]) -> int:
    released = 0
    for group in groups:
        try:
            if _is_reserved(group):
                remove_placement_group(group)
                released += 1
                logger.warning("Released placement group %s of a finished worker group "
                               "(ray-project/ray#54305).", group.id.hex())
        except Exception:  # noqa: BLE001 - best effort: Ray may have removed it meanwhile
            logger.debug("Could not release placement group %s", group.id.hex(), exc_info=True)
    return released


class _Guard:
    """Detached: removes the watched placement groups once the controller has died."""

    def __init__(self, controller, poll_s: float = 1.0):
        self._controller = controller
        self._groups: dict[str, PlacementGroup] = {}
        self._stop = threading.Event()
        threading.Thread(target=self._watch, args=(poll_s,), daemon=True).start()

    def watch(self, group: PlacementGroup) -> None:
        self._groups[group.id.hex()] = group

    def forget(self, group_ids: list[str]) -> None:
        for group_id in group_ids:
            self._groups.pop(group_id, None)

    def stop(self) -> None:
        self._stop.set()

    def _watch(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            try:
                ray.get(self._controller.__ray_ready__.remote(), timeout=30)
            except ray.exceptions.RayActorError:
                _remove_reserved(list(self._groups.values()))
                break
            except Exception:  # noqa: BLE001 - busy or slow is not dead
                continue
        # Detached: nothing else ends it.
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)


class PlacementGroupReaper(WorkerGroupCallback, ControllerCallback):
    """Removes the placement groups of this run's earlier worker groups (see the module)."""

    def __init__(self, guard: bool = False):
        self._groups: list[PlacementGroup] = []
        self._use_guard = guard
        self._guard = None

    def after_controller_start(self, train_run_context) -> None:
        if not self._use_guard:
            return
        try:
            # DEFAULT: not inside the Tune trial's placement group, which Tune removes (and every
            # actor in it) when the trial ends.
            self._guard = ray.remote(num_cpus=0)(_Guard).options(
                lifetime="detached", scheduling_strategy="DEFAULT"
            ).remote(ray.get_runtime_context().current_actor)
        except Exception:  # noqa: BLE001 - without it, only an ungraceful end can leak
            logger.warning("Could not start the placement group guard", exc_info=True)

    def after_worker_group_start(self, worker_group) -> None:
        self.record(worker_group.get_worker_group_state().placement_group_handle.placement_group)

    def record(self, group: PlacementGroup) -> None:
        """Remember a worker group's placement group (and have the guard watch it)."""
        self._groups.append(group)
        if self._guard is not None:
            try:
                # Waited for (once the guard is up, milliseconds): a call still queued when the
                # controller dies would die with it.
                ray.get(self._guard.watch.remote(group), timeout=30)
            except Exception:  # noqa: BLE001 - the reaper still releases it on a graceful end
                logger.warning("The placement group guard did not answer", exc_info=True)

    def before_worker_group_start(self, worker_group_context) -> None:
        self.release()

    def after_controller_finish(self, result) -> None:
        self.release()
        self._stop_guard()

    def before_controller_abort(self) -> None:
        self.release()
        self._stop_guard()

    def _stop_guard(self) -> None:
        if self._guard is not None:
            self._guard.stop.remote()
            self._guard = None

    def release(self) -> int:
        """Removes every recorded placement group still reserved; returns how many."""
        released = _remove_reserved(self._groups)
        if self._guard is not None:
            self._guard.forget.remote([group.id.hex() for group in self._groups])
        self._groups.clear()
        return released


def reaper_first(callbacks: list[Any]) -> list[Any]:
    """The controller's callbacks with the reapers moved to the front (the module says why);
    the others keep their order."""
    reapers = [callback for callback in callbacks if isinstance(callback, PlacementGroupReaper)]
    return reapers + [callback for callback in callbacks if callback not in reapers]


def _bundles(entry: dict) -> str:
    shapes = [dict(bundle) for bundle in entry.get("bundles", {}).values()]
    if not shapes:
        return "nothing"
    first = ", ".join(
        f"{key}: {value / 2**20:.0f} MiB" if "memory" in key else f"{key}: {value:g}"
        for key, value in sorted(shapes[0].items())
    )
    same = all(shape == shapes[0] for shape in shapes)
    return f"{{{first}}} x {len(shapes)}" if same else f"{len(shapes)} bundles"


def waiting_for_resources() -> bool:
    """Whether a placement group of this job waits for resources (a worker group that cannot
    be placed), as opposed to one that holds them while its workers start."""
    own_job = ray.get_runtime_context().get_job_id()
    return any(
        group_id.endswith(own_job) and entry.get("state") in ("PENDING", "RESCHEDULING")
        for group_id, entry in ray.util.placement_group_table().items()
    )


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
