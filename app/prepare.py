"""Command line: ``python -m app.prepare`` — a data set as sharded Parquet plus a manifest.

Writes ``<output>/train/part-NNNNN.parquet`` and ``<output>/val/part-NNNNN.parquet`` (columns
``id``: int64 index within the split, ``image``: 784 raw uint8 pixels as fixed-size binary,
``label``: uint8) and, last, ``<output>/manifest.json`` (data set, row counts, per-file SHA-256,
pixel statistics). The manifest marks the output complete: a run cut short leaves part files but
no manifest, and readers must not take such a folder as a data set. Local paths and ``s3://``
URIs both go through pyarrow's filesystem layer.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import posixpath
import sys

import numpy as np
import pyarrow as pa
import pyarrow.fs
import pyarrow.parquet as pq

from app.cli import HelpFormatter, Parser, run_main
from app.storage import storage_uri
from app.config import DATASETS, DataConfig, UserError
from app.console import Console

FORMAT = "app-digits-parquet/1"
MANIFEST = "manifest.json"
_IMAGE_BYTES = 28 * 28
NUM_CLASSES = 10
"""Labels are class indices 0-9: the ConvNet's outputs."""
SCHEMA = pa.schema([
    ("id", pa.int64()),
    ("image", pa.binary(_IMAGE_BYTES)),
    ("label", pa.uint8()),
])
"""The columns of every part file; readers check it before training."""


def _source_digest(raw) -> str:
    digest = hashlib.sha256(raw.name.encode())
    for split in (raw.train, raw.val):
        digest.update(np.ascontiguousarray(split.images).tobytes())
        digest.update(np.ascontiguousarray(split.labels).tobytes())
    return digest.hexdigest()


def _table(images: np.ndarray, labels: np.ndarray, first_id: int) -> pa.Table:
    flat = np.ascontiguousarray(images, dtype=np.uint8).reshape(len(images), _IMAGE_BYTES)
    image_column = pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(_IMAGE_BYTES), len(flat), [None, pa.py_buffer(flat.tobytes())]
    )
    return pa.table({
        "id": pa.array(np.arange(first_id, first_id + len(flat), dtype=np.int64)),
        "image": image_column,
        "label": pa.array(labels.astype(np.uint8)),
    }, schema=SCHEMA)


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


def prepare(raw, output: str, num_files: dict[str, int]) -> tuple[dict, str]:
    """Write ``raw`` under ``output``; returns the manifest and what was done: "written",
    "unchanged" (the same data set is there, every file intact) or "repaired" (the same data
    set with files missing or changed: written again)."""
    try:
        filesystem, root = pyarrow.fs.FileSystem.from_uri(output)
    except (pa.ArrowInvalid, OSError) as error:
        raise UserError(f"cannot use {output} as an output location: {error}") from None
    root = root.rstrip("/")
    source = _source_digest(raw)
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
        "dataset": raw.name,
        "image_shape": [28, 28],
        "mean": raw.mean,
        "std": raw.std,
        "source_sha256": source,
        "splits": {},
    }
    try:
        for split_name, split in (("train", raw.train), ("val", raw.val)):
            folder = f"{root}/{split_name}"
            filesystem.create_dir(folder, recursive=True)
            parts = min(num_files[split_name], max(1, len(split.labels)))
            files = []
            for part, indices in enumerate(np.array_split(np.arange(len(split.labels)), parts)):
                path = f"{folder}/part-{part:05d}.parquet"
                first = int(indices[0]) if len(indices) else 0
                pq.write_table(
                    _table(split.images[indices], split.labels[indices], first),
                    path, filesystem=filesystem,
                )
                files.append({
                    "path": f"{split_name}/part-{part:05d}.parquet",
                    "rows": len(indices),
                    "sha256": _sha256(filesystem, path),
                })
            manifest["splits"][split_name] = {"rows": len(split.labels), "files": files}
        # Last: the manifest is what marks the folder complete.
        with filesystem.open_output_stream(f"{root}/{MANIFEST}") as stream:
            stream.write(json.dumps(manifest, indent=1).encode())
    except OSError as error:
        raise UserError(f"cannot write to {output}: {error}") from None
    if repaired:
        manifest["repaired"] = repaired
    return manifest, "repaired" if repaired else "written"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="python -m app.prepare",
        description="Convert a data set into sharded Parquet files with a manifest (counts, "
        "checksums, pixel statistics), locally or on S3, for reading with Ray Data.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--dataset", choices=DATASETS, default="mnist", help="data set")
    parser.add_argument("--data-dir", default="data",
                        help="folder with the data set in torchvision's layout")
    parser.add_argument("--output", required=True,
                        help="folder or s3://bucket/prefix to write the Parquet files to")
    parser.add_argument("--train-files", type=int, default=8,
                        help="Parquet files for the training split (they shard across readers)")
    parser.add_argument("--val-files", type=int, default=2,
                        help="Parquet files for the validation split")
    return parser


def _run(args: argparse.Namespace, console: Console) -> int:
    from app import data

    if args.train_files < 1 or args.val_files < 1:
        raise UserError("--train-files and --val-files must be >= 1")
    raw = data.load_raw(DataConfig(dataset=args.dataset, data_dir=args.data_dir))
    output = storage_uri(args.output, "--output")
    manifest, done = prepare(raw, output, {"train": args.train_files, "val": args.val_files})
    splits = manifest["splits"]
    summary = (
        f"{manifest['dataset']}: {splits['train']['rows']:,} train / {splits['val']['rows']:,} "
        f"validation images in {len(splits['train']['files'])} + {len(splits['val']['files'])} "
        f"Parquet files"
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
