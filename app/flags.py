"""The flags the command lines share (the task and its data, the cluster, storage), defined once,
and the task-dependent resolution behind them: the task's defaults, its data set (with the
offline fallback), and the data checks made before any worker starts."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from app.config import DataConfig, UserError
from app.console import Console
from app.task import BUILTIN_HELP, DEFAULT_TASK, Task, build_datasets, check_on_samples, \
    load_task, resolve_reference

if TYPE_CHECKING:
    from app.parquet import Manifest

TASK_DEFAULTS = ("lr", "lr_decay", "global_batch_size", "epochs")
"""Flags whose default comes from the task (argparse default None)."""


def add_task_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                       dataset_help: str = "") -> None:
    """--task, --dataset and --data-dir."""
    builtins = "; ".join(f"{name}: {text}" for name, text in BUILTIN_HELP.items())
    parser.add_argument(
        "--task", default=DEFAULT_TASK, metavar="NAME|module:ATTR|file.py:ATTR",
        help=f"what to train: a built-in task ({builtins}), or your own app.task.Task given as "
        "package.module:ATTR or path/to/file.py:ATTR (see README, 'Train your own model')",
    )
    parser.add_argument(
        "--dataset", default=None,
        help=dataset_help or "one of the task's data sets (mnist-convnet: mnist, "
        "fashion-mnist, digits) [default: the task's own; for the MNIST tasks, scikit-learn's "
        "bundled digits when MNIST is neither in --data-dir nor downloadable]",
    )
    parser.add_argument(
        "--data-dir", default="data",
        help="folder the task reads its data set from, and downloads it to (MNIST: "
        "<dir>/MNIST/raw/..., CIFAR-10: <dir>/cifar-10-batches-py/...)",
    )


def add_cluster_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--address and --verbose."""
    parser.add_argument(
        "--address", default=os.environ.get("RAY_ADDRESS"),
        help="Ray cluster to join (e.g. auto, 10.0.0.1:6379) [default: RAY_ADDRESS if set, "
        "else an embedded local cluster]",
    )
    parser.add_argument(
        "--verbose", action="store_true", help="show Ray's own logs and full tracebacks"
    )


def add_tracking_arguments(parser: argparse.ArgumentParser, what: str = "the run") -> None:
    """--mlflow-uri and --mlflow-experiment."""
    from app.tracking import DEFAULT_EXPERIMENT

    group = parser.add_argument_group(
        "tracking (TensorBoard event files are always written under the run's folder)")
    group.add_argument(
        "--mlflow-uri", default=None, metavar="URI",
        help=f"log {what} to this MLflow tracking server (params, per-epoch metrics, the best "
        "checkpoint, the curves and timeline) [default: $MLFLOW_TRACKING_URI; unset: no MLflow]",
    )
    group.add_argument(
        "--mlflow-experiment", default=DEFAULT_EXPERIMENT, metavar="NAME",
        help="MLflow experiment the runs go in",
    )


def add_checkpoint_arguments(parser: argparse.ArgumentParser, where: str = "") -> None:
    """--checkpoint and --task, for the commands that use a trained model."""
    parser.add_argument(
        "--checkpoint", required=True, metavar="PATH|s3://...",
        help="a checkpoint folder (checkpoint_epoch_NNNN), or a run folder: its best checkpoint "
        f"by the task's score{where}",
    )
    parser.add_argument("--task", default=None,
                        help="the task [default: the one recorded in the checkpoint]")


def resolve_task(args: argparse.Namespace, fill_defaults: bool = True) -> tuple[str, Task]:
    """The task's reference (as workers and checkpoints keep it) and the task; with
    ``fill_defaults``, fills the flags left at None (TASK_DEFAULTS) with the task's defaults."""
    reference = resolve_reference(args.task)
    task = load_task(reference)
    for flag in TASK_DEFAULTS if fill_defaults else ():
        if getattr(args, flag, "absent") is None:
            setattr(args, flag, getattr(task, flag))
    return reference, task


def check_data_flags(args: argparse.Namespace, task: Task) -> None:
    """Every check of the data flags that reads no data, made before a cluster starts (an
    embedded one would take seconds to start and stop again around the refusal): the data set's
    name, and the flags that apply to --parquet data sets only."""
    if getattr(args, "parquet", None) is not None:
        if args.dataset is not None:
            raise UserError("--dataset and --parquet both name a data set: give one of them")
        return
    for flag in ("stream_data", "verify_data"):
        if getattr(args, flag, False):
            raise UserError(f"--{flag.replace('_', '-')} applies to --parquet data sets only")
    task.builder(args.dataset or "")  # an unknown name fails now, listing the task's data sets


def resolve_data(
    args: argparse.Namespace, task: Task, console: Console, load: bool,
    global_batch_size: int | None = None,
) -> tuple[DataConfig, Manifest | None]:
    """The data set to train on, checked (after ``check_data_flags``).

    ``--parquet``: the checked manifest (it must have been prepared for this task). Otherwise
    the task's data set ``--dataset`` (its default when not given), loaded now when ``load``
    (workers on this machine read the same folder: a missing or corrupt file is reported now,
    by name). When no --dataset was given, the task has an offline fallback and its default data
    set cannot be loaded, it says so and trains on the fallback. ``global_batch_size``, when
    given, must fit in the training set.
    """
    from app.batching import check_batch_fits

    batch = global_batch_size
    if getattr(args, "parquet", None) is not None:
        from app import parquet
        from app.storage import storage_uri

        manifest = parquet.open_manifest(storage_uri(args.parquet, "--parquet"),
                                         verify=getattr(args, "verify_data", False))
        if manifest.task and manifest.task != task.name:
            raise UserError(f"{manifest.uri} was prepared for the task {manifest.task!r}, not "
                            f"{task.name!r}: pass --task with that task, or prepare it again")
        if batch is not None:
            check_batch_fits(batch, manifest.num_train, manifest.dataset)
        config = DataConfig(dataset=manifest.dataset, data_dir=args.data_dir,
                            parquet=manifest.uri, stream=getattr(args, "stream_data", False))
        return config, manifest
    name = args.dataset or ""
    if name or not task.offline_fallback:
        if load:
            train, _ = build_datasets(task, name, args.data_dir)
            check_on_samples(task, train)
            if batch is not None:
                check_batch_fits(batch, len(train), name or task.default_dataset)
        return DataConfig(dataset=name, data_dir=args.data_dir), None
    try:
        train, _ = build_datasets(task, "", args.data_dir)
    except UserError:
        console.line(
            f"{task.default_dataset} is not in {args.data_dir} and cannot be downloaded: "
            f"training on {task.offline_fallback} instead (--dataset chooses)."
        )
        name = task.offline_fallback
        train, _ = build_datasets(task, name, args.data_dir)
    check_on_samples(task, train)
    if batch is not None:
        check_batch_fits(batch, len(train), name or task.default_dataset)
    return DataConfig(dataset=name, data_dir=args.data_dir), None
