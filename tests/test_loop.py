"""The training loop in one process: a real step, and an exact checkpoint round trip."""

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


def _trainer(state=None):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = TrainConfig(loop=LoopConfig(epochs=3, global_batch_size=16, eval_batch_size=7))
    train, val = _splits()
    return Trainer(config, ConvNet(), train, val, torch.device("cpu"), 0, 1, state)


def test_training_lowers_loss_and_learns():
    trainer = _trainer()
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
