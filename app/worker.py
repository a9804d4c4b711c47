"""The per-worker entry point that Ray Train runs on every rank.

Everything that depends on the current world size (the per-worker batch, the sampler's shards)
is derived here, every time the worker group (re)starts; the checkpoint holds none of it.
"""

from __future__ import annotations

import tempfile
import time
from typing import Any

import ray
import ray.train
import ray.train.torch
import torch

from app import checkpoint, data
from app.config import TrainConfig
from app.loop import Trainer, parameter_checksum
from app.model import ConvNet

PROGRESS_KEY = "progress_queue"
"""Optional key of the worker config: a ray.util.queue.Queue that rank 0 sends progress to."""


def _owned_cpus() -> int:
    return max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)))


def _restore() -> checkpoint.TrainingState | None:
    latest = ray.train.get_checkpoint()
    if latest is None:
        return None
    with latest.as_directory() as directory:
        return checkpoint.load(directory)


def train_loop_per_worker(worker_config: dict[str, Any]) -> None:
    config = TrainConfig.from_dict(worker_config)
    progress = worker_config.get(PROGRESS_KEY)
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    # More threads than owned CPUs makes workers on one machine fight over cores.
    torch.set_num_threads(_owned_cpus())

    dataset = data.load(config.data)
    state = _restore()
    torch.manual_seed(config.loop.seed)  # identical initial weights on every rank
    model = ray.train.torch.prepare_model(ConvNet(dataset.num_classes))
    device = ray.train.torch.get_device()
    trainer = Trainer(config, model, dataset.train, dataset.val, device, rank, world_size, state)

    if rank == 0 and progress is not None:
        batch_per_worker = config.loop.global_batch_size // world_size
        progress.put(
            {
                "event": "start",
                "world_size": world_size,
                "device": device.type,
                "precision": trainer.precision,
                "dataset": dataset.name,
                "num_train": len(dataset.train),
                "num_val": len(dataset.val),
                "batch_per_worker": batch_per_worker,
                "resumed_at_epoch": trainer.epochs_done if state is not None else None,
                "epochs": config.loop.epochs,
            }
        )

    while trainer.epochs_done < config.loop.epochs:
        result = trainer.run_epoch()
        evaluation = trainer.evaluate()
        metrics = {
            "epoch": trainer.epochs_done,
            "step": trainer.state.step,
            "world_size": world_size,
            "train_loss": result.train_loss,
            "val_loss": evaluation.loss,
            "val_accuracy": evaluation.accuracy,
            "samples_per_second": result.num_samples / result.seconds,
            "epoch_seconds": result.seconds,
            "lr": trainer.scheduler.get_last_lr()[0],
            "param_checksum": parameter_checksum(model),
            "time": time.time(),
        }
        trainer.state.history.append(metrics)
        state = trainer.snapshot()  # collective: every rank takes part
        if rank == 0:
            with tempfile.TemporaryDirectory() as directory:
                checkpoint.save(state, directory)
                ray.train.report(
                    metrics,
                    checkpoint=ray.train.Checkpoint.from_directory(directory),
                    checkpoint_dir_name=f"checkpoint_epoch_{trainer.epochs_done:04d}",
                )
            if progress is not None:
                progress.put({"event": "epoch", **metrics})
        else:
            ray.train.report(metrics)
