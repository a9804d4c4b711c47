"""A user's task, defined outside the app: regression on scikit-learn's bundled diabetes data
(442 patients, 10 features; no download). Lower validation loss is better."""

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from app.task import Task

NUM_VAL = 88


def build_datasets(data_dir: str):
    from sklearn.datasets import load_diabetes

    features, targets = load_diabetes(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(targets))
    val, train = order[:NUM_VAL], order[NUM_VAL:]
    mean, std = features[train].mean(axis=0), features[train].std(axis=0)
    target_mean, target_std = targets[train].mean(), targets[train].std()

    def split(rows):
        return TensorDataset(
            torch.tensor((features[rows] - mean) / std, dtype=torch.float32),
            torch.tensor((targets[rows] - target_mean) / target_std,
                         dtype=torch.float32).unsqueeze(1),
        )

    return split(train), split(val)


def absolute_error(output, target):
    return (output - target).abs().squeeze(1)


task = Task(
    name="diabetes",
    build_model=lambda: nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1)),
    build_datasets=build_datasets,
    loss=F.mse_loss,
    build_optimizer=lambda parameters, lr: torch.optim.Adam(parameters, lr=lr),
    metrics={"mae": absolute_error},
    lr=0.01,
    global_batch_size=32,
    epochs=8,
)
