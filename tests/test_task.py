"""The Task API in one process (no Ray): finding tasks, validating them, training a user's task
with its own loss and metrics, resume compatibility, and scoring checkpoints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from torch.utils.data import TensorDataset

from app import checkpoint, evaluate
from app.batching import InMemoryData
from app.builtin_tasks import mnist_convnet, random_crop_flip
from app.config import LoopConfig, OptimConfig, TrainConfig, UserError
from app.loop import Trainer
from app.task import BUILTINS, Task, load_task, resolve_reference

USER_TASK_FILE = Path(__file__).parent / "diabetes_task.py"
USER_TASK = f"{USER_TASK_FILE}:task"


def test_tasks_are_found_by_name_module_or_file():
    assert load_task("mnist-convnet") is mnist_convnet
    assert {load_task(name).name for name in BUILTINS} == set(BUILTINS)
    assert load_task("diabetes_task:task").name == "diabetes"  # tests/ is on sys.path
    reference = resolve_reference(f"{USER_TASK_FILE.relative_to(Path.cwd())}:task") \
        if USER_TASK_FILE.is_relative_to(Path.cwd()) else USER_TASK
    assert reference == USER_TASK, "a file path is made absolute for the workers"
    assert load_task(reference).name == "diabetes"


@pytest.mark.parametrize("reference, message", [
    ("nope", "give a built-in task"),
    ("/no/such/file.py:task", "is not a file"),
    ("no_such_module_xyz:task", "cannot import no_such_module_xyz"),
    ("json:nothing", "has no attribute 'nothing'"),
    ("json:dumps", "dumps() failed: TypeError"),
    ("collections:OrderedDict", "is a OrderedDict, not an app.task.Task"),
])
def test_a_reference_that_names_no_task_says_why(reference, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_task(resolve_reference(reference))


@pytest.mark.parametrize("changes, message", [
    ({"score": "val_accuracy"}, "score 'val_accuracy' is not one of its validation metrics"),
    ({"metrics": {"Bad Name": lambda o, t: o}}, "metric name 'Bad Name'"),
    ({"score_mode": "lowest"}, "score_mode must be 'min' or 'max'"),
    ({"offline_fallback": "digits"}, "offline_fallback 'digits' is not one of its datasets"),
])
def test_a_malformed_task_is_refused_when_defined(changes, message):
    fields = dict(name="t", build_model=lambda: None, build_datasets=lambda d: None,
                  loss=lambda o, t: o, build_optimizer=lambda p, lr: None)
    with pytest.raises(UserError, match=message):
        Task(**(fields | changes))


def _diabetes_trainer(state=None, seed=0, precision="fp32"):
    task = load_task(USER_TASK)
    torch.manual_seed(seed)
    config = TrainConfig(task=USER_TASK, optim=OptimConfig(lr=task.lr, lr_decay=1.0),
                         loop=LoopConfig(epochs=4, global_batch_size=32, eval_batch_size=25,
                                         precision=precision))
    train, val = task.build_datasets("unused")
    data = InMemoryData(train, val, 32, world_size=1, rank=0, seed=0)
    return Trainer(config, task, task.build_model(), data, torch.device("cpu"), 0, 1, state)


def test_a_user_task_trains_with_its_own_loss_and_exact_metrics():
    trainer = _diabetes_trainer()
    before = trainer.evaluate()
    for _ in range(4):
        trainer.run_epoch()
    after = trainer.evaluate()
    assert set(after.metrics) == {"val_mae"}
    assert after.loss < 0.7 * before.loss, (before, after)
    # Exact means over the whole validation split, whatever the eval batch size (25 of 88).
    _, val = trainer.task.build_datasets("unused")
    inputs, targets = val.tensors
    with torch.no_grad():
        output = trainer.model.eval()(inputs)
    assert after.loss == pytest.approx(torch.nn.functional.mse_loss(output, targets).item(),
                                       rel=1e-5)
    assert after.metrics["val_mae"] == pytest.approx((output - targets).abs().mean().item(),
                                                     rel=1e-5)
    assert after.num_samples == 88


def test_changed_settings_are_named_and_allowed_ones_are_not_compared():
    config = TrainConfig(task="mnist-convnet", loop=LoopConfig(epochs=5, global_batch_size=128))
    saved = checkpoint.run_settings(config, "mnist-convnet", "mnist", "Adadelta",
                                    {"fc1.weight": [64, 4608]})
    more_epochs = TrainConfig(task="mnist-convnet",
                              loop=LoopConfig(epochs=9, global_batch_size=128, precision="fp32",
                                              max_batch_per_worker=16))
    assert checkpoint.incompatibility("r", saved, checkpoint.run_settings(
        more_epochs, "mnist-convnet", "mnist")) is None
    changed = TrainConfig(task="x.py:task", optim=OptimConfig(lr=0.1),
                          loop=LoopConfig(global_batch_size=256))
    refusal = checkpoint.incompatibility("r", saved, checkpoint.run_settings(
        changed, "x", "digits", "SGD", {"fc1.weight": [10, 4608]}))
    for part in ("--task 'x.py:task' (the run has 'mnist-convnet')",
                 "--dataset 'digits' (the run has 'mnist')",
                 "--global-batch-size 256 (the run has 128)", "--lr 0.1 (the run has 0.5)",
                 "the task's optimiser 'SGD' (the run has 'Adadelta')",
                 "the task's model (parameter fc1.weight: [10, 4608] now, [64, 4608] in the run)"):
        assert part in refusal, refusal
    assert "\n" not in refusal


def _save_epochs(run: Path, losses: list[float]) -> None:
    trainer = _diabetes_trainer()
    for epoch, loss in enumerate(losses, start=1):
        trainer.run_epoch()
        trainer.state.history.append({"epoch": epoch, "val_loss": loss, "precision": "fp32"})
        trainer.state.settings = checkpoint.run_settings(trainer.config, "diabetes", "diabetes")
        checkpoint.save(trainer.snapshot(), run / f"checkpoint_epoch_{epoch:04d}")


def test_evaluate_picks_a_runs_best_checkpoint_by_the_tasks_score(tmp_path):
    _save_epochs(tmp_path / "run", [0.5, 0.2, 0.3])
    best = evaluate.find_checkpoint(str(tmp_path / "run"), None)
    assert best.endswith("checkpoint_epoch_0002"), "lower validation loss is better"
    loaded = evaluate.load(str(tmp_path / "run"))
    assert (loaded.task.name, loaded.epoch) == ("diabetes", 2)
    with pytest.raises(UserError, match="does not fit the model of task 'mnist-convnet'"):
        evaluate.load(str(tmp_path / "run"), "mnist-convnet")
    (tmp_path / "run" / "checkpoint_epoch_0002" / "state.pt").write_bytes(b"cut short")
    with pytest.raises(UserError, match="is not a complete checkpoint"):
        evaluate.load(str(tmp_path / "run"))
    with pytest.raises(UserError, match="no checkpoint at"):
        evaluate.load(str(tmp_path / "elsewhere"))


def test_the_predictor_writes_outputs_and_argmax_for_a_classifier(tmp_path):
    from app.predict import Predictor
    from app.prepare import TensorSpec, _binary

    torch.manual_seed(0)
    config = TrainConfig(loop=LoopConfig(global_batch_size=8, precision="fp32"))
    images, labels = torch.randn(16, 1, 28, 28), torch.arange(16) % 10
    data = InMemoryData(TensorDataset(images, labels), TensorDataset(images, labels), 8, 1, 0, 0)
    trainer = Trainer(config, mnist_convnet, mnist_convnet.build_model(), data,
                      torch.device("cpu"), 0, 1)
    trainer.run_epoch()
    trainer.state.settings = checkpoint.run_settings(config, "mnist-convnet", "mnist")
    checkpoint.save(trainer.snapshot(), tmp_path / "checkpoint_epoch_0001")
    spec = TensorSpec.of(images)
    manifest = {"input": spec.to_dict(), "target": TensorSpec.of(labels).to_dict()}
    predictor = Predictor(str(tmp_path / "checkpoint_epoch_0001"), None, manifest, "fp32",
                          classifier=True, num_cpus=1)
    table = pa.table({"id": pa.array(np.arange(100, 116)), "input": _binary(images, spec.num_bytes)})
    result = predictor(table)
    assert result.column("id").to_pylist() == list(range(100, 116))
    outputs = np.array(result.column("output").to_pylist())
    expected = evaluate.outputs(predictor.loaded, images, "fp32", torch.device("cpu")).numpy()
    np.testing.assert_allclose(outputs, expected, rtol=1e-6)
    assert result.column("prediction").to_pylist() == expected.argmax(axis=1).tolist()


def test_cifar_augmentation_crops_and_flips_each_image_reproducibly():
    images = torch.arange(2 * 3 * 8 * 8, dtype=torch.float32).view(2, 3, 8, 8)
    torch.manual_seed(3)
    first = random_crop_flip(images, padding=2)
    torch.manual_seed(3)
    assert torch.equal(first, random_crop_flip(images, padding=2))
    padded = torch.nn.functional.pad(images, (2, 2, 2, 2))
    for sample in range(2):
        crops = [padded[sample, :, dy:dy + 8, dx:dx + 8] for dy in range(5) for dx in range(5)]
        assert any(torch.equal(first[sample], crop) or torch.equal(first[sample], crop.flip(-1))
                   for crop in crops)


def test_cifar_resnet18_task_takes_a_step_on_cifar_shaped_data(tmp_path):
    from app import data

    generator = np.random.default_rng(0)
    folder = tmp_path / data.CIFAR10_FOLDER
    for name in (*data.CIFAR10_TRAIN_FILES, data.CIFAR10_VAL_FILE):
        data.write_cifar_batch(folder / name, generator.integers(0, 256, (4, 3, 32, 32)),
                               generator.integers(0, 10, 4))
    task = load_task("cifar10-resnet18")
    train, val = task.build_datasets(str(tmp_path))
    config = TrainConfig(task="cifar10-resnet18",
                         optim=OptimConfig(lr=task.lr),
                         loop=LoopConfig(epochs=1, global_batch_size=10, precision="fp32"))
    loader = InMemoryData(train, val, 10, world_size=1, rank=0, seed=0)
    torch.manual_seed(0)
    trainer = Trainer(config, task, task.build_model(), loader, torch.device("cpu"), 0, 1)
    result = trainer.run_epoch()
    assert trainer.state.step == 2 and np.isfinite(result.train_loss)
    assert type(trainer.optimizer).__name__ == "SGD"
    assert type(trainer.scheduler).__name__ == "CosineAnnealingLR"
    assert set(trainer.evaluate().metrics) == {"val_accuracy"}


@pytest.mark.parametrize("changes, message", [
    ({"loss": lambda output, target: (output - target) ** 2},
     r"loss\(output, target\) must return the batch mean, a scalar tensor; it returned shape "
     r"\(2, 1\)"),
    ({"metrics": {"mae": lambda output, target: (output - target).abs().mean()}},
     r"metric 'mae' must return one value per sample \(shape \(2,\)\)"),
    ({"build_model": lambda: torch.nn.Linear(7, 1)},
     r"the model's forward pass on two training samples failed: RuntimeError"),
    ({"build_model": lambda: 1 / 0}, r"build_model\(\) failed: ZeroDivisionError"),
])
def test_a_task_that_cannot_run_is_one_line_before_any_worker_starts(changes, message):
    import dataclasses

    from app.task import check_on_samples

    task = dataclasses.replace(load_task(USER_TASK), **changes)
    train, _ = task.build_datasets("unused")
    with pytest.raises(UserError, match=message):
        check_on_samples(task, train)
    check_on_samples(load_task(USER_TASK), train)  # the task as written passes


def test_the_sample_check_builds_the_optimiser_without_importing_the_compiler():
    """torch imports torch._dynamo on the first optimiser built (1.5-3 s of CPU); the driver's
    check never compiles nor steps, so it goes without, and optimisers built after it (in a
    process that does import the compiler) are wrapped as torch makes them."""
    script = (
        "import sys\n"
        "from app.task import check_on_samples, load_task\n"
        "task = load_task('mnist-convnet')\n"
        "train, _ = task.builder('digits')('')\n"
        "check_on_samples(task, train)\n"
        "assert 'torch._dynamo' not in sys.modules, 'the check imported the compiler'\n"
        "import torch, torch._dynamo\n"
        "function = torch.optim.Optimizer.add_param_group.__wrapped__\n"
        "assert not hasattr(function, '__dynamo_disable')\n"
        "model = torch.nn.Linear(2, 1)\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "assert function.__dynamo_disable is not function, 'dynamo wraps it again'\n"
        "model(torch.ones(1, 2)).sum().backward(); optimizer.step()\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
