"""A run's record across its driver sessions (``<run>/run.json``): when it started, restarted,
resized, lost workers, was preempted and finished each epoch; its goodput (seconds training ÷
wall seconds) and the seconds each event cost; ``timeline.png``; the status ``app.runs`` lists.

The driver writes it from the progress events it already receives, so it costs the workers
nothing; it is rewritten whole at each event (a few kB), through pyarrow's filesystem layer, so
an ``s3://`` run keeps one too.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from app import results
from app.storage import join

RECORD_FILE = "run.json"
TIMELINE_FILE = "timeline.png"

_KEPT = {
    "start": ("world_size", "step", "resumed_at_epoch", "resumed_at_epoch_step", "device"),
    "failure": ("workers", "fatal", "during_start"),
    "partial": ("reason", "step", "epoch", "epoch_step", "world_size"),
    "epoch": ("epoch", "step", "world_size", "epoch_seconds", "samples_per_second", "val_loss"),
}
"""The events a record keeps, and their fields (besides ``event`` and ``time``)."""


_frozen = threading.Event()
_saving = threading.Lock()


def freeze_records() -> None:
    """Stop every ``RunRecord`` of this process from writing, for good, once no write is under
    way. A sweep's trial calls it as Ray Tune stops the trial: Tune does not stop the trial's
    training thread, which goes on reporting until the process is gone, and the sweep closes
    the record (``finalize``) with the verdict only it knows."""
    with _saving:
        _frozen.set()


def records_frozen() -> bool:
    """Whether ``freeze_records`` was called in this process."""
    return _frozen.is_set()


def load(run_uri: str) -> dict[str, Any] | None:
    """The record of the run at ``run_uri``; None when it has none (or it cannot be read)."""
    try:
        record = json.loads(results.read_file(join(run_uri, RECORD_FILE)))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and "sessions" in record else None


class RunRecord:
    """Keeps ``<run>/run.json`` as the run goes (a tracker: ``handle`` every progress event,
    ``finish`` once)."""

    def __init__(self, run_uri: str, name: str, info: dict[str, Any], started: float):
        self.run_uri = run_uri
        self.record = load(run_uri) or {"name": name, "sessions": [], "events": []}
        self.record.update(info)  # task, dataset, epochs planned, score (the latest command's)
        self.record["status"] = "running"
        for earlier in self.record["sessions"]:
            # The run lock keeps a second driver off a running run: this driver's predecessor
            # died without closing its session (kill -9, a lost machine).
            if earlier.get("status") == "running":
                earlier.update(status="lost", ended=earlier.get("last_seen", earlier["started"]))
        self.session = {"started": started, "last_seen": time.time(), "status": "running",
                        "host": socket.gethostname(), "pid": os.getpid()}
        self.record["sessions"].append(self.session)
        self.save()

    def save(self) -> None:
        with _saving:
            if not _frozen.is_set():
                results.write_file(join(self.run_uri, RECORD_FILE),
                                   json.dumps(self.record, indent=1).encode())

    def handle(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind not in _KEPT:
            return
        kept = {"event": kind, "time": event.get("time") or time.time()}
        kept.update({key: event[key] for key in _KEPT[kind] if key in event})
        if kind == "epoch" and self.record.get("score") in event:
            kept["score"] = event[self.record["score"]]
        self.record["events"].append(kept)
        self.session["last_seen"] = time.time()
        self.save()

    def finish(self, status: str, summary: Any = None) -> None:
        """The tracker's end: nothing, the launcher ``close``s the record before it writes the
        results, which hold its goodput."""

    def close(self, status: str, best: dict[str, Any] | None = None) -> None:
        """``status``: finished, failed, interrupted or terminated."""
        now = time.time()
        self.session.update(last_seen=now, ended=now, status=status)
        self.record["status"] = status
        if best is not None:
            self.record["best"] = best
        self.save()


# --- reading a record ---------------------------------------------------------------------------

@dataclass
class Disturbance:
    """Something that stopped training, and the wall seconds from the work it lost (since the
    checkpoint the run went on from) to the next step."""

    kind: str
    """startup, driver restart, restart (a failure), resize or preemption."""
    time: float
    seconds: float
    detail: str = ""
    world_size: int = 0
    """The world size the run went on with."""


@dataclass
class Analysis:
    wall_seconds: float
    training_seconds: float
    disturbances: list[Disturbance] = field(default_factory=list)
    world_sizes: list[int] = field(default_factory=list)

    @property
    def goodput(self) -> float:
        return self.training_seconds / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def lost(self, kind: str) -> float:
        return sum(item.seconds for item in self.disturbances if item.kind == kind)

    def summary(self) -> str:
        """'71% (30.1 s training of 42.4 s; startup 9.0 s, 1 restart 6.2 s, ...)'."""
        parts = []
        for kind in ("startup", "driver restart", "restart", "resize", "preemption"):
            items = [item for item in self.disturbances if item.kind == kind]
            if items:
                count = f"{len(items)} " if kind != "startup" else ""
                plural = "s" if len(items) > 1 and kind != "startup" else ""
                parts.append(f"{count}{kind}{plural} {sum(i.seconds for i in items):.1f} s")
        other = self.wall_seconds - self.training_seconds - sum(
            item.seconds for item in self.disturbances)
        parts.append(f"validation, checkpoints and the rest {max(other, 0.0):.1f} s")
        return (f"{100 * self.goodput:.0f}% ({self.training_seconds:.1f} s training of "
                f"{self.wall_seconds:.1f} s; " + ", ".join(parts) + ")")


def _session_end(session: dict[str, Any]) -> float:
    return session.get("ended") or session.get("last_seen") or session["started"]


def wall_clock(record: dict[str, Any]):
    """A function from a time to the run's wall seconds up to it: the driver sessions' seconds,
    so the hours between a killed driver and its rerun do not count."""
    sessions = sorted(record["sessions"], key=lambda session: session["started"])

    def at(moment: float) -> float:
        total = 0.0
        for index, session in enumerate(sessions):
            if moment < session["started"]:
                break
            end = _session_end(session)
            if index == len(sessions) - 1:
                end = max(end, moment)  # the session still running
            total += min(moment, end) - session["started"]
        return total

    return at


def _session_of(record: dict[str, Any], moment: float) -> int:
    index = 0
    for position, session in enumerate(record["sessions"]):
        if session["started"] <= moment:
            index = position
    return index


def analyse(record: dict[str, Any], history: list[dict[str, Any]] | None = None) -> Analysis:
    """Goodput and the disturbances of a run's record. ``history``: the epochs the run kept
    (the latest checkpoint's); without it, the last record of each epoch stands in."""
    events = sorted(record["events"], key=lambda event: event["time"])
    sessions = record["sessions"]
    if history is None:
        by_epoch = {event["epoch"]: event for event in events if event["event"] == "epoch"}
        history = list(by_epoch.values())
    analysis = Analysis(
        wall_seconds=sum(_session_end(s) - s["started"] for s in sessions),
        training_seconds=sum(row.get("epoch_seconds", 0.0) for row in history),
    )
    checkpoints = [event for event in events if event["event"] in ("epoch", "partial")]
    previous_start: dict[str, Any] | None = None
    for index, event in enumerate(events):
        if event["event"] != "start":
            continue
        analysis.world_sizes.append(event["world_size"])
        since = [e for e in events[:index] if previous_start is None
                 or e["time"] > previous_start["time"]]
        session = sessions[_session_of(record, event["time"])]
        first_of_session = previous_start is None or \
            _session_of(record, previous_start["time"]) != _session_of(record, event["time"])
        # The checkpoint the group started from: the last one reported at its step.
        resumed_from = [c for c in checkpoints if c["time"] < event["time"]
                        and c.get("step") == event.get("step")]
        kept_at = resumed_from[-1]["time"] if resumed_from else None
        if first_of_session:
            if previous_start is None and not event.get("resumed_at_epoch"):
                kind, seconds, detail = "startup", event["time"] - session["started"], ""
            else:
                kind, detail = "driver restart", "the driver was stopped and rerun"
                seconds = event["time"] - session["started"]
                before = sessions[_session_of(record, event["time"]) - 1] \
                    if _session_of(record, event["time"]) > 0 else None
                if before is not None and kept_at is not None and kept_at >= before["started"]:
                    seconds += _session_end(before) - kept_at  # the work it lost
        else:
            failures = [e for e in since if e["event"] == "failure"]
            grow = [e for e in since if e["event"] == "partial" and e.get("reason") == "resize"]
            drain = [e for e in since if e["event"] == "partial"
                     and e.get("reason") == "preemption"]
            if failures and not grow:
                kind = "restart"
                lost = "; ".join(f"rank {rank}: {why}" for failure in failures
                                 for rank, why in failure["workers"].items())
                detail = f"lost {lost}"
                since_time = kept_at if kept_at is not None else failures[0]["time"]
            elif grow:
                kind, detail, since_time = "resize", "grew onto new nodes", grow[-1]["time"]
            elif drain:
                kind, detail, since_time = "preemption", "a node was drained", drain[-1]["time"]
            else:
                kind, detail = "resize", "the worker group was resized"
                since_time = kept_at if kept_at is not None else previous_start["time"]
            seconds = event["time"] - since_time
            if drain and kind == "restart":
                kind = "preemption"
        analysis.disturbances.append(Disturbance(
            kind=kind, time=event["time"], seconds=max(seconds, 0.0), detail=detail,
            world_size=event["world_size"],
        ))
        previous_start = event
    return analysis


def with_goodput(record: dict[str, Any] | None, history: list[dict[str, Any]]
                 ) -> list[dict[str, Any]]:
    """The epoch rows with ``wall_seconds`` (the run's wall time at the row), ``goodput``
    (training seconds up to the row ÷ that) and ``lost_seconds`` (what the starts, restarts
    and resizes since the previous row cost, named in ``lost_to``), for metrics.csv."""
    if record is None or not record.get("sessions"):
        return history
    at = wall_clock(record)
    disturbances = analyse(record, history).disturbances
    rows, trained, previous = [], 0.0, float("-inf")
    for row in history:
        trained += row.get("epoch_seconds", 0.0)
        moment = row.get("time", previous)
        wall = at(moment) if "time" in row else 0.0
        since = [item for item in disturbances if previous < item.time <= moment]
        previous = moment
        rows.append({**row, "wall_seconds": round(wall, 3),
                     "goodput": round(trained / wall, 4) if wall > 0 else "",
                     "lost_seconds": round(sum(item.seconds for item in since), 3),
                     "lost_to": "; ".join(f"{item.kind} {item.seconds:.1f} s" for item in since)})
    return rows


_MARKERS = {
    "startup": ("^", "tab:green"),
    "driver restart": ("s", "tab:purple"),
    "restart": ("^", "tab:orange"),
    "resize": ("D", "tab:blue"),
    "preemption": ("v", "tab:brown"),
}


def timeline_png(record: dict[str, Any], analysis: Analysis, title: str) -> bytes:
    """World size over the run's wall time, every start, restart, resize, failure and
    preemption marked, and the epochs' ends."""
    pyplot = results.load_plotting()
    at = wall_clock(record)
    events = sorted(record["events"], key=lambda event: event["time"])
    figure, axes = pyplot.subplots(figsize=(10, 4))
    # The world size: set by each start, 0 from a failure or the end of a driver session.
    xs, ys, size = [0.0], [0], 0
    for event in events:
        x = at(event["time"])
        if event["event"] == "start":
            size = event["world_size"]
        elif event["event"] == "failure":
            size = 0
        else:
            continue
        xs.append(x)
        ys.append(size)
    for session in record["sessions"][:-1]:
        xs.append(at(_session_end(session)))
        ys.append(0)
    xs.append(analysis.wall_seconds)
    ys.append(ys[-1] if record.get("status") == "running" else 0)
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    axes.step([xs[i] for i in order], [ys[i] for i in order], where="post", color="black",
              linewidth=1.5, label="workers")
    top = max([*ys, 1])
    for kind, (marker, colour) in _MARKERS.items():
        items = [item for item in analysis.disturbances if item.kind == kind]
        if items:
            axes.scatter([at(item.time) for item in items], [item.world_size for item in items],
                         marker=marker, s=80, color=colour, zorder=3,
                         label=f"{kind} ({sum(item.seconds for item in items):.1f} s lost)")
    failures = [event for event in events if event["event"] == "failure"]
    if failures:
        axes.scatter([at(event["time"]) for event in failures], [0] * len(failures), marker="x",
                     s=80, color="tab:red", zorder=3, label="worker failure")
    trained = [event for event in events if event["event"] == "epoch"]
    for number, event in enumerate(trained):
        # An epoch's training seconds end where its validation began, just before its row.
        end = at(event["time"])
        axes.axvspan(end - event.get("epoch_seconds", 0.0), end, color="tab:green", alpha=0.15,
                     linewidth=0, label="training" if number == 0 else None)
    for event in events:
        if event["event"] == "epoch":
            axes.axvline(at(event["time"]), color="grey", alpha=0.3, linewidth=0.8)
            axes.annotate(f"{event['epoch']}", (at(event["time"]), top + 0.25), ha="center",
                          fontsize=7, color="grey")
    for session in record["sessions"][1:]:
        axes.axvline(at(session["started"]), color="tab:purple", linestyle="--", linewidth=1)
    axes.set(xlabel="wall seconds (driver sessions end to end; grey lines: epoch ends)",
             ylabel="workers", ylim=(-0.3, top + 0.8))
    axes.yaxis.get_major_locator().set_params(integer=True)
    axes.grid(alpha=0.3)
    axes.legend(loc="lower right", fontsize=8)
    return results.png_bytes(figure, f"{title}: goodput {100 * analysis.goodput:.0f}%")


def close_record(record: dict[str, Any], status: str) -> Analysis:
    """End a record's last session with ``status`` and note its goodput and world sizes."""
    session = record["sessions"][-1]
    session.setdefault("ended", session.get("last_seen", session["started"]))
    session["status"] = status
    record["status"] = status
    analysis = analyse(record)
    record["goodput"] = round(analysis.goodput, 4)
    record["world_sizes"] = sorted(set(analysis.world_sizes))
    return analysis


def finalize(run_uri: str, status: str, *, overrule: Collection[str] = ()) -> None:
    """Close the record of a run whose driver could not (a sweep trial that Tune ended) and
    draw its timeline. A record already closed is left as it is, unless its status is one of
    ``overrule``: the trial's own process can record ``failed`` as Tune stops it."""
    record = load(run_uri)
    if record is None or record.get("status") not in {"running", *overrule}:
        return
    analysis = close_record(record, status)
    results.write_file(join(run_uri, RECORD_FILE), json.dumps(record, indent=1).encode())
    results.write_file(join(run_uri, TIMELINE_FILE), timeline_png(
        record, analysis, run_uri.rstrip("/").rsplit("/", 1)[-1]))
