"""Command line: ``python -m app.train`` (also installed as ``app-train``).

Parses and validates every flag once, here; what runs below receives typed configs only.
"""

from __future__ import annotations

import argparse
import sys
import time

from app import PROCESS_STARTED, flags
from app.cli import HelpFormatter, Parser, run_main
from app.storage import storage_uri
from app.config import (
    COMPILE_MODES,
    PRECISIONS,
    CheckpointConfig,
    FaultToleranceConfig,
    LoopConfig,
    OptimConfig,
    RunConfig,
    TrainConfig,
    UserError,
    WorkersConfig,
    check_name,
    parse_worker_range,
)
from app.console import Console
from app.results import count, format_metric


def build_parser() -> argparse.ArgumentParser:
    defaults = LoopConfig()
    parser = Parser(
        prog="python -m app.train",
        description=(
            "Data-parallel training of a task (the book's MNIST ConvNet by default, or your own "
            "model) on Ray Train (DistributedDataParallel; gloo on CPU, NCCL on GPU), elastic "
            "over a worker range. Starts an embedded local Ray "
            "cluster unless --address or RAY_ADDRESS names one to join. Rerunning with the same "
            "--name and --storage-path resumes from the latest checkpoint."
        ),
        formatter_class=HelpFormatter,
    )
    scaling = parser.add_argument_group("workers")
    scaling.add_argument(
        "--num-workers", default="1", metavar="N|MIN-MAX",
        help="training workers: a number, or a range such as 2-8 for an elastic run that grows "
        "and shrinks with the cluster",
    )
    scaling.add_argument("--use-gpu", action="store_true", help="one GPU per worker, NCCL")
    scaling.add_argument(
        "--cpus-per-worker", type=int, default=1,
        help="CPUs reserved per worker (also torch's thread count in it)",
    )
    scaling.add_argument(
        "--max-failures", type=int, default=None,
        help="worker-group failures to recover from by restarting at the latest checkpoint "
        "(-1: no limit) [default: 3 when elastic, else 0]",
    )
    scaling.add_argument(
        "--resize-interval", type=float, default=FaultToleranceConfig().resize_interval_s,
        metavar="SECONDS", help="how often an elastic run considers growing onto new nodes",
    )
    scaling.add_argument(
        "--placement-timeout", type=float, default=FaultToleranceConfig().placement_timeout_s,
        metavar="SECONDS",
        help="stop with an error when the cluster cannot host the minimum number of workers, "
        "or no worker has run (e.g. its resources are held elsewhere), for this long; it also "
        "bounds a restart (an embedded cluster's size is checked at once)",
    )
    training = parser.add_argument_group("training (defaults: the task's)")
    flags.add_task_arguments(training)
    training.add_argument("--epochs", type=int, default=None,
                          help="epochs in total (mnist-convnet: 5)")
    training.add_argument(
        "--global-batch-size", type=int, default=None,
        help="samples per optimiser step over all workers; each worker takes its share "
        "(mnist-convnet: 128)",
    )
    training.add_argument("--lr", type=float, default=None,
                          help="learning rate of the task's optimiser (mnist-convnet: Adadelta, 0.5)")
    training.add_argument(
        "--lr-decay", type=float, default=None,
        help="learning-rate factor applied after every epoch, unless the task schedules its "
        "own (mnist-convnet: 1.0, no decay, as in the book)",
    )
    training.add_argument(
        "--max-batch-per-worker", type=int, default=defaults.max_batch_per_worker,
        help="largest batch a worker computes at once; a larger share of the global batch is "
        "split into micro-batches with accumulated gradients (0: no limit)",
    )
    training.add_argument("--seed", type=int, default=defaults.seed, help="random seed")
    training.add_argument(
        "--precision", choices=PRECISIONS, default=defaults.precision,
        help="auto: bf16 autocast where the device computes bf16 natively (AVX512-BF16/AMX "
        "CPUs, Ampere+ GPUs), else fp32; fp32 or bf16 force one",
    )
    training.add_argument(
        "--channels-last", action=argparse.BooleanOptionalAction, default=defaults.channels_last,
        help="keep a model with 2-D convolutions and its image batches channels-last (NHWC), "
        "the layout of oneDNN's and cuDNN's fast convolutions",
    )
    training.add_argument(
        "--compile", choices=COMPILE_MODES, default=defaults.compile,
        help="torch.compile the model; auto: on GPUs only (on CPU the built-in tasks measured "
        "slower compiled, after seconds of compiling)",
    )
    data = parser.add_argument_group("Parquet data (app.prepare)")
    data.add_argument(
        "--parquet", default=None, metavar="PATH|s3://...",
        help="train on a Parquet data set written by 'python -m app.prepare' (a folder or an "
        "s3:// prefix) for the same --task, read with Ray Data and split across the workers, "
        "instead of --dataset",
    )
    data.add_argument(
        "--verify-data", action="store_true",
        help="with --parquet: check every file's SHA-256 against the manifest before training "
        "(reads all the data once; the manifest, paths, schemas and labels are always checked)",
    )
    data.add_argument(
        "--stream-data", action="store_true",
        help="with --parquet: re-read the files every epoch instead of reading them once into "
        "Ray's object store (for data larger than the cluster's object store and spill disk; "
        "needs a CPU beside the workers)",
    )
    output = parser.add_argument_group("run and cluster")
    output.add_argument(
        "--storage-path", default="runs",
        help="where runs are kept (local folder or s3://bucket/prefix)",
    )
    output.add_argument(
        "--name", default=None,
        help="run name; rerunning with the same name resumes [default: <dataset>-<time>]",
    )
    output.add_argument(
        "--keep-checkpoints", type=int, default=CheckpointConfig().num_to_keep,
        help="keep this many best checkpoints by the task's score, plus the latest",
    )
    output.add_argument(
        "--log-every-steps", type=int, default=defaults.log_every_steps, metavar="N",
        help="a progress point every N steps (at most 4 a second): the live line on a terminal "
        "and the TensorBoard step curves (0: none)",
    )
    output.add_argument(
        "--checkpoint-every-steps", type=int, default=CheckpointConfig().every_steps,
        metavar="N",
        help="also checkpoint every N steps inside an epoch, so a failure loses at most N steps "
        "(0: at epoch ends only)",
    )
    flags.add_cluster_arguments(output)
    flags.add_tracking_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_main(
        build_parser(), _run, argv,
        interrupted="checkpoints written so far are kept; rerun the same command "
        "(same --name) to resume",
    )


def _run(args: argparse.Namespace, console: Console) -> int:
    if args.name is not None:
        check_name(args.name)
    reference, task = flags.resolve_task(args)
    min_workers, max_workers = parse_worker_range(args.num_workers)
    workers = WorkersConfig(
        min_workers=min_workers, max_workers=max_workers, use_gpu=args.use_gpu,
        cpus_per_worker=args.cpus_per_worker,
    )
    optim = OptimConfig(lr=args.lr, lr_decay=args.lr_decay)
    loop = LoopConfig(
        epochs=args.epochs, global_batch_size=args.global_batch_size, seed=args.seed,
        precision=args.precision, max_batch_per_worker=args.max_batch_per_worker,
        channels_last=args.channels_last, compile=args.compile,
        log_every_steps=args.log_every_steps,
    )
    if loop.global_batch_size < workers.max_workers:
        raise UserError(
            f"--global-batch-size {loop.global_batch_size} is smaller than the "
            f"{workers.max_workers} workers asked for: each worker needs a sample per step"
        )
    checkpoints = CheckpointConfig(
        num_to_keep=args.keep_checkpoints, every_steps=args.checkpoint_every_steps
    )
    fault_tolerance = FaultToleranceConfig(
        max_failures=(
            args.max_failures if args.max_failures is not None
            else 3 if workers.is_elastic else 0
        ),
        resize_interval_s=args.resize_interval,
        placement_timeout_s=args.placement_timeout,
    )
    storage_path = storage_uri(args.storage_path)
    embedded = not args.address
    from app import tracking

    args.mlflow = tracking.mlflow_settings(args.mlflow_uri, args.mlflow_experiment)

    from app import cluster, storage

    if embedded:
        cluster.check_capacity(workers, nodes=cluster.local_resources())
    storage.check_storage(storage_path)
    # Before the rerun check: a data set the task does not have is reported as unknown, not as
    # a difference from the earlier run.
    flags.check_data_flags(args, task)
    if args.name is not None and args.parquet is None:
        # Before the data is loaded (or downloaded): a rerun with other settings is refused
        # now. The data set is compared once known when the task may fall back to another.
        early = RunConfig(name=args.name, storage_path=storage_path)
        dataset = args.dataset or ("" if task.offline_fallback else task.default_dataset)
        _check_resumable(early, TrainConfig(task=reference, optim=optim, loop=loop),
                         task.name, dataset)
    resolved = None
    if args.parquet is not None:
        # A Parquet set's manifest and file footers are a few small reads: a set that is
        # missing, incomplete or for another task is refused before a cluster starts (an
        # embedded one would take seconds to start and stop again around the error).
        resolved = flags.resolve_data(args, task, console, load=embedded,
                                      global_batch_size=loop.global_batch_size)
    # Every check that needs no data has passed: the cluster starts now, beside the data's
    # load, the task's check on its samples and the launcher's imports.
    with cluster.Connecting(args.address, verbose=args.verbose) as connection:
        data, manifest = resolved or flags.resolve_data(
            args, task, console, load=embedded, global_batch_size=loop.global_batch_size
        )
        dataset = data.dataset or task.default_dataset
        run = RunConfig(
            name=args.name or f"{dataset}-{time.strftime('%Y%m%d-%H%M%S')}",
            storage_path=storage_path,
        )
        config = TrainConfig(task=reference, data=data, optim=optim, loop=loop,
                             checkpoint=checkpoints)
        with storage.RunLock(run):
            _check_resumable(run, config, task.name, dataset)
            from app import launcher  # noqa: F401 - imported while the cluster starts

            connection.wait()
            return _train(args, console, config, task, workers, run, fault_tolerance,
                          manifest, embedded)


def _check_resumable(run: RunConfig, config: TrainConfig, task_name: str, dataset: str) -> None:
    """A rerun must share the settings its checkpoints depend on (the workers check again,
    with the model's parameters and the optimiser)."""
    from app import checkpoint, storage

    saved = storage.latest_settings(run)
    current = checkpoint.run_settings(config, task_name, dataset)
    if not dataset:
        del current["dataset"]  # not known yet
    refusal = checkpoint.incompatibility(run.name, saved, current)
    if refusal is not None:
        raise UserError(refusal)


def _train(args, console, config, task, workers, run, fault_tolerance, manifest, embedded) -> int:
    from app import cluster, launcher

    try:
        # An embedded cluster never grows, so there is nothing to wait for.
        cluster.check_capacity(
            workers, wait_s=0 if embedded else fault_tolerance.placement_timeout_s
        )
        summary = launcher.launch(
            config, workers, run, console=console, fault_tolerance=fault_tolerance,
            verbose=args.verbose, manifest=manifest, mlflow=args.mlflow, started=PROCESS_STARTED,
        )
    except launcher.RunFailed as error:
        if args.verbose:
            raise
        if error.explained:
            print(f"error: {error}", file=sys.stderr)
        else:
            print(f"error: training failed: {error} (rerun with --verbose for details)",
                  file=sys.stderr)
        return 1
    console.line()
    best = summary.best_metrics
    console.line(
        f"Best {task.score.replace('val_', 'validation ', 1).replace('_', ' ')} {format_metric(task.score, best[task.score])} at "
        f"epoch {best['epoch']} ({count(len(summary.history), 'epoch')} trained)."
    )
    console.line(f"Checkpoints: {summary.run_uri}  (best: {summary.best_checkpoint})")
    console.line(f"Metrics:     {summary.metrics_uri}")
    console.line(f"Curves:      {summary.curves_uri}")
    if summary.analysis is not None:
        console.line(f"Timeline:    {summary.timeline_uri}")
        console.line(f"Goodput:     {summary.analysis.summary()}")
    console.line(f"TensorBoard: tensorboard --logdir {run.storage_path}")
    if summary.mlflow_link:
        console.line(f"MLflow:      {summary.mlflow_link}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
