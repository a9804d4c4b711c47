"""The training state that survives restarts and resizes, and its round trip through a folder.

Nothing in it depends on the world size except the per-rank RNG states, which are used only when
the run resumes at the same world size (otherwise each rank reseeds from seed, epoch and rank).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

STATE_FILE = "state.pt"
HISTORY_FILE = "history.json"


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


def save(state: TrainingState, directory: str | Path) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(asdict(state), directory / STATE_FILE)
    # A small readable copy, so results can be read without loading the weights.
    (directory / HISTORY_FILE).write_text(json.dumps(state.history, indent=1))


def load(directory: str | Path) -> TrainingState:
    values = torch.load(Path(directory) / STATE_FILE, map_location="cpu", weights_only=True)
    return TrainingState(**values)


def load_history(directory: str | Path) -> list[dict[str, Any]]:
    return json.loads((Path(directory) / HISTORY_FILE).read_text())
