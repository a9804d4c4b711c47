"""Runs one training job on Ray Train: the TorchTrainer, its scaling, storage and checkpoint
policy, live progress on the driver, and the results written at the end."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue as queue_module
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow.fs
import ray
import ray.data
import ray.train
from ray.train.torch import TorchTrainer
from ray.util.queue import Queue
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from app import checkpoint, cluster, lean, parquet, results, timeline, tracking
from app.cluster import ClusterWatch
from app.failures import AppFailurePolicy, FailureReporter, not_retryable_cause
from app.placement import PlacementGroupReaper, reaper_first
from app.progress import CONTROLLER_EVENT, AnnounceController
from app.resize import RESIZE_SIGNAL_KEY, CheckpointFirstScalingPolicy, ResizeSignal
from app.storage import Snapshot, join, set_aside_snapshot, snapshot_state
from app.config import (
    FaultToleranceConfig,
    RunConfig,
    TrainConfig,
    UserError,
    WorkersConfig,
)
from app.console import Console
from app.parquet import Manifest
from app.worker import PARQUET_KEY, PROGRESS_KEY, RESUME_KEY, train_loop_per_worker


class RunFailed(RuntimeError):
    """Training failed for a reason that is not the user's input (after all retries).

    ``explained``: the message says what happened and what to do (a diverged loss, a full
    disk), so the CLI prints it as it is rather than pointing at --verbose.
    """

    def __init__(self, message: str, explained: bool = False):
        super().__init__(message)
        self.explained = explained


@dataclass(frozen=True)
class RunSummary:
    run_uri: str
    """Folder (or URI) of the run: checkpoints, metrics.csv and curves.png are under it."""
    history: list[dict[str, Any]]
    """Per-epoch metrics of every epoch trained, across resumes."""
    best_metrics: dict[str, Any]
    """The reported metrics of the best checkpoint by the task's score (``epoch``, ``val_*``)."""
    best_checkpoint: str
    latest_checkpoint: str
    metrics_uri: str
    curves_uri: str
    timeline_uri: str = ""
    """timeline.png: world size over wall time, every restart, resize and failure marked."""
    analysis: timeline.Analysis | None = None
    """Goodput and the seconds each start, restart and resize cost (``app.timeline``)."""
    mlflow_link: str | None = None
    """The run's page on the MLflow server, when the run was logged to one."""


class AppTorchTrainer(TorchTrainer):
    """TorchTrainer with this app's failure policy (``app.failures``): errors that no restart
    can fix end the run; a worker lost while the group restarts is one more failure. An elastic
    run also gets the app's scaling policy (``app.resize``): the workers checkpoint before the
    group grows. Ray Train's helpers that have nothing to do are left out (``app.lean``).

    ``embedded``: the cluster is the command's own, one machine that never grows.
    """

    def __init__(self, *args, embedded: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.embedded = embedded

    def _initialize_and_run_controller(self, **controller_init_kwargs) -> ray.train.Result:
        # Ray Train builds its default policies from its configs and offers no hook to choose
        # others; the controller takes them as arguments (ray 2.60, pinned in pyproject.toml).
        worker_config = self.train_loop_config or {}
        controller_init_kwargs["failure_policy"] = AppFailurePolicy(
            self.run_config.failure_config, worker_config.get(PROGRESS_KEY)
        )
        if worker_config.get(RESIZE_SIGNAL_KEY) is not None:
            controller_init_kwargs["scaling_policy"] = CheckpointFirstScalingPolicy(
                self.scaling_config, worker_config[RESIZE_SIGNAL_KEY]
            )
        elif self.embedded and not self.datasets:
            controller_init_kwargs["scaling_policy"] = lean.LocalFixedScalingPolicy(
                self.scaling_config
            )
        controller_init_kwargs["callbacks"] = reaper_first(lean.needed_callbacks(
            controller_init_kwargs["callbacks"], has_datasets=bool(self.datasets)
        ))
        controller_init_kwargs["callbacks"].append(lean.ImportTorchEarly())
        if worker_config.get(PROGRESS_KEY) is not None:
            controller_init_kwargs["callbacks"].append(
                AnnounceController(worker_config[PROGRESS_KEY])
            )
        # Only where this process started the cluster (the settings its processes inherited).
        inherited = cluster.embedded_environment()
        if inherited is not None and lean.controller_env().items() <= inherited.items():
            return lean.run_controller(self, controller_init_kwargs)
        return super()._initialize_and_run_controller(**controller_init_kwargs)


_STOP = "stop"
"""Put on the progress queue to end the pump's wait at once (events are dicts)."""
_ABORT_WAIT_S = 2.0
"""How long the controller of a run the driver gives up on gets to abort it (stop its workers,
run its callbacks' abort hooks) before it is killed; its fit thread then gets as long again to
return."""


class _ProgressPump:
    """Prints the events rank 0 puts on a Ray queue while fit() blocks the main thread."""

    def __init__(self, console: Console):
        self.console = console
        self.last_alive = time.monotonic()
        """When rank 0 last sent anything (its heartbeat comes every few seconds)."""
        self.controller: ray.actor.ActorHandle | None = None
        """Ray Train's controller, once it has started (``AnnounceController``)."""
        # On the driver's node, like Ray Train's controller: a worker node may leave mid-run.
        self.queue = Queue(
            actor_options={
                "num_cpus": 0,
                "scheduling_strategy": NodeAffinitySchedulingStrategy(
                    ray.get_runtime_context().get_node_id(), soft=False
                ),
            }
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                event = self.queue.get(timeout=0.5)
                if event == _STOP:
                    return
                self._take(event)
            except queue_module.Empty:
                continue
            except ray.exceptions.RayError:
                return  # the queue actor is gone: the cluster is shutting down

    def _take(self, event: dict[str, Any]) -> None:
        if event.get("event") == CONTROLLER_EVENT:
            self.controller = event["controller"]
            return
        self.last_alive = time.monotonic()
        self.console.handle(event)

    def abort_run(self) -> None:
        """End the controller's run, so that fit() returns: an abort (its workers stop, the
        placement group goes) within ``_ABORT_WAIT_S``, else a kill (its workers and placement
        group die with it). A controller busy in a blocking wait, such as a worker group's
        placement, takes an abort only when that wait ends."""
        if self.controller is None:
            return
        try:
            ray.get(self.controller.abort.remote(), timeout=_ABORT_WAIT_S)
        except ray.exceptions.GetTimeoutError:
            ray.kill(self.controller, no_restart=True)
        except ray.exceptions.RayError:
            pass  # it exits as it aborts (RayActorError)

    def __enter__(self) -> _ProgressPump:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        try:
            self.queue.put_nowait(_STOP)  # ends a get() that would wait out its timeout
        except (queue_module.Full, ray.exceptions.RayError):
            pass
        self._thread.join()
        try:
            while not self.queue.empty():
                event = self.queue.get_nowait()
                if event != _STOP:
                    self._take(event)
        except (queue_module.Empty, ray.exceptions.RayError):
            pass
        ray.kill(self.queue.actor)


def _resize_signal(workers: WorkersConfig) -> dict[str, Any]:
    """The worker-config entry of an elastic run's ResizeSignal actor; none for a fixed size."""
    if not workers.is_elastic:
        return {}
    # On the driver's node, like Ray Train's controller: a worker node may leave mid-run.
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return {RESIZE_SIGNAL_KEY: ResizeSignal.options(scheduling_strategy=here).remote()}


def _fit_interruptibly(
    trainer: TorchTrainer, watch: Callable[[], None], abort: Callable[[], None]
) -> ray.train.Result:
    """trainer.fit(), leaving Ctrl-C to raise KeyboardInterrupt in the main thread.

    In the main thread, fit() installs a SIGINT handler that aborts the controller and then exits
    the process with status 1 and no message. From another thread it installs none, so the
    interrupt reaches us; the caller then shuts Ray down, and the checkpoints already reported
    stay as they are (Ray records a checkpoint only once it is fully persisted). ``watch`` is
    called twice a second and may raise to end the run the same way.

    Either way ``abort`` ends the controller's run first, and fit() gets a few seconds to
    return: a run given up on must not train on behind the caller's back, nor its thread
    outlive the Ray session it calls into (in one process that connects again, such a thread
    made Ray's core worker abort the process).
    """
    outcome: dict[str, Any] = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as error:  # handed to the main thread below
            outcome["error"] = error

    thread = threading.Thread(target=fit, name="fit", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(timeout=0.5)
            watch()
    except BaseException:
        abort()
        thread.join(_ABORT_WAIT_S)
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def fit_watched(
    build: Callable[[Queue], TorchTrainer], workers: WorkersConfig, placement_timeout_s: float,
    console: Console,
) -> ray.train.Result:
    """Fit the trainer ``build`` makes (given the progress queue for its workers), printing
    progress on ``console`` and ending the run when ``ClusterWatch`` says it cannot go on.

    Raises UserError for the user's mistakes (also a worker's) and a watchdog's verdict, and
    RunFailed when training fails after its retries.
    """
    for name, value in cluster.TRAIN_CONTROLLER_ENV.items():
        os.environ.setdefault(name, value)
    with _ProgressPump(console) as pump:
        trainer = build(pump.queue)
        watch = ClusterWatch(workers, placement_timeout_s)
        try:
            return _fit_interruptibly(
                trainer, lambda: watch.check(pump.last_alive), pump.abort_run
            )
        except ray.train.TrainingFailedError as error:
            cause = not_retryable_cause(error)
            if isinstance(cause, UserError):
                raise UserError(str(cause)) from None
            if cause is not None:
                raise RunFailed(str(cause), explained=True) from None
            raise RunFailed(str(error).splitlines()[-1] or type(error).__name__) from error


def make_trainer(
    train_config: TrainConfig,
    workers: WorkersConfig,
    run: RunConfig,
    *,
    fault_tolerance: FaultToleranceConfig,
    verbose: bool,
    callbacks: Sequence[ray.train.UserCallback] = (),
    extra_worker_config: dict[str, Any] | None = None,
    datasets: dict[str, ray.data.Dataset] | None = None,
    guard_placement_groups: bool = False,
) -> TorchTrainer:
    """``guard_placement_groups``: the controller may be killed before it ends its run (inside
    a Ray Tune trial); see ``app.placement``."""
    num_workers = (
        (workers.min_workers, workers.max_workers) if workers.is_elastic else workers.min_workers
    )
    progress = (extra_worker_config or {}).get(PROGRESS_KEY)
    return AppTorchTrainer(
        train_loop_per_worker,
        embedded=cluster.is_embedded(),
        train_loop_config={**train_config.to_dict(), **(extra_worker_config or {})},
        torch_config=lean.TorchConfig(),
        datasets=datasets,
        dataset_config=parquet.data_config(),
        scaling_config=ray.train.ScalingConfig(
            num_workers=num_workers,
            use_gpu=workers.use_gpu,
            resources_per_worker={"CPU": workers.cpus_per_worker}
            | ({"GPU": 1} if workers.use_gpu else {}),
            elastic_resize_monitor_interval_s=fault_tolerance.resize_interval_s,
        ),
        run_config=ray.train.RunConfig(
            name=run.name,
            storage_path=run.storage_path,
            checkpoint_config=ray.train.CheckpointConfig(
                num_to_keep=train_config.checkpoint.num_to_keep,
                checkpoint_score_attribute="checkpoint_score",
                checkpoint_score_order="max",
            ),
            failure_config=ray.train.FailureConfig(max_failures=fault_tolerance.max_failures),
            logging_config=ray.train.LoggingConfig(log_level="INFO" if verbose else "WARNING"),
            callbacks=[
                *callbacks,
                PlacementGroupReaper(guard=guard_placement_groups),
                *([FailureReporter(progress)] if progress is not None else []),
            ],
        ),
    )


def data_inputs(
    train_config: TrainConfig, workers: WorkersConfig, manifest: Manifest | None,
    console: Console, verbose: bool,
) -> tuple[dict[str, ray.data.Dataset] | None, dict[str, Any]]:
    """The Ray Data sets and worker-config entries for a Parquet data set; none otherwise."""
    if not train_config.data.parquet:
        return None, {}
    assert manifest is not None, "a Parquet run needs its checked manifest"
    if train_config.data.stream:
        cluster.check_data_cpus(workers)
        console.line(f"Streaming {manifest.uri} with Ray Data (re-read every epoch).")
    else:
        console.line(
            f"Reading {manifest.uri} into Ray's object store ({manifest.total_bytes / 2**20:.1f} "
            "MiB of Parquet) with Ray Data..."
        )
    return parquet.ray_datasets(manifest, train_config.data, verbose), {
        PARQUET_KEY: manifest.to_dict()
    }


def _uri(filesystem: pyarrow.fs.FileSystem | None, path: str) -> str:
    """Ray reports paths within their filesystem; s3://... is what a person can use again."""
    if filesystem is None or isinstance(filesystem, pyarrow.fs.LocalFileSystem):
        return path
    return f"{filesystem.type_name}://{path}"


def summarise(result: ray.train.Result, tracked: RunTracking | None = None) -> RunSummary:
    latest = result.checkpoint
    run_uri = _uri(result.filesystem, result.path)
    if latest is None:
        raise RunFailed(f"the run ended without a checkpoint; see the logs under {run_uri}")
    with latest.as_directory() as directory:
        history = checkpoint.load_history(directory)
    best_checkpoint, best_metrics = max(
        result.best_checkpoints, key=lambda pair: pair[1]["checkpoint_score"]
    )
    title = run_uri.rstrip("/").rsplit("/", 1)[-1]
    analysis, timeline_uri = None, ""
    try:
        if tracked is not None:
            analysis, timeline_uri = tracked.end_record("finished", history, best_metrics)
        metrics_uri, curves_uri = results.write(
            run_uri, timeline.with_goodput(tracked and tracked.record_data(), history), title
        )
    except OSError as error:
        raise RunFailed(
            f"cannot write the results under {run_uri} ({error}); the checkpoints are there",
            explained=True,
        ) from None
    return RunSummary(
        run_uri=run_uri,
        history=history,
        best_metrics=best_metrics,
        best_checkpoint=_uri(best_checkpoint.filesystem, best_checkpoint.path),
        latest_checkpoint=_uri(latest.filesystem, latest.path),
        metrics_uri=metrics_uri,
        curves_uri=curves_uri,
        timeline_uri=timeline_uri,
        analysis=analysis,
    )


class RunTracking:
    """What a run leaves besides its checkpoints as it goes: its record (``app.timeline``),
    TensorBoard event files, and an MLflow run when one is asked for. All fed by the console's
    events on the driver."""

    def __init__(self, run: RunConfig, console: Console, info: dict[str, Any],
                 params: dict[str, Any], mlflow: tracking.MlflowSettings | None, started: float,
                 warn: Callable[[str], None] | None = None):
        self.run_uri = join(run.storage_path, run.name)
        self.console = console
        if warn is not None:
            self.warn = warn  # type: ignore[method-assign]
        self.record: timeline.RunRecord | None = None
        trackers: list[Any] = []
        try:
            self.record = timeline.RunRecord(self.run_uri, run.name, info, started)
            trackers.append(self.record)
        except OSError as error:
            self.warn(f"cannot write the run's record under {self.run_uri} ({error}); "
                      "training goes on without it")
        trackers.append(tracking.TensorBoardLog(self.run_uri))
        if mlflow is not None:
            trackers.append(tracking.MlflowLog(mlflow, self.run_uri, run.name, params,
                                               self.warn))
        self._all = list(trackers)
        self.trackers = tracking.Trackers(trackers, self.warn)
        console.sinks.append(self.trackers)
        self._ended = False

    def warn(self, message: str) -> None:
        self.console.line(f"warning: {message}")

    def mlflow_link(self) -> str | None:
        return next((tracker.link for tracker in self._all
                     if isinstance(tracker, tracking.MlflowLog)), None)

    def record_data(self) -> dict[str, Any] | None:
        return self.record.record if self.record is not None else None

    def end_record(self, status: str, history: list[dict[str, Any]] | None = None,
                   best: dict[str, Any] | None = None) -> tuple[timeline.Analysis | None, str]:
        """Close the record (``status``); write timeline.png. Returns the analysis and the
        timeline's location."""
        if self.record is None or self._ended or timeline.records_frozen():
            return None, ""  # frozen: the sweep closes it and draws its timeline
        self._ended = True
        score = self.record.record.get("score")
        self.record.close(status, best={"epoch": best["epoch"], score: best.get(score)}
                           if best is not None and score else None)
        analysis = timeline.analyse(self.record.record, history)
        self.record.record["goodput"] = round(analysis.goodput, 4)
        self.record.record["world_sizes"] = sorted(set(analysis.world_sizes))
        self.record.save()
        uri = join(self.run_uri, timeline.TIMELINE_FILE)
        results.write_file(uri, timeline.timeline_png(
            self.record.record, analysis, self.run_uri.rstrip("/").rsplit("/", 1)[-1]))
        return analysis, uri

    def finish(self, status: str, summary: RunSummary | None = None) -> None:
        """The end of the run: every tracker is closed (after the results are written)."""
        if self.trackers in self.console.sinks:
            self.console.sinks.remove(self.trackers)
        if summary is None:
            try:
                self.end_record(status)
            except Exception as error:  # noqa: BLE001 - the run's own error matters more
                self.warn(f"cannot write the run's timeline ({error})")
        self.trackers.finish(status, summary)

    @contextlib.contextmanager
    def ending(self):
        """Closes the trackers with the status of the block: failed, interrupted, terminated."""
        from app.cli import was_terminated

        try:
            yield
        except KeyboardInterrupt:
            self.finish("terminated" if was_terminated() else "interrupted")
            raise
        except BaseException:
            self.finish("failed")
            raise


def launch(
    train_config: TrainConfig,
    workers: WorkersConfig,
    run: RunConfig,
    *,
    console: Console,
    fault_tolerance: FaultToleranceConfig | None = None,
    verbose: bool = False,
    callbacks: Sequence[ray.train.UserCallback] = (),
    manifest: Manifest | None = None,
    mlflow: tracking.MlflowSettings | None = None,
    started: float | None = None,
) -> RunSummary:
    """Train on the connected Ray cluster; returns where the results are.

    ``manifest``: the checked Parquet data set when ``train_config.data.parquet`` is set.
    ``mlflow``: log the run to this MLflow server. ``started``: when the command started, for
    the run's timeline (default: now).
    Raises UserError for mistakes in the input (also when a worker hits one) and RunFailed when
    training fails after its retries.
    """
    if fault_tolerance is None:
        fault_tolerance = FaultToleranceConfig(max_failures=3 if workers.is_elastic else 0)
    resume_from = {}
    state = snapshot_state(run)
    if state is not Snapshot.MISSING:
        console.line(f"Run {run.name!r} exists in {run.storage_path}: resuming it.")
    if state is Snapshot.UNREADABLE:
        resume_from = recover_snapshot(run, console.line)
    datasets, extras = data_inputs(train_config, workers, manifest, console, verbose)
    if verbose:
        console.launched = time.time()
    # Ready for the curves at the end, imported while the driver only waits.
    threading.Thread(target=_import_plotting, name="import-plotting", daemon=True).start()
    tracked = RunTracking(
        run, console, info=run_info(train_config), params=run_params(train_config, workers),
        mlflow=mlflow, started=started or time.time(),
    )
    with tracked.ending():
        result = fit_watched(
            lambda progress: make_trainer(
                train_config, workers, run, fault_tolerance=fault_tolerance, verbose=verbose,
                callbacks=callbacks,
                extra_worker_config={PROGRESS_KEY: progress, **extras, **resume_from,
                                     **_resize_signal(workers)},
                datasets=datasets,
            ),
            workers, fault_tolerance.placement_timeout_s, console,
        )
        summary = summarise(result, tracked)
    tracked.finish("finished", summary)
    return dataclasses.replace(summary, mlflow_link=tracked.mlflow_link())


def recover_snapshot(run: RunConfig, say: Callable[[str], None]) -> dict[str, str]:
    """Sets aside Ray Train's unreadable record of the run's checkpoints
    (``storage.set_aside_snapshot``) and ``say``s so in one line; returns the worker-config entry
    that resumes the run from its newest checkpoint instead."""
    kept_as, newest = set_aside_snapshot(run)
    where = f"resuming from its newest checkpoint, {newest}" if newest \
        else "the run has no checkpoint: starting it over"
    say(f"Ray Train's record of the run's checkpoints cannot be read (cut short: its driver "
        f"killed while writing it?); kept as {kept_as}, {where}.")
    return {RESUME_KEY: newest} if newest else {}


def _import_plotting() -> None:
    """matplotlib and TensorBoard's writer, imported while the driver only waits."""
    import importlib

    results.load_plotting()
    importlib.import_module("torch.utils.tensorboard")


def run_info(train_config: TrainConfig) -> dict[str, Any]:
    """What ``app.runs`` lists about a run, known before it starts."""
    from app.task import load_task

    task = load_task(train_config.task)
    return {"task": task.name, "dataset": train_config.data.dataset or task.default_dataset,
            "epochs": train_config.loop.epochs, "score": task.score,
            "score_mode": task.score_mode}


def run_params(train_config: TrainConfig, workers: WorkersConfig) -> dict[str, Any]:
    """A run's settings as MLflow parameters."""
    num_workers = f"{workers.min_workers}-{workers.max_workers}" if workers.is_elastic \
        else workers.min_workers
    return {**tracking.flat_params(train_config.to_dict()), "num_workers": num_workers,
            "use_gpu": workers.use_gpu, "cpus_per_worker": workers.cpus_per_worker}
