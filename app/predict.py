"""Command line: ``python -m app.predict`` — batch inference with a checkpoint, on Ray Data.

Reads a Parquet set written by ``app.prepare`` with Ray Data, runs the checkpoint's model in a
pool of actors (``map_batches``, one model per actor, ``--num-workers`` actors, a GPU each with
``--use-gpu``), and writes one row per input row: ``id``, ``output`` (the model's fp32 output)
and, for a classifier, ``prediction`` (the argmax), as Parquet, locally or on ``s3://``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs

from app import flags
from app.cli import HelpFormatter, Parser, run_main
from app.config import WorkersConfig, UserError
from app.console import Console
from app.storage import storage_uri

_INTEGER_DTYPES = ("int64", "int32", "int16", "int8", "uint8")


class Predictor:
    """One actor of the pool: the model loaded once, applied to every batch it is given."""

    def __init__(self, checkpoint: str, task: str, manifest: dict[str, Any], precision: str,
                 classifier: bool, num_cpus: int):
        import torch

        from app import evaluate
        from app.parquet import _spec

        torch.set_num_threads(max(1, num_cpus))
        self.loaded = evaluate.load(checkpoint, task)
        self.input_spec = _spec(manifest["input"])
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.precision = precision
        self.classifier = classifier

    def __call__(self, table: pa.Table) -> pa.Table:
        from app import evaluate

        inputs = self.input_spec.decode(table.column("input"))
        outputs = evaluate.outputs(self.loaded, inputs, self.precision, self.device).numpy()
        columns = {"id": table.column("id")}
        if outputs.ndim == 1:
            columns["output"] = pa.array(outputs.astype(np.float32))
        else:
            flat = outputs.reshape(len(outputs), -1).astype(np.float32)
            columns["output"] = pa.FixedSizeListArray.from_arrays(
                pa.array(flat.reshape(-1)), flat.shape[1]
            )
        if self.classifier and outputs.ndim == 2:
            columns["prediction"] = pa.array(outputs.argmax(axis=1).astype(np.int64))
        return pa.table(columns)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="python -m app.predict",
        description="Batch inference with a checkpoint over a Parquet data set (app.prepare), "
        "with Ray Data: the model runs in a pool of actors; predictions are written as "
        "Parquet (id, output, and prediction for a classifier).",
        formatter_class=HelpFormatter,
    )
    flags.add_checkpoint_arguments(
        parser, "; every actor reads it, so on a multi-node cluster give shared storage or s3://"
    )
    parser.add_argument("--parquet", required=True, metavar="PATH|s3://...",
                        help="the Parquet data set (written by app.prepare) to predict on")
    parser.add_argument("--split", choices=("val", "train"), default="val",
                        help="which split of the data set")
    parser.add_argument("--output", required=True, metavar="PATH|s3://...",
                        help="folder or prefix to write the predictions to (must not exist "
                        "yet, or be empty)")
    parser.add_argument("--num-workers", type=int, default=1,
                        help="actors in the pool, each with its own copy of the model")
    parser.add_argument("--use-gpu", action="store_true", help="one GPU per actor")
    parser.add_argument("--cpus-per-worker", type=int, default=1,
                        help="CPUs per actor (also its torch thread count)")
    parser.add_argument("--batch-size", type=int, default=1000,
                        help="rows per model call")
    flags.add_cluster_arguments(parser)
    return parser


def _check_output_empty(uri: str) -> None:
    filesystem, path = pyarrow.fs.FileSystem.from_uri(uri)
    try:
        found = filesystem.get_file_info(pyarrow.fs.FileSelector(path, allow_not_found=True))
    except OSError as error:
        raise UserError(f"cannot use --output {uri}: {error}") from None
    if found:
        raise UserError(f"--output {uri} already holds {len(found)} file(s): choose a new "
                        "folder, or delete it first")


def _run(args: argparse.Namespace, console: Console) -> int:
    from app import cluster, evaluate, parquet
    from app.task import resolve_reference

    if args.batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {args.batch_size}")
    workers = WorkersConfig(min_workers=args.num_workers, max_workers=args.num_workers,
                            use_gpu=args.use_gpu, cpus_per_worker=args.cpus_per_worker)
    reference = resolve_reference(args.task) if args.task else None
    loaded = evaluate.load(storage_uri(args.checkpoint, "--checkpoint"), reference)
    manifest = parquet.open_manifest(storage_uri(args.parquet, "--parquet"))
    if manifest.task and manifest.task != loaded.task.name:
        raise UserError(f"{manifest.uri} was prepared for the task {manifest.task!r}, but the "
                        f"checkpoint is of {loaded.task.name!r}")
    output = storage_uri(args.output, "--output")
    _check_output_empty(output)
    files = manifest.val_files if args.split == "val" else manifest.train_files
    num_rows = manifest.num_val if args.split == "val" else manifest.num_train
    classifier = manifest.target.dtype in _INTEGER_DTYPES and manifest.target.shape == ()
    embedded = not args.address
    if embedded:
        cluster.check_capacity(workers, nodes=cluster.local_resources())
    cluster.connect(args.address, verbose=args.verbose)
    try:
        cluster.check_capacity(workers, wait_s=0 if embedded else 60)
        import ray.data

        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = args.verbose
        context.print_on_execution_start = args.verbose
        if not args.verbose:
            logging.getLogger("ray.data").setLevel(logging.ERROR)
        # Ray Data's V2 Parquet reader lists files in a task that takes a whole CPU, which the
        # actors may already hold (a deadlock on a small cluster); V1 reads in CPU-free tasks.
        context.use_datasource_v2 = False
        console.line(f"Predicting {num_rows:,} rows of {manifest.uri} ({args.split}) with "
                     f"{loaded.uri} ({loaded.task.name}, epoch {loaded.epoch}) on "
                     f"{args.num_workers} {'GPU' if args.use_gpu else 'CPU'} actor(s)...")
        # Reading and writing are I/O: they take no CPU from the model actors, which would
        # otherwise wait for each other on a small cluster.
        dataset = ray.data.read_parquet(list(files), file_extensions=None,
                                        num_cpus=0)
        predictions = dataset.map_batches(
            Predictor,
            fn_constructor_kwargs={
                "checkpoint": loaded.uri, "task": reference or loaded.state.settings.get("task")
                or loaded.state.config.get("task"),
                "manifest": manifest.to_dict(),
                "precision": evaluate.precision_of(loaded, "auto", _driver_device(args)),
                "classifier": classifier, "num_cpus": args.cpus_per_worker,
            },
            batch_size=args.batch_size, batch_format="pyarrow", concurrency=args.num_workers,
            num_cpus=args.cpus_per_worker, num_gpus=1 if args.use_gpu else 0,
        )
        predictions.write_parquet(output, ray_remote_args={"num_cpus": 0})
    finally:
        cluster.disconnect()
    console.line(f"Wrote {num_rows:,} predictions to {output} (columns: id, output"
                 f"{', prediction' if classifier else ''}).")
    return 0


def _driver_device(args: argparse.Namespace):
    import torch

    return torch.device("cuda" if args.use_gpu else "cpu")


def main(argv: list[str] | None = None) -> int:
    return run_main(build_parser(), _run, argv,
                    interrupted="the output may hold part of the predictions; delete it and "
                    "rerun")


if __name__ == "__main__":
    sys.exit(main())
