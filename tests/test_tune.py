"""Ray Tune sweeps of whole training runs, through the command line, on real local clusters."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import forkcli
import pytest
import ray
from localnet import free_port
from localray import local_ray

from app import tune
from app.storage import UNREADABLE_SUFFIX

pytestmark = pytest.mark.integration


def _sweep_args(args, address):
    return [*args, *(["--address", address] if address else [])]


def _tune(*args, cwd, timeout=600, address=None):
    command = [sys.executable, "-m", "app.tune", *_sweep_args(args, address)]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _refused(*args, cwd, address=None):
    """A sweep command expected to be refused, forked from a process that has imported the app
    (see forkcli) instead of started from nothing."""
    return forkcli.run("app.tune", *_sweep_args(args, address), cwd=cwd, timeout=60)


def _table_rows(path: Path) -> list[list[str]]:
    """The ranked trial rows of trials.txt, split into columns."""
    lines = path.read_text().split("\n\n")[0].splitlines()[1:]
    return [line.split() for line in lines]


def test_sweep_ranks_trials_and_reports_scaling(small_mnist_dir, tmp_path, mlflow_server):
    result = _tune(
        "--lr", "0.7,0.0001", "--num-workers", "1,2", "--num-samples", "1", "--epochs", "3",
        "--scheduler", "fifo", "--data-dir", str(small_mnist_dir), "--name", "grid",
        "--target", "0.8", "--mlflow-uri", mlflow_server, "--mlflow-experiment", "sweeps",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # The sweep's own lines, none of Tune's tables, boxes or hints.
    for noise in ("Trial status", "Configuration for experiment", "│", "╭", "tensorboard --logdir",
                  "View detailed results"):
        assert noise not in result.stdout + result.stderr, noise
    lines = result.stdout.splitlines()
    assert len([line for line in lines if re.match(r"trial \w+ started: lr ", line)]) == 4
    assert len([line for line in lines if re.match(r"trial \w+ finished: lr .*; best "
                                                   r"val_accuracy .* at epoch \d; \d+ s", line)]) == 4
    sweep = tmp_path / "runs" / "grid"
    rows = _table_rows(sweep / "trials.txt")
    assert len(rows) == 4
    best = rows[0]
    assert float(best[2]) == pytest.approx(0.7), "the sensible learning rate wins"
    assert float(best[5].rstrip("%")) >= 85.0
    assert {row[3] for row in rows} == {"1", "2"}
    assert all(float(row[5].rstrip("%")) < 30 for row in rows if float(row[2]) < 0.001)
    scaling = (sweep / "trials.txt").read_text().split("\n\n")[1]
    assert "efficiency" in scaling and "100%" in scaling
    assert (sweep / "scaling.png").read_bytes()[:4] == b"\x89PNG"
    assert "Best checkpoint:" in result.stdout
    best_checkpoint = Path(result.stdout.split("Best checkpoint: ")[1].split()[0])
    assert (best_checkpoint / "state.pt").exists()

    # MLflow: the sweep is a parent run with one child run per trial.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("sweeps")
    found = client.search_runs([experiment.experiment_id])
    (parent,) = [run for run in found if run.info.run_name == "grid"]
    children = [run for run in found if run.data.tags.get("mlflow.parentRunId") ==
                parent.info.run_id]
    assert len(found) == 5 and len(children) == 4
    assert {run.data.params["num_workers"] for run in children} == {"1", "2"}
    assert all(run.info.status == "FINISHED" for run in found)
    for child in children:
        history = client.get_metric_history(child.info.run_id, "val_accuracy")
        assert [point.step for point in history] == [1, 2, 3]
    assert parent.data.metrics["best_val_accuracy"] == pytest.approx(float(best[5].rstrip("%")) / 100,
                                                                     abs=1e-4)

    shown = _tune("--name", "grid", "--show", "--target", "0.8", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "\n".join(" ".join(r) for r in rows[:1]) in "\n".join(
        " ".join(line.split()) for line in shown.stdout.splitlines()
    )


@pytest.fixture
def local_cluster():
    with local_ray() as address:
        yield address


def test_asha_stops_a_hopeless_trial_and_no_placement_group_leaks(
    small_mnist_dir, tmp_path, local_cluster
):
    result = _tune(
        "--lr", "0.7,0.00001", "--num-workers", "1", "--num-samples", "1", "--epochs", "4",
        "--scheduler", "asha", "--max-concurrent-trials", "1", "--data-dir", str(small_mnist_dir),
        "--name", "asha", cwd=tmp_path, address=local_cluster,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {float(row[2]): row for row in _table_rows(tmp_path / "runs" / "asha" / "trials.txt")}
    assert rows[0.7][-1] == "completed"
    assert rows[1e-5][-5:] == ["stopped", "early", "by", "the", "scheduler"]
    assert int(rows[1e-5][6]) < 4
    stopped = rows[1e-5][1]
    assert re.search(rf"trial {stopped} stopped by the scheduler after epoch \d", result.stdout)
    # Tune ended that trial before its driver could close its record: the sweep closed it.
    record = json.loads(
        (tmp_path / "runs" / "asha" / "train_runs" / f"trial-{stopped}" / "run.json").read_text())
    assert record["status"] == "stopped early" and 0 <= record["goodput"] < 1
    # Stopped and finished trials released their workers: nothing of ours is left placed
    # (Ray removes a dead trial's groups within moments).
    deadline = time.monotonic() + 10
    while True:
        leftover = [
            pg for pg in ray.util.placement_group_table().values() if pg["state"] != "REMOVED"
        ]
        if not leftover or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert leftover == []


def test_interrupted_sweep_resumes_without_redoing_finished_trials(small_mnist_dir, tmp_path):
    args = [
        sys.executable, "-m", "app.tune", "--lr", "0.7,0.5", "--num-workers", "1",
        "--num-samples", "1", "--epochs", "2", "--scheduler", "fifo",
        "--max-concurrent-trials", "1", "--data-dir", str(small_mnist_dir), "--name", "resume",
    ]
    train_runs = tmp_path / "runs" / "resume" / "train_runs"
    with open(tmp_path / "first.log", "w") as log:
        sweep = subprocess.Popen(args, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)

    def finished_trials():
        done = []
        for run in train_runs.glob("trial-*"):
            try:
                latest = json.loads((run / "checkpoint_manager_snapshot.json").read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                continue
            if (latest.get("latest_checkpoint_result") or {}).get("metrics", {}).get("epoch") == 2:
                done.append(run)
        return done

    deadline = time.monotonic() + 300
    # A sweep that exits before its first trial finished fails the test now, not at the deadline.
    while not finished_trials() and sweep.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    first_done = finished_trials()
    assert first_done, (tmp_path / "first.log").read_text()[-3000:]
    # Ctrl-C while the second trial is running: Tune stops it, and it must not count as done.
    while len(list(train_runs.glob("trial-*"))) < 2 and sweep.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(list(train_runs.glob("trial-*"))) == 2, (tmp_path / "first.log").read_text()[-3000:]
    sweep.send_signal(signal.SIGINT)
    assert sweep.wait(timeout=120) == 130, (tmp_path / "first.log").read_text()[-3000:]
    stamps = {run: (run / "checkpoint_manager_snapshot.json").stat().st_mtime for run in first_done}
    # The stopped trial's record of its checkpoints cut short, as by a sweep killed while Ray
    # rewrote it (or at its very first write): the trial resumes all the same.
    (stopped,) = set(train_runs.glob("trial-*")) - set(first_done)
    snapshot = stopped / "checkpoint_manager_snapshot.json"
    cut_short = snapshot.read_bytes()[:100] if snapshot.exists() else b'{"checkpoints": [{'
    snapshot.write_bytes(cut_short)

    resumed = _tune("--name", "resume", "--resume", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    rows = _table_rows(tmp_path / "runs" / "resume" / "trials.txt")
    assert len(rows) == 2 and all(row[-1] == "completed" for row in rows), rows
    assert snapshot.with_name(snapshot.name + UNREADABLE_SUFFIX).read_bytes() == cut_short
    assert json.loads(snapshot.read_text())["latest_checkpoint_result"]["metrics"]["epoch"] == 2
    for run, stamp in stamps.items():
        assert (run / "checkpoint_manager_snapshot.json").stat().st_mtime == stamp, (
            f"{run.name} was trained again"
        )


def test_world_size_the_cluster_can_never_host_is_refused(tmp_path):
    started = time.monotonic()
    result = _refused("--num-workers", "1,4", "--dataset", "digits", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "can never host 4 worker(s)" in result.stderr
    assert "Traceback" not in result.stderr
    assert time.monotonic() - started < 30


def test_an_unknown_data_set_is_refused_before_a_cluster_starts(tmp_path, capsys):
    started = AssertionError("a Ray cluster was started for a refused sweep")
    with mock.patch("app.cluster.Connecting", side_effect=started):
        assert tune.main(["--dataset", "nope", "--storage-path", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "has no data set 'nope'" in err, err


def test_bad_sweep_flags_are_one_line_errors(tmp_path):
    # Refused before the sweep connects: the address has nothing listening, so an error found
    # after connecting would be about the address instead.
    nowhere = f"127.0.0.1:{free_port()}"
    for args, expected in (
        (["--lr-range", "1,0.1"], "--lr-range must be MIN,MAX"),
        (["--lr", "0.5,0"], "learning rates and batch sizes must be > 0, got 0.0"),
        (["--num-workers", "1,2", "--global-batch-size", "64,1"],
         "--global-batch-size 1 is smaller than the 2 workers"),
        (["--epochs", "0"], "epochs must be >= 1, got 0"),
        (["--num-workers", "a,b"], "--num-workers must be a comma-separated list"),
        (["--show"], "--resume and --show need the --name"),
    ):
        result = _refused(*args, "--dataset", "digits", cwd=tmp_path, address=nowhere)
        assert result.returncode == 2, (args, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0], (args, result.stderr)
    # On a real cluster: the sweep's folder is looked for there.
    result = _refused("--name", "nothing", "--show", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "no sweep named 'nothing'" in result.stderr and "Traceback" not in result.stderr
