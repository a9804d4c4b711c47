"""The floor of what Ray Train costs: the smallest hand-written Ray Train V2 loop on the same
model and data as the app's default task, for bench/throughput.py to compare the app against.

In-memory tensors (each worker reads the data dir and takes its rank's share of every global
batch), DDP over gloo, the book's ConvNet with Adadelta lr 0.5, one thread per worker, the app's
compute recipe (bf16 autocast where the CPU has it natively, channels-last), no validation, no
checkpoints, no progress: only what every Ray Train user writes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import ray.train
import torch
import torch.nn.functional as F
from ray.train.torch import TorchTrainer


def _loop(config: dict) -> None:
    from app import data
    from app.model import ConvNet

    torch.set_num_threads(1)
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    train, _ = data.load("mnist", config["data_dir"], download_missing=False)
    images, labels = train.tensors
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(ConvNet().to(memory_format=torch.channels_last))
    optimizer = torch.optim.Adadelta(model.parameters(), lr=0.5)
    bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    batch, share = config["global_batch_size"], config["global_batch_size"] // world
    rates = []
    for epoch in range(config["epochs"]):
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(epoch))
        started, samples = time.perf_counter(), 0
        for start in range(0, len(order) - batch + 1, batch):
            rows = order[start + rank * share:start + (rank + 1) * share]
            inputs = images[rows].contiguous(memory_format=torch.channels_last)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                output = model(inputs)
            loss = F.cross_entropy(output.float(), labels[rows])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            samples += batch
        rates.append(samples / (time.perf_counter() - started))
    if rank == 0:
        Path(config["output"]).write_text(json.dumps(rates))


def rates(data_dir: str, storage: str, workers: int, global_batch_size: int,
          epochs: int) -> list[float]:
    """Samples/s of each epoch on the connected Ray cluster."""
    output = Path(storage) / f"minimal-{workers}.json"
    TorchTrainer(
        _loop,
        train_loop_config={"data_dir": data_dir, "global_batch_size": global_batch_size,
                           "epochs": epochs, "output": str(output)},
        scaling_config=ray.train.ScalingConfig(num_workers=workers),
        run_config=ray.train.RunConfig(storage_path=storage, name=f"minimal-{workers}"),
    ).fit()
    return json.loads(output.read_text())
