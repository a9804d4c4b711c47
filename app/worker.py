"""The per-worker entry point that Ray Train runs on every rank.

Everything that depends on the current world size (the per-worker batch, the sampler's shards)
is derived here, every time the worker group (re)starts; the checkpoint holds none of it.
"""

from __future__ import annotations

import contextlib
import tempfile
import threading
import time
from typing import Any

import ray
import ray.train
import ray.train.torch
import torch

from app import batching, checkpoint
from app.progress import send
from app.batching import InMemoryData, TrainData
from app.config import StorageFailure, TrainConfig, UserError
from app.loop import TimedSchedule, Trainer, parameter_checksum, prepare_for_speed, resolve_compile
from app.resize import RESIZE_SIGNAL_KEY
from app.storage import checkpoint_folders
from app.task import Task, build_datasets, call, load_task

PROGRESS_KEY = "progress_queue"
"""Optional key of the worker config: a ray.util.queue.Queue that rank 0 sends progress to."""
PARQUET_KEY = "parquet"
"""Key of the worker config holding the Parquet manifest's statistics (``Manifest.to_dict``)."""
RESUME_KEY = "resume_from"
"""Optional key of the worker config: the URI of a checkpoint to resume from while Ray Train
has none registered (its record of the run's checkpoints was unreadable: ``app.launcher``)."""


HEARTBEAT_S = 2.0
"""How often rank 0 tells the driver it is alive; the driver's watchdog ends a run whose workers
have been silent for its placement timeout."""


@contextlib.contextmanager
def _heartbeat(progress):
    """Sends a heartbeat every HEARTBEAT_S while the block runs.

    From a thread, so a long validation or checkpoint upload is not mistaken for a hang."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(HEARTBEAT_S):
            send(progress, {"event": "heartbeat"})

    thread = threading.Thread(target=beat, name="heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()


def _owned_cpus() -> int:
    return max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)))


def _load(candidate: ray.train.Checkpoint) -> checkpoint.TrainingState:
    try:
        with candidate.as_directory() as directory:
            return checkpoint.load(directory)
    except OSError as error:  # a download from remote storage that failed
        raise checkpoint.UnreadableCheckpoint(str(error)) from None


def _older_checkpoints(latest: ray.train.Checkpoint) -> list[ray.train.Checkpoint]:
    """The run's other checkpoint folders, newest first (Ray keeps the best K and the latest)."""
    parent, _, latest_name = latest.path.rstrip("/").rpartition("/")
    latest_order = checkpoint.age_order(latest_name)
    if latest_order is None:
        return []
    return [ray.train.Checkpoint(f"{parent}/{name}", filesystem=latest.filesystem)
            for name in checkpoint_folders(latest.filesystem, parent)
            if checkpoint.age_order(name) < latest_order]


def _restore(progress, rank: int, settings: dict[str, Any],
             resume_from: str | None = None) -> checkpoint.TrainingState | None:
    """The latest checkpoint's state; if it cannot be read, the newest older one that can.

    A corrupt latest checkpoint (a truncated file, a missing part) would otherwise fail every
    restart the same way until the retries run out. A checkpoint of other ``settings`` (another
    task, batch, learning rate...) is refused, naming each difference. ``resume_from``: the
    checkpoint to start from while Ray Train has none registered (``RESUME_KEY``).
    """
    latest = ray.train.get_checkpoint()
    if latest is None and resume_from:
        latest = ray.train.Checkpoint(resume_from)
    if latest is None:
        return None
    try:
        return _compatible(_load(latest), settings, latest)
    except checkpoint.UnreadableCheckpoint as error:
        problem = f"the latest checkpoint {latest.path} cannot be read ({error})"
    for candidate in _older_checkpoints(latest):
        try:
            state = _compatible(_load(candidate), settings, candidate)
        except checkpoint.UnreadableCheckpoint:
            continue
        if rank == 0:
            send(progress, {"event": "warning",
                             "message": f"{problem}: resuming from {candidate.path} instead."})
        return state
    raise StorageFailure(
        f"{problem} and no earlier checkpoint of the run can be: start again under a new --name"
    )


def _compatible(state: checkpoint.TrainingState, settings: dict[str, Any],
                source: ray.train.Checkpoint) -> checkpoint.TrainingState:
    refusal = checkpoint.incompatibility(
        source.path.rstrip("/").rsplit("/", 2)[-2], state.settings, settings
    )
    if refusal is not None:
        raise UserError(refusal)
    return state


def _train_data(config: TrainConfig, task: Task, worker_config: dict[str, Any], rank: int,
                world_size: int, device: torch.device) -> tuple[str, TrainData]:
    if config.data.parquet:
        from app.parquet import ShardData

        stats = worker_config[PARQUET_KEY]
        return stats["dataset"], ShardData(
            ray.train.get_dataset_shard("train"), ray.train.get_dataset_shard("val"), stats,
            config.loop.global_batch_size, world_size, rank, config.loop.seed,
            stream=config.data.stream,
        )
    train, val = build_datasets(task, config.data.dataset, config.data.data_dir)
    return config.data.dataset or task.default_dataset, InMemoryData(
        train, val, config.loop.global_batch_size, world_size, rank, config.loop.seed,
        device=device,
    )


def train_loop_per_worker(worker_config: dict[str, Any]) -> None:
    entered = time.time()
    progress = worker_config.get(PROGRESS_KEY)
    rank = ray.train.get_context().get_world_rank()
    with _heartbeat(progress) if rank == 0 else contextlib.nullcontext():
        _train(TrainConfig.from_dict(worker_config), worker_config, progress, entered)


def _train(config: TrainConfig, worker_config: dict[str, Any], progress,
           entered: float) -> None:
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    # More threads than owned CPUs makes workers on one machine fight over cores.
    torch.set_num_threads(_owned_cpus())

    device = ray.train.torch.get_device()
    task = load_task(config.task)
    dataset_name, train_data = _train_data(config, task, worker_config, rank, world_size, device)
    batching.check_batch_fits(config.loop.global_batch_size, train_data.num_train, dataset_name)
    data_loaded = time.time()
    torch.manual_seed(config.loop.seed)  # identical initial weights on every rank
    model = call(task, "build_model()", task.build_model)
    optimizer = call(task, "build_optimizer(parameters, lr)", task.build_optimizer,
                     model.parameters(), config.optim.lr)
    settings = checkpoint.run_settings(
        config, task.name, dataset_name, optimizer=type(optimizer).__name__,
        parameters=checkpoint.parameter_shapes(model),
    )
    state = _restore(progress, rank, settings, worker_config.get(RESUME_KEY))
    model = ray.train.torch.prepare_model(prepare_for_speed(model, config.loop, device))
    trainer = Trainer(config, task, model, train_data, device, rank, world_size, state)
    trainer.state.settings = settings
    model_ready = time.time()

    reporter = _Reporter(trainer, rank, world_size, progress)
    if rank == 0:
        send(
            progress,
            {
                "event": "start",
                "world_size": world_size,
                "device": device.type,
                "precision": trainer.precision,
                "channels_last": trainer.layout is torch.channels_last,
                "compiled": resolve_compile(config.loop.compile, device),
                "task": task.name,
                "metrics": list(task.metric_columns),
                "score": task.score,
                "score_mode": task.score_mode,
                "dataset": dataset_name,
                "source": "parquet" if config.data.parquet else "memory",
                "num_train": train_data.num_train,
                "num_val": train_data.num_val,
                "batch_per_worker": config.loop.global_batch_size // world_size,
                "resumed_at_epoch": trainer.epochs_done if state is not None else None,
                "resumed_at_epoch_step": trainer.state.epoch_step if state is not None else 0,
                "step": trainer.state.step,  # the global step the group starts from
                "epochs": config.loop.epochs,
                # When rank 0 entered the loop, had its data, had the model (with DDP's
                # process group): where a start's seconds go (``--verbose``, bench/startup.py).
                "phases": {"worker_entry": entered, "data_loaded": data_loaded,
                           "model_ready": model_ready},
                # Sent just before the first step: restarts are timed from loss to here.
                "time": time.time(),
            },
        )

    interval = config.checkpoint.every_steps
    checks = TimedSchedule(config.checkpoint.preemption_check_s, device,
                           start_step=trainer.state.step)
    resize_signal = worker_config.get(RESIZE_SIGNAL_KEY)
    preemption_handled = False
    live = _StepProgress(
        trainer, progress, config.loop.log_every_steps,
        steps_per_epoch(train_data.num_train, config.loop.global_batch_size, world_size),
    ) if rank == 0 and progress is not None and config.loop.log_every_steps else None

    def after_step() -> None:
        nonlocal preemption_handled
        step = trainer.state.step
        if live is not None:
            live.after_step()
        if checks.due(step):
            trainer.check_diverged()  # the same verdict on every rank, at the same step
            # Rank 0 asks whether the controller wants to grow the group; the check's
            # all-reduce tells every rank.
            asked = rank == 0 and resize_signal is not None and \
                ray.get(resize_signal.is_requested.remote())
            (resize,) = checks.reschedule(step, (float(asked),))
            if resize:
                _checkpoint_for_resize(reporter, resize_signal, rank, step)
                return
            if not preemption_handled:
                # A collective (every rank asks at the same step). When a node of this run is
                # being drained, checkpoint now: nothing since is lost when the node goes.
                notice = ray.train.get_preemption_info()
                if notice is not None:
                    preemption_handled = True
                    reporter.report_partial(reason="preemption")
                    return
        if interval and step % interval == 0:
            reporter.report_partial(reason="interval")

    if trainer.epochs_done >= config.loop.epochs and state is not None \
            and ray.train.get_checkpoint() is None:
        if trainer.state.epoch_step:  # a mid-epoch checkpoint past a lowered --epochs
            reporter.report_partial(reason="resumed")
        else:
            reporter.report_last_epoch_again()
    while trainer.epochs_done < config.loop.epochs:
        result = trainer.run_epoch(after_step=after_step)
        evaluation = trainer.evaluate()
        reporter.report_epoch(result, evaluation, model)


PROGRESS_MAX_HZ = 4.0
"""Progress points a second at most: the driver's live line needs no more."""


def steps_per_epoch(num_train: int, global_batch_size: int, world_size: int) -> int:
    """Steps in an epoch (``GlobalBatchSampler``: a last batch smaller than the world size is
    dropped)."""
    full, rest = divmod(num_train, global_batch_size)
    return full + (rest >= world_size)


class _StepProgress:
    """Rank 0's progress points inside an epoch: every ``every_steps`` steps, at most
    ``PROGRESS_MAX_HZ`` a second; the loss is rank 0's mean since the previous point (one host
    sync per point, none per step)."""

    def __init__(self, trainer: Trainer, progress, every_steps: int, steps_in_epoch: int):
        self.trainer = trainer
        self.progress = progress
        self.every_steps = every_steps
        self.steps_in_epoch = steps_in_epoch
        self._epoch = -1  # the epoch the baseline below belongs to

    def _mark(self) -> None:
        state = self.trainer.state
        self._epoch = state.epoch
        self._time = time.perf_counter()
        self._samples = state.epoch_samples
        self._step = state.step
        self._loss, self._local = self.trainer.running_loss()

    def after_step(self) -> None:
        state = self.trainer.state
        if state.epoch != self._epoch:  # a new epoch: its first step is the baseline
            self._mark()
            return
        if state.step % self.every_steps or \
                time.perf_counter() - self._time < 1 / PROGRESS_MAX_HZ:
            return
        then, samples, step, loss, local = \
            self._time, self._samples, self._step, self._loss, self._local
        self._mark()
        seconds = max(self._time - then, 1e-9)
        send(self.progress, {
            "event": "step",
            "epoch": state.epoch + 1,
            "epoch_step": state.epoch_step,
            "steps_in_epoch": self.steps_in_epoch,
            "epochs": self.trainer.config.loop.epochs,
            "step": state.step,
            "loss": (self._loss - loss) / max(self._local - local, 1),
            "lr": self.trainer.lr,
            "samples_per_second": (self._samples - samples) / seconds,
            "steps_per_second": (self._step - step) / seconds,
            "world_size": self.trainer.world_size,
            "time": time.time(),
        })


RESIZE_WAIT_S = 40.0
"""How long workers that checkpointed for a resize wait to be stopped by it (the controller
holds a resize at most ``resize.CHECKPOINT_WAIT_S``); then they carry on."""


def _checkpoint_for_resize(reporter: _Reporter, signal, rank: int, step: int) -> None:
    """Checkpoint at this step for the resize the controller holds, tell it, and wait to be
    stopped, so the larger group starts exactly here: no step is trained twice."""
    reporter.report_partial(reason="resize")
    if rank == 0:
        ray.get(signal.saved.remote(step))
    deadline = time.monotonic() + RESIZE_WAIT_S
    while time.monotonic() < deadline:
        time.sleep(0.2)


PARTIAL_SCORE = -1e300
"""Checkpoint score of a mid-epoch checkpoint: below every epoch checkpoint's."""


def checkpoint_score(task: Task, value: float) -> float:
    """Ray keeps the checkpoints with the highest score: the task's score, negated when lower
    is better."""
    return value if task.score_mode == "max" else -value


class _Reporter:
    """Reports metrics from every rank and a checkpoint from rank 0 (Ray Train's pattern)."""

    def __init__(self, trainer: Trainer, rank: int, world_size: int, progress):
        self.trainer = trainer
        self.task = trainer.task
        self.rank = rank
        self.world_size = world_size
        self.progress = progress

    def _report(self, metrics: dict[str, Any], checkpoint_dir_name: str,
                announce: bool = True) -> None:
        state = self.trainer.snapshot()  # collective: every rank takes part
        if self.rank != 0:
            ray.train.report(metrics)
            return
        try:
            with tempfile.TemporaryDirectory() as directory:
                checkpoint.save(state, directory)
                ray.train.report(
                    metrics,
                    checkpoint=ray.train.Checkpoint.from_directory(directory),
                    checkpoint_dir_name=checkpoint_dir_name,
                )
        except OSError as error:  # disk full, no permission: a restart would fail the same way
            raise StorageFailure(f"cannot write the checkpoint {checkpoint_dir_name}: {error}") \
                from None
        if announce:
            send(self.progress, {"event": metrics["kind"], **metrics})

    def report_epoch(self, result, evaluation, model) -> None:
        state = self.trainer.state
        metrics = {
            "kind": "epoch",
            "epoch": state.epoch,
            "step": state.step,
            "world_size": self.world_size,
            "train_loss": result.train_loss,
            **evaluation.as_metrics(),
            "samples_per_second": result.num_samples / result.seconds,
            "epoch_seconds": result.seconds,
            "lr": self.trainer.scheduler.get_last_lr()[0],
            "param_checksum": parameter_checksum(model),
            "precision": self.trainer.precision,
            "time": time.time(),
        }
        state.history.append(metrics)
        score = evaluation.as_metrics()[self.task.score]
        self._report(
            {**metrics, "checkpoint_score": checkpoint_score(self.task, score)},
            f"checkpoint_epoch_{state.epoch:04d}",
        )

    def report_last_epoch_again(self) -> None:
        """Registers the restored last epoch's checkpoint with Ray Train again, under its own
        name and with its own metrics, for a run resumed (``RESUME_KEY``) with every epoch
        done: Ray Train lost its record, so the run would end with no checkpoint, and the next
        resume would start over. The console has shown that epoch already."""
        state = self.trainer.state
        metrics = state.history[-1]
        self._report(
            {**metrics, "checkpoint_score": checkpoint_score(self.task, metrics[self.task.score])},
            f"checkpoint_epoch_{state.epoch:04d}", announce=False,
        )

    def report_partial(self, reason: str) -> None:
        """A mid-epoch checkpoint, for recovery only: it scores below every epoch checkpoint,
        so best-K keeps epoch ends, while Ray always keeps the latest for resuming."""
        state = self.trainer.state
        metrics = {
            "kind": "partial",
            "reason": reason,
            "epoch": state.epoch,
            "epoch_step": state.epoch_step,
            "step": state.step,
            "world_size": self.world_size,
            "checkpoint_score": PARTIAL_SCORE,
            "time": time.time(),
        }
        self._report(
            metrics, f"checkpoint_epoch_{state.epoch + 1:04d}_step_{state.epoch_step:06d}"
        )
