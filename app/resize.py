"""Resizes that redo no work: the workers checkpoint before an elastic run grows.

Ray Train restarts the worker group from the latest checkpoint on every resize, and has no hook
to checkpoint first: a group that grew redid every step since the last checkpoint. Here the
controller's scaling policy, when it decides to grow, first raises a flag on a small actor and
holds the decision. The ranks read the flag together at their periodic check (rank 0 asks the
actor; the answer reaches every rank through the check's all-reduce), checkpoint at that step,
say so, and wait to be stopped. The policy then lets the resize happen, from that checkpoint.
"""

from __future__ import annotations

import ray
from ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client import (
    AUTOSCALING_REQUESTS_GET_TIMEOUT_S,
)
from ray.train.v2._internal.execution.scaling_policy.elastic import ElasticScalingPolicy
from ray.train.v2._internal.execution.scaling_policy.scaling_policy import (
    NoopDecision,
    ResizeDecision,
    ScalingDecision,
)
from ray.train.v2._internal.util import time_monotonic

RESIZE_SIGNAL_KEY = "resize_signal"
"""Key of the worker config holding the ResizeSignal actor's handle (elastic runs only)."""

CHECKPOINT_WAIT_S = 30.0
"""How long the policy holds a resize for the workers' checkpoint (a group stuck in a long
validation still resizes then, from its latest checkpoint)."""


@ray.remote(num_cpus=0)
class ResizeSignal:
    """What the controller asks of the workers, and what they did about it."""

    def __init__(self):
        self._requested = False
        self._saved_step: int | None = None

    def request(self) -> None:
        self._requested, self._saved_step = True, None

    def is_requested(self) -> bool:
        return self._requested

    def saved(self, step: int) -> None:
        self._requested, self._saved_step = False, step

    def saved_step(self) -> int | None:
        return self._saved_step

    def clear(self) -> None:
        self._requested, self._saved_step = False, None


class CheckpointFirstScalingPolicy(ElasticScalingPolicy):
    """Ray Train's elastic policy, except that a decision to grow waits for the workers'
    checkpoint (or ``CHECKPOINT_WAIT_S``), and that a (re)start is sized on the cluster as it
    is at that moment.

    Ray's policy counts the nodes in the autoscaling coordinator's reservation, which the
    coordinator recomputes on its own tick (20 s). A restart right after a node left was sized
    for the departed node too: its placement group could never be placed, and the restart
    waited out the worker-group start timeout before it was sized again.
    """

    def __init__(self, scaling_config, signal):
        super().__init__(scaling_config)
        self._signal = signal
        self._pending: ResizeDecision | None = None
        self._requested_at = 0.0
        self._probe = None
        self._saved_seen = False
        self._recompute = False

    def make_decision_for_non_running_worker_group(self) -> ScalingDecision:
        if self._pending is not None or self._saved_seen:
            self._pending, self._probe, self._saved_seen = None, None, False
            self._signal.clear.remote()
        self._recompute = True
        return super().make_decision_for_non_running_worker_group()

    def _get_reserved_resources(self):
        if not self._recompute:
            return super()._get_reserved_resources()
        # Asked after Ray's policy has sent its resource request, so the recomputed
        # reservation includes it.
        self._recompute = False
        try:
            reserved = ray.get(
                self._autoscaling_coordinator.get_reserved_resources.remote(
                    self._requester_id, recompute=True
                ),
                timeout=AUTOSCALING_REQUESTS_GET_TIMEOUT_S,
            )
        except Exception:  # noqa: BLE001 - Ray's own view (and its warning) instead
            return super()._get_reserved_resources()
        self._latest_reserved_resources = reserved
        self._latest_reserved_resources_query_time = time_monotonic()
        return reserved

    def make_decision_for_running_worker_group(self, worker_group_state, worker_group_status):
        if self._pending is not None:
            if self._saved_seen or time_monotonic() - self._requested_at > CHECKPOINT_WAIT_S:
                # The poll before this decision collected the checkpoint's report.
                decision = self._pending
                self._pending, self._probe, self._saved_seen = None, None, False
                return decision
            self._saved_seen = self._saved()
            return NoopDecision()
        decision = super().make_decision_for_running_worker_group(
            worker_group_state, worker_group_status
        )
        if isinstance(decision, ResizeDecision) and \
                decision.num_workers > worker_group_state.num_workers:
            self._signal.request.remote()
            self._pending, self._requested_at = decision, time_monotonic()
            return NoopDecision()
        return decision

    def _saved(self) -> bool:
        """Whether the workers saved their checkpoint (never blocks the controller's loop)."""
        if self._probe is None:
            self._probe = self._signal.saved_step.remote()
        ready, _ = ray.wait([self._probe], timeout=0)
        if not ready:
            return False
        step, self._probe = ray.get(ready[0]), None
        return step is not None
