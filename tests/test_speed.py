"""The speed options change how the default task computes, not what it learns: a channels-last
and a compiled model train, on real MNIST images, to the eager model's accuracy band."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from app import checkpoint
from app.batching import InMemoryData
from app.builtin_tasks import mnist_convnet
from app.config import LoopConfig, TrainConfig
from app.loop import Trainer, memory_format, prepare_for_speed, resolve_compile
from app.task import build_datasets

CPU = torch.device("cpu")


def _train(data_dir, *, channels_last: bool, compile: str) -> tuple[Trainer, float]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = TrainConfig(loop=LoopConfig(
        epochs=2, global_batch_size=32, precision="bf16", channels_last=channels_last,
        compile=compile,
    ))
    train, val = build_datasets(mnist_convnet, "mnist", str(data_dir))
    data = InMemoryData(train, val, config.loop.global_batch_size, world_size=1, rank=0, seed=0)
    model = prepare_for_speed(mnist_convnet.build_model(), config.loop, CPU)
    trainer = Trainer(config, mnist_convnet, model, data, CPU, 0, 1)
    for _ in range(config.loop.epochs):
        trainer.run_epoch()
    return trainer, trainer.evaluate().metrics["val_accuracy"]


@pytest.fixture(scope="module")
def eager(small_mnist_dir) -> float:
    trainer, accuracy = _train(small_mnist_dir, channels_last=False, compile="off")
    assert trainer.layout is torch.contiguous_format
    assert accuracy > 0.85  # two epochs of 2,000 real images
    return accuracy


def test_channels_last_trains_to_the_eager_accuracy(small_mnist_dir, eager):
    trainer, accuracy = _train(small_mnist_dir, channels_last=True, compile="off")
    assert trainer.layout is torch.channels_last
    assert trainer.model.cn1.weight.is_contiguous(memory_format=torch.channels_last)
    assert not trainer.model.cn2.weight.is_contiguous()
    assert abs(accuracy - eager) < 0.03, (accuracy, eager)


def test_compiled_model_trains_to_the_eager_accuracy_and_checkpoints_like_it(
        small_mnist_dir, eager, tmp_path):
    trainer, accuracy = _train(small_mnist_dir, channels_last=True, compile="on")
    assert trainer.model._compiled_call_impl is not None  # really compiled
    assert abs(accuracy - eager) < 0.03, (accuracy, eager)
    # Compiled in place: the parameter names, and so the checkpoints, are the eager model's.
    checkpoint.save(trainer.snapshot(), tmp_path)
    mnist_convnet.build_model().load_state_dict(checkpoint.load(tmp_path).model)


def test_layout_and_compile_choices():
    assert memory_format(mnist_convnet.build_model(), True) is torch.channels_last
    assert memory_format(mnist_convnet.build_model(), False) is torch.contiguous_format
    assert memory_format(nn.Sequential(nn.Linear(3, 2)), True) is torch.contiguous_format
    assert resolve_compile("auto", CPU) is False
    assert resolve_compile("auto", torch.device("cuda", 0)) is True
    assert resolve_compile("on", CPU) is True and resolve_compile("off", torch.device("cuda")) is False
    with pytest.raises(Exception, match="unknown compile mode 'fast'"):
        LoopConfig(compile="fast")
