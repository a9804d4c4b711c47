"""A finished run's outputs beside its checkpoints: the metrics as CSV and the curves as PNG.

Written through pyarrow's filesystem layer, so a storage path on S3 works like a local one.
"""

from __future__ import annotations

import csv
import io
from typing import Any

import pyarrow.fs

METRICS_FILE = "metrics.csv"
CURVES_FILE = "curves.png"
_COLUMNS = (
    "epoch", "step", "world_size", "train_loss", "val_loss", "val_accuracy",
    "samples_per_second", "epoch_seconds", "lr", "param_checksum", "time",
)


def write_file(uri: str, payload: bytes) -> None:
    filesystem, path = pyarrow.fs.FileSystem.from_uri(uri)
    with filesystem.open_output_stream(path) as stream:
        stream.write(payload)


def read_file(uri: str) -> bytes:
    filesystem, path = pyarrow.fs.FileSystem.from_uri(uri)
    with filesystem.open_input_stream(path) as stream:
        return stream.read()


def metrics_csv(history: list[dict[str, Any]]) -> bytes:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=_COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(history)
    return buffer.getvalue().encode()


def curves_png(history: list[dict[str, Any]], title: str) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    epochs = [row["epoch"] for row in history]
    figure, (loss_axes, accuracy_axes) = pyplot.subplots(1, 2, figsize=(10, 4))
    loss_axes.plot(epochs, [row["train_loss"] for row in history], "o-", label="train")
    loss_axes.plot(epochs, [row["val_loss"] for row in history], "o-", label="validation")
    loss_axes.set(xlabel="epoch", ylabel="loss", title="Loss")
    loss_axes.legend()
    accuracy_axes.plot(epochs, [100 * row["val_accuracy"] for row in history], "o-")
    accuracy_axes.set(xlabel="epoch", ylabel="accuracy (%)", title="Validation accuracy")
    for axes in (loss_axes, accuracy_axes):
        axes.grid(alpha=0.3)
        axes.xaxis.get_major_locator().set_params(integer=True)
    return png_bytes(figure, title)


def png_bytes(figure, title: str) -> bytes:
    """Title, lay out, render and close a matplotlib figure."""
    from matplotlib import pyplot

    figure.suptitle(title)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    pyplot.close(figure)
    return buffer.getvalue()


def write(run_uri: str, history: list[dict[str, Any]], title: str) -> tuple[str, str]:
    """Write metrics.csv and curves.png under ``run_uri``; returns their locations."""
    metrics_uri = f"{run_uri.rstrip('/')}/{METRICS_FILE}"
    curves_uri = f"{run_uri.rstrip('/')}/{CURVES_FILE}"
    write_file(metrics_uri, metrics_csv(history))
    write_file(curves_uri, curves_png(history, title))
    return metrics_uri, curves_uri
