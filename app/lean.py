"""The parts of Ray Train's start that a run does not need, left out.

Each helper Ray Train starts is an actor, and so a Python process that imports Ray Train: about
a second of CPU, taken from the workers' own start on a small machine (two cores: a process's
second is half a second of everyone's wall time before the first step). Left out, where they
have nothing to do:

- Ray Train's placement group cleaner, on every run. It removes a dead controller's placement
  group, asking the dashboard's state API whether the controller lives. The app's own
  ``PlacementGroupReaper`` already removes a run's earlier groups, and in a sweep (where a
  controller can die before its run ends) its guard removes a dead controller's; outside a
  sweep the controller dies with its driver, and Ray removes the groups of a finished job.
- The dataset manager, when the run has no Ray Data sets (the in-memory path).
- On the embedded cluster (one machine, started by the command, nothing to add or drain):
  the autoscaling coordinator that a fixed-size run registers its request with (no autoscaler
  can act on it; an elastic run still reads its nodes through it, and Ray Data budgets its
  CPUs from it, so those keep it), and the preemption watcher (no node of it is ever drained;
  ``app.cluster`` switches it off in the embedded cluster's environment, as Ray Train's
  controller reads it from there).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
from ray.train.v2._internal.callbacks.placement_group_callback import (
    PlacementGroupCleanerCallback,
)
from ray.train.v2._internal.execution.scaling_policy.fixed import FixedScalingPolicy


def needed_callbacks(callbacks: Sequence[Any], *, has_datasets: bool) -> list[Any]:
    """Ray Train's default controller callbacks without those that have nothing to do."""
    unneeded: tuple[type, ...] = (PlacementGroupCleanerCallback,)
    if not has_datasets:
        unneeded += (DatasetsCallback,)
    return [callback for callback in callbacks if not isinstance(callback, unneeded)]


class LocalFixedScalingPolicy(FixedScalingPolicy):
    """A fixed-size policy that asks no autoscaler for anything: for a cluster that cannot
    grow. Ray's ``FixedScalingPolicy`` registers and refreshes a resource request with the
    autoscaling coordinator actor, which it would start for that."""

    def after_controller_start(self, train_run_context) -> None:
        pass

    def _maybe_send_resource_request(self) -> None:
        pass

    def _send_resource_request(self) -> None:
        pass
