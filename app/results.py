"""A finished run's outputs beside its checkpoints: the metrics as CSV and the curves as PNG.

Written through pyarrow's filesystem layer, so a storage path on S3 works like a local one.
"""

from __future__ import annotations

import csv
import io
import os
import tempfile
from typing import Any

import pyarrow.fs

METRICS_FILE = "metrics.csv"
CURVES_FILE = "curves.png"
_LEADING = ("epoch", "step", "world_size", "train_loss", "val_loss")
_TRAILING = ("samples_per_second", "epoch_seconds", "lr", "param_checksum", "time",
             "wall_seconds", "goodput", "lost_seconds", "lost_to")


def metric_columns(history: list[dict[str, Any]]) -> list[str]:
    """The task's validation metrics (``val_<name>``) in the order the rows hold them."""
    names: list[str] = []
    for row in history:
        names += [key for key in row if key.startswith("val_") and key != "val_loss"
                  and key not in names]
    return names


def count(number: int, noun: str) -> str:
    """``1 epoch``, ``5 epochs``: a number of things as a person writes it."""
    return f"{number:,} {noun}{'' if number == 1 else 's'}"


def format_metric(name: str, value: float) -> str:
    """A metric as a person reads it: accuracies as percentages, the rest with 4 decimals."""
    if name.endswith("accuracy"):
        return f"{100 * value:.2f}%"
    return f"{value:.4f}" if abs(value) < 1e5 else f"{value:.4g}"


def write_file(uri: str, payload: bytes) -> None:
    """Write ``payload`` whole: a reader sees the old file or the new one, never part of one (a
    local file is written beside it and renamed over it; an object store's put is atomic)."""
    filesystem, path = pyarrow.fs.FileSystem.from_uri(uri)
    if not isinstance(filesystem, pyarrow.fs.LocalFileSystem):
        with filesystem.open_output_stream(path) as stream:
            stream.write(payload)
        return
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=folder, prefix=f".{os.path.basename(path)}.",
                                     delete=False) as stream:
        stream.write(payload)
    try:
        os.chmod(stream.name, _mode_for(path))
        os.replace(stream.name, path)
    except BaseException:
        os.unlink(stream.name)
        raise


def _mode_for(path: str) -> int:
    """The mode the file had, else the one ``open`` would give a new file (the temporary file
    is owner-only). The umask is read from /proc: setting it to read it races other threads."""
    try:
        return os.stat(path).st_mode & 0o777
    except FileNotFoundError:
        pass
    try:
        with open("/proc/self/status") as status:
            mask = next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = 0o022
    return 0o666 & ~mask


def read_file(uri: str) -> bytes:
    filesystem, path = pyarrow.fs.FileSystem.from_uri(uri)
    with filesystem.open_input_stream(path) as stream:
        return stream.read()


def metrics_csv(history: list[dict[str, Any]]) -> bytes:
    buffer = io.StringIO()
    columns = [*_LEADING, *metric_columns(history), *_TRAILING]
    writer = csv.DictWriter(buffer, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(history)
    return buffer.getvalue().encode()


def load_plotting():
    """matplotlib's pyplot on the Agg backend (importing it takes about half a second: the
    launcher does it in the background while the run trains)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    return pyplot


def curves_png(history: list[dict[str, Any]], title: str) -> bytes:
    pyplot = load_plotting()

    epochs = [row["epoch"] for row in history]
    metrics = metric_columns(history)
    figure, all_axes = pyplot.subplots(1, 1 + len(metrics), figsize=(5 * (1 + len(metrics)), 4),
                                       squeeze=False)
    loss_axes, *metric_axes = all_axes[0]
    loss_axes.plot(epochs, [row["train_loss"] for row in history], "o-", label="train")
    loss_axes.plot(epochs, [row["val_loss"] for row in history], "o-", label="validation")
    loss_axes.set(xlabel="epoch", ylabel="loss", title="Loss")
    loss_axes.legend()
    for axes, name in zip(metric_axes, metrics):
        scale = 100 if name.endswith("accuracy") else 1
        axes.plot(epochs, [scale * row.get(name, float("nan")) for row in history], "o-")
        label = name.removeprefix("val_").replace("_", " ")
        axes.set(xlabel="epoch", ylabel=f"{label} (%)" if scale == 100 else label,
                 title=f"Validation {label}")
    for axes in all_axes[0]:
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
    from app.storage import join

    metrics_uri = join(run_uri, METRICS_FILE)
    curves_uri = join(run_uri, CURVES_FILE)
    write_file(metrics_uri, metrics_csv(history))
    write_file(curves_uri, curves_png(history, title))
    return metrics_uri, curves_uri
