"""Reliability on real Ray, through the command lines a user runs: SIGTERM, divergence, the
no-progress watchdog, a world-size sweep on 2 CPUs, corrupt checkpoints, a full disk, repeated
worker kills, a second driver on the same run, unreachable clusters. Nothing of Ray is mocked."""

from __future__ import annotations

import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import forkcli
import psutil
import pytest
import torch
from localnet import free_port
from test_cli import _committed_epoch

from app.cluster import lean_head
from app.config import RunConfig
from app.storage import RunLock

pytestmark = pytest.mark.integration


def _command(*args):
    return [sys.executable, "-m", "app.train", *args]


def _run(*args, cwd, timeout=300):
    return subprocess.run(_command(*args), cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr and "SIGTERM received" not in stderr, stderr
    return lines[0]


class Background:
    """A CLI run in the background with its output in files (Ray's daemons inherit pipes)."""

    def __init__(self, args, cwd: Path):
        self.stdout_path, self.stderr_path = cwd / "stdout", cwd / "stderr"
        with open(self.stdout_path, "w") as out, open(self.stderr_path, "w") as err:
            self.process = subprocess.Popen(_command(*args), cwd=cwd, stdout=out, stderr=err)

    def wait_for(self, predicate, timeout_s=120):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return
            assert self.process.poll() is None, self.output()
            time.sleep(0.1)
        raise AssertionError(f"not seen in {timeout_s} s:\n{self.output()}")

    def output(self) -> str:
        return self.stdout_path.read_text() + self.stderr_path.read_text()


def test_sigterm_stops_like_ctrl_c_and_the_rerun_resumes(tmp_path):
    args = ["--dataset", "digits", "--num-workers", "2", "--epochs", "60", "--name", "term"]
    run_dir = tmp_path / "runs" / "term"
    run = Background(args, tmp_path)
    run.wait_for(lambda: _committed_epoch(run_dir) >= 2)
    run.process.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    assert run.process.wait(timeout=30) == 143, run.output()
    assert time.monotonic() - sent < 10, "SIGTERM must end the run within 10 s"
    line = _one_line(run.stderr_path.read_text())
    assert line.startswith("terminated: checkpoints written so far are kept")
    done = _committed_epoch(run_dir)
    assert not (run_dir / RunLock.FILE).exists(), "the run lock is released"

    rerun = _run(*args[:-4], "--epochs", str(done + 1), "--name", "term", cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stderr
    assert f"Resumed from the checkpoint after epoch {done} of {done + 1}" in rerun.stdout


def test_divergence_stops_at_once_and_leaves_no_nan_checkpoint(tmp_path):
    started = time.monotonic()
    # An elastic range retries failures by default: divergence must not be retried.
    result = _run("--dataset", "digits", "--num-workers", "1-2", "--lr", "1e12",
                  "--checkpoint-every-steps", "1", "--name", "nan", cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    line = _one_line(result.stderr)
    assert line.startswith("error: training diverged at step ")
    assert "lower the learning rate" in line
    assert "restarting" not in result.stdout
    assert time.monotonic() - started < 90
    for state_file in (tmp_path / "runs" / "nan").glob("checkpoint_*/state.pt"):
        weights = torch.load(state_file, weights_only=True)["model"]
        assert all(torch.isfinite(value).all() for value in weights.values()), state_file

    refused = forkcli.run("app.train", "--dataset", "digits", "--lr", "inf", cwd=tmp_path)
    assert refused.returncode == 2
    assert "learning rate must be a finite number" in _one_line(refused.stderr)


def test_watchdog_ends_a_run_whose_workers_cannot_be_placed(tmp_path):
    """The cluster has 2 CPUs, but another job's placement group holds both: the run ends after
    --placement-timeout with one line saying what holds them (it used to wait forever)."""
    import ray
    from ray.cluster_utils import Cluster

    with lean_head(log_monitor=False):
        cluster = Cluster(initialize_head=True,
                          head_node_args={"num_cpus": 2, "include_dashboard": False})
    holder = subprocess.Popen([sys.executable, "-c", f"""
import ray, sys, time
ray.init(address={cluster.address!r}, log_to_driver=False)
from ray.util.placement_group import placement_group
group = placement_group([{{"CPU": 1}}] * 2)
ray.get(group.ready())
print("held", flush=True)
for _ in sys.stdin:  # each line asks how many placement groups wait to be placed
    table = ray.util.placement_group_table().values()
    print(sum(entry["state"] == "PENDING" for entry in table), flush=True)
"""], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def pending_groups() -> int:
        holder.stdin.write("?\n")
        holder.stdin.flush()
        return int(holder.stdout.readline())

    try:
        assert holder.stdout.readline().strip() == "held"
        # Hung (a long timeout): SIGTERM still ends it within 10 s.
        hung_dir = tmp_path / "hung"
        hung_dir.mkdir()
        hung = Background(["--address", cluster.address, "--dataset", "digits",
                           "--num-workers", "2", "--placement-timeout", "300", "--name", "hung"],
                          hung_dir)
        # Connected, and its workers' placement group waits behind the holder's.
        hung.wait_for(lambda: pending_groups() > 0, timeout_s=60)
        assert "epoch  workers" not in hung.output()
        hung.process.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        assert hung.process.wait(timeout=30) == 143, hung.output()
        assert time.monotonic() - sent < 10
        assert "terminated:" in hung.stderr_path.read_text()

        started = time.monotonic()
        result = _run("--address", cluster.address, "--dataset", "digits", "--num-workers", "2",
                      "--placement-timeout", "8", "--name", "stuck", cwd=tmp_path, timeout=150)
        elapsed = time.monotonic() - started
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
        ray.shutdown()
        cluster.shutdown()
    assert result.returncode == 2, result.stdout + result.stderr
    line = _one_line(result.stderr)
    assert "no training worker has run for 8 s" in line
    assert "reserved: {CPU: 1} x 2 by job" in line, line
    assert elapsed < 60


def _rows(trials_txt: Path) -> list[str]:
    return trials_txt.read_text().split("\n\n")[0].splitlines()[1:]


def test_world_size_sweep_with_asha_finishes_on_two_cpus(tmp_path):
    """ASHA stops each trial at its last epoch, which killed the trial with its Train run and
    left the run's placement group holding a CPU: the 2-worker trial then waited forever."""
    result = subprocess.run(
        [sys.executable, "-m", "app.tune", "--num-workers", "1,2", "--num-samples", "1",
         "--epochs", "2", "--dataset", "digits", "--name", "sizes", "--placement-timeout", "60",
         "--target", "0.5"],
        cwd=tmp_path, capture_output=True, text=True, timeout=400,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = _rows(tmp_path / "runs" / "sizes" / "trials.txt")
    assert len(rows) == 2
    # Every trial ran to its end or to ASHA's stop (which is where the placement group used to
    # leak); none failed or was left waiting.
    assert all(row.endswith(("completed", "stopped early by the scheduler")) for row in rows), \
        rows
    assert {row.split()[3] for row in rows} == {"1", "2"}


def test_sweep_resume_refuses_changed_flags_and_sigterm_stops_a_sweep(tmp_path):
    """The flags that define a sweep cannot change on --resume; SIGTERM ends a sweep like
    Ctrl-C (exit 143, one line, resumable)."""
    command = [sys.executable, "-m", "app.tune", "--num-workers", "1", "--num-samples", "3",
               "--epochs", "30", "--dataset", "digits", "--name", "long", "--scheduler", "fifo"]
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        sweep = subprocess.Popen(command, cwd=tmp_path, stdout=out, stderr=err)
    deadline = time.monotonic() + 120
    while not list((tmp_path / "runs" / "long" / "train_runs").glob("*/checkpoint_epoch_0001")):
        assert time.monotonic() < deadline and sweep.poll() is None, (tmp_path / "err").read_text()
        time.sleep(0.2)
    sweep.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    assert sweep.wait(timeout=30) == 143, (tmp_path / "err").read_text()
    assert time.monotonic() - sent < 10
    stderr = (tmp_path / "err").read_text()
    assert "terminated:" in stderr and "--resume" in stderr, stderr

    changed = forkcli.run("app.tune", "--name", "long", "--resume", "--epochs", "5",
                          cwd=tmp_path)
    assert changed.returncode == 2
    assert "--epochs 5 (the sweep has 30)" in _one_line(changed.stderr)

    foreign = tmp_path / "runs" / "foreign"
    shutil.copytree(tmp_path / "runs" / "long", foreign)
    (foreign / "sweep.json").unlink()
    refused = forkcli.run("app.tune", "--name", "foreign", "--show", cwd=tmp_path)
    assert refused.returncode == 2
    assert "refusing to load its Ray Tune state" in _one_line(refused.stderr)
    assert oct((tmp_path / "runs" / "long").stat().st_mode & 0o777) == "0o700"


def test_a_trial_that_cannot_be_placed_fails_with_the_reason(tmp_path):
    """A world size the cluster has CPUs for but can never reserve (another job holds them):
    the trial fails after --placement-timeout, saying why, and the report says so."""
    import ray
    from ray.cluster_utils import Cluster

    with lean_head(log_monitor=False):
        cluster = Cluster(initialize_head=True,
                          head_node_args={"num_cpus": 2, "include_dashboard": False})
    holder = subprocess.Popen([sys.executable, "-c", f"""
import ray, sys
ray.init(address={cluster.address!r}, log_to_driver=False)
from ray.util.placement_group import placement_group
ray.get(placement_group([{{"CPU": 1}}]).ready())
print("held", flush=True)
sys.stdin.read()
"""], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        result = subprocess.run(
            [sys.executable, "-m", "app.tune", "--address", cluster.address, "--num-workers",
             "1,2", "--num-samples", "1", "--epochs", "1", "--dataset", "digits", "--name",
             "held", "--placement-timeout", "8", "--scheduler", "fifo"],
            cwd=tmp_path, capture_output=True, text=True, timeout=300,
        )
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
        ray.shutdown()
        cluster.shutdown()
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    rows = _rows(tmp_path / "runs" / "held" / "trials.txt")
    by_size = {row.split()[3]: row for row in rows}
    assert by_size["1"].endswith("completed")
    assert "failed: no training worker has run for 8 s" in by_size["2"], by_size["2"]


def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    args = ["--dataset", "digits", "--name", "corrupt"]
    first = _run(*args, "--epochs", "2", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    run_dir = tmp_path / "runs" / "corrupt"
    latest = run_dir / "checkpoint_epoch_0002" / "state.pt"
    latest.write_bytes(latest.read_bytes()[:2000])

    second = _run(*args, "--epochs", "3", cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert "warning: the latest checkpoint" in second.stdout
    assert "checkpoint_epoch_0001 instead" in second.stdout
    assert "Resumed from the checkpoint after epoch 1 of 3" in second.stdout
    epochs = [line.split(",")[0] for line in (run_dir / "metrics.csv").read_text().splitlines()]
    assert epochs[1:] == ["1", "2", "3"]

    for state_file in run_dir.glob("checkpoint_*/state.pt"):
        state_file.write_bytes(b"not a checkpoint")
    third = _run(*args, "--epochs", "4", cwd=tmp_path)
    assert third.returncode == 1
    assert "no earlier checkpoint of the run can be" in _one_line(third.stderr)


@pytest.fixture
def full_disk(tmp_path):
    """A 2 MiB tmpfs: the write probe fits, a checkpoint does not."""
    folder = tmp_path / "tiny"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({mounted.stderr.strip()})")
    yield folder
    subprocess.run(["umount", str(folder)], check=False)


def test_a_full_disk_ends_the_run_in_one_line_without_retries(tmp_path, full_disk):
    started = time.monotonic()
    result = _run("--dataset", "digits", "--max-failures", "-1", "--storage-path",
                  str(full_disk), "--name", "full", cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    line = _one_line(result.stderr)
    assert "cannot write the checkpoint checkpoint_epoch_0001" in line
    assert "No space left on device" in line
    assert time.monotonic() - started < 90, "no restart loop"


def _train_workers():
    return [process for process in psutil.process_iter(["cmdline"])
            if any("RayTrainWorker" in part for part in (process.info["cmdline"] or []))]


def _wait_for_workers(run: Background, exclude: set[int], timeout_s: float = 60):
    """Training workers not in ``exclude`` (new ones), once there are any."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [process for process in _train_workers() if process.pid not in exclude]
        if found:
            return found
        assert run.process.poll() is None, "the run ended before the storm did:\n" + run.output()
        time.sleep(0.05)
    raise AssertionError("no training workers appeared:\n" + run.output())


def test_repeated_kills_including_during_restarts_finish_the_run(tmp_path):
    """kill -9 of random workers, again while the group is restarting: every failure is one
    more retry, and the run finishes with each epoch trained once."""
    epochs = 20  # the storm trains only a few of them: the run must outlive it, no more
    args = ["--dataset", "digits", "--num-workers", "2", "--epochs", str(epochs),
            "--checkpoint-every-steps", "5", "--max-failures", "10", "--name", "storm"]
    run = Background(args, tmp_path)
    run.wait_for(lambda: "epoch  workers" in run.stdout_path.read_text())
    rng = random.Random(0)
    for _ in range(2):
        time.sleep(rng.uniform(2, 4))
        victims = _wait_for_workers(run, set())
        rng.choice(victims).kill()
        # Again as soon as the restarted group's workers exist (before they train).
        _wait_for_workers(run, {process.pid for process in victims})[0].kill()
    assert run.process.wait(timeout=400) == 0, run.output()
    output = run.stdout_path.read_text()
    # Each failure is one line in the app's voice (a kill may also fail the surviving rank's
    # collective, and a kill during a restart has a line of its own).
    assert output.count("restarting") >= 2 and "Lost " in output, output
    assert "A worker died or was killed" not in run.output(), "Ray's paragraph is filtered"
    metrics = (tmp_path / "runs" / "storm" / "metrics.csv").read_text().splitlines()
    assert [line.split(",")[0] for line in metrics[1:]] == [str(e) for e in range(1, epochs + 1)]


def test_a_second_driver_on_the_same_run_refuses(tmp_path):
    with RunLock(RunConfig(name="busy", storage_path=str(tmp_path / "runs"))):
        result = forkcli.run("app.train", "--dataset", "digits", "--name", "busy",
                             cwd=tmp_path, timeout=60)
    assert result.returncode == 2
    assert "is being trained by another command" in _one_line(result.stderr)


def test_unreachable_and_http_addresses_fail_fast(tmp_path):
    for address, expected in ((f"127.0.0.1:{free_port()}", "cannot reach the Ray cluster"),
                              ("http://127.0.0.1:8265", "is a dashboard (HTTP) URL")):
        started = time.monotonic()
        result = forkcli.run("app.train", "--address", address, "--dataset", "digits",
                              cwd=tmp_path, timeout=60)
        assert result.returncode == 2
        assert expected in _one_line(result.stderr)
        assert time.monotonic() - started < 15
