"""What a person watching a run sees: a header, one row per epoch, and where the results are."""

from __future__ import annotations

import shutil
import sys
import threading
import time
from typing import Any, TextIO

from app.results import count, format_metric


def _row(epoch, world, train_loss, val_loss, metrics, throughput, seconds) -> str:
    """One line of the epoch table: a column per validation metric of the task."""
    columns = "".join(f" {value:>{max(9, len(name))}}" for name, value in metrics)
    return (f"{epoch:>7} {world:>8} {train_loss:>11} {val_loss:>9}{columns} {throughput:>10} "
            f"{seconds:>8}")


def _column_title(name: str) -> str:
    return name.replace("val_accuracy", "val acc").replace("_", " ")


def _clock(seconds: float) -> str:
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


BAR_WIDTH = 20
"""The progress bar's width where the line has room for it."""


def progress_line(event: dict[str, Any], columns: int = 1000) -> str:
    """The live line of a step event: where the epoch is, how fast, the loss, and the time
    left in the epoch and in the run (from the current speed; validation not counted).

    Within ``columns``: the bar (which only repeats the step count) narrows, then goes, then
    the words get shorter, before anything is cut, so a narrow terminal still shows the ETA.
    """
    steps, step = event["steps_in_epoch"], min(event["epoch_step"], event["steps_in_epoch"])
    rate = event.get("steps_per_second") or 0.0
    left_epoch = steps - step
    left_run = left_epoch + (event["epochs"] - event["epoch"]) * steps
    eta = f"ETA {_clock(left_epoch / rate)} (run {_clock(left_run / rate)})" if rate > 0 \
        else "ETA --"
    head = f"epoch {event['epoch']}/{event['epochs']} "
    tail = (f"{step}/{steps} steps | {event['samples_per_second']:,.0f} samples/s | "
            f"loss {event['loss']:.4f} | {eta}")
    width = min(BAR_WIDTH, columns - len(head) - len(tail) - 3)  # 3: the brackets and a space
    if width >= 5:
        done = round(width * step / max(steps, 1))
        return f"{head}[{'#' * done}{'.' * (width - done)}] {tail}"
    compact = f"{step}/{steps} {event['samples_per_second']:,.0f}/s loss {event['loss']:.4f} {eta}"
    for line in (head + tail, head + compact):
        if len(line) <= columns:
            return line
    return (head + compact)[:columns]


class Console:
    """Prints a run's progress events; keeps them, with their arrival time, in ``events``.

    ``live``: show one line that updates in place inside an epoch (step events), for a person
    at a terminal; by default when the stream is one. Logs get the epoch rows only.
    """

    def __init__(self, stream: TextIO | None = None, live: bool | None = None):
        self.stream = stream if stream is not None else sys.stdout
        self.live = live if live is not None else _is_terminal(self.stream)
        self.sinks: list[Any] = []
        """Trackers (``app.tracking``, ``app.timeline``) that see every event after it is
        printed; each has ``handle(event)``."""
        self._line_open = False
        self._lock = threading.Lock()
        self.events: list[dict[str, Any]] = []
        self._header_shown = False
        self._metrics: list[str] = []
        self.launched: float | None = None
        """When the launcher asked Ray Train for the worker group; set to print, on every
        start, where the seconds before the first step went (--verbose)."""

    def line(self, text: str = "") -> None:
        with self._lock:
            if self._line_open:  # the live line gives way to the row
                self.stream.write("\r\x1b[K")
                self._line_open = False
            print(text, file=self.stream, flush=True)

    def _live(self, event: dict[str, Any]) -> None:
        columns = shutil.get_terminal_size((100, 24)).columns
        with self._lock:
            self.stream.write("\r\x1b[K" + progress_line(event, max(columns - 1, 20)))
            self.stream.flush()
            self._line_open = True

    def _timings(self, event: dict[str, Any]) -> None:
        phases = event.get("phases")
        if self.launched is None or not phases:
            return
        self.line(
            f"Start: workers running {phases['worker_entry'] - self.launched:.1f} s after launch; "
            f"data {phases['data_loaded'] - phases['worker_entry']:.1f} s; model and process "
            f"group {phases['model_ready'] - phases['data_loaded']:.1f} s; first step at "
            f"{event['time'] - self.launched:.1f} s."
        )

    def start(self, event: dict[str, Any]) -> None:
        """The worker group (re)started: say with what, and from where."""
        self._timings(event)
        device = "GPU" if event["device"] == "cuda" else "CPU"
        if event["resumed_at_epoch"] is not None and event["resumed_at_epoch"] >= event["epochs"]:
            self.line(
                f"All {event['epochs']} epochs were already trained; raise --epochs to train more."
            )
            return
        if event["resumed_at_epoch"] is not None:
            where = f"after epoch {event['resumed_at_epoch']}"
            if event["resumed_at_epoch_step"]:
                where = (
                    f"at step {event['resumed_at_epoch_step']} of epoch "
                    f"{event['resumed_at_epoch'] + 1}"
                )
            self.line(
                f"Resumed from the checkpoint {where} of {event['epochs']} "
                f"({event['world_size']} {device} workers)."
            )
        else:
            self.line(
                f"Training {event.get('task', 'the task')}"
                f"{'' if event['dataset'] == event.get('task') else ' on ' + event['dataset']}"
                f"{' (Parquet, Ray Data)' if event.get('source') == 'parquet' else ''}: "
                f"{event['num_train']:,} train / "
                f"{event['num_val']:,} validation samples, {count(event['epochs'], 'epoch')}, "
                f"{count(event['world_size'], device + ' worker')}, "
                f"{event['batch_per_worker']} samples per worker per step, "
                f"{_speedups(event)}."
            )
        if not self._header_shown:
            self._metrics = list(event.get("metrics", []))
            self.line(_row(
                "epoch", "workers", "train loss", "val loss",
                [(_column_title(name), _column_title(name)) for name in self._metrics],
                "samples/s", "seconds",
            ))
            self._header_shown = True

    def epoch(self, metrics: dict[str, Any]) -> None:
        self.line(_row(
            metrics["epoch"], metrics["world_size"], f"{metrics['train_loss']:.4f}",
            f"{metrics['val_loss']:.4f}",
            [(_column_title(name), format_metric(name, metrics[name])) for name in self._metrics
             if name in metrics],
            f"{metrics['samples_per_second']:,.0f}", f"{metrics['epoch_seconds']:.1f}",
        ))

    def handle(self, event: dict[str, Any]) -> None:
        if event["event"] == "heartbeat":
            return  # for the driver's watchdog only
        if event["event"] == "step":
            if self.live:
                self._live(event)
        else:
            self.events.append({**event, "received": time.time()})
            self._print(event)
        for sink in self.sinks:
            sink.handle(event)

    def _print(self, event: dict[str, Any]) -> None:
        if event["event"] == "start":
            self.start(event)
        elif event["event"] == "epoch":
            self.epoch(event)
        elif event["event"] == "failure" and event.get("during_start"):
            (why,) = event["workers"].values()
            then = "giving up (no failures left)" if event["fatal"] else "restarting again"
            self.line(f"Lost a worker while the group restarted ({why}): {then}.")
        elif event["event"] == "failure" and not event["fatal"]:  # a fatal one ends the run,
            lost = "; ".join(f"rank {rank}: {why}" for rank, why in event["workers"].items())
            self.line(f"Lost {count(len(event['workers']), 'worker')} ({lost}): restarting from the "
                      "latest checkpoint.")  # which the CLI then says in its error line
        elif event["event"] == "warning":
            self.line(f"warning: {event['message']}")
        elif event["event"] == "partial" and event["reason"] == "resize":
            self.line(
                f"The cluster has room for more workers: checkpointed at step "
                f"{event['epoch_step']} of epoch {event['epoch'] + 1} to grow from there."
            )
        elif event["event"] == "partial" and event["reason"] == "preemption":
            self.line(
                f"A node is being drained: checkpointed at step {event['epoch_step']} of epoch "
                f"{event['epoch'] + 1}."
            )


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _speedups(event: dict[str, Any]) -> str:
    """'bf16, channels-last, compiled': how the workers compute."""
    options = [event["precision"]]
    options += ["channels-last"] if event.get("channels_last") else []
    options += ["compiled"] if event.get("compiled") else []
    return ", ".join(options)
