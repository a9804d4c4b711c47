"""What a person watching a run sees: a header, one row per epoch, and where the results are."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

_ROW = "{epoch:>7} {world:>8} {train_loss:>11} {val_loss:>9} {val_acc:>8} {throughput:>10} {seconds:>8}"


class Console:
    """Prints a run's progress events; keeps them, with their arrival time, in ``events``."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream if stream is not None else sys.stdout
        self.events: list[dict[str, Any]] = []
        self._header_shown = False

    def line(self, text: str = "") -> None:
        print(text, file=self.stream, flush=True)

    def start(self, event: dict[str, Any]) -> None:
        """The worker group (re)started: say with what, and from where."""
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
                f"Training ConvNet on {event['dataset']}"
                f"{' (Parquet, Ray Data)' if event.get('source') == 'parquet' else ''}: "
                f"{event['num_train']:,} train / "
                f"{event['num_val']:,} validation images, {event['epochs']} epochs, "
                f"{event['world_size']} {device} worker(s), "
                f"{event['batch_per_worker']} samples per worker per step, {event['precision']}."
            )
        if not self._header_shown:
            self.line(
                _ROW.format(
                    epoch="epoch", world="workers", train_loss="train loss", val_loss="val loss",
                    val_acc="val acc", throughput="samples/s", seconds="seconds",
                )
            )
            self._header_shown = True

    def epoch(self, metrics: dict[str, Any]) -> None:
        self.line(
            _ROW.format(
                epoch=metrics["epoch"],
                world=metrics["world_size"],
                train_loss=f"{metrics['train_loss']:.4f}",
                val_loss=f"{metrics['val_loss']:.4f}",
                val_acc=f"{100 * metrics['val_accuracy']:.2f}%",
                throughput=f"{metrics['samples_per_second']:,.0f}",
                seconds=f"{metrics['epoch_seconds']:.1f}",
            )
        )

    def handle(self, event: dict[str, Any]) -> None:
        if event["event"] == "heartbeat":
            return  # for the driver's watchdog only
        self.events.append({**event, "received": time.time()})
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
            self.line(f"Lost {len(event['workers'])} worker(s) ({lost}): restarting from the "
                      "latest checkpoint.")  # which the CLI then says in its error line
        elif event["event"] == "warning":
            self.line(f"warning: {event['message']}")
        elif event["event"] == "partial" and event["reason"] == "preemption":
            self.line(
                f"A node is being drained: checkpointed at step {event['epoch_step']} of epoch "
                f"{event['epoch'] + 1}."
            )
