"""Experiment trackers fed by the driver's progress events: TensorBoard event files under every
run folder, and an MLflow run when a tracking server is named.

Every tracker sees every event (``handle``) on the driver, in the progress pump's thread, and
ends once (``finish``). None of them may stop or slow training: a tracker that fails warns once
on the console and is dropped.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import queue
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import pyarrow.fs

from app import results
from app.storage import join

TENSORBOARD_DIR = "tensorboard"
MLFLOW_FILE = "mlflow.json"
"""The run's MLflow run id, so a rerun (after a driver kill, a failure, a resize) continues it."""
DEFAULT_EXPERIMENT = "ray-elastic-train"


def _is_local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


class TensorBoardLog:
    """``<run>/tensorboard/``: one stream across restarts, resizes and driver reruns.

    Scalars are indexed by the global optimiser step, which a resize does not change (the global
    batch is fixed). Each (re)start opens a new event file with ``purge_step`` just after the
    step it resumed from, so TensorBoard drops the points of the steps that are trained again:
    one line per tag, never two overlapping ones. For an ``s3://`` run the files are written in
    a local folder and copied up at every epoch's end and at the end.
    """

    def __init__(self, run_uri: str):
        self.run_uri = run_uri
        self.target = join(run_uri, TENSORBOARD_DIR)
        self.local = self.target if _is_local(run_uri) else tempfile.mkdtemp(prefix="tb-")
        self.writer = None
        self._metrics: list[str] = []
        self._step = 0
        """The step of the latest point, for text events that come without one."""

    def _open(self, purge_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        if self.writer is not None:
            self.writer.close()
        self.writer = SummaryWriter(self.local, purge_step=purge_step, flush_secs=5)

    def handle(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "start":
            resumed = event.get("resumed_at_epoch") is not None
            # Also for a start from nothing: a driver killed before the first checkpoint left
            # points that this run trains again.
            self._open(event.get("step", 0) + 1)
            self._metrics = list(event.get("metrics", [])) or self._metrics
            self.writer.add_scalar("run/world_size", event["world_size"], event.get("step", 0))
            what = f"resumed at step {event.get('step', 0)}" if resumed else "started"
            self._text(event.get("step", 0), f"{what} with {results.count(event['world_size'], 'worker')}")
        if self.writer is None:
            return
        if kind == "step":
            step = event["step"]
            self.writer.add_scalar("train/loss", event["loss"], step)
            self.writer.add_scalar("train/lr", event["lr"], step)
            self.writer.add_scalar("train/samples_per_second", event["samples_per_second"], step)
        elif kind == "epoch":
            step = event["step"]
            self.writer.add_scalar("epoch/train_loss", event["train_loss"], step)
            self.writer.add_scalar("epoch/val_loss", event["val_loss"], step)
            for name in self._metrics:
                if name in event:
                    self.writer.add_scalar(f"epoch/{name}", event[name], step)
            self.writer.add_scalar("epoch/samples_per_second", event["samples_per_second"], step)
            self.writer.add_scalar("epoch/epoch", event["epoch"], step)
            self.writer.add_scalar("run/world_size", event["world_size"], step)
            self.writer.flush()
            self._upload()
        elif kind == "partial" and event.get("reason") in ("resize", "preemption"):
            why = "to grow the group" if event["reason"] == "resize" else "a node is drained"
            self._text(event["step"], f"checkpointed at step {event['step']}: {why}")
        elif kind == "failure":
            lost = "; ".join(f"rank {rank}: {why}" for rank, why in event["workers"].items())
            self._text(self._step, f"worker failure ({lost})")

    def _text(self, step: int, text: str) -> None:
        self._step = step
        self.writer.add_text("events", text, step)

    def _upload(self) -> None:
        if self.local == self.target:
            return
        filesystem, path = pyarrow.fs.FileSystem.from_uri(self.target)
        pyarrow.fs.copy_files(self.local, path, source_filesystem=pyarrow.fs.LocalFileSystem(),
                              destination_filesystem=filesystem)

    def finish(self, status: str, summary: Any = None) -> None:
        if self.writer is None:
            return
        self.writer.add_text("events", f"run {status}", self._step)
        self.writer.close()
        self._upload()
        if self.local != self.target:
            shutil.rmtree(self.local, ignore_errors=True)


@dataclass(frozen=True)
class MlflowSettings:
    tracking_uri: str
    experiment: str = DEFAULT_EXPERIMENT
    parent_run_id: str | None = None
    """A sweep's run: this run is one of its trials (a nested, child run)."""

    def to_dict(self) -> dict[str, Any]:
        return {"tracking_uri": self.tracking_uri, "experiment": self.experiment,
                "parent_run_id": self.parent_run_id}


def mlflow_settings(uri: str | None, experiment: str | None) -> MlflowSettings | None:
    """From ``--mlflow-uri`` or else ``MLFLOW_TRACKING_URI`` (MLflow's own variable); None
    when neither is set."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return None
    return MlflowSettings(tracking_uri=uri, experiment=experiment or DEFAULT_EXPERIMENT)


def _quick_failures() -> None:
    # MLflow retries a failed request 7 times with backoff (minutes) by default; a tracker that
    # is down should cost seconds, once.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


def _client(tracking_uri: str):
    _quick_failures()
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def experiment_id(client, name: str) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    try:
        return client.create_experiment(name)
    except Exception:  # noqa: BLE001 - another run created it meanwhile
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id


def open_run(settings: MlflowSettings, folder_uri: str, run_name: str,
             params: dict[str, Any], tags: dict[str, str] | None = None) -> tuple[Any, str, bool]:
    """The MLflow run of the run (or sweep) in ``folder_uri``: the one its ``mlflow.json`` names
    when it still exists on the same server, else a new one. Returns (client, run id,
    whether it was continued)."""
    client = _client(settings.tracking_uri)
    try:
        saved = json.loads(results.read_file(join(folder_uri, MLFLOW_FILE)))
    except (OSError, ValueError):
        saved = None
    if isinstance(saved, dict) and saved.get("tracking_uri") == settings.tracking_uri:
        try:
            run = client.get_run(saved["run_id"])
            if run.info.lifecycle_stage == "active":
                client.update_run(saved["run_id"], status="RUNNING")
                return client, saved["run_id"], True
        except Exception:  # noqa: BLE001 - deleted on the server: start a new one
            pass
    from mlflow.entities import Param

    all_tags = {**(tags or {}), "run_folder": folder_uri}
    if settings.parent_run_id:
        all_tags["mlflow.parentRunId"] = settings.parent_run_id
    run = client.create_run(experiment_id(client, settings.experiment), run_name=run_name,
                            tags=all_tags)
    run_id = run.info.run_id
    client.log_batch(run_id, params=[Param(key, str(value)[:6000])
                                     for key, value in sorted(params.items())])
    results.write_file(join(folder_uri, MLFLOW_FILE), json.dumps(
        {"tracking_uri": settings.tracking_uri, "run_id": run_id,
         "experiment": settings.experiment}).encode())
    return client, run_id, False


_END = object()


class MlflowLog:
    """Logs a run to an MLflow tracking server from a background thread, so a slow or dead
    server never holds up the console or training; its first error warns once and ends the
    logging (training goes on)."""

    FINISH_TIMEOUT_S = 30.0

    def __init__(self, settings: MlflowSettings, run_uri: str, run_name: str,
                 params: dict[str, Any], warn: Callable[[str], None]):
        self.settings = settings
        self.run_uri = run_uri
        self.warn = warn
        self.run_id: str | None = None
        self.link: str | None = None
        """Where a person sees the run: its page on the server, or its id."""
        self._client = None
        self._failed = False
        self._metrics: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="mlflow", daemon=True)
        self._queue.put(lambda: self._open(run_name, params))
        self._thread.start()

    def _open(self, run_name: str, params: dict[str, Any]) -> None:
        self._client, self.run_id, _ = open_run(self.settings, self.run_uri, run_name, params)
        self.link = run_link(self._client, self.settings.tracking_uri, self.run_id)

    def _work(self) -> None:
        while True:
            call = self._queue.get()
            if call is _END:
                return
            if self._failed:
                continue
            try:
                call()
            except Exception as error:  # noqa: BLE001 - tracking must never stop training
                self._failed = True
                first = str(error).strip().splitlines()[0] if str(error).strip() \
                    else type(error).__name__
                self.warn(f"MLflow tracking at {_safe(self.settings.tracking_uri)} failed "
                          f"({first[:200]}); training goes on without it")

    def _log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[
            Metric(key, float(value), now, step) for key, value in metrics.items()])

    def handle(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "start":
            self._metrics = list(event.get("metrics", [])) or self._metrics
        elif kind == "epoch":
            values = {key: event[key] for key in (
                "train_loss", "val_loss", *self._metrics, "samples_per_second", "epoch_seconds",
                "world_size", "lr") if key in event}
            self._queue.put(lambda: self._log(values, event["epoch"]))

    def finish(self, status: str, summary: Any = None) -> None:
        if summary is not None:
            self._queue.put(lambda: self._finish_summary(summary))
        mlflow_status = {"finished": "FINISHED", "failed": "FAILED"}.get(status, "KILLED")
        self._queue.put(lambda: terminate(self._client, self.run_id, mlflow_status))
        self._queue.put(_END)
        # An interrupted run should stop at once, not wait on a slow server.
        timeout = self.FINISH_TIMEOUT_S if status == "finished" else 5.0
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.warn(f"MLflow tracking at {_safe(self.settings.tracking_uri)} did not answer "
                      f"within {timeout:.0f} s; the last metrics may be missing")

    def _finish_summary(self, summary) -> None:
        from mlflow.entities import RunTag

        tags = [RunTag("best_checkpoint", summary.best_checkpoint),
                RunTag("latest_checkpoint", summary.latest_checkpoint)]
        self._client.log_batch(self.run_id, tags=tags)
        self._log({"best_epoch": summary.best_metrics["epoch"],
                   "goodput": summary.analysis.goodput if summary.analysis else 0.0},
                  len(summary.history))
        with tempfile.TemporaryDirectory() as folder:
            for uri in (summary.curves_uri, summary.timeline_uri):
                if not uri:
                    continue
                local = os.path.join(folder, uri.rstrip("/").rsplit("/", 1)[-1])
                with open(local, "wb") as file:
                    file.write(results.read_file(uri))
                self._client.log_artifact(self.run_id, local)


def run_link(client, tracking_uri: str, run_id: str) -> str:
    """The run's page on an HTTP tracking server; its id elsewhere (a file store)."""
    if not tracking_uri.startswith(("http://", "https://")):
        return f"run id {run_id}"
    experiment = client.get_run(run_id).info.experiment_id
    return f"{_safe(tracking_uri).rstrip('/')}/#/experiments/{experiment}/runs/{run_id}"


def terminate(client, run_id: str, status: str) -> None:
    """End an MLflow run; MLflow's own links on stdout would land among the console's rows
    (the console prints the link itself)."""
    with contextlib.redirect_stdout(io.StringIO()):
        client.set_terminated(run_id, status=status)


def _safe(uri: str) -> str:
    """A tracking URI without the credentials it may hold (user:password@)."""
    scheme, sep, rest = uri.partition("://")
    if sep and "@" in rest.split("/", 1)[0]:
        rest = rest.split("@", 1)[1]
    return f"{scheme}{sep}{rest}"


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as MLflow params: ``loop.epochs``, ``optim.lr``..."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(flat_params(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class Trackers:
    """The trackers of one run: each event to each; a failing one warns once and is dropped."""

    def __init__(self, trackers: list, warn: Callable[[str], None]):
        self.trackers = list(trackers)
        self.warn = warn

    def _each(self, call: Callable[[Any], None]) -> None:
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as error:  # noqa: BLE001 - never a reason to stop training
                self.trackers.remove(tracker)
                self.warn(f"{type(tracker).__name__} stopped: {error}; training goes on")

    def handle(self, event: dict[str, Any]) -> None:
        self._each(lambda tracker: tracker.handle(event))

    def finish(self, status: str, summary: Any = None) -> None:
        self._each(lambda tracker: tracker.finish(status, summary))
        self.trackers = []


def close_child_run(folder_uri: str, outcome: str, console) -> None:
    """Tag a sweep trial's MLflow run with its ``outcome`` (finished, stopped early, failed)
    and end it if the trial could not (Tune ends a trial the scheduler stops). Warns, never
    raises: called from Tune's callbacks."""
    try:
        saved = json.loads(results.read_file(join(folder_uri, MLFLOW_FILE)))
        client = _client(saved["tracking_uri"])
        client.set_tag(saved["run_id"], "outcome", outcome)
        if client.get_run(saved["run_id"]).info.status == "RUNNING":
            terminate(client, saved["run_id"], "FAILED" if outcome == "failed" else "FINISHED")
    except FileNotFoundError:
        return  # the trial never started its run
    except Exception as error:  # noqa: BLE001 - tracking never stops the sweep
        console.line(f"warning: could not close the MLflow run of {folder_uri}: {error}")


class SweepRun:
    """A sweep's parent MLflow run: its flags as params; the trials are its children."""

    def __init__(self, settings: MlflowSettings, sweep_uri: str, name: str,
                 params: dict[str, Any], console):
        self.console = console
        self.settings = settings
        self.client = None
        try:
            self.client, self.run_id, _ = open_run(settings, sweep_uri, name, params,
                                                   tags={"kind": "sweep"})
            self.link = run_link(self.client, settings.tracking_uri, self.run_id)
        except Exception as error:  # noqa: BLE001 - tracking never stops the sweep
            self._warn(error)

    def _warn(self, error: Exception) -> None:
        self.client = None
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        self.console.line(f"warning: MLflow tracking at {_safe(self.settings.tracking_uri)} "
                          f"failed ({first[:200]}); the sweep goes on without it")

    def child_settings(self) -> dict[str, Any] | None:
        """What each trial needs to log itself as a child run."""
        if self.client is None:
            return None
        return MlflowSettings(self.settings.tracking_uri, self.settings.experiment,
                              parent_run_id=self.run_id).to_dict()

    def finish(self, status: str, best: dict[str, float], tags: dict[str, str],
               artifacts: list[str]) -> None:
        if self.client is None:
            return
        from mlflow.entities import Metric, RunTag

        try:
            now = int(time.time() * 1000)
            self.client.log_batch(
                self.run_id, metrics=[Metric(k, float(v), now, 0) for k, v in best.items()],
                tags=[RunTag(k, str(v)) for k, v in tags.items()])
            with tempfile.TemporaryDirectory() as folder:
                for uri in artifacts:
                    local = os.path.join(folder, uri.rstrip("/").rsplit("/", 1)[-1])
                    with open(local, "wb") as file:
                        file.write(results.read_file(uri))
                    self.client.log_artifact(self.run_id, local)
            terminate(self.client, self.run_id, status)
        except Exception as error:  # noqa: BLE001 - tracking never stops the sweep
            self._warn(error)
