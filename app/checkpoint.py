"""The training state that survives restarts and resizes, and its round trip through a folder.

Nothing in it depends on the world size except the per-rank RNG states, which are used only when
the run resumes at the same world size (otherwise each rank reseeds from seed, epoch and rank).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

STATE_FILE = "state.pt"
HISTORY_FILE = "history.json"
SETTINGS_FILE = "settings.json"
FORMAT_VERSION = 2
"""Layout of ``state.pt``; raised when it changes incompatibly, so an old app refuses a newer
checkpoint by name instead of failing on a missing key."""


class UnreadableCheckpoint(ValueError):
    """A checkpoint folder that cannot be loaded (truncated, partial, foreign or newer)."""


@dataclass
class TrainingState:
    epoch: int = 0
    """Epochs completed."""
    step: int = 0
    """Optimiser steps completed since the start of the run."""
    epoch_step: int = 0
    """Steps of the current (unfinished) epoch already taken; 0 at an epoch boundary."""
    epoch_loss_sum: float = 0.0
    """Training loss summed over the samples of the unfinished epoch so far (all ranks)."""
    epoch_samples: int = 0
    """Samples of the unfinished epoch trained so far (all ranks)."""
    epoch_seconds: float = 0.0
    """Training seconds spent on the unfinished epoch so far."""
    global_batch_size: int = 0
    """Samples per optimiser step, summed over workers."""
    model: dict[str, Any] = field(default_factory=dict)
    """Model weights, unwrapped from DDP."""
    optimizer: dict[str, Any] = field(default_factory=dict)
    scheduler: dict[str, Any] = field(default_factory=dict)
    rng_states: list[torch.Tensor] = field(default_factory=list)
    """torch CPU RNG state of each rank, indexed by rank; restored only mid-epoch."""
    history: list[dict[str, Any]] = field(default_factory=list)
    """Per-epoch metrics of every epoch completed so far."""
    config: dict[str, Any] = field(default_factory=dict)
    """The TrainConfig the run was started with, as a dict."""
    settings: dict[str, Any] = field(default_factory=dict)
    """What the saved state depends on (``run_settings``): a rerun must match it."""
    format_version: int = FORMAT_VERSION


def save(state: TrainingState, directory: str | Path) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(asdict(state), directory / STATE_FILE)
    # Small readable copies, so results and settings can be read without loading the weights.
    (directory / SETTINGS_FILE).write_text(json.dumps(state.settings, indent=1))
    (directory / HISTORY_FILE).write_text(json.dumps(state.history, indent=1))


def load(directory: str | Path) -> TrainingState:
    """Raises UnreadableCheckpoint, saying why, for anything but a complete checkpoint."""
    directory = Path(directory)
    try:
        values = torch.load(directory / STATE_FILE, map_location="cpu", weights_only=True)
        # Written after state.pt: a checkpoint without it was cut short.
        json.loads((directory / HISTORY_FILE).read_text())
    except FileNotFoundError as error:
        raise UnreadableCheckpoint(f"{Path(error.filename).name} is missing") from None
    except Exception as error:  # noqa: BLE001 - torch raises RuntimeError, pickle and zip errors
        first = (str(error).strip().splitlines() or [""])[0][:160]
        raise UnreadableCheckpoint(f"{type(error).__name__}: {first}") from None
    if not isinstance(values, dict):
        raise UnreadableCheckpoint(f"{STATE_FILE} is not a training state")
    version = values.get("format_version", 1)  # the first layout carried no version
    if version > FORMAT_VERSION:
        raise UnreadableCheckpoint(
            f"written in checkpoint format {version} by a newer version of this app (this one "
            f"reads up to {FORMAT_VERSION}); upgrade it"
        )
    try:
        return TrainingState(**values)
    except TypeError as error:
        raise UnreadableCheckpoint(f"{STATE_FILE} is not a training state ({error})") from None


_CHECKPOINT_NAME = re.compile(r"^checkpoint_epoch_(\d+)(?:_step_(\d+))?$")


def age_order(name: str) -> tuple[int, float] | None:
    """Sort key of a checkpoint folder name, oldest first; None for other names.

    ``checkpoint_epoch_0005`` ends epoch 5; ``checkpoint_epoch_0005_step_000020`` is 20 steps
    into epoch 5, so it comes before the end of that epoch (a plain name sort gets this wrong).
    """
    match = _CHECKPOINT_NAME.match(name)
    if match is None:
        return None
    step = match.group(2)
    return int(match.group(1)), float("inf") if step is None else int(step)


def load_history(directory: str | Path) -> list[dict[str, Any]]:
    return json.loads((Path(directory) / HISTORY_FILE).read_text())


# --- what a resumed run must share with the run it resumes ------------------------------------

FIXED_SETTINGS = {
    "task": "--task",
    "dataset": "--dataset",
    "source": "--parquet",
    "global_batch_size": "--global-batch-size",
    "seed": "--seed",
    "lr": "--lr",
    "lr_decay": "--lr-decay",
    "optimizer": "the task's optimiser",
    "parameters": "the task's model",
}
"""Settings the saved state depends on, and the flag (or task part) that sets each. Everything
else (--epochs, worker counts, precision, micro-batches, cluster and output flags) may change
between reruns of a run."""


def run_settings(config, task_name: str, dataset: str, optimizer: str | None = None,
                 parameters: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """The settings of a run (``config``: a TrainConfig); ``optimizer`` and ``parameters``
    are known only where the model is built (the workers)."""
    settings = {
        "task": config.task,
        "task_name": task_name,
        "dataset": dataset,
        "source": "parquet" if config.data.parquet else "memory",
        "global_batch_size": config.loop.global_batch_size,
        "seed": config.loop.seed,
        "lr": config.optim.lr,
        "lr_decay": config.optim.lr_decay,
    }
    if optimizer is not None:
        settings["optimizer"] = optimizer
    if parameters is not None:
        settings["parameters"] = parameters
    return settings


def parameter_shapes(model) -> dict[str, list[int]]:
    return {name: list(parameter.shape) for name, parameter in model.state_dict().items()}


def _describe(key: str, value: Any) -> str:
    if key == "parameters":
        return f"{len(value)} tensors" if isinstance(value, dict) else repr(value)
    return repr(value)


def differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Each fixed setting both know and that differs, as '<flag> <now> (the run has <then>)'."""
    found = []
    for key, flag in FIXED_SETTINGS.items():
        if key not in saved or key not in current or saved[key] == current[key]:
            continue
        if key == "parameters" and isinstance(saved[key], dict):
            changed = sorted(set(saved[key]) ^ set(current[key])) or [
                name for name in saved[key] if saved[key][name] != current[key][name]]
            found.append(f"{flag} (parameter {changed[0]}: "
                         f"{current[key].get(changed[0])} now, {saved[key].get(changed[0])} "
                         "in the run)")
            continue
        found.append(f"{flag} {_describe(key, current[key])} "
                     f"(the run has {_describe(key, saved[key])})")
    return found


def incompatibility(run_name: str, saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """The one-line refusal when ``current`` cannot resume a run saved with ``saved``."""
    found = differences(saved, current)
    if not found:
        return None
    return (f"run {run_name!r} was trained with other settings, which its checkpoints depend "
            f"on: {'; '.join(found)}. Rerun with the run's settings, or start a new run "
            "under another --name")


def load_settings(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / SETTINGS_FILE
    return json.loads(path.read_text()) if path.exists() else {}
