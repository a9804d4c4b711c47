import pytest
import torch

from app.batching import GlobalBatchSampler
from torch.utils.data import TensorDataset


def _epoch(num_samples, global_batch_size, world_size, epoch=0, seed=0):
    """Per rank, the list of batches of one epoch."""
    per_rank = []
    for rank in range(world_size):
        sampler = GlobalBatchSampler(num_samples, global_batch_size, world_size, rank, seed=seed)
        sampler.set_epoch(epoch)
        per_rank.append(list(sampler))
    return per_rank


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_global_batches_are_the_same_at_every_world_size(world_size):
    reference = [b.indices.tolist() for b in _epoch(37, 10, 1)[0]]
    per_rank = _epoch(37, 10, world_size)
    assert len({len(batches) for batches in per_rank}) == 1, "ranks must take equal steps"
    for step, expected in enumerate(reference):
        combined = [i for batches in per_rank for i in batches[step].indices.tolist()]
        assert combined == expected
        sizes = [len(batches[step].indices) for batches in per_rank]
        assert max(sizes) - min(sizes) <= 1
        assert {batches[step].global_size for batches in per_rank} == {len(expected)}


def test_each_sample_once_per_epoch_and_reshuffled_by_set_epoch():
    first = [i for b in _epoch(40, 8, 2, epoch=0)[0] + _epoch(40, 8, 2, epoch=0)[1]
             for i in b.indices.tolist()]
    assert sorted(first) == list(range(40))
    again = [b.indices.tolist() for b in _epoch(40, 8, 2, epoch=0)[0]]
    other = [b.indices.tolist() for b in _epoch(40, 8, 2, epoch=1)[0]]
    assert again == [b.indices.tolist() for b in _epoch(40, 8, 2, epoch=0)[0]]
    assert again != other


def test_tail_smaller_than_world_size_is_dropped():
    per_rank = _epoch(41, 8, 2)  # 5 full batches, then 1 sample: cannot be split over 2 ranks
    assert all(len(batches) == 5 for batches in per_rank)
    per_rank = _epoch(42, 8, 2)  # tail of 2 samples: one each
    assert all(len(batches) == 6 for batches in per_rank)


def test_start_step_skips_batches_already_trained():
    sampler = GlobalBatchSampler(50, 10, 2, 1)
    sampler.set_epoch(3)
    full = [b.indices.tolist() for b in sampler]
    sampler.set_start_step(2)
    assert len(sampler) == 3
    assert [b.indices.tolist() for b in sampler] == full[2:]


def test_global_batch_must_cover_every_rank():
    with pytest.raises(ValueError, match="smaller than the world size"):
        GlobalBatchSampler(100, 2, 4, 0)
    assert isinstance(GlobalBatchSampler(10, 4, 2, 0), torch.utils.data.DistributedSampler)


def test_tensor_data_sets_are_made_resident_on_an_accelerator_once():
    from app.batching import InMemoryData, resident

    images, labels = torch.randn(12, 1, 4, 4), torch.arange(12)
    dataset = TensorDataset(images, labels)
    assert resident(dataset, None) is dataset
    assert resident(dataset, torch.device("cpu")) is dataset
    # The meta device stands in for a GPU here: the tensors move, batches are looked up there.
    data = InMemoryData(dataset, dataset, 4, world_size=2, rank=1, seed=0,
                        device=torch.device("meta"))
    assert all(tensor.is_meta for tensor in data.train.tensors + data.val.tensors)
    batch = next(data.train_batches(epoch=0, start_step=0))
    assert batch.inputs.is_meta and batch.inputs.shape == (2, 1, 4, 4)
    assert batch.targets.is_meta and batch.global_size == 4
    # A set that is not tensors stays on the host.
    items = [(images[i], labels[i]) for i in range(12)]
    assert resident(items, torch.device("meta")) is items
