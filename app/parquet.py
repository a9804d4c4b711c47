"""Training from a Parquet data set written by ``app.prepare``, through Ray Data.

On the driver: ``open_manifest`` checks the data set (manifest, files, schema) before any worker
starts, and ``ray_datasets`` builds the Ray Data sets handed to ``TorchTrainer(datasets=...)``,
which splits them across the workers at every (re)start. In each worker: ``ShardData`` turns the
worker's shard into the training loop's batches with ``iter_torch_batches``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.fs
import pyarrow.parquet as pq
import torch

from app.batching import TrainBatch, rank_seed, val_range
from app.config import DataConfig, UserError
from app.storage import filesystem as storage_filesystem, join
from app.prepare import FORMAT, MANIFEST, TensorSpec, changed_files, is_inside, schema

SHUFFLE_BUFFER_ROWS = 2_000
"""Rows each worker shuffles locally on top of the per-epoch file/block order."""


@dataclass(frozen=True)
class Manifest:
    uri: str
    task: str
    """Name of the task whose data set this is."""
    dataset: str
    input: TensorSpec
    target: TensorSpec
    num_train: int
    num_val: int
    train_files: tuple[str, ...]
    val_files: tuple[str, ...]
    total_bytes: int

    def to_dict(self) -> dict:
        """The primitives the workers need (they do not re-read the manifest)."""
        return {"dataset": self.dataset, "input": self.input.to_dict(),
                "target": self.target.to_dict(), "num_train": self.num_train,
                "num_val": self.num_val}


def _storage_error(uri: str, error: BaseException) -> UserError:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if "NO_SUCH_BUCKET" in text or "NoSuchBucket" in text:
        hint = "the bucket does not exist"
    elif "ACCESS_DENIED" in text or "AccessDenied" in text or re.search(r"\b403\b", text):
        # The status as a word: the text may name an endpoint whose port holds "403".
        hint = "access denied: check the AWS credentials in the environment"
    elif "NETWORK_CONNECTION" in text or "connect" in text.lower():
        hint = "the storage endpoint is unreachable (check AWS_ENDPOINT_URL and the network)"
    else:
        hint = text
    return UserError(f"cannot read {uri}: {hint}")


def _filesystem(uri: str) -> tuple[pyarrow.fs.FileSystem, str]:
    return storage_filesystem(uri, "data")


def _uri(uri: str, relative: str) -> str:
    return join(uri, relative)


def open_manifest(uri: str, verify: bool = False) -> Manifest:
    """The data set at ``uri``, checked: one line naming the problem otherwise.

    Always: the manifest, that its paths stay inside the set, that every file is there with our
    schema (the columns its dtypes and shapes make, from each file's footer). With ``verify``, also
    every file's SHA-256 against the manifest (reads all the data).
    """
    filesystem, root = _filesystem(uri)
    manifest_path = f"{root}/{MANIFEST}"
    try:
        info = filesystem.get_file_info(manifest_path)
        if info.type != pyarrow.fs.FileType.File:
            bucket = root.split("/", 1)[0]
            if uri.startswith("s3://") and \
                    filesystem.get_file_info(bucket).type == pyarrow.fs.FileType.NotFound:
                raise UserError(f"cannot read {uri}: the bucket {bucket!r} does not exist")
            listing = filesystem.get_file_info(pyarrow.fs.FileSelector(root, recursive=True,
                                                                       allow_not_found=True))
            if any(entry.path.endswith(".parquet") for entry in listing):
                raise UserError(
                    f"{uri} has Parquet files but no {MANIFEST}: it was not written by "
                    f"app.prepare, or that run did not finish; rerun "
                    f"'python -m app.prepare --output {uri}'"
                )
            raise UserError(
                f"no Parquet data set at {uri}: write one with "
                f"'python -m app.prepare --output {uri}'"
            )
        with filesystem.open_input_stream(manifest_path) as stream:
            values = json.loads(stream.read())
    except OSError as error:
        raise _storage_error(uri, error) from None
    except json.JSONDecodeError as error:
        raise UserError(f"{_uri(uri, MANIFEST)} is not valid JSON: {error}") from None
    if not isinstance(values, dict) or values.get("format") != FORMAT:
        found = values.get("format") if isinstance(values, dict) else None
        raise UserError(
            f"{_uri(uri, MANIFEST)} is not an app.prepare manifest (format {found!r}, "
            f"expected {FORMAT!r})"
        )
    try:
        splits = {name: values["splits"][name] for name in ("train", "val")}
        files = {name: [entry["path"] for entry in split["files"]]
                 for name, split in splits.items()}
        manifest = Manifest(
            uri=uri, task=str(values["task"]), dataset=str(values["dataset"]),
            input=_spec(values["input"]), target=_spec(values["target"]),
            num_train=int(splits["train"]["rows"]), num_val=int(splits["val"]["rows"]),
            train_files=tuple(_uri(uri, path) for path in files["train"]),
            val_files=tuple(_uri(uri, path) for path in files["val"]),
            total_bytes=0,
        )
    except (KeyError, TypeError, ValueError) as error:
        raise UserError(f"{_uri(uri, MANIFEST)} is incomplete ({error!r} missing or invalid)") \
            from None
    outside = [path for split in files.values() for path in split if not is_inside(path)]
    if outside:
        raise UserError(
            f"{_uri(uri, MANIFEST)} lists a file outside the data set's folder ({outside[0]!r}); "
            "refusing to read it"
        )
    manifest = _check_files(manifest, filesystem, root, files)
    if verify:
        try:
            changed = changed_files(filesystem, root, values)
        except OSError as error:
            raise _storage_error(uri, error) from None
        if changed:
            raise UserError(
                f"{uri}: {len(changed)} file(s) differ from the manifest, e.g. {changed[0]}; "
                f"rerun 'python -m app.prepare --output {uri}' with the same data to repair it"
            )
    return manifest


def _spec(values: dict) -> TensorSpec:
    from app.prepare import DTYPES

    spec = TensorSpec(str(values["dtype"]), tuple(int(size) for size in values["shape"]))
    if spec.dtype not in DTYPES or any(size < 0 for size in spec.shape):
        raise ValueError(f"tensor {values}")
    return spec


def _check_files(manifest: Manifest, filesystem, root: str, files: dict[str, list[str]]):
    """Every listed file is there, with the columns the manifest's dtypes and shapes make
    (footers only: no data is read)."""
    expected = schema(manifest.input, manifest.target)
    paths = [f"{root}/{path}" for split in files.values() for path in split]
    try:
        infos = filesystem.get_file_info(paths)
        missing = [info.path for info in infos if info.type != pyarrow.fs.FileType.File]
        if missing:
            raise UserError(
                f"{manifest.uri} is incomplete: {len(missing)} file(s) its manifest lists are "
                f"missing, e.g. {missing[0]}; rerun 'python -m app.prepare --output "
                f"{manifest.uri}' with the same data to repair it"
            )
        for path in paths:
            try:
                with filesystem.open_input_file(path) as handle:
                    metadata = pq.read_metadata(handle)
            except pa.ArrowInvalid as error:
                raise UserError(f"{path} is not a readable Parquet file: {error}") from None
            found = metadata.schema.to_arrow_schema()
            if not found.remove_metadata().equals(expected):
                raise UserError(
                    f"{path} has columns ({', '.join(f'{f.name}: {f.type}' for f in found)}); "
                    f"expected ({', '.join(f'{f.name}: {f.type}' for f in expected)}) as "
                    "app.prepare writes them for its manifest"
                )
    except OSError as error:
        raise _storage_error(manifest.uri, error) from None
    return dataclasses.replace(manifest, total_bytes=sum(info.size for info in infos))


def ray_datasets(manifest: Manifest, config: DataConfig, verbose: bool) -> dict:
    """The splits as Ray Data sets: read once into Ray's object store (it spills to disk when
    full), or, with ``config.stream``, re-read from storage every epoch in a new file order."""
    import ray.data

    context = ray.data.DataContext.get_current()
    # One line per epoch from the console; Ray Data's bars and logs only with --verbose.
    context.enable_progress_bars = verbose
    context.print_on_execution_start = verbose
    if not verbose:
        logging.getLogger("ray.data").setLevel(logging.ERROR)
    datasets = {}
    for name, files in (("train", manifest.train_files), ("val", manifest.val_files)):
        shuffle = ray.data.FileShuffleConfig(seed=None) if config.stream and name == "train" \
            else None
        dataset = ray.data.read_parquet(list(files), shuffle=shuffle, file_extensions=None)
        if not config.stream:
            # Blocks of about a file each, so the order can change every epoch below.
            dataset = dataset.repartition(len(files)).materialize()
            if name == "train":
                dataset = dataset.randomize_block_order()
        datasets[name] = dataset
    return datasets


def data_config():
    """How Ray Train hands the sets to the workers: the training set split into equal shards at
    every (re)start; the validation set whole to every worker (``ShardData.val_batches``)."""
    import ray.train

    return ray.train.DataConfig(datasets_to_split=["train"])


def to_tensors(table: pa.Table, input_spec: TensorSpec, target_spec: TensorSpec
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs, targets, int64 ids) of a table of app.prepare's columns."""
    return (
        input_spec.decode(table.column("input")),
        target_spec.decode(table.column("target")),
        torch.from_numpy(table.column("id").to_numpy().astype(np.int64)),
    )


def _collate_fn(input_spec: TensorSpec, target_spec: TensorSpec):
    from ray.data.collate_fn import ArrowBatchCollateFn

    class ToTensors(ArrowBatchCollateFn):
        def __call__(self, table: pa.Table):
            return to_tensors(table, input_spec, target_spec)

    return ToTensors()


class ShardData:
    """A worker's Ray Data shards as the loop's ``TrainData``.

    Ray Train splits the training set (only) into equal shards (``streaming_split(equal=True)``, up to
    world_size - 1 rows dropped per epoch), so every rank yields the same number of batches.
    Each rank's batch is ``global_batch_size // world_size`` rows; the loss is averaged over the
    batch of all ranks.

    Cached data (the default): at the start of an epoch the rank pulls its whole shard as uint8
    (the shards change every epoch with the block order) and trains on a full permutation of it,
    so iterating costs nothing during the steps. Streamed data (``stream``): batches come straight
    from ``iter_torch_batches`` with a bounded local shuffle buffer, for shards too large to
    hold. Mid-epoch resume skips the batches already trained: the step count is exact, the
    samples of the rest of that epoch are a fresh draw.
    """

    def __init__(self, train_shard, val_shard, stats: dict, global_batch_size: int,
                 world_size: int, rank: int, seed: int, stream: bool = False):
        self.train_shard = train_shard
        self.val_shard = val_shard
        self.num_train = stats["num_train"]
        self.num_val = stats["num_val"]
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.stream = stream
        self.batch_size = global_batch_size // world_size
        self.collate_fn = _collate_fn(_spec(stats["input"]), _spec(stats["target"]))
        self.seen_ids: list[torch.Tensor] | None = None
        """When a list, the ids of every training sample this rank yields are appended."""

    def _epoch_seed(self, epoch: int) -> int:
        return rank_seed(self.seed, epoch, self.rank)

    def _streamed(self, epoch: int) -> Iterator[tuple[torch.Tensor, ...]]:
        return self.train_shard.iter_torch_batches(
            batch_size=self.batch_size, collate_fn=self.collate_fn,
            local_shuffle_buffer_size=SHUFFLE_BUFFER_ROWS,
            local_shuffle_seed=self._epoch_seed(epoch), prefetch_batches=4,
        )

    def _cached(self, epoch: int) -> Iterator[tuple[torch.Tensor, ...]]:
        parts = list(self.train_shard.iter_torch_batches(batch_size=4_096,
                                                         collate_fn=self.collate_fn))
        inputs, targets, ids = (torch.cat(column) for column in zip(*parts, strict=True))
        order = torch.randperm(len(targets),
                               generator=torch.Generator().manual_seed(self._epoch_seed(epoch)))
        for start in range(0, len(order), self.batch_size):
            chosen = order[start:start + self.batch_size]
            yield inputs[chosen], targets[chosen], ids[chosen]

    def train_batches(self, epoch: int, start_step: int) -> Iterator[TrainBatch]:
        batches = self._streamed(epoch) if self.stream else self._cached(epoch)
        for step, (inputs, targets, ids) in enumerate(batches):
            if step < start_step:
                continue
            if self.seen_ids is not None:
                self.seen_ids.append(ids)
            yield TrainBatch(inputs, targets, len(targets) * self.world_size)

    def val_batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # The validation split is not sharded (every rank reads it whole: it is small, and an
        # equal split would drop rows); each rank scores a contiguous part, as in memory.
        start, end = val_range(self.num_val, self.rank, self.world_size)
        position = 0
        for inputs, targets, _ in self.val_shard.iter_torch_batches(
            batch_size=batch_size, collate_fn=self.collate_fn
        ):
            first, last = max(start - position, 0), min(end - position, len(targets))
            position += len(targets)
            if first < last:
                yield inputs[first:last], targets[first:last]
            if position >= end:
                break


def read_split(manifest: Manifest, split: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs, targets, ids) of a whole split, read here with pyarrow (no Ray), in id order."""
    files = manifest.train_files if split == "train" else manifest.val_files
    try:
        filesystem, _ = _filesystem(manifest.uri)
        tables = []
        for uri in files:
            _, path = pyarrow.fs.FileSystem.from_uri(uri) if "://" in uri else (None, uri)
            tables.append(pq.read_table(path, filesystem=filesystem))
    except OSError as error:
        raise _storage_error(manifest.uri, error) from None
    inputs, targets, ids = to_tensors(pa.concat_tables(tables), manifest.input, manifest.target)
    order = torch.argsort(ids)
    return inputs[order], targets[order], ids[order]
