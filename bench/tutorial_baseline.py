"""The classic "distributed training with PyTorch" MNIST script, as the tutorials write it:
torch.multiprocessing.spawn, one process per rank, MASTER_ADDR/MASTER_PORT set by hand, a
torchvision MNIST data set with per-sample PIL transforms (ToTensor + Normalize) through a
DataLoader with a DistributedSampler, DDP over gloo, the book's ConvNet and Adadelta (lr 0.5), and
torch's default thread count in every process. Kept faithful on purpose: it is the baseline bench/throughput.py measures against.

The one change: the port is picked free instead of hard-coded, so the benchmark cannot collide with
something else listening on 12355.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

from app.model import ConvNet  # the book's network, the app's default task


def _worker(rank, world_size, port, data_dir, batch_size, epochs, results):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(1)
    transform = transforms.Compose(
        [transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))]
    )
    dataset = datasets.MNIST(data_dir, train=True, download=False, transform=transform)
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    model = DDP(ConvNet())
    optimizer = torch.optim.Adadelta(model.parameters(), lr=0.5)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        model.train()
        started, samples = time.perf_counter(), 0
        for data, target in loader:
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            samples += len(data)
        elapsed = time.perf_counter() - started
        if rank == 0:
            # Every rank trains the same number of samples; the global rate is world_size times.
            results.put((epoch, samples * world_size / elapsed))
    dist.destroy_process_group()


def run(world_size: int, data_dir: str, global_batch_size: int, epochs: int) -> list[float]:
    """Samples/s of each epoch, all processes together."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.spawn(
        _worker,
        args=(world_size, port, data_dir, global_batch_size // world_size, epochs, results),
        nprocs=world_size,
    )
    rates = []
    while not results.empty():
        rates.append(results.get()[1])
    return rates
