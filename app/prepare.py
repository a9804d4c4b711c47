"""Command line: ``python -m app.prepare`` — a task's data set as sharded Parquet plus a manifest.

Writes ``<output>/train/part-NNNNN.parquet`` and ``<output>/val/part-NNNNN.parquet`` (columns
``id``: int64 index within the split, ``input`` and ``target``: each sample's tensor as
fixed-size bytes) and, last, ``<output>/manifest.json`` (task, data set, the input and target
dtypes and shapes, row counts, per-file SHA-256). The manifest marks the output complete: a run
cut short leaves part files but no manifest, and readers must not take such a folder as a data
set. Local paths and ``s3://`` URIs both go through pyarrow's filesystem layer.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import posixpath
import sys
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.fs
import pyarrow.parquet as pq
import torch

from app import flags
from app.cli import HelpFormatter, Parser, run_main
from app.storage import storage_uri
from app.config import UserError
from app.console import Console

FORMAT = "app-tensors-parquet/1"
MANIFEST = "manifest.json"
DTYPES = ("float32", "float64", "float16", "int64", "int32", "int16", "int8", "uint8", "bool")
"""Tensor dtypes a Parquet set can hold (those numpy reads back byte for byte)."""


@dataclass(frozen=True)
class TensorSpec:
    """The dtype and shape of one sample's input or target."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    def to_dict(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def of(cls, batch: torch.Tensor) -> TensorSpec:
        dtype = str(batch.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise UserError(f"cannot store {batch.dtype} tensors in Parquet: use one of "
                            f"{', '.join(DTYPES)}")
        return cls(dtype, tuple(batch.shape[1:]))

    def decode(self, column: pa.Array) -> torch.Tensor:
        """A fixed-size binary column back into an N x shape tensor, without a copy per row."""
        column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
        width = column.type.byte_width
        raw = np.frombuffer(column.buffers()[1], dtype=np.uint8, count=len(column) * width,
                            offset=column.offset * width)
        return torch.from_numpy(raw.view(self.dtype).reshape(len(column), *self.shape).copy())


def schema(input_spec: TensorSpec, target_spec: TensorSpec) -> pa.Schema:
    """The columns of every part file; readers check it before training."""
    return pa.schema([
        ("id", pa.int64()),
        ("input", pa.binary(input_spec.num_bytes)),
        ("target", pa.binary(target_spec.num_bytes)),
    ])


def _binary(batch: torch.Tensor, width: int) -> pa.Array:
    flat = np.ascontiguousarray(batch.numpy()).view(np.uint8).reshape(len(batch), width)
    return pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(width), len(flat), [None, pa.py_buffer(flat.tobytes())]
    )


def _table(inputs: torch.Tensor, targets: torch.Tensor, first_id: int,
           specs: tuple[TensorSpec, TensorSpec]) -> pa.Table:
    return pa.table({
        "id": pa.array(np.arange(first_id, first_id + len(inputs), dtype=np.int64)),
        "input": _binary(inputs, specs[0].num_bytes),
        "target": _binary(targets, specs[1].num_bytes),
    }, schema=schema(*specs))


def _source_digest(dataset: str, splits: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> str:
    digest = hashlib.sha256(dataset.encode())
    for inputs, targets in splits.values():
        digest.update(np.ascontiguousarray(inputs.numpy()).tobytes())
        digest.update(np.ascontiguousarray(targets.numpy()).tobytes())
    return digest.hexdigest()


def _sha256(filesystem: pyarrow.fs.FileSystem, path: str) -> str:
    digest = hashlib.sha256()
    with filesystem.open_input_stream(path) as stream:
        while chunk := stream.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def is_inside(relative: str) -> bool:
    """Whether a manifest's file path stays inside the data set's folder (no absolute paths,
    no '..', no URI): a manifest must not send readers elsewhere."""
    normal = posixpath.normpath(relative)
    return bool(relative) and "://" not in relative and not relative.startswith("/") \
        and normal != ".." and not normal.startswith("../")


def changed_files(filesystem, root: str, values: dict) -> list[str]:
    """The files a manifest lists that are missing or whose SHA-256 differs from the one it
    recorded (reads every byte)."""
    changed = []
    for split in ("train", "val"):
        for entry in values["splits"][split]["files"]:
            path = f"{root}/{entry['path']}"
            try:
                if _sha256(filesystem, path) != entry["sha256"]:
                    changed.append(f"{entry['path']} (checksum differs)")
            except FileNotFoundError:
                changed.append(f"{entry['path']} (missing)")
    return changed


def _existing_manifest(filesystem, root: str) -> dict | None:
    path = f"{root}/{MANIFEST}"
    if filesystem.get_file_info(path).type != pyarrow.fs.FileType.File:
        return None
    with filesystem.open_input_stream(path) as stream:
        return json.loads(stream.read())


def prepare(task: str, dataset: str, splits: dict[str, tuple[torch.Tensor, torch.Tensor]],
            output: str, num_files: dict[str, int]) -> tuple[dict, str]:
    """Write the (inputs, targets) of the "train" and "val" ``splits`` under ``output``; returns
    the manifest and what was done: "written", "unchanged" (the same data set is there, every
    file intact) or "repaired" (the same data set with files missing or changed: written
    again)."""
    try:
        filesystem, root = pyarrow.fs.FileSystem.from_uri(output)
    except (pa.ArrowInvalid, OSError) as error:
        raise UserError(f"cannot use {output} as an output location: {error}") from None
    root = root.rstrip("/")
    specs = (TensorSpec.of(splits["train"][0]), TensorSpec.of(splits["train"][1]))
    source = _source_digest(dataset, splits)
    try:
        existing = _existing_manifest(filesystem, root)
    except (OSError, ValueError) as error:
        raise UserError(f"cannot read {output}/{MANIFEST}: {error}") from None
    repaired: list[str] = []
    if existing is not None:
        if existing.get("source_sha256") == source:
            try:
                repaired = changed_files(filesystem, root, existing)
            except (KeyError, TypeError):
                repaired = [f"{MANIFEST} (incomplete)"]
            except OSError as error:
                raise UserError(f"cannot read {output}: {error}") from None
            if not repaired:
                return existing, "unchanged"
            # The same data: write it again. Until the new manifest is written last, the set
            # is incomplete, as a first write would be.
            filesystem.delete_file(f"{root}/{MANIFEST}")
        else:
            raise UserError(
                f"{output} already holds a different data set ({existing.get('dataset')}, "
                f"{existing.get('source_sha256', '?')[:12]}); choose another output or delete it"
            )
    manifest = {
        "format": FORMAT,
        "task": task,
        "dataset": dataset,
        "input": specs[0].to_dict(),
        "target": specs[1].to_dict(),
        "source_sha256": source,
        "splits": {},
    }
    try:
        for split_name in ("train", "val"):
            inputs, targets = splits[split_name]
            folder = f"{root}/{split_name}"
            filesystem.create_dir(folder, recursive=True)
            parts = min(num_files[split_name], max(1, len(targets)))
            files = []
            for part, indices in enumerate(np.array_split(np.arange(len(targets)), parts)):
                path = f"{folder}/part-{part:05d}.parquet"
                first = int(indices[0]) if len(indices) else 0
                chosen = torch.from_numpy(indices)
                pq.write_table(_table(inputs[chosen], targets[chosen], first, specs), path,
                               filesystem=filesystem)
                files.append({
                    "path": f"{split_name}/part-{part:05d}.parquet",
                    "rows": len(indices),
                    "sha256": _sha256(filesystem, path),
                })
            manifest["splits"][split_name] = {"rows": len(targets), "files": files}
        # Last: the manifest is what marks the folder complete.
        with filesystem.open_output_stream(f"{root}/{MANIFEST}") as stream:
            stream.write(json.dumps(manifest, indent=1).encode())
    except OSError as error:
        raise UserError(f"cannot write to {output}: {error}") from None
    if repaired:
        manifest["repaired"] = repaired
    return manifest, "repaired" if repaired else "written"


def split_tensors(dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole map-style data set as (inputs, targets) tensors."""
    from app.batching import rows

    return rows(dataset, torch.arange(len(dataset)))


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="python -m app.prepare",
        description="Convert a task's data set into sharded Parquet files with a manifest "
        "(dtypes, shapes, counts, checksums), locally or on S3, for training with "
        "'app.train --parquet' (Ray Data) and for 'app.predict'.",
        formatter_class=HelpFormatter,
    )
    flags.add_task_arguments(
        parser, dataset_help="one of the task's data sets (mnist-convnet: mnist, fashion-mnist, "
        "digits) [default: the task's own]",
    )
    parser.add_argument("--output", required=True,
                        help="folder or s3://bucket/prefix to write the Parquet files to")
    parser.add_argument("--train-files", type=int, default=8,
                        help="Parquet files for the training split (they shard across readers)")
    parser.add_argument("--val-files", type=int, default=2,
                        help="Parquet files for the validation split")
    return parser


def _run(args: argparse.Namespace, console: Console) -> int:
    if args.train_files < 1 or args.val_files < 1:
        raise UserError("--train-files and --val-files must be >= 1")
    from app.task import build_datasets

    output = storage_uri(args.output, "--output")
    _, task = flags.resolve_task(args)
    dataset = args.dataset or ""
    train, val = build_datasets(task, dataset, args.data_dir)
    splits = {"train": split_tensors(train), "val": split_tensors(val)}
    manifest, done = prepare(task.name, dataset or task.default_dataset, splits, output,
                             {"train": args.train_files, "val": args.val_files})
    splits = manifest["splits"]
    summary = (
        f"{manifest['dataset']}: {splits['train']['rows']:,} train / {splits['val']['rows']:,} "
        f"validation samples in {len(splits['train']['files'])} + "
        f"{len(splits['val']['files'])} Parquet files"
    )
    if done == "unchanged":
        console.line(f"{output} already holds this data set ({summary}), every file intact; "
                     "nothing to do.")
        return 0
    if done == "repaired":
        console.line(f"{output} held this data set with {len(manifest['repaired'])} file(s) "
                     f"missing or changed ({', '.join(manifest['repaired'][:3])}): rewrote it.")
    console.line(f"Wrote {summary} to {output} (manifest: {output}/{MANIFEST}).")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(build_parser(), _run, argv,
                    interrupted="no manifest was written, so the output is not taken as complete")


if __name__ == "__main__":
    sys.exit(main())
