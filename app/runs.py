"""Command line: ``python -m app.runs`` — the runs kept in a storage path, and one run's story.

Reads each run's record (``run.json``, ``app.timeline``): no Ray, no cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from typing import Any

import pyarrow.fs

from app import results, timeline
from app.cli import HelpFormatter, Parser, run_main
from app.config import UserError
from app.console import Console
from app.storage import join, storage_uri
from app.tracking import MLFLOW_FILE, TENSORBOARD_DIR


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="python -m app.runs",
        description="List the training runs in a storage path (name, task, status, epochs, "
        "best score, world sizes, goodput), or show one: its starts, restarts, resizes, "
        "failures and epochs, and where its results are. Sweep trials are listed as "
        "SWEEP/trial-ID.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("name", nargs="?", default=None,
                        help="show this run (as listed) instead of listing them all")
    parser.add_argument("--storage-path", default="runs",
                        help="where the runs are kept (local folder or s3://bucket/prefix)")
    return parser


def _folders(storage: str, prefix: str = "") -> list[tuple[str, str]]:
    """(listed name, URI) of the run folders under ``storage``, and of sweeps' trial runs."""
    filesystem, base = pyarrow.fs.FileSystem.from_uri(storage)
    try:
        infos = filesystem.get_file_info(pyarrow.fs.FileSelector(base, allow_not_found=True))
    except (OSError, pyarrow.ArrowException) as error:
        raise UserError(f"cannot list {storage}: {error}") from None
    found = []
    for info in sorted(infos, key=lambda info: info.base_name):
        if info.type != pyarrow.fs.FileType.Directory or info.base_name.startswith("."):
            continue
        uri = join(storage, info.base_name)
        name = f"{prefix}{info.base_name}"
        if not prefix and _exists(join(uri, "sweep.json")):
            found += _folders(join(uri, "train_runs"), prefix=f"{name}/")
        else:
            found.append((name, uri))
    return found


def _exists(uri: str) -> bool:
    filesystem, path = pyarrow.fs.FileSystem.from_uri(uri)
    try:
        return filesystem.get_file_info(path).type != pyarrow.fs.FileType.NotFound
    except (OSError, pyarrow.ArrowException):
        return False


def status(record: dict[str, Any]) -> str:
    """The record's status; a run still 'running' whose driver is gone is 'stopped'."""
    if record.get("status") != "running":
        return record.get("status", "?")
    session = record["sessions"][-1]
    if session.get("host") == socket.gethostname():
        try:
            os.kill(int(session.get("pid", -1)), 0)
        except ProcessLookupError:
            return "stopped (driver lost)"
        except (PermissionError, ValueError, OverflowError):
            pass
    return "running"


def _epochs(record: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """The last record of each epoch trained."""
    return {event["epoch"]: event for event in record["events"] if event["event"] == "epoch"}


def _best(record: dict[str, Any]) -> tuple[float, int] | None:
    scored = [(event["score"], number) for number, event in _epochs(record).items()
              if "score" in event]
    if not scored:
        return None
    pick = max if record.get("score_mode", "max") == "max" else min
    return pick(scored, key=lambda pair: pair[0])


def summarise(name: str, record: dict[str, Any]) -> dict[str, Any]:
    analysis = timeline.analyse(record)
    epochs = _epochs(record)
    best = _best(record)
    score = record.get("score", "score")
    return {
        "name": name,
        "task": record.get("task", "?"),
        "status": status(record),
        "epochs": f"{max(epochs, default=0)}/{record.get('epochs', '?')}",
        "best": f"{results.format_metric(score, best[0])} ({score.removeprefix('val_')})"
        if best else "-",
        "workers": ",".join(map(str, sorted(set(analysis.world_sizes)))) or "-",
        "goodput": f"{100 * analysis.goodput:.0f}%" if analysis.wall_seconds else "-",
        "started": time.strftime("%Y-%m-%d %H:%M", time.localtime(record["sessions"][0]["started"]))
        if record.get("sessions") else "-",
    }


COLUMNS = ("name", "task", "status", "epochs", "best", "workers", "goodput", "started")


def table(rows: list[dict[str, Any]]) -> str:
    widths = {column: max(len(column), *(len(str(row[column])) for row in rows))
              for column in COLUMNS}
    lines = ["  ".join(column.ljust(widths[column]) for column in COLUMNS)]
    lines += ["  ".join(str(row[column]).ljust(widths[column]) for column in COLUMNS)
              for row in rows]
    return "\n".join(line.rstrip() for line in lines)


def list_runs(storage: str, console: Console) -> int:
    rows = []
    for name, uri in _folders(storage):
        record = timeline.load(uri)
        if record is not None:
            rows.append(summarise(name, record))
        elif _exists(join(uri, "checkpoint_manager_snapshot.json")):
            rows.append({column: "?" for column in COLUMNS} | {
                "name": name, "status": "? (no run.json)"})
    if not rows:
        console.line(f"No runs in {storage}.")
        return 0
    console.line(table(rows))
    return 0


def show_run(storage: str, name: str, console: Console) -> int:
    sweep, _, trial = name.partition("/")
    uri = join(storage, sweep, "train_runs", trial) if trial else join(storage, name)
    record = timeline.load(uri)
    if record is None:
        raise UserError(f"no run named {name!r} with a record in {storage} "
                        f"(python -m app.runs --storage-path {storage} lists them)")
    row = summarise(name, record)
    analysis = timeline.analyse(record)
    console.line(f"Run {name}: {row['task']} on {record.get('dataset', '?')}, {row['status']}")
    console.line(f"  folder:      {uri}")
    console.line(f"  epochs:      {row['epochs']}; best {row['best']}")
    console.line(f"  world sizes: {row['workers']}")
    console.line(f"  goodput:     {analysis.summary()}")
    console.line(f"  sessions:    {len(record['sessions'])} (driver runs of the command)")
    console.line()
    at = timeline.wall_clock(record)
    disturbances = {item.time: item for item in analysis.disturbances}
    for session in record["sessions"]:
        console.line(f"  {at(session['started']):8.1f} s  command started "
                     f"({time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(session['started']))}"
                     f", pid {session.get('pid', '?')})")
        for event in sorted(record["events"], key=lambda event: event["time"]):
            if not session["started"] <= event["time"] <= timeline._session_end(session) + 1 \
                    or event.get("reason") == "interval":
                continue
            console.line(f"  {at(event['time']):8.1f} s  {_describe(event, record, disturbances)}")
        if "ended" in session:
            console.line(f"  {at(session['ended']):8.1f} s  command ended: {session['status']}")
    console.line()
    for label, file in (("metrics", results.METRICS_FILE), ("curves", results.CURVES_FILE),
                        ("timeline", timeline.TIMELINE_FILE), ("tensorboard", TENSORBOARD_DIR)):
        if _exists(join(uri, file)):
            console.line(f"  {label + ':':12} {join(uri, file)}")
    try:
        saved = json.loads(results.read_file(join(uri, MLFLOW_FILE)))
        console.line(f"  {'mlflow:':12} run {saved['run_id']} at {saved['tracking_uri']}")
    except (OSError, ValueError, KeyError):
        pass
    return 0


def _describe(event: dict[str, Any], record: dict[str, Any],
              disturbances: dict[float, timeline.Disturbance]) -> str:
    kind = event["event"]
    if kind == "start":
        item = disturbances.get(event["time"])
        what = item.kind if item is not None else "start"
        lost = f", {item.seconds:.1f} s lost" if item is not None else ""
        detail = f"; {item.detail}" if item is not None and item.detail else ""
        where = f" at step {event.get('step', 0)}" if event.get("step") else ""
        return f"{what}: {results.count(event['world_size'], 'worker')}{where}{lost}{detail}"
    if kind == "epoch":
        score = record.get("score", "")
        value = f", {score} {results.format_metric(score, event['score'])}" \
            if "score" in event else ""
        return (f"epoch {event['epoch']} done ({event['world_size']} workers, "
                f"{event['samples_per_second']:,.0f} samples/s{value})")
    if kind == "failure":
        lost = "; ".join(f"rank {rank}: {why}" for rank, why in event["workers"].items())
        return f"worker failure: {lost}{' (fatal)' if event.get('fatal') else ''}"
    if kind == "partial":
        why = {"resize": "to grow the group", "preemption": "a node is being drained",
               "interval": "periodic"}.get(event.get("reason"), event.get("reason"))
        return f"checkpoint at step {event['step']} ({why})"
    return kind


def main(argv: list[str] | None = None) -> int:
    def run(args, console: Console) -> int:
        storage = storage_uri(args.storage_path)
        if args.name:
            return show_run(storage, args.name, console)
        return list_runs(storage, console)

    return run_main(build_parser(), run, argv, interrupted="nothing was changed")


if __name__ == "__main__":
    sys.exit(main())
