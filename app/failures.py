"""Which failures Ray Train retries for this app: its failure policy, and finding the cause.

Ray Train's default policy retries every worker-group error up to ``max_failures`` (also a
``UserError`` or a diverged loss, which a restart cannot fix) and ends the run at once when a
worker dies while the group is being (re)started, since that reaches it as an unexpected
controller error. Both are wrong for a run that is meant to survive worker deaths: this policy
ends the run on errors no restart can fix, and counts a death during a restart as one more
worker failure.
"""

from __future__ import annotations

import time

import ray.train
from ray.exceptions import RayActorError
from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy
from ray.train.v2._internal.execution.failure_handling.failure_policy import FailureDecision
from ray.train.v2.api.exceptions import ControllerError, TrainingFailedError, WorkerGroupError

from app.config import NOT_RETRYABLE
from app.progress import send


def find_cause(error: BaseException | None, types: tuple[type, ...]) -> BaseException | None:
    """The first exception of ``types`` in ``error``'s chain (Ray wraps a worker's exception in
    its own types; ``cause`` and ``__cause__`` lead back to it)."""
    seen = 0
    while error is not None and seen < 20:
        if isinstance(error, types):
            return error
        error = getattr(error, "cause", None) or error.__cause__ or error.__context__
        seen += 1
    return None


def not_retryable_cause(error: BaseException) -> BaseException | None:
    """The error a worker raised that no restart can fix, if that is what failed the run."""
    failures = getattr(error, "worker_failures", {}) or {}
    for failure in failures.values():
        cause = find_cause(failure, NOT_RETRYABLE)
        if cause is not None:
            return cause
    return None


class AppFailurePolicy(DefaultFailurePolicy):
    """Ray Train's policy, except: errors in ``NOT_RETRYABLE`` end the run; a worker that dies
    while the group starts is a worker-group failure (retried within ``max_failures``), and the
    console hears of it (``progress``: the driver's progress queue, or None)."""

    def __init__(self, failure_config, progress=None):
        super().__init__(failure_config)
        self.progress = progress

    def make_decision(self, training_failed_error: TrainingFailedError) -> FailureDecision:
        if isinstance(training_failed_error, WorkerGroupError) and not_retryable_cause(
            training_failed_error
        ):
            return FailureDecision.RAISE
        if isinstance(training_failed_error, ControllerError) and find_cause(
            training_failed_error.controller_failure, (RayActorError,)
        ):
            self._worker_group_failures += 1
            limit = self.failure_config.max_failures
            decision = FailureDecision.RAISE if limit != -1 and \
                self._worker_group_failures > limit else FailureDecision.RETRY
            send(self.progress, {
                "event": "failure", "during_start": True,
                "fatal": decision == FailureDecision.RAISE,
                "workers": {"?": describe_failure(training_failed_error.controller_failure)},
                "time": time.time(),
            })
            return decision
        return super().make_decision(training_failed_error)


def describe_failure(error: BaseException) -> str:
    """A worker's failure in a few words, for the console."""
    # Ray Train wraps a dead worker's error in a failed health check.
    error = getattr(error, "health_check_failure", None) or error
    text = str(error)
    if "gloo" in text.lower() or "nccl" in text.lower():
        return "its collective failed when a peer was lost"
    if find_cause(error, (RayActorError,)):
        text = str(error).lower()
        if "node" in text.lower() and "worker process" not in text.lower():
            return "its node left the cluster"
        return "its process died"
    cause = find_cause(error, NOT_RETRYABLE) or error
    first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
    return f"{type(cause).__name__}: {first}"[:200]


class FailureReporter(ray.train.UserCallback):
    """Tells the driver's console, in the app's voice, which workers failed and why (Ray's own
    paragraph about a dead worker is filtered from the console; see ``cli.run_main``)."""

    def __init__(self, progress):
        self.progress = progress

    def after_exception(self, run_context, worker_exceptions) -> None:
        if not worker_exceptions:
            return
        fatal = any(find_cause(error, NOT_RETRYABLE) for error in worker_exceptions.values())
        event = {
            "event": "failure",
            "workers": {int(rank): describe_failure(error)
                        for rank, error in sorted(worker_exceptions.items())},
            "fatal": fatal,
            "time": time.time(),
        }
        send(self.progress, event)
