"""The training loop in one process: a real step, and an exact checkpoint round trip."""

import pytest
import torch

from app import checkpoint
from app.config import LoopConfig, TrainConfig
from app.data import Split
from app.loop import Trainer, parameter_checksum
from app.model import ConvNet


def _splits():
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 10, (96,), generator=generator)
    # Learnable: the label is written into the image as a bright column.
    images = torch.randn(96, 1, 28, 28, generator=generator) * 0.1
    images[torch.arange(96), 0, :, labels * 2] += 3.0
    return Split(images[:64], labels[:64]), Split(images[64:], labels[64:])


def _trainer(state=None, precision="fp32"):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = TrainConfig(
        loop=LoopConfig(epochs=3, global_batch_size=16, eval_batch_size=7, precision=precision)
    )
    train, val = _splits()
    return Trainer(config, ConvNet(), train, val, torch.device("cpu"), 0, 1, state)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_training_lowers_loss_and_learns(precision):
    trainer = _trainer(precision=precision)
    before = trainer.evaluate()
    first = trainer.run_epoch()
    for _ in range(3):
        last = trainer.run_epoch()
    after = trainer.evaluate()
    assert first.num_samples == 64
    assert trainer.state.step == 16 and trainer.epochs_done == 4
    assert last.train_loss < first.train_loss
    assert after.loss < before.loss
    assert after.num_samples == 32
    assert after.accuracy > 0.5


def test_checkpoint_round_trip_resumes_exactly(tmp_path):
    uninterrupted = _trainer()
    for _ in range(2):
        uninterrupted.run_epoch()

    interrupted = _trainer()
    interrupted.run_epoch()
    interrupted.state.history.append({"epoch": 1})
    checkpoint.save(interrupted.snapshot(), tmp_path)

    restored_state = checkpoint.load(tmp_path)
    assert restored_state.epoch == 1 and restored_state.step == 4
    assert restored_state.global_batch_size == 16
    assert restored_state.config["loop"]["global_batch_size"] == 16
    assert checkpoint.load_history(tmp_path) == [{"epoch": 1}]
    resumed = _trainer(restored_state)
    assert parameter_checksum(resumed.model) == parameter_checksum(interrupted.model)
    assert resumed.scheduler.get_last_lr() == interrupted.scheduler.get_last_lr()
    resumed.run_epoch()
    assert resumed.epochs_done == 2
    assert parameter_checksum(resumed.model) == parameter_checksum(uninterrupted.model)


def test_auto_precision_is_fp32_without_native_bf16():
    from app.loop import resolve_precision

    assert resolve_precision("fp32", torch.device("cpu")) == "fp32"
    assert resolve_precision("bf16", torch.device("cpu")) == "bf16"
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert resolve_precision("auto", torch.device("cpu")) == ("bf16" if native else "fp32")
