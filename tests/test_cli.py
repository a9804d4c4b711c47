"""The command line as a user meets it: exit codes, one-line errors, Ctrl-C, resume."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import forkcli
import numpy as np
import pytest

from app import data
from app.storage import UNREADABLE_SUFFIX

pytestmark = pytest.mark.integration


def _cli(*args, cwd, timeout=120):
    """``python -m app.train *args``, forked from a process that has imported the app (see
    forkcli): the test of ``--help`` and the runs below start the real command."""
    return forkcli.run("app.train", *args, cwd=cwd, timeout=timeout)


def _assert_one_line_error(result, expected):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert expected in lines[0]


def test_help_describes_every_flag(tmp_path):
    result = subprocess.run([sys.executable, "-m", "app.train", "--help"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0
    for flag in (
        "--num-workers", "--use-gpu", "--cpus-per-worker", "--epochs", "--global-batch-size",
        "--lr", "--dataset", "--data-dir", "--storage-path", "--name", "--seed", "--address",
        "--verbose", "--task", "mnist-convnet", "mnist-examples", "cifar10-resnet18",
    ):
        assert flag in result.stdout


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--num-workers", "zero"], "--num-workers must be N or MIN-MAX"),
        (["--num-workers", "4-2"], "worker range 4-2 is empty"),
        (["--epochs", "0"], "epochs must be >= 1"),
        (["--epochs", "two"], "invalid int value"),
        (["--lr", "-0.1"], "learning rate must be a finite number > 0"),
        (["--dataset", "imagenet"],
         "task mnist-convnet has no data set 'imagenet': choose one of mnist, fashion-mnist, digits"),
        (["--task", "nope"], "give a built-in task (mnist-convnet, mnist-examples"),
        (["--task", "no/such/task.py:task"], "is not a file"),
        (["--task", "json:dumps"], "dumps() failed"),
        (["--global-batch-size", "1", "--num-workers", "2"], "smaller than the 2 workers"),
        (["--name", "a/b"], "run name"),
        (["--name", "x" * 300], "run name is 300 characters long"),
        (["--storage-path", "s3:/bucket/runs"], "write it as s3://bucket/runs"),
        (["--storage-path", "foo://bucket"], "unknown scheme"),
        (["--placement-timeout", "nan"], "placement timeout must be a finite number"),
        (["--resize-interval", "nan"], "resize interval must be a finite number"),
        (["--lr", "inf"], "learning rate must be a finite number"),
        (["--global-batch-size", "100000"], "larger than the 1,438 training samples"),
        (["--num-workers", "64"], "can never host 64 worker(s)"),
        (["--cpus-per-worker", "64"], "can never host 1 worker(s) of 64 CPUs"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, expected):
    _assert_one_line_error(_cli(*args, "--dataset" if "--dataset" not in args else "--seed",
                                "digits" if "--dataset" not in args else "1", cwd=tmp_path),
                           expected)


def test_use_gpu_without_gpus_fails_fast_naming_the_cluster(tmp_path):
    started = time.monotonic()
    result = _cli("--use-gpu", "--dataset", "digits", cwd=tmp_path)
    assert time.monotonic() - started < 10
    _assert_one_line_error(result, "0 GPUs")
    assert "drop --use-gpu" in result.stderr


def test_unwritable_storage_path(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    result = _cli("--dataset", "digits", "--storage-path", str(blocker / "runs"), cwd=tmp_path)
    _assert_one_line_error(result, f"cannot write to storage path {blocker / 'runs'}")


def _cluster_servers() -> set[int]:
    """Process ids of the Ray GCS servers running on this machine."""
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"gcs_server" in (entry / "cmdline").read_bytes():
                found.add(int(entry.name))
        except OSError:
            pass  # ended meanwhile
    return found


def test_missing_and_corrupt_data_name_the_file(tmp_path):
    before = _cluster_servers()
    result = _cli("--dataset", "mnist", "--data-dir", str(tmp_path / "nothing"), cwd=tmp_path)
    _assert_one_line_error(result, "mnist")
    # The embedded cluster starts beside the data's load; a load that fails stops it.
    deadline = time.monotonic() + 10
    while _cluster_servers() - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _cluster_servers() - before, "the command left its cluster running"
    raw = data.raw_folder(tmp_path / "data", "mnist")
    for prefix, count in (("train", 30), ("t10k", 10)):
        data.write_idx(raw / f"{prefix}-images-idx3-ubyte", np.zeros((count, 28, 28), np.uint8))
        data.write_idx(raw / f"{prefix}-labels-idx1-ubyte", np.zeros(count, np.uint8))
    corrupt = raw / "train-images-idx3-ubyte"
    corrupt.write_bytes(corrupt.read_bytes()[:1000])
    result = _cli("--dataset", "mnist", "--data-dir", str(tmp_path / "data"), cwd=tmp_path)
    _assert_one_line_error(result, f"{corrupt}: IDX data is")


def _committed_epoch(run_dir) -> int:
    """The epoch of the latest checkpoint Ray Train has recorded as complete (0 if none)."""
    try:
        snapshot = json.loads((run_dir / "checkpoint_manager_snapshot.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return 0
    latest = snapshot.get("latest_checkpoint_result") or {}
    return int(latest.get("metrics", {}).get("epoch", 0))


def test_offline_default_falls_back_to_bundled_digits_and_ctrl_c_keeps_checkpoints(tmp_path):
    """No --dataset, no MNIST, no internet: trains on the digits. Ctrl-C after the first
    checkpoint exits 130 and keeps it; the same command then resumes after that epoch."""
    command = [
        sys.executable, "-m", "app.train", "--num-workers", "2", "--epochs", "40",
        "--name", "interrupt", "--data-dir", str(tmp_path / "empty"),
    ]
    run_dir = tmp_path / "runs" / "interrupt"
    # Files, not pipes: Ray's daemons inherit the descriptors and may close them a little after
    # the command itself has exited, which would make communicate() wait on them.
    stdout_path, stderr_path = tmp_path / "stdout", tmp_path / "stderr"
    with open(stdout_path, "w") as stdout_file, open(stderr_path, "w") as stderr_file:
        process = subprocess.Popen(command, cwd=tmp_path, stdout=stdout_file, stderr=stderr_file)
    deadline = time.monotonic() + 120
    while _committed_epoch(run_dir) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _committed_epoch(run_dir) >= 2, "no second checkpoint within 120 s"
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=60) == 130, stderr_path.read_text()
    stdout, stderr = stdout_path.read_text(), stderr_path.read_text()
    assert "cannot be downloaded" in stdout and "training on digits instead" in stdout
    assert "rerun the same command" in stderr
    done = _committed_epoch(run_dir)
    assert (run_dir / f"checkpoint_epoch_{done:04d}" / "state.pt").exists()

    result = subprocess.run(
        command[:5] + ["--epochs", str(done + 1)] + command[7:],
        cwd=tmp_path, capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stderr
    assert f"Resumed from the checkpoint after epoch {done} of {done + 1}" in result.stdout, result.stdout
    assert (run_dir / "metrics.csv").read_text().count("\n") == done + 2

    # Ray Train's record of the checkpoints cut short (as by a driver killed while Ray rewrote
    # it): the next rerun keeps it aside and resumes from the newest checkpoint all the same.
    snapshot = run_dir / "checkpoint_manager_snapshot.json"
    cut_short = snapshot.read_bytes()[:100]
    snapshot.write_bytes(cut_short)
    result = subprocess.run(
        command[:5] + ["--epochs", str(done + 2)] + command[7:],
        cwd=tmp_path, capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Ray Train's record of the run's checkpoints cannot be read" in result.stdout
    assert f"resuming from its newest checkpoint, {run_dir}/checkpoint_epoch_{done + 1:04d}." \
        in result.stdout, result.stdout
    assert f"Resumed from the checkpoint after epoch {done + 1} of {done + 2}" in result.stdout
    rows = (run_dir / "metrics.csv").read_text().splitlines()[1:]
    assert [int(row.split(",")[0]) for row in rows] == list(range(1, done + 3))
    assert snapshot.with_name(snapshot.name + UNREADABLE_SUFFIX).read_bytes() == cut_short
    assert _committed_epoch(run_dir) == done + 2, "Ray Train records the run's checkpoints again"

    # Cut short once its epochs were all done (the sweep test's trial, Ctrl-C'd as it ended):
    # the rerun trains nothing, ends with the last checkpoint, and Ray records it again.
    snapshot.write_bytes(cut_short)
    result = subprocess.run(
        command[:5] + ["--epochs", str(done + 2)] + command[7:],
        cwd=tmp_path, capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"All {done + 2} epochs were already trained" in result.stdout, result.stdout
    assert (run_dir / "metrics.csv").read_text().splitlines()[1:] == rows
    assert _committed_epoch(run_dir) == done + 2, "the finished run's record is whole again"
