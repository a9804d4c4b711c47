"""Which samples each rank trains on: global batches, split across however many ranks there are.

``TrainData`` is what the training loop iterates; ``InMemoryData`` serves it from tensors held by
every worker (the Parquet path, ``app.parquet``, serves it from a Ray Data shard).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.utils.data import Dataset, TensorDataset, default_collate
from torch.utils.data.distributed import DistributedSampler

from app.config import UserError


def rank_seed(seed: int, epoch: int, rank: int) -> int:
    """The seed of a rank's random draws in an epoch (dropout, augmentation, a Parquet shard's
    order): distinct per rank, reproducible per (seed, epoch, rank), so an epoch replayed
    after a restart draws what it would have drawn undisturbed."""
    return seed * 1_000_003 + epoch * 1_009 + rank


def val_range(num_val: int, rank: int, world_size: int) -> tuple[int, int]:
    """The contiguous part of the validation split a rank scores; sizes differ by at most one
    and the parts of all ranks cover the split exactly."""
    return num_val * rank // world_size, num_val * (rank + 1) // world_size


def rows(dataset: Dataset, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of ``indices`` as two batched tensors: one indexing per tensor for a
    TensorDataset, else the items collated as a DataLoader would."""
    if isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2:
        inputs, targets = dataset.tensors
        if inputs.is_cuda:  # resident on a GPU: an asynchronous copy of the indices, no sync
            indices = indices.pin_memory().to(inputs.device, non_blocking=True)
        return inputs[indices], targets[indices]
    inputs, targets = default_collate([dataset[int(index)] for index in indices])
    return inputs, targets


def check_batch_fits(global_batch_size: int, num_train: int, dataset: str) -> None:
    """A global batch larger than the training set would be one short step per epoch."""
    if global_batch_size > num_train:
        raise UserError(
            f"--global-batch-size {global_batch_size:,} is larger than the {num_train:,} "
            f"training samples of {dataset}: use at most {num_train:,}"
        )


@dataclass(frozen=True)
class TrainBatch:
    inputs: torch.Tensor
    """This rank's share of a global batch (N x the task's input shape)."""
    targets: torch.Tensor
    """N x the task's target shape."""
    global_size: int
    """Samples in the whole global batch, over all ranks: the loss is averaged over these."""


class TrainData(Protocol):
    """One rank's view of a data set, re-created whenever the worker group (re)starts."""

    num_train: int
    """Training samples in the whole data set (all ranks)."""
    num_val: int

    def train_batches(self, epoch: int, start_step: int) -> Iterator[TrainBatch]:
        """This rank's batches of ``epoch``, skipping its first ``start_step`` (a resume).
        Every rank yields the same number of batches: DDP waits on each step."""
        ...

    def val_batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's part of the validation split, as (inputs, targets); the parts of all
        ranks together cover the split (``val_range``)."""
        ...


@dataclass(frozen=True)
class Batch:
    indices: torch.Tensor
    """This rank's sample indices (may differ in length from other ranks' by one)."""
    global_size: int
    """Samples in the whole global batch, over all ranks: the loss is averaged over these."""


class GlobalBatchSampler(DistributedSampler):
    """Yields this rank's share of each global batch.

    An epoch is one permutation of the data set, seeded by ``seed + epoch`` as in PyTorch's
    DistributedSampler (``set_epoch`` must be called every epoch), cut into global batches of
    ``global_batch_size``. Each global batch is split across the ranks into contiguous slices
    whose sizes differ by at most one. Hence:

    - the sequence of global batches is the same at every world size, so a run that shrinks or
      grows trains on the same batches an undisturbed run would (with a loss summed per rank and
      divided by ``global_size``, the averaged gradient is the same too);
    - every rank takes the same number of steps, so DDP never waits on a rank that ran out;
    - no sample is repeated to pad the shards (DistributedSampler pads by duplicating samples).

    A final global batch smaller than the world size is dropped, since some rank would get
    nothing; that is at most ``world_size - 1`` samples an epoch.
    """

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        num_replicas: int,
        rank: int,
        seed: int = 0,
        shuffle: bool = True,
    ):
        super().__init__(
            range(num_samples), num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed
        )
        if global_batch_size < num_replicas:
            raise ValueError(
                f"global batch size {global_batch_size} is smaller than the world size "
                f"{num_replicas}: every worker needs at least one sample per step"
            )
        self.global_batch_size = global_batch_size
        self.start_step = 0

    def set_start_step(self, step: int) -> None:
        """Skip the first ``step`` batches of the current epoch (resuming mid-epoch)."""
        self.start_step = step

    def _global_batch_bounds(self) -> list[tuple[int, int]]:
        bounds = []
        for start in range(0, len(self.dataset), self.global_batch_size):
            end = min(start + self.global_batch_size, len(self.dataset))
            if end - start >= self.num_replicas:
                bounds.append((start, end))
        return bounds

    def __len__(self) -> int:
        return len(self._global_batch_bounds()) - self.start_step

    def __iter__(self) -> Iterator[Batch]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(len(self.dataset), generator=generator)
        else:
            order = torch.arange(len(self.dataset))
        for start, end in self._global_batch_bounds()[self.start_step :]:
            size = end - start
            # Near-equal contiguous slices: the first (size % world) ranks get one extra sample.
            base, extra = divmod(size, self.num_replicas)
            offset = start + self.rank * base + min(self.rank, extra)
            length = base + (1 if self.rank < extra else 0)
            yield Batch(indices=order[offset : offset + length], global_size=size)


def resident(dataset: Dataset, device: torch.device | None) -> Dataset:
    """A TensorDataset with its tensors moved to an accelerator ``device`` once, so a batch is
    an index lookup there with no copy per step (MNIST's 60,000 images take 188 MB, CIFAR-10's
    50,000 take 614 MB). Other sets, and any set for the CPU, stay as they are."""
    if device is None or device.type == "cpu" or not isinstance(dataset, TensorDataset):
        return dataset
    return TensorDataset(*(tensor.to(device) for tensor in dataset.tensors))


class InMemoryData:
    """Both splits in this worker's memory (an accelerator's, for tensor data sets); batches are
    index lookups."""

    def __init__(self, train: Dataset, val: Dataset, global_batch_size: int, world_size: int,
                 rank: int, seed: int, device: torch.device | None = None):
        train, val = resident(train, device), resident(val, device)
        # Batches collated on the host for an accelerator: pinned, so the copy is asynchronous.
        self._pin = device is not None and device.type == "cuda" and \
            not isinstance(train, TensorDataset)
        self.train = train
        self.val = val
        self.num_train = len(train)
        self.num_val = len(val)
        self.rank = rank
        self.world_size = world_size
        self.sampler = GlobalBatchSampler(
            num_samples=len(train), global_batch_size=global_batch_size,
            num_replicas=world_size, rank=rank, seed=seed,
        )

    def train_batches(self, epoch: int, start_step: int) -> Iterator[TrainBatch]:
        self.sampler.set_epoch(epoch)
        self.sampler.set_start_step(start_step)
        for batch in self.sampler:
            inputs, targets = rows(self.train, batch.indices)
            if self._pin:
                inputs, targets = inputs.pin_memory(), targets.pin_memory()
            yield TrainBatch(inputs, targets, batch.global_size)

    def val_batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        start, end = val_range(self.num_val, self.rank, self.world_size)
        for offset in range(start, end, batch_size):
            yield rows(self.val, torch.arange(offset, min(offset + batch_size, end)))
