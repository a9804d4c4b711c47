"""A user's own task through every command, on real Ray clusters (each command starts its own
embedded one, as a person's would): elastic training, evaluate, resume refusals, a sweep, and
batch prediction with Ray Data."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import forkcli
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

pytestmark = pytest.mark.integration

USER_TASK = f"{Path(__file__).parent / 'diabetes_task.py'}:task"


def _run(module: str, *args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", f"app.{module}", *args], cwd=cwd, capture_output=True, text=True,
        timeout=timeout, env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)},
    )


def _refused(module: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """A command expected to be refused before it trains, forked (see forkcli)."""
    return forkcli.run(f"app.{module}", *args, cwd=cwd, timeout=120)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The user's task trained at a 1-2 worker range (the embedded cluster gives it 2)."""
    cwd = tmp_path_factory.mktemp("user-task")
    result = _run("train", "--task", USER_TASK, "--num-workers", "1-2", "--name", "diabetes",
                  "--epochs", "6", cwd=cwd)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Training diabetes: 354 train / 88 validation samples" in result.stdout
    assert "val mae" in result.stdout  # a console column per metric of the task
    return cwd


def test_the_best_checkpoint_is_the_lowest_validation_loss_and_evaluate_reproduces_it(trained):
    run = trained / "runs" / "diabetes"
    rows = list(csv.DictReader((run / "metrics.csv").open()))
    assert [int(row["epoch"]) for row in rows] == list(range(1, 7))
    assert list(rows[0])[:6] == ["epoch", "step", "world_size", "train_loss", "val_loss",
                                 "val_mae"]
    assert {row["world_size"] for row in rows} == {"2"}
    best = min(rows, key=lambda row: float(row["val_loss"]))
    assert float(rows[-1]["val_loss"]) < float(rows[0]["val_loss"])

    result = _run("evaluate", "--checkpoint", str(run), "--json", cwd=trained)
    assert result.returncode == 0, result.stderr
    scored = json.loads(result.stdout)
    assert scored["checkpoint"].endswith(f"checkpoint_epoch_{int(best['epoch']):04d}")
    assert scored["num_samples"] == 88
    for name in ("val_loss", "val_mae"):
        assert scored[name] == pytest.approx(float(best[name]), rel=2e-3, abs=1e-5), name

    foreign = _refused("evaluate", "--checkpoint", str(run), "--task", "mnist-convnet",
                       cwd=trained)
    assert foreign.returncode == 2
    assert foreign.stderr.startswith("error: ") and "does not fit the model" in foreign.stderr
    assert len(foreign.stderr.strip().splitlines()) == 1


def test_a_rerun_with_other_settings_is_refused_naming_each_and_allowed_changes_resume(trained):
    refused = _refused("train", "--task", USER_TASK, "--name", "diabetes",
                       "--global-batch-size", "64", "--lr", "0.02", cwd=trained)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "--global-batch-size 64 (the run has 32)" in refused.stderr
    assert "--lr 0.02 (the run has 0.01)" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1

    other_task = _refused("train", "--name", "diabetes", "--dataset", "digits", cwd=trained)
    assert other_task.returncode == 2
    assert "--task 'mnist-convnet'" in other_task.stderr
    assert "--dataset 'digits' (the run has 'diabetes')" in other_task.stderr

    more = _run("train", "--task", USER_TASK, "--name", "diabetes", "--epochs", "8",
                "--num-workers", "1", "--precision", "fp32", cwd=trained)
    assert more.returncode == 0, more.stdout + more.stderr
    assert "Resumed from the checkpoint after epoch 6 of 8 (1 CPU workers)" in more.stdout
    rows = list(csv.DictReader((trained / "runs" / "diabetes" / "metrics.csv").open()))
    assert [int(row["epoch"]) for row in rows] == list(range(1, 9))
    assert [row["world_size"] for row in rows[6:]] == ["1", "1"]


def test_a_changed_data_set_is_refused(tmp_path):
    first = _run("train", "--dataset", "digits", "--name", "digits-run", "--epochs", "1",
                 cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    changed = _refused("train", "--dataset", "fashion-mnist", "--name", "digits-run",
                       "--epochs", "2", cwd=tmp_path)
    assert changed.returncode == 2
    assert "--dataset 'fashion-mnist' (the run has 'digits')" in changed.stderr
    # A name that is no data set of the task is that error, not a difference from the run.
    unknown = _refused("train", "--dataset", "nope", "--name", "digits-run", "--lr", "0.1",
                       cwd=tmp_path)
    assert unknown.returncode == 2
    assert unknown.stderr.strip() == ("error: task mnist-convnet has no data set 'nope': "
                                      "choose one of mnist, fashion-mnist, digits"), unknown.stderr


def test_a_sweep_of_the_users_task_ranks_by_its_score(tmp_path):
    result = _run("tune", "--task", USER_TASK, "--num-workers", "1,2", "--num-samples", "1",
                  "--epochs", "3", "--scheduler", "fifo", "--name", "sweep", cwd=tmp_path,
                  timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = (tmp_path / "runs" / "sweep" / "trials.txt").read_text()
    assert "best loss" in table and table.count("completed") == 2, table
    assert "Best trial:" in result.stdout and "val_loss" in result.stdout


def test_predict_writes_one_row_per_input_equal_to_evaluates_outputs(trained):
    from app import evaluate, parquet

    data = trained / "diabetes-parquet"
    prepared = _run("prepare", "--task", USER_TASK, "--output", str(data), "--val-files", "3",
                    cwd=trained)
    assert prepared.returncode == 0, prepared.stderr
    loaded = evaluate.load(str(trained / "runs" / "diabetes"))
    manifest = parquet.open_manifest(str(data))
    inputs, _, ids = parquet.read_split(manifest, "val")
    precision = evaluate.precision_of(loaded, "auto", torch.device("cpu"))
    expected = evaluate.outputs(loaded, inputs, precision, torch.device("cpu")).numpy()
    for workers in ("1", "2"):
        output = trained / f"predictions-{workers}"
        result = _run("predict", "--checkpoint", str(trained / "runs" / "diabetes"),
                      "--parquet", str(data), "--output", str(output), "--num-workers",
                      workers, "--batch-size", "20", cwd=trained)
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"Wrote 88 predictions to {output}" in result.stdout
        table = pq.read_table(output)
        assert table.num_rows == 88 and "prediction" not in table.column_names  # a regression
        order = np.argsort(table.column("id").to_numpy())
        assert (table.column("id").to_numpy()[order] == ids.numpy()).all()
        written = np.array(table.column("output").to_pylist())[order]
        np.testing.assert_allclose(written, expected, rtol=1e-5, atol=1e-6)
    again = _refused("predict", "--checkpoint", str(trained / "runs" / "diabetes"),
                     "--parquet", str(data), "--output", str(trained / "predictions-1"),
                     cwd=trained)
    assert again.returncode == 2 and "already holds" in again.stderr
