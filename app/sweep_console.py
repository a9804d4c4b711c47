"""The console of a sweep (``app.tune``): a line when a trial starts, finishes, is stopped by
the scheduler or fails, in place of Ray Tune's periodic status tables (``--verbose`` shows
those)."""

from __future__ import annotations

import re
import time
from typing import Any

from ray import tune

from app import timeline, tracking
from app.config import UserError
from app.console import Console
from app.results import count

_active: SweepConsole | None = None
"""The sweep console of this process. Tune pickles its callbacks with the experiment (and
restores them on --resume), so the callback finds the console here rather than holding it."""


class SweepCallback(tune.Callback):
    """Hands Tune's trial events to this process's ``SweepConsole``."""

    def on_trial_start(self, iteration, trials, trial, **info):
        if _active is not None:
            _active.trial_started(trial)

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if _active is not None:
            _active.trial_result(trial, result)

    def on_trial_complete(self, iteration, trials, trial, **info):
        if _active is not None:
            _active.trial_ended(trial, error=False)

    def on_trial_error(self, iteration, trials, trial, **info):
        if _active is not None:
            _active.trial_ended(trial, error=True)


def activate(sweep_console: SweepConsole | None) -> None:
    global _active
    _active = sweep_console


class SweepConsole:
    """The sweep's own compact lines, in place of Ray Tune's status tables: one when a trial
    starts, finishes, is stopped by the scheduler or fails. Also closes each trial's MLflow
    run (a trial the scheduler stops is ended by Tune before it can close its own)."""

    def __init__(self, console: Console, score: str, mode: str, train_storage: str,
                 mlflow_on: bool):
        self.console = console
        self.score = score
        self.mode = mode
        self.train_storage = train_storage
        self.mlflow_on = mlflow_on
        self.best: dict[str, tuple[float, int]] = {}
        self.started: dict[str, float] = {}
        self.ended: dict[str, str] = {}
        """The run folder of every trial that ended, and how it ended (its record's status)."""

    @staticmethod
    def _what(trial) -> str:
        config = trial.config
        return (f"lr {config['train']['optim']['lr']:.4g}, {count(config['num_workers'], 'worker')}, "
                f"batch {config['train']['loop']['global_batch_size']}")

    def trial_started(self, trial) -> None:
        self.started[trial.trial_id] = time.monotonic()
        self.console.line(f"trial {trial.trial_id} started: {self._what(trial)}")

    def trial_result(self, trial, result: dict[str, Any]) -> None:
        if self.score not in result:
            return
        value, epoch = result[self.score], int(result.get("epoch", 0))
        best = self.best.get(trial.trial_id)
        better = best is None or (value > best[0] if self.mode == "max" else value < best[0])
        if better:
            self.best[trial.trial_id] = (value, epoch)

    def trial_ended(self, trial, error: bool) -> None:
        from app.results import format_metric

        seconds = time.monotonic() - self.started.get(trial.trial_id, time.monotonic())
        best = self.best.get(trial.trial_id)
        score = (f"best {self.score} {format_metric(self.score, best[0])} at epoch {best[1]}"
                 if best else "no epoch finished")
        planned = trial.config["train"]["loop"]["epochs"]
        last = int((trial.last_result or {}).get("epoch", 0))
        if error:
            reason = _trial_error(trial)
            how, status = f"failed ({reason})", "failed"
        elif last < planned:
            how, status = f"stopped by the scheduler after epoch {last}", "stopped early"
        else:
            how, status = "finished", "finished"
        self.console.line(f"trial {trial.trial_id} {how}: {self._what(trial)}; {score}; "
                          f"{seconds:.0f} s")
        run_uri = f"{self.train_storage}/trial-{trial.trial_id}"
        self.ended[run_uri] = status
        self._close_record(run_uri, status)
        if self.mlflow_on:
            tracking.close_child_run(run_uri, status, self.console)

    def close_records(self) -> None:
        """Close the ended trials' records again once the sweep is over. Tune reports a trial
        stopped by the scheduler before the trial's process is gone, and that process may
        still save its record (as running) after the first close; none is left by now."""
        for run_uri, status in self.ended.items():
            self._close_record(run_uri, status)

    def _close_record(self, run_uri: str, status: str) -> None:
        try:
            # Tune's verdict wins over a "failed" that the trial's process recorded while Tune
            # stopped it; any other closed record is left as it is.
            timeline.finalize(run_uri, status,
                              overrule=("failed",) if status == "stopped early" else ())
        except Exception as error:  # noqa: BLE001 - never a reason to stop the sweep
            self.console.line(f"warning: cannot close the record of {run_uri}: {error}")


def _trial_error(trial) -> str:
    from app.failures import find_cause

    try:
        error = trial.get_pickled_error() or trial.get_error()
    except Exception:  # noqa: BLE001 - only for the console line
        error = None
    if error is None:
        return "see its logs"
    cause = find_cause(error, (UserError,)) or error
    lines = [line.strip() for line in str(cause).strip().splitlines() if line.strip()]
    return re.sub(r"^(?:[\w.]+(?:Error|Exception): )+", "", lines[-1])[:200] if lines \
        else type(error).__name__
