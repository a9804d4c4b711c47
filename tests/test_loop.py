"""The training loop in one process: a real step, and an exact checkpoint round trip."""

import pytest
import torch

from app import checkpoint
from app.batching import InMemoryData, TrainBatch
from app.builtin_tasks import mnist_convnet
from app.config import LoopConfig, TrainConfig
from app.loop import Trainer, parameter_checksum
from torch.utils.data import TensorDataset


def _splits():
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 10, (96,), generator=generator)
    # Learnable: the label is written into the image as a bright column.
    images = torch.randn(96, 1, 28, 28, generator=generator) * 0.1
    images[torch.arange(96), 0, :, labels * 2] += 3.0
    return TensorDataset(images[:64], labels[:64]), TensorDataset(images[64:], labels[64:])


def _trainer(state=None, precision="fp32"):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = TrainConfig(
        loop=LoopConfig(epochs=3, global_batch_size=16, eval_batch_size=7, precision=precision)
    )
    train, val = _splits()
    data = InMemoryData(train, val, config.loop.global_batch_size, world_size=1, rank=0, seed=0)
    return Trainer(config, mnist_convnet, mnist_convnet.build_model(), data, torch.device("cpu"),
                   0, 1, state)


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
    assert after.metrics["val_accuracy"] > 0.5


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


def _without_dropout(trainer):
    for module in trainer.model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
    return trainer


def test_micro_batches_accumulate_to_the_same_step():
    whole = _without_dropout(_trainer())
    whole.run_epoch()
    split = _without_dropout(_trainer())
    split.config = TrainConfig(
        loop=LoopConfig(epochs=3, global_batch_size=16, max_batch_per_worker=5, precision="fp32")
    )
    batch = TrainBatch(torch.zeros(16, 1, 28, 28), torch.arange(16), 16)
    assert [len(labels) for _, labels in split._micro_batches(batch)] == [5, 5, 5, 1]
    split.run_epoch()
    for a, b in zip(whole.model.parameters(), split.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_mid_epoch_checkpoint_resumes_exactly_and_skips_trained_batches(tmp_path):
    uninterrupted = _trainer()
    uninterrupted.run_epoch()
    reference = uninterrupted.run_epoch()

    interrupted = _trainer()
    interrupted.run_epoch()
    steps_seen = []

    def save_after_two_steps():
        steps_seen.append(interrupted.state.epoch_step)
        if interrupted.state.epoch_step == 2:
            checkpoint.save(interrupted.snapshot(), tmp_path)
            raise KeyboardInterrupt  # the worker dies here

    try:
        interrupted.run_epoch(after_step=save_after_two_steps)
    except KeyboardInterrupt:
        pass
    assert steps_seen == [1, 2]

    state = checkpoint.load(tmp_path)
    assert (state.epoch, state.epoch_step, state.step, state.epoch_samples) == (1, 2, 6, 32)
    resumed = _trainer(state)
    steps_after_resume = []
    result = resumed.run_epoch(after_step=lambda: steps_after_resume.append(resumed.state.step))
    assert steps_after_resume == [7, 8]  # only the two batches not yet trained
    assert result.num_samples == 64
    assert result.train_loss == pytest.approx(reference.train_loss, rel=1e-6)
    assert parameter_checksum(resumed.model) == parameter_checksum(uninterrupted.model)
