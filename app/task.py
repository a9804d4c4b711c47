"""The ``Task`` contract: what a user's model plugs into the elastic machinery, and how a task
is found again from its reference (``--task``, a checkpoint).

A task says *what* to train (model, data, loss, metrics, optimiser and its defaults); everything
about *how* (workers, resizes, global batches, checkpoints, resume, Tune, Parquet, S3) is the
app's and works the same for every task. No Ray here.

A reference is a built-in name (``mnist-convnet``), ``package.module:ATTR`` or
``path/to/file.py:ATTR``; ATTR names a ``Task`` or a function of no arguments returning one.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from app.config import UserError

DatasetsBuilder = Callable[[str], "tuple[Dataset, Dataset]"]

SCORE_MODES = ("min", "max")
_METRIC_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class Task:
    """A model and how to train and score it. Frozen: the app never changes it."""

    name: str
    """Short name, shown on the console and recorded in every checkpoint."""
    build_model: Callable[[], nn.Module]
    """A fresh model; called on every rank with the same seed, so initial weights agree."""
    build_datasets: DatasetsBuilder
    """Called with ``--data-dir``: the (training, validation) sets, map-style, whose items are
    ``(input, target)`` tensors of fixed shapes (a ``TensorDataset`` is fastest)."""
    loss: Callable[[Tensor, Tensor], Tensor]
    """``loss(output, target)``: the batch *mean*. The app rescales it so the gradient is the one
    of the whole global batch at any world size."""
    build_optimizer: Callable[[Iterable[nn.Parameter], float], torch.optim.Optimizer]
    """``build_optimizer(parameters, lr)``."""
    metrics: Mapping[str, Callable[[Tensor, Tensor], Tensor]] = field(default_factory=dict)
    """``name: fn(output, target)`` giving one value per sample (``output.argmax(1) == target``
    for accuracy); reported as ``val_<name>``, the exact mean over the whole validation split."""
    score: str = "val_loss"
    """The validation metric that picks the best checkpoints and that Tune optimises."""
    score_mode: str = "min"
    """Whether a lower (``min``) or higher (``max``) ``score`` is better."""
    lr: float = 1e-3
    """Default learning rate (``--lr``)."""
    lr_decay: float = 1.0
    """Default factor applied to the learning rate after every epoch (``--lr-decay``)."""
    global_batch_size: int = 128
    """Default samples per optimiser step over all workers (``--global-batch-size``)."""
    epochs: int = 5
    """Default epochs (``--epochs``)."""
    build_scheduler: Callable[[torch.optim.Optimizer, int], Any] | None = None
    """``build_scheduler(optimizer, epochs)``: a learning-rate scheduler stepped once per epoch,
    instead of the ``--lr-decay`` one."""
    augment: Callable[[Tensor], Tensor] | None = None
    """Applied to every training batch's inputs on the worker's device (random crops, flips);
    draws from torch's RNG, which the app seeds per rank and epoch, so a resume replays it."""
    datasets: Mapping[str, DatasetsBuilder] = field(default_factory=dict)
    """Other data sets ``--dataset NAME`` may choose, each with ``build_datasets``' contract."""
    dataset: str = ""
    """Name of the data set ``build_datasets`` loads [default: the task's name]."""
    offline_fallback: str = ""
    """A key of ``datasets`` to train on when ``--dataset`` is not given and the default data
    set is neither on disk nor downloadable (said on the console)."""
    target: float | None = None
    """A ``score`` worth reaching: the sweep's scaling report times each world size to it."""
    description: str = ""
    """One line for ``--help``."""

    def __post_init__(self):
        if not self.name or not isinstance(self.name, str):
            raise UserError("a task needs a non-empty name")
        for metric in self.metrics:
            if not _METRIC_NAME.match(metric) or metric == "loss":
                raise UserError(
                    f"task {self.name}: metric name {metric!r} must be lower_case letters, digits "
                    "and '_' (and not 'loss'): it becomes the column val_<name>"
                )
        if self.score not in self.score_names:
            raise UserError(
                f"task {self.name}: score {self.score!r} is not one of its validation metrics "
                f"({', '.join(self.score_names)})"
            )
        if self.score_mode not in SCORE_MODES:
            raise UserError(f"task {self.name}: score_mode must be 'min' or 'max', "
                            f"got {self.score_mode!r}")
        if self.offline_fallback and self.offline_fallback not in self.datasets:
            raise UserError(f"task {self.name}: offline_fallback {self.offline_fallback!r} is not "
                            "one of its datasets")

    @property
    def metric_columns(self) -> tuple[str, ...]:
        """``val_<name>`` for every metric, in the task's order."""
        return tuple(f"val_{name}" for name in self.metrics)

    @property
    def score_names(self) -> tuple[str, ...]:
        return ("val_loss", *self.metric_columns)

    @property
    def default_dataset(self) -> str:
        return self.dataset or self.name

    def dataset_names(self) -> tuple[str, ...]:
        return (self.default_dataset, *(name for name in self.datasets
                                        if name != self.default_dataset))

    def builder(self, dataset: str) -> DatasetsBuilder:
        """The builder of ``dataset`` ("" or the default name: ``build_datasets``)."""
        if dataset in ("", self.default_dataset):
            return self.build_datasets
        if dataset not in self.datasets:
            raise UserError(
                f"task {self.name} has no data set {dataset!r}: choose one of "
                f"{', '.join(self.dataset_names())}"
            )
        return self.datasets[dataset]

    def better(self, value: float, than: float) -> bool:
        return value < than if self.score_mode == "min" else value > than


# --- built-ins ------------------------------------------------------------------------------

BUILTINS: dict[str, str] = {
    "mnist-convnet": "app.builtin_tasks:mnist_convnet",
    "mnist-examples": "app.builtin_tasks:mnist_examples",
    "cifar10-resnet18": "app.builtin_tasks:cifar10_resnet18",
}
"""Built-in task names and where they are defined."""
DEFAULT_TASK = "mnist-convnet"

BUILTIN_HELP = {
    "mnist-convnet": "the book's ConvNet on MNIST (Adadelta, lr 0.5, batch 128) [default]",
    "mnist-examples": "PyTorch's MNIST example network, for comparison",
    "cifar10-resnet18": "ResNet-18 on CIFAR-10 (SGD, momentum, cosine schedule)",
}


def resolve_reference(reference: str) -> str:
    """The reference as workers and checkpoints keep it: a file path made absolute (workers may
    start in another directory). Refuses a malformed one with the forms it accepts."""
    reference = reference.strip()
    if reference in BUILTINS:
        return reference
    module, colon, attribute = reference.rpartition(":")
    if not colon or not module or not attribute.isidentifier():
        raise UserError(
            f"--task {reference!r}: give a built-in task ({', '.join(BUILTINS)}), "
            "package.module:ATTR or path/to/file.py:ATTR"
        )
    if module.endswith(".py"):
        path = Path(module).expanduser().resolve()
        if not path.is_file():
            raise UserError(f"--task {reference!r}: {path} is not a file")
        return f"{path}:{attribute}"
    return reference


def _import_file(path: str):
    # One module per file, named after its path, so pickles (Ray) and a second load agree.
    name = "app_user_task_" + re.sub(r"\W", "_", path)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UserError(f"cannot import {path} as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_task(reference: str) -> Task:
    """The task a reference names; UserError saying why when it names none."""
    target = BUILTINS.get(reference, reference)
    module_name, _, attribute = target.rpartition(":")
    try:
        module = _import_file(module_name) if module_name.endswith(".py") \
            else importlib.import_module(module_name)
    except UserError:
        raise
    except ModuleNotFoundError as error:
        raise UserError(f"task {reference!r}: cannot import {module_name} ({error}); is it on "
                        "PYTHONPATH (and in the job's working_dir on a remote cluster)?") from None
    except Exception as error:  # noqa: BLE001 - the user's module raised while importing
        raise UserError(f"task {reference!r}: importing {module_name} failed: "
                        f"{type(error).__name__}: {error}") from None
    value = getattr(module, attribute, None)
    if value is None:
        raise UserError(f"task {reference!r}: {module_name} has no attribute {attribute!r}")
    if callable(value) and not isinstance(value, Task):
        try:
            value = value()
        except UserError:
            raise
        except Exception as error:  # noqa: BLE001
            raise UserError(f"task {reference!r}: {attribute}() failed: "
                            f"{type(error).__name__}: {error}") from None
    if not isinstance(value, Task):
        raise UserError(f"task {reference!r}: {attribute} is a {type(value).__name__}, "
                        "not an app.task.Task (or a function returning one)")
    return value


def call(task: Task, what: str, function: Callable, *args):
    """``function(*args)`` of the user's task; its exception as one UserError saying which
    part of which task failed (no retry can fix it)."""
    try:
        return function(*args)
    except UserError:
        raise
    except Exception as error:  # noqa: BLE001 - the user's code
        raise UserError(f"task {task.name}: {what} failed: {type(error).__name__}: "
                        f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}"
                        ) from None


@contextlib.contextmanager
def _compiler_not_imported():
    """Optimisers built here without torch importing its compiler.

    ``Optimizer.add_param_group`` is wrapped so that torch.compile never traces it, and the
    wrapper imports ``torch._dynamo`` on its first call to say so: 1.5-3 s of CPU in a process
    that only checks the task and never compiles nor steps (the workers import it anyway, in
    ``Optimizer.step``). The wrapper keeps what it made in an attribute of the wrapped
    function; the function itself stands there while the optimiser is built.
    """
    function = getattr(torch.optim.Optimizer.add_param_group, "__wrapped__", None)
    if function is None or "torch._dynamo" in sys.modules \
            or hasattr(function, "__dynamo_disable"):
        yield
        return
    function.__dynamo_disable = function
    try:
        yield
    finally:
        del function.__dynamo_disable


def check_on_samples(task: Task, train: Dataset) -> None:
    """The task's model, loss and metrics on two training samples, before any worker starts:
    a shape or dtype mistake in a user's task is one line now, not a failed run later."""
    from app.batching import rows

    inputs, targets = rows(train, torch.arange(min(2, len(train))))
    model = call(task, "build_model()", task.build_model)
    with _compiler_not_imported():
        call(task, "build_optimizer(parameters, lr)", task.build_optimizer, model.parameters(),
             task.lr)
    with torch.no_grad():
        output = call(task, "the model's forward pass on two training samples",
                      model.eval(), inputs)
        loss = call(task, "loss(output, target)", task.loss, output.float(), targets)
        if not isinstance(loss, Tensor) or loss.ndim != 0:
            raise UserError(f"task {task.name}: loss(output, target) must return the batch "
                            f"mean, a scalar tensor; it returned shape "
                            f"{tuple(getattr(loss, 'shape', ()))}")
        for name, metric in task.metrics.items():
            values = call(task, f"metric {name!r}", metric, output.float(), targets)
            if not isinstance(values, Tensor) or tuple(values.shape[:1]) != (len(targets),) \
                    or values.ndim != 1:
                raise UserError(f"task {task.name}: metric {name!r} must return one value per "
                                f"sample (shape ({len(targets)},)); it returned shape "
                                f"{tuple(getattr(values, 'shape', ()))}")


def build_datasets(task: Task, dataset: str, data_dir: str) -> tuple[Dataset, Dataset]:
    """The task's (training, validation) sets, checked; the task's own errors as one line."""
    try:
        train, val = task.builder(dataset)(data_dir)
    except UserError:
        raise
    except Exception as error:  # noqa: BLE001 - the user's code: say whose and what
        raise UserError(f"task {task.name}: loading the data set {dataset or task.default_dataset!r} "
                        f"failed: {type(error).__name__}: {error}") from None
    for split, name in ((train, "training"), (val, "validation")):
        if not hasattr(split, "__getitem__") or not hasattr(split, "__len__"):
            raise UserError(f"task {task.name}: the {name} set is not a map-style data set")
        if len(split) == 0:
            raise UserError(f"task {task.name}: the {name} set is empty")
    return train, val
