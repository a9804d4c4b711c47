"""Your own model on the elastic trainer: a small classifier of scikit-learn's bundled breast
cancer data (569 tumours, 30 measurements each; no download).

    python -m app.train --task examples/breast_cancer.py:task --num-workers 1-2
    python -m app.tune --task examples/breast_cancer.py:task --num-workers 1,2
    python -m app.evaluate --checkpoint runs/<run name>
    python -m app.prepare --task examples/breast_cancer.py:task --output data/cancer-parquet
    python -m app.predict --checkpoint runs/<run name> --parquet data/cancer-parquet --output preds

Everything the app needs is the ``Task`` below: a model, the data as (input, target) tensors,
a loss that is a batch mean, an optimiser, and per-sample metrics.
"""

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from app.task import Task


def build_datasets(data_dir: str):
    """A fixed 80/20 split; features standardised with the training split's statistics.
    (``data_dir`` is unused: the data ships with scikit-learn.)"""
    from sklearn.datasets import load_breast_cancer

    features, labels = load_breast_cancer(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(labels))
    val, train = order[: len(order) // 5], order[len(order) // 5:]
    mean, std = features[train].mean(axis=0), features[train].std(axis=0)

    def split(rows):
        inputs = torch.tensor((features[rows] - mean) / std, dtype=torch.float32)
        return TensorDataset(inputs, torch.tensor(labels[rows], dtype=torch.int64))

    return split(train), split(val)


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(30, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 2))


def accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output.argmax(dim=1) == target).float()


task = Task(
    name="breast-cancer",
    build_model=build_model,
    build_datasets=build_datasets,
    loss=F.cross_entropy,
    build_optimizer=lambda parameters, lr: torch.optim.AdamW(parameters, lr=lr),
    metrics={"accuracy": accuracy},
    score="val_loss",        # lower is better: the best checkpoints and Tune's metric
    score_mode="min",
    lr=3e-3,
    global_batch_size=64,
    epochs=20,
    target=0.1,              # the validation loss the sweep's scaling report times
)
