"""Command line: ``python -m app.train`` (also installed as ``app-train``).

Parses and validates every flag once, here; what runs below receives typed configs only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TYPE_CHECKING

from app.cli import HelpFormatter, Parser, run_main
from app.storage import storage_uri
from app.config import (
    DATASETS,
    PRECISIONS,
    CheckpointConfig,
    DataConfig,
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

if TYPE_CHECKING:
    from app.parquet import Manifest


def build_parser() -> argparse.ArgumentParser:
    defaults = LoopConfig()
    parser = Parser(
        prog="python -m app.train",
        description=(
            "Data-parallel training of the reference MNIST ConvNet on Ray Train "
            "(DistributedDataParallel; gloo on CPU, NCCL on GPU). Starts an embedded local Ray "
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
    training = parser.add_argument_group("training")
    training.add_argument("--epochs", type=int, default=defaults.epochs, help="epochs in total")
    training.add_argument(
        "--global-batch-size", type=int, default=defaults.global_batch_size,
        help="samples per optimiser step over all workers; each worker takes its share",
    )
    training.add_argument("--lr", type=float, default=OptimConfig().lr, help="Adadelta learning rate")
    training.add_argument(
        "--lr-decay", type=float, default=OptimConfig().lr_decay,
        help="learning-rate factor applied after every epoch",
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
    data = parser.add_argument_group("data")
    data.add_argument(
        "--dataset", choices=DATASETS, default=None,
        help="data set [default: mnist; if MNIST is neither in --data-dir nor downloadable, "
        "scikit-learn's bundled digits]",
    )
    data.add_argument(
        "--data-dir", default="data",
        help="folder with the data set in torchvision's layout (<dir>/MNIST/raw/...); "
        "downloads go here",
    )
    data.add_argument(
        "--parquet", default=None, metavar="PATH|s3://...",
        help="train on a Parquet data set written by 'python -m app.prepare' (a folder or an "
        "s3:// prefix), read with Ray Data and split across the workers, instead of --dataset",
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
        help="keep this many best checkpoints by validation accuracy, plus the latest",
    )
    output.add_argument(
        "--checkpoint-every-steps", type=int, default=CheckpointConfig().every_steps,
        metavar="N",
        help="also checkpoint every N steps inside an epoch, so a failure loses at most N steps "
        "(0: at epoch ends only)",
    )
    output.add_argument(
        "--address", default=os.environ.get("RAY_ADDRESS"),
        help="Ray cluster to join (e.g. auto, 10.0.0.1:6379) [default: RAY_ADDRESS if set, "
        "else an embedded local cluster]",
    )
    output.add_argument(
        "--verbose", action="store_true", help="show Ray's own logs and full tracebacks"
    )
    return parser


def _resolve_data(
    args: argparse.Namespace, console: Console, embedded: bool
) -> tuple[DataConfig, Manifest | None]:
    """The data set to train on; falls back to the bundled digits only if none was asked for."""
    from app import data
    from app.batching import check_batch_fits

    if args.parquet is not None:
        from app import parquet

        if args.dataset is not None:
            raise UserError("--dataset and --parquet both name a data set: give one of them")
        manifest = parquet.open_manifest(storage_uri(args.parquet, "--parquet"),
                                         verify=args.verify_data)
        check_batch_fits(args.global_batch_size, manifest.num_train, manifest.dataset)
        config = DataConfig(dataset=manifest.dataset, parquet=manifest.uri,
                            stream=args.stream_data)
        return config, manifest
    if args.stream_data or args.verify_data:
        flag = "--stream-data" if args.stream_data else "--verify-data"
        raise UserError(f"{flag} applies to --parquet data sets only")
    if args.dataset is not None:
        config = DataConfig(dataset=args.dataset, data_dir=args.data_dir)
    else:
        config = DataConfig(dataset="mnist", data_dir=args.data_dir)
        if not data.is_available(config):
            console.line(
                f"MNIST is not in {args.data_dir} and cannot be downloaded: training on "
                "scikit-learn's bundled handwritten digits (1,797 8x8 images, resized to 28x28)."
            )
            config = DataConfig(dataset="digits", data_dir=args.data_dir)
    if embedded:
        # Workers read the same folder: a missing or corrupt file is reported now, by name.
        loaded = data.load(config)
        check_batch_fits(args.global_batch_size, len(loaded.train), config.dataset)
    return config, None


def main(argv: list[str] | None = None) -> int:
    return run_main(
        build_parser(), _run, argv,
        interrupted="checkpoints written so far are kept; rerun the same command "
        "(same --name) to resume",
    )


def _run(args: argparse.Namespace, console: Console) -> int:
    if args.name is not None:
        check_name(args.name)
    min_workers, max_workers = parse_worker_range(args.num_workers)
    workers = WorkersConfig(
        min_workers=min_workers, max_workers=max_workers, use_gpu=args.use_gpu,
        cpus_per_worker=args.cpus_per_worker,
    )
    optim = OptimConfig(lr=args.lr, lr_decay=args.lr_decay)
    loop = LoopConfig(
        epochs=args.epochs, global_batch_size=args.global_batch_size, seed=args.seed,
        precision=args.precision, max_batch_per_worker=args.max_batch_per_worker,
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

    from app import cluster, storage

    if embedded:
        cluster.check_capacity(workers, nodes=cluster.local_resources())
    storage.check_storage(storage_path)
    data, manifest = _resolve_data(args, console, embedded)
    run = RunConfig(
        name=args.name or f"{data.dataset}-{time.strftime('%Y%m%d-%H%M%S')}",
        storage_path=storage_path,
    )
    config = TrainConfig(data=data, optim=optim, loop=loop, checkpoint=checkpoints)
    with storage.RunLock(run):
        return _train(args, console, config, workers, run, fault_tolerance, manifest, embedded)


def _train(args, console, config, workers, run, fault_tolerance, manifest, embedded) -> int:
    from app import cluster, launcher

    cluster.connect(args.address, verbose=args.verbose)
    try:
        # An embedded cluster never grows, so there is nothing to wait for.
        cluster.check_capacity(
            workers, wait_s=0 if embedded else fault_tolerance.placement_timeout_s
        )
        summary = launcher.launch(
            config, workers, run, console=console, fault_tolerance=fault_tolerance,
            verbose=args.verbose, manifest=manifest,
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
    finally:
        cluster.disconnect()
    console.line()
    console.line(
        f"Best validation accuracy {100 * summary.best_accuracy:.2f}% at epoch "
        f"{summary.best_epoch} ({len(summary.history)} epochs trained)."
    )
    console.line(f"Checkpoints: {summary.run_uri}  (best: {summary.best_checkpoint})")
    console.line(f"Metrics:     {summary.metrics_uri}")
    console.line(f"Curves:      {summary.curves_uri}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
