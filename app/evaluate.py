"""Command line: ``python -m app.evaluate`` — score a checkpoint of any task on a split.

Rebuilds the model from the checkpoint (the task comes from it unless ``--task`` is given),
scores the split with the task's loss and metrics the way the run's validation did (same
batching and precision), and prints the numbers, or one JSON object with ``--json``. No Ray:
it runs in this process, on a GPU if there is one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow.fs
import torch

from app import checkpoint, flags
from app.cli import HelpFormatter, Parser, run_main
from app.config import PRECISIONS, UserError
from app.console import Console
from app import storage
from app.storage import join, storage_uri
from app.task import Task, load_task


@dataclass(frozen=True)
class Loaded:
    """A checkpoint read back: where it was, its state, and the task and model it trains."""

    uri: str
    state: checkpoint.TrainingState
    task: Task
    model: torch.nn.Module

    @property
    def epoch(self) -> int:
        return self.state.epoch

    def recorded(self) -> dict[str, Any]:
        """The metrics the run recorded for this checkpoint's epoch ({} mid-epoch)."""
        rows = [row for row in self.state.history if row.get("epoch") == self.state.epoch]
        return rows[-1] if rows and self.state.epoch_step == 0 else {}


def _filesystem(uri: str) -> tuple[pyarrow.fs.FileSystem, str]:
    return storage.filesystem(uri, "checkpoint")


def _is_file(filesystem, path: str) -> bool:
    return filesystem.get_file_info(path).type == pyarrow.fs.FileType.File


def _read_json(filesystem, path: str) -> Any:
    with filesystem.open_input_stream(path) as stream:
        return json.loads(stream.read())


def find_checkpoint(uri: str, task_reference: str | None) -> str:
    """``uri`` itself when it is a checkpoint folder; for a run folder, its best epoch
    checkpoint by the task's score. UserError when it is neither."""
    filesystem, path = _filesystem(uri)
    try:
        if _is_file(filesystem, join(path, checkpoint.STATE_FILE)) or \
                _is_file(filesystem, join(path, checkpoint.HISTORY_FILE)):
            return uri
        info = filesystem.get_file_info(path)
        if info.type == pyarrow.fs.FileType.NotFound:
            raise UserError(f"no checkpoint at {uri}: it does not exist")
        if info.type != pyarrow.fs.FileType.Directory:
            raise UserError(f"{uri} is not a checkpoint: give a checkpoint folder "
                            "(checkpoint_epoch_NNNN) or a run folder")
        # Epoch ends only: a mid-epoch checkpoint has no validation metrics to rank it by.
        epochs = {checkpoint.age_order(name)[0]: name
                  for name in storage.checkpoint_folders(filesystem, path)
                  if checkpoint.age_order(name)[1] == float("inf")}
        if not epochs:
            raise UserError(f"no checkpoint at {uri}: it holds no checkpoint_epoch_NNNN folder "
                            "(nor state.pt)")
        newest = join(path, epochs[max(epochs)])
        history = _read_json(filesystem, join(newest, checkpoint.HISTORY_FILE))
        reference = task_reference or _read_json(
            filesystem, join(newest, checkpoint.SETTINGS_FILE)).get("task")
    except UserError:
        raise
    except OSError as error:
        raise UserError(f"cannot read {uri}: {error}") from None
    except (ValueError, KeyError) as error:
        raise UserError(f"{uri}: its newest checkpoint is partial or foreign ({error})") from None
    if not reference:
        raise UserError(f"{uri}: the checkpoints do not say which task made them; pass --task")
    task = load_task(reference)
    rows = [row for row in history if row.get("epoch") in epochs and task.score in row]
    if not rows:
        return join(uri, epochs[max(epochs)])
    best = rows[0]
    for row in rows[1:]:
        if task.better(row[task.score], best[task.score]):
            best = row
    return join(uri, epochs[best["epoch"]])


@contextlib.contextmanager
def _local_copy(uri: str) -> Iterator[str]:
    """A local folder with the checkpoint's files (downloaded first from remote storage)."""
    filesystem, path = _filesystem(uri)
    if isinstance(filesystem, pyarrow.fs.LocalFileSystem):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="app-evaluate-") as directory:
        try:
            pyarrow.fs.copy_files(path, directory, source_filesystem=filesystem)
        except OSError as error:
            raise UserError(f"cannot download {uri}: {error}") from None
        yield directory


def load(uri: str, task_reference: str | None = None) -> Loaded:
    """The checkpoint at ``uri`` (a checkpoint or run folder, local or remote), with its task's
    model holding its weights. One-line UserErrors for a missing, partial or foreign one."""
    uri = find_checkpoint(uri, task_reference)
    with _local_copy(uri) as directory:
        try:
            state = checkpoint.load(directory)
        except checkpoint.UnreadableCheckpoint as error:
            raise UserError(f"{uri} is not a complete checkpoint of this app ({error})") from None
    reference = task_reference or state.settings.get("task") or state.config.get("task")
    if not reference:
        raise UserError(f"{uri} does not say which task made it (written by an older version "
                        "of the app); pass --task")
    task = load_task(reference)
    model = task.build_model()
    expected = checkpoint.parameter_shapes(model)
    found = {name: list(value.shape) for name, value in state.model.items()}
    if expected != found:
        names = sorted(set(expected) ^ set(found)) or \
            [name for name in expected if expected[name] != found[name]]
        raise UserError(
            f"{uri} does not fit the model of task {task.name!r}: {names[0]} is "
            f"{found.get(names[0], 'absent')} in the checkpoint and "
            f"{expected.get(names[0], 'absent')} in the model; pass the --task it was trained "
            "with"
        )
    model.load_state_dict(state.model)
    model.eval()
    return Loaded(uri=uri, state=state, task=task, model=model)


def split_data(loaded: Loaded, split: str, dataset: str | None = None,
               data_dir: str | None = None, parquet: str | None = None):
    """The split the checkpoint's run trained on (or the one given), as a map-style set."""
    from torch.utils.data import TensorDataset

    from app.task import build_datasets

    config = loaded.state.config.get("data", {})
    parquet = parquet or config.get("parquet") or None
    if parquet and dataset is None:
        from app import parquet as parquet_module

        manifest = parquet_module.open_manifest(storage_uri(parquet, "--parquet"))
        inputs, targets, _ = parquet_module.read_split(manifest, split)
        return TensorDataset(inputs, targets)
    if dataset is None:
        dataset = config.get("dataset", "")
    train, val = build_datasets(loaded.task, dataset, data_dir or config.get("data_dir", "data"))
    return train if split == "train" else val


def batches(dataset, batch_size: int):
    from app.batching import rows

    for start in range(0, len(dataset), batch_size):
        yield rows(dataset, torch.arange(start, min(start + batch_size, len(dataset))))


def precision_of(loaded: Loaded, requested: str, device: torch.device) -> str:
    """The precision the run validated this checkpoint with, unless one is requested."""
    from app.loop import resolve_precision

    if requested == "auto" and loaded.recorded().get("precision"):
        return loaded.recorded()["precision"]
    return resolve_precision(requested, device)


def evaluate(loaded: Loaded, dataset, batch_size: int, precision: str,
             device: torch.device) -> dict[str, float]:
    """``{"loss": ..., <metric>: ...}``: exact means over ``dataset``."""
    from app.loop import score_batches

    model = loaded.model.to(device)
    sums, count = score_batches(loaded.task, model, batches(dataset, batch_size), device,
                                precision)
    totals = (sums / max(count, 1)).tolist()
    return {"loss": totals[0], **dict(zip(loaded.task.metrics, totals[1:])),
            "num_samples": count}


@torch.inference_mode()
def outputs(loaded: Loaded, inputs: torch.Tensor, precision: str,
            device: torch.device) -> torch.Tensor:
    """The model's fp32 outputs for a batch of inputs (what ``app.predict`` writes)."""
    from app.loop import autocast

    model = loaded.model.to(device)
    with autocast(precision, device):
        result = model(inputs.to(device))
    return result.float().cpu()


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="python -m app.evaluate",
        description="Score a checkpoint (of any task) on a split of its data set: the loss and "
        "every metric of the task, as the run's validation computed them.",
        formatter_class=HelpFormatter,
    )
    flags.add_checkpoint_arguments(parser)
    parser.add_argument("--dataset", default=None,
                        help="one of the task's data sets [default: the run's]")
    parser.add_argument("--data-dir", default=None,
                        help="folder the task reads its data from [default: the run's]")
    parser.add_argument("--parquet", default=None, metavar="PATH|s3://...",
                        help="score a Parquet data set written by app.prepare instead "
                        "[default: the run's, if it trained on one]")
    parser.add_argument("--split", choices=("val", "train"), default="val",
                        help="which split to score")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="samples per forward pass [default: the run's eval batch size]")
    parser.add_argument("--precision", choices=PRECISIONS, default="auto",
                        help="auto: the precision the run validated with")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (val_loss, val_<metric>...) instead of text")
    return parser


def _run(args: argparse.Namespace, console: Console) -> int:
    from app.task import resolve_reference

    reference = resolve_reference(args.task) if args.task else None
    loaded = load(storage_uri(args.checkpoint, "--checkpoint"), reference)
    dataset = split_data(loaded, args.split, args.dataset, args.data_dir, args.parquet)
    batch_size = args.batch_size or loaded.state.config.get("loop", {}).get("eval_batch_size",
                                                                             1000)
    if batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {batch_size}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = precision_of(loaded, args.precision, device)
    values = evaluate(loaded, dataset, batch_size, precision, device)
    prefix = "val_" if args.split == "val" else "train_"
    metrics = {f"{prefix}{name}": value for name, value in values.items()
               if name != "num_samples"}
    if args.json:
        print(json.dumps({"checkpoint": loaded.uri, "task": loaded.task.name,
                          "epoch": loaded.epoch, "split": args.split,
                          "num_samples": values["num_samples"], "precision": precision,
                          **metrics}))
        return 0
    from app.results import format_metric

    console.line(f"{loaded.uri}: task {loaded.task.name}, epoch {loaded.epoch}, "
                 f"{values['num_samples']:,} {args.split} samples, {precision}")
    recorded = loaded.recorded() if args.split == "val" else {}
    for name, value in metrics.items():
        was = f"  (recorded in training: {format_metric(name, recorded[name])})" \
            if name in recorded else ""
        console.line(f"  {name:<16} {format_metric(name, value):>10}{was}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(build_parser(), _run, argv, interrupted="nothing was changed")


if __name__ == "__main__":
    sys.exit(main())
