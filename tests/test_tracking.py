"""The driver's trackers without Ray: the run record's goodput and timeline, TensorBoard's one
stream across restarts, the live progress line, MLflow when its server is down, app.runs."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import time

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from app import runs, timeline, tracking
from app.console import Console, progress_line

T0 = 1_800_000_000.0


def _record(sessions=1):
    """A run: 10 s to its first step, a worker lost in epoch 2 (resumed from epoch 1's
    checkpoint), a resize to 3 workers, and (with ``sessions=2``) a driver killed and rerun."""
    record = {
        "name": "r", "task": "mnist-convnet", "dataset": "digits", "epochs": 3,
        "score": "val_accuracy", "score_mode": "max", "status": "finished",
        "sessions": [{"started": T0, "last_seen": T0 + 60, "ended": T0 + 60,
                      "status": "finished", "host": "elsewhere", "pid": 1}],
        "events": [
            {"event": "start", "time": T0 + 10, "world_size": 2, "step": 0,
             "resumed_at_epoch": None},
            {"event": "epoch", "time": T0 + 20, "epoch": 1, "step": 10, "world_size": 2,
             "epoch_seconds": 8.0, "samples_per_second": 100.0, "score": 0.9},
            {"event": "failure", "time": T0 + 25, "workers": {"1": "killed"}, "fatal": False},
            {"event": "start", "time": T0 + 30, "world_size": 2, "step": 10,
             "resumed_at_epoch": 1},
            {"event": "partial", "time": T0 + 40, "reason": "resize", "step": 20, "epoch": 1,
             "epoch_step": 10, "world_size": 2},
            {"event": "start", "time": T0 + 44, "world_size": 3, "step": 20,
             "resumed_at_epoch": 1},
            {"event": "epoch", "time": T0 + 50, "epoch": 2, "step": 25, "world_size": 3,
             "epoch_seconds": 12.0, "samples_per_second": 120.0, "score": 0.95},
        ],
    }
    if sessions == 2:
        record["sessions"][0].update(status="killed")
        record["sessions"].append({"started": T0 + 1000, "last_seen": T0 + 1020,
                                   "ended": T0 + 1020, "status": "finished"})
        record["events"] += [
            {"event": "start", "time": T0 + 1005, "world_size": 3, "step": 25,
             "resumed_at_epoch": 2},
            {"event": "epoch", "time": T0 + 1015, "epoch": 3, "step": 30, "world_size": 3,
             "epoch_seconds": 6.0, "samples_per_second": 120.0, "score": 0.97},
        ]
    return record


def test_goodput_and_the_seconds_each_disturbance_cost():
    analysis = timeline.analyse(_record())
    assert [(d.kind, d.seconds) for d in analysis.disturbances] == [
        ("startup", 10.0), ("restart", 10.0), ("resize", 4.0)]
    assert "rank 1: killed" in analysis.disturbances[1].detail
    assert analysis.training_seconds == 20.0 and analysis.wall_seconds == 60.0
    assert analysis.goodput == pytest.approx(1 / 3)
    assert analysis.world_sizes == [2, 2, 3]
    assert analysis.summary().startswith("33% (20.0 s training of 60.0 s; startup 10.0 s, "
                                         "1 restart 10.0 s, 1 resize 4.0 s")


def test_a_driver_rerun_counts_its_lost_tail_and_not_the_hours_between():
    record = _record(sessions=2)
    analysis = timeline.analyse(record)
    rerun = analysis.disturbances[-1]
    # 10 s after epoch 2's checkpoint until the driver died, and 5 s to the first step again.
    assert (rerun.kind, rerun.seconds) == ("driver restart", 15.0)
    assert analysis.wall_seconds == 80.0  # the 940 s without a driver are not the run's
    rows = timeline.with_goodput(record, [
        {"epoch": n, "time": e["time"], "epoch_seconds": e["epoch_seconds"]}
        for n, e in enumerate([e for e in record["events"] if e["event"] == "epoch"], 1)])
    assert [row["wall_seconds"] for row in rows] == [20.0, 50.0, 75.0]
    assert rows[-1]["goodput"] == pytest.approx(26 / 75, abs=1e-4)
    assert [row["lost_seconds"] for row in rows] == [10.0, 14.0, 15.0]
    assert rows[1]["lost_to"] == "restart 10.0 s; resize 4.0 s"
    png = timeline.timeline_png(record, analysis, "r")
    assert png[:4] == b"\x89PNG" and len(png) > 10_000


def test_tensorboard_is_one_stream_across_a_restart(tmp_path):
    log = tracking.TensorBoardLog(str(tmp_path / "run"))

    def epoch(number, step, val_loss):
        return {"event": "epoch", "epoch": number, "step": step, "world_size": 2,
                "train_loss": 1.0, "val_loss": val_loss, "val_accuracy": 0.5,
                "samples_per_second": 10.0}

    log.handle({"event": "start", "world_size": 2, "step": 0, "resumed_at_epoch": None,
                "metrics": ["val_accuracy"]})
    log.handle({"event": "step", "step": 5, "loss": 2.0, "lr": 0.5, "samples_per_second": 9.0})
    log.handle(epoch(1, 10, 0.9))
    log.handle(epoch(2, 20, 0.8))  # lost with its checkpoint: the run resumes from step 10
    log.handle({"event": "failure", "workers": {"0": "killed"}, "fatal": False})
    log.handle({"event": "start", "world_size": 2, "step": 10, "resumed_at_epoch": 1})
    log.handle(epoch(2, 20, 0.7))
    log.handle(epoch(3, 30, 0.6))
    log.finish("finished")
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    val = [(point.step, round(point.value, 3)) for point in events.Scalars("epoch/val_loss")]
    assert val == [(10, 0.9), (20, 0.7), (30, 0.6)]
    assert [point.step for point in events.Scalars("train/loss")] == [5]
    assert [point.value for point in events.Scalars("epoch/val_accuracy")] == [0.5] * 3


def _step(epoch_step):
    return {"event": "step", "epoch": 2, "epochs": 5, "epoch_step": epoch_step,
            "steps_in_epoch": 100, "step": 100 + epoch_step, "loss": 0.25, "lr": 0.5,
            "samples_per_second": 6400.0, "steps_per_second": 50.0, "world_size": 2}


def test_live_line_updates_in_place_and_gives_way_to_rows():
    stream = io.StringIO()
    console = Console(stream, live=True)
    console.handle(_step(40))
    console.line("a row")
    text = stream.getvalue()
    assert text.startswith("\r\x1b[Kepoch 2/5 [########............] 40/100 steps | 6,400 "
                           "samples/s | loss 0.2500 | ETA 0:01 (run 0:07)\r")
    assert text.endswith("\r\x1b[Ka row\n")
    plain = io.StringIO()
    Console(plain, live=False).handle(_step(40))
    assert plain.getvalue() == ""


def test_live_line_keeps_the_run_eta_on_a_narrow_terminal():
    full = progress_line(_step(40))
    assert len(full) > 80
    for columns in (80, 72, 60):
        line = progress_line(_step(40), columns)
        assert len(line) <= columns, line
        assert line.endswith("ETA 0:01 (run 0:07)"), line
    narrower = progress_line(_step(40), 90)
    assert len(narrower) <= 90 and "[####.......] 40/100 steps" in narrower, narrower
    assert "[" not in progress_line(_step(40), 80), "no bar where none fits"
    assert progress_line(_step(40), 60) == \
        "epoch 2/5 40/100 6,400/s loss 0.2500 ETA 0:01 (run 0:07)"
    assert len(progress_line(_step(40), 30)) == 30


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_mlflow_server_down_warns_once_and_never_blocks(tmp_path):
    warnings = []
    started = time.monotonic()
    log = tracking.MlflowLog(
        tracking.MlflowSettings(f"http://127.0.0.1:{_free_port()}"), str(tmp_path), "r",
        {"lr": 0.5}, warnings.append)
    for number in (1, 2, 3):
        log.handle({"event": "epoch", "epoch": number, "val_loss": 0.5, "train_loss": 0.5})
    log.finish("finished")
    assert time.monotonic() - started < 30
    assert len(warnings) == 1 and "training goes on without it" in warnings[0], warnings


def test_runs_lists_and_shows_runs(tmp_path, capsys):
    folder = tmp_path / "runs" / "r"
    folder.mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps(_record(sessions=2)))
    (folder / "metrics.csv").write_text("epoch\n1\n")
    assert runs.main(["--storage-path", str(tmp_path / "runs")]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed[0].split() == list(runs.COLUMNS)
    assert listed[1].split()[:7] == ["r", "mnist-convnet", "finished", "3/3", "97.00%",
                                     "(accuracy)", "2,3"]
    assert runs.main(["--storage-path", str(tmp_path / "runs"), "r"]) == 0
    shown = capsys.readouterr().out
    assert "restart: 2 workers at step 10, 10.0 s lost; lost rank 1: killed" in shown
    assert "driver restart: 3 workers at step 25, 15.0 s lost" in shown
    assert f"metrics:     {folder / 'metrics.csv'}" in shown
    assert runs.main(["--storage-path", str(tmp_path / "runs"), "nope"]) == 2
    assert "no run named 'nope'" in capsys.readouterr().err


def test_runs_output_cut_short_by_its_reader_is_no_traceback(tmp_path, monkeypatch):
    folder = tmp_path / "runs" / "r"
    folder.mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps(_record()))

    class ClosedPipe(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr("sys.stdout", ClosedPipe())
    assert runs.main(["--storage-path", str(tmp_path / "runs"), "r"]) == 0


def test_a_trial_record_reopened_after_its_stop_is_closed_again_when_the_sweep_ends(tmp_path):
    """Tune reports a trial stopped by the scheduler while the trial's process may still save
    its record as running: the sweep closes it at once, and again after the sweep."""
    from types import SimpleNamespace

    from app.sweep_console import SweepConsole

    run_uri = str(tmp_path / "trial-t1")
    trial_side = timeline.RunRecord(run_uri, "trial-t1", {"epochs": 4, "score": "val_accuracy",
                                                        "score_mode": "max"}, time.time())
    trial_side.save()
    sweep = SweepConsole(Console(io.StringIO()), "val_accuracy", "max", str(tmp_path),
                         mlflow_on=False)
    trial = SimpleNamespace(trial_id="t1", last_result={"epoch": 1, "val_accuracy": 0.5},
                            config={"num_workers": 1, "train": {"optim": {"lr": 0.1},
                                                                "loop": {"epochs": 4,
                                                                         "global_batch_size": 64}}})
    sweep.trial_ended(trial, error=False)
    assert timeline.load(run_uri)["status"] == "stopped early"
    trial_side.save()  # the trial's process, not yet gone, saves its record again
    assert timeline.load(run_uri)["status"] == "running"
    sweep.close_records()
    assert timeline.load(run_uri)["status"] == "stopped early"


def test_a_trial_that_recorded_failed_as_tune_stopped_it_is_closed_as_stopped_early(tmp_path):
    """The trial's process can see an error while Tune stops it and close its record as failed
    first; Tune's verdict wins. A trial that Tune saw fail keeps its failed record."""
    from types import SimpleNamespace

    from app.sweep_console import SweepConsole

    sweep = SweepConsole(Console(io.StringIO()), "val_accuracy", "max", str(tmp_path),
                         mlflow_on=False)
    config = {"num_workers": 1, "train": {"optim": {"lr": 0.1},
                                          "loop": {"epochs": 4, "global_batch_size": 64}}}
    for trial_id, error, expected in (("t1", False, "stopped early"), ("t2", True, "failed")):
        run_uri = str(tmp_path / f"trial-{trial_id}")
        trial_side = timeline.RunRecord(run_uri, f"trial-{trial_id}",
                                        {"epochs": 4, "score": "val_accuracy"}, time.time())
        trial_side.close("failed")  # the trial's process, as Tune stops it
        trial = SimpleNamespace(trial_id=trial_id, config=config,
                                last_result={"epoch": 1, "val_accuracy": 0.5},
                                get_pickled_error=lambda: None, get_error=lambda: None)
        sweep.trial_ended(trial, error=error)
        record = timeline.load(run_uri)
        assert (record["status"], record["sessions"][-1]["status"]) == (expected, expected)
        assert (tmp_path / f"trial-{trial_id}" / timeline.TIMELINE_FILE).exists() \
            == (expected == "stopped early")
    sweep.close_records()
    assert timeline.load(str(tmp_path / "trial-t1"))["status"] == "stopped early"


def test_a_trial_record_frozen_as_tune_stops_the_trial_keeps_the_sweeps_verdict(
        tmp_path, monkeypatch):
    """Tune stops a trial without stopping its training thread; from the trial's cleanup on,
    that thread's progress events no longer touch the record the sweep closes."""
    import threading
    from types import SimpleNamespace

    from app.sweep_console import SweepConsole

    monkeypatch.setattr(timeline, "_frozen", threading.Event())  # this process's flag
    run_uri = str(tmp_path / "trial-t1")
    trial_side = timeline.RunRecord(run_uri, "trial-t1", {"epochs": 4, "score": "val_accuracy"},
                                    time.time())
    trial_side.handle({"event": "epoch", "epoch": 1, "step": 5, "val_accuracy": 0.5})
    timeline.freeze_records()  # the trial's cleanup, as Tune stops it
    sweep = SweepConsole(Console(io.StringIO()), "val_accuracy", "max", str(tmp_path),
                         mlflow_on=False)
    trial = SimpleNamespace(trial_id="t1", last_result={"epoch": 1, "val_accuracy": 0.5},
                            config={"num_workers": 1, "train": {"optim": {"lr": 0.1},
                                                                "loop": {"epochs": 4,
                                                                         "global_batch_size": 64}}})
    sweep.trial_ended(trial, error=False)
    trial_side.handle({"event": "epoch", "epoch": 2, "step": 10, "val_accuracy": 0.6})
    trial_side.close("failed")
    record = timeline.load(run_uri)
    assert record["status"] == "stopped early"
    assert [event["epoch"] for event in record["events"] if event["event"] == "epoch"] == [1]


def test_a_record_read_while_it_is_rewritten_is_the_old_or_the_new_one_whole(tmp_path):
    """The sweep reads a trial's record while the trial's process rewrites it: never a part."""
    import threading

    from app import results

    uri = str(tmp_path / "run" / "run.json")
    payloads = [json.dumps({"n": n, "pad": "x" * 400_000}).encode() for n in range(2)]
    results.write_file(uri, payloads[0])
    (tmp_path / "run" / "run.json").chmod(0o640)
    done = threading.Event()

    def rewrite():
        for n in range(200):
            results.write_file(uri, payloads[n % 2])
        done.set()

    writer = threading.Thread(target=rewrite)
    writer.start()
    reads = 0
    while not done.is_set():
        assert results.read_file(uri) in payloads
        reads += 1
    writer.join()
    assert reads > 10
    assert sorted(path.name for path in (tmp_path / "run").iterdir()) == ["run.json"]
    assert (tmp_path / "run" / "run.json").stat().st_mode & 0o777 == 0o640


_PROBE = """
import os, time
import app.train
from app import PROCESS_STARTED
with open("/proc/self/stat") as stat:  # field 22: the start, in clock ticks since boot
    ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
with open("/proc/uptime") as uptime:
    age = float(uptime.read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
print(age - (time.time() - PROCESS_STARTED))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads Linux's /proc")
def test_a_runs_startup_counts_from_the_command_not_from_its_imports():
    # A fresh interpreter, as `python -m app.train` is: its timeline's start is the process's
    # own, not a moment after torch's import (1-2 s here).
    result = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                            timeout=60, check=True)
    assert float(result.stdout) < 0.3, "counted from after the imports"
