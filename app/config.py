"""Configuration: one small validated dataclass per concern.

Parsed once at the CLI edge. Across the Ray boundary the worker receives ``TrainConfig.to_dict()``
(plain primitives, so Ray Tune can sample its leaves) and rebuilds it with ``TrainConfig.from_dict``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any


class UserError(ValueError):
    """Something the user can fix; the CLI prints it as one line and exits with status 2."""


class TrainingDiverged(RuntimeError):
    """The loss or its gradient became NaN or infinite. A restart from the last checkpoint would
    diverge the same way, so Ray Train must not retry it; the CLI exits with status 1."""


class StorageFailure(RuntimeError):
    """A checkpoint could not be written (disk full, no permission). A restart would fail the
    same way, so Ray Train must not retry it; the CLI exits with status 1."""


NOT_RETRYABLE = (UserError, TrainingDiverged, StorageFailure)
"""Worker errors that end a run at once, whatever ``--max-failures`` allows."""


DEFAULT_TASK = "mnist-convnet"
PRECISIONS = ("auto", "fp32", "bf16")
COMPILE_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class DataConfig:
    dataset: str = ""
    """Which of the task's data sets to train on ("": its default, ``Task.build_datasets``)."""
    data_dir: str = "data"
    """Folder the task's data sets are read from (and downloaded to)."""
    parquet: str = ""
    """Folder or s3:// URI of a data set written by ``app.prepare``: when set, workers read it
    with Ray Data instead of loading ``dataset`` from ``data_dir`` (the name is the manifest's)."""
    stream: bool = False
    """Parquet only: re-read the files every epoch instead of caching them in Ray's object store
    (for data larger than the cluster's object store and spill disk)."""

    def __post_init__(self):
        if not self.data_dir:
            raise UserError("data_dir must not be empty")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 0.5
    """Learning rate given to the task's optimiser."""
    lr_decay: float = 0.7
    """Multiply the learning rate by this after every epoch (StepLR gamma), unless the task
    builds its own scheduler."""

    def __post_init__(self):
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise UserError(f"learning rate must be a finite number > 0, got {self.lr}")
        if not 0 < self.lr_decay <= 1:
            raise UserError(f"lr decay must be in (0, 1], got {self.lr_decay}")


@dataclass(frozen=True)
class LoopConfig:
    epochs: int = 5
    """Epochs to train in total (a resumed run trains only the ones left)."""
    global_batch_size: int = 128
    """Samples per optimiser step summed over all workers; independent of the world size."""
    eval_batch_size: int = 1000
    """Samples per forward pass during validation (per worker)."""
    seed: int = 0
    """Seed for model initialisation, shuffling and dropout."""
    max_batch_per_worker: int = 0
    """Largest batch one worker computes at once; a larger share is split into micro-batches
    whose gradients are accumulated (0: no limit)."""
    precision: str = "auto"
    """bf16 autocast where the worker's device computes bf16 natively, else fp32; or forced."""
    channels_last: bool = True
    """Keep a model with 2-D convolutions, and its image batches, channels-last (NHWC): the
    layout oneDNN's and cuDNN's fast convolutions use (1.2-1.4x on the default task on CPU)."""
    compile: str = "auto"
    """torch.compile the model: "auto" compiles on GPUs only (on CPU it measured slower for the
    built-in tasks, after 5-30 s of compiling); "on" or "off" force it."""
    log_every_steps: int = 10
    """Rank 0 sends a progress point (running training loss, learning rate, samples/s) every
    this many steps, at most ``PROGRESS_MAX_HZ`` a second: the console's live line and the
    TensorBoard and MLflow step curves (0: none)."""

    def __post_init__(self):
        if self.epochs < 1:
            raise UserError(f"epochs must be >= 1, got {self.epochs}")
        if self.global_batch_size < 1:
            raise UserError(f"global batch size must be >= 1, got {self.global_batch_size}")
        if self.eval_batch_size < 1:
            raise UserError(f"eval batch size must be >= 1, got {self.eval_batch_size}")
        if self.max_batch_per_worker < 0:
            raise UserError(f"max batch per worker must be >= 0, got {self.max_batch_per_worker}")
        if self.seed < 0:
            raise UserError(f"seed must be >= 0, got {self.seed}")
        if self.log_every_steps < 0:
            raise UserError(f"log interval must be >= 0 steps, got {self.log_every_steps}")
        if self.compile not in COMPILE_MODES:
            raise UserError(
                f"unknown compile mode {self.compile!r}: choose one of {', '.join(COMPILE_MODES)}"
            )
        if self.precision not in PRECISIONS:
            raise UserError(
                f"unknown precision {self.precision!r}: choose one of {', '.join(PRECISIONS)}"
            )


@dataclass(frozen=True)
class CheckpointConfig:
    num_to_keep: int = 3
    """Keep the best K checkpoints by the task's score (the latest is always kept too)."""
    every_steps: int = 0
    """Also checkpoint every N optimiser steps inside an epoch (0: at epoch ends only)."""
    preemption_check_s: float = 2.0
    """About every this many seconds the ranks check together (on a step they agree on,
    ``loop.TimedSchedule``) whether a node of the run is being drained and whether the
    controller waits on a checkpoint to grow the group: one small all-reduce and a query or two,
    so a drain or a join is acted on within about this long."""

    def __post_init__(self):
        if self.num_to_keep < 1:
            raise UserError(f"checkpoints to keep must be >= 1, got {self.num_to_keep}")
        if self.every_steps < 0:
            raise UserError(f"checkpoint interval must be >= 0 steps, got {self.every_steps}")
        if not (self.preemption_check_s > 0 and math.isfinite(self.preemption_check_s)):
            raise UserError(
                f"preemption check interval must be a finite number of seconds > 0, got "
                f"{self.preemption_check_s}"
            )


@dataclass(frozen=True)
class TrainConfig:
    """Everything the worker loop needs; nothing about where or on how many workers it runs."""

    task: str = DEFAULT_TASK
    """Reference of the task to train (``app.task``): a built-in name, ``module:ATTR`` or
    ``/abs/path/file.py:ATTR``."""
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        return cls(
            task=values.get("task", DEFAULT_TASK),
            data=DataConfig(**values.get("data", {})),
            optim=OptimConfig(**values.get("optim", {})),
            loop=LoopConfig(**values.get("loop", {})),
            checkpoint=CheckpointConfig(**values.get("checkpoint", {})),
        )


_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
MAX_NAME_LENGTH = 100
"""Folder names of runs, sweeps and trials (``trial-<id>`` under a sweep) must fit in one path
component (255 bytes) with room for Ray's suffixes."""


def check_name(name: str, what: str = "run name") -> str:
    """``name`` if it is usable as a folder name everywhere; UserError otherwise."""
    if len(name) > MAX_NAME_LENGTH:
        raise UserError(f"{what} is {len(name)} characters long; use at most {MAX_NAME_LENGTH}")
    if not _NAME.match(name):
        raise UserError(
            f"{what} {name!r} must start with a letter or digit and contain only "
            "letters, digits, '.', '_' and '-'"
        )
    return name


@dataclass(frozen=True)
class WorkersConfig:
    """How many training workers, and what each one owns."""

    min_workers: int = 1
    """Fewest workers to train with."""
    max_workers: int = 1
    """Most workers to train with; larger than min_workers means elastic."""
    use_gpu: bool = False
    """Give each worker one GPU and use NCCL."""
    cpus_per_worker: int = 1
    """CPUs reserved per worker; also torch's intra-op thread count in that worker."""

    def __post_init__(self):
        if self.min_workers < 1:
            raise UserError(f"number of workers must be >= 1, got {self.min_workers}")
        if self.max_workers < self.min_workers:
            raise UserError(
                f"worker range {self.min_workers}-{self.max_workers} is empty: "
                "write it as MIN-MAX with MIN <= MAX"
            )
        if self.cpus_per_worker < 1:
            raise UserError(f"cpus per worker must be >= 1, got {self.cpus_per_worker}")

    @property
    def is_elastic(self) -> bool:
        return self.max_workers > self.min_workers


@dataclass(frozen=True)
class FaultToleranceConfig:
    """How the run reacts when workers or nodes come and go."""

    max_failures: int = 0
    """Worker-group failures to recover from at the latest checkpoint (-1: no limit)."""
    resize_interval_s: float = 10.0
    """How often an elastic run considers growing onto new capacity (Ray's default is 60 s)."""
    placement_timeout_s: float = 120.0
    """Give up when fewer than the minimum workers can be placed for this long."""

    def __post_init__(self):
        if self.max_failures < -1:
            raise UserError(f"max failures must be -1 (no limit) or >= 0, got {self.max_failures}")
        # `not x > 0` also refuses NaN, which would make every deadline unreachable.
        if not (self.resize_interval_s > 0 and math.isfinite(self.resize_interval_s)):
            raise UserError(
                f"resize interval must be a finite number of seconds > 0, got "
                f"{self.resize_interval_s}"
            )
        if not (self.placement_timeout_s > 0 and math.isfinite(self.placement_timeout_s)):
            raise UserError(
                f"placement timeout must be a finite number of seconds > 0, got "
                f"{self.placement_timeout_s}"
            )


@dataclass(frozen=True)
class RunConfig:
    """Where a run's checkpoints and results live; the name is what a rerun resumes by."""

    name: str
    """Run name; rerunning with the same name and storage path resumes the run."""
    storage_path: str
    """Absolute local folder or URI (s3://...) that holds ``<name>/``."""

    def __post_init__(self):
        check_name(self.name)


def parse_worker_range(text: str) -> tuple[int, int]:
    """'4' -> (4, 4); '2-8' -> (2, 8)."""
    match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text)
    if not match:
        raise UserError(f"--num-workers must be N or MIN-MAX (e.g. 4 or 2-8), got {text!r}")
    low = int(match.group(1))
    high = int(match.group(2)) if match.group(2) is not None else low
    return low, high
