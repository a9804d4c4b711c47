"""Reliability pieces in one process, without a Ray cluster: input validation, divergence,
unreadable checkpoints, the failure policy's decisions, the run lock, a sweep's trial outcomes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ray.exceptions import ActorDiedError
from ray.train.v2._internal.execution.failure_handling.failure_policy import FailureDecision
from ray.train.v2.api.config import FailureConfig
from ray.train.v2.api.exceptions import ControllerError, WorkerGroupError

from app import checkpoint
from app.batching import InMemoryData, check_batch_fits
from app.config import (
    FaultToleranceConfig,
    LoopConfig,
    OptimConfig,
    RunConfig,
    StorageFailure,
    TrainConfig,
    TrainingDiverged,
    UserError,
    check_name,
)
from app.failures import AppFailurePolicy, describe_failure, not_retryable_cause
from app.loop import Trainer
from app.builtin_tasks import mnist_convnet
from app.storage import (
    UNREADABLE_SUFFIX,
    RunLock,
    Snapshot,
    set_aside_snapshot,
    snapshot_state,
    storage_uri,
)
from test_loop import _splits


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("s3:/bucket/runs", "write it as s3://bucket/runs"),
        ("foo://x/y", "unknown scheme 'foo:'"),
        ("s3://", "names no bucket"),
        ("", "must not be empty"),
    ],
)
def test_storage_uris_that_would_land_elsewhere_are_refused(uri, expected):
    with pytest.raises(UserError, match=expected):
        storage_uri(uri)


def test_storage_uris_that_work():
    assert storage_uri("s3://bucket/runs") == "s3://bucket/runs"
    assert storage_uri("runs").startswith("/")


def test_names_are_bounded_and_safe():
    assert check_name("run-1.a_b") == "run-1.a_b"
    with pytest.raises(UserError, match="300 characters long; use at most 100"):
        check_name("a" * 300)
    with pytest.raises(UserError, match="must start with a letter or digit"):
        check_name("../../x", "sweep name")
    with pytest.raises(UserError):
        RunConfig(name="a" * 101, storage_path="/tmp")


@pytest.mark.parametrize(
    "make",
    [
        lambda: FaultToleranceConfig(placement_timeout_s=math.nan),
        lambda: FaultToleranceConfig(resize_interval_s=math.nan),
        lambda: FaultToleranceConfig(placement_timeout_s=math.inf),
        lambda: OptimConfig(lr=math.inf),
        lambda: OptimConfig(lr=math.nan),
        lambda: OptimConfig(lr_decay=math.nan),
    ],
)
def test_nan_and_infinite_settings_are_refused(make):
    with pytest.raises(UserError):
        make()


def test_a_global_batch_larger_than_the_data_is_refused():
    check_batch_fits(1_438, 1_438, "digits")
    with pytest.raises(UserError, match="larger than the 1,438 training samples of digits"):
        check_batch_fits(100_000, 1_438, "digits")


def _diverging_trainer(lr: float, every: int = 0) -> Trainer:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = TrainConfig(optim=OptimConfig(lr=lr),
                         loop=LoopConfig(epochs=3, global_batch_size=16, precision="fp32"))
    train, val = _splits()
    data = InMemoryData(train, val, 16, world_size=1, rank=0, seed=0)
    return Trainer(config, mnist_convnet, mnist_convnet.build_model(), data,
                   torch.device("cpu"), 0, 1)


def test_divergence_stops_at_the_step_and_never_snapshots_bad_weights():
    trainer = _diverging_trainer(lr=1e12)
    snapshots = []

    def after_step():
        snapshots.append(trainer.state.step)
        trainer.snapshot()  # what a step checkpoint does; raises rather than save NaN weights

    with pytest.raises(TrainingDiverged) as caught:
        trainer.run_epoch(after_step=after_step)
    message = str(caught.value)
    assert message.startswith("training diverged at step ")
    assert "lower the learning rate (it is 1e+12)" in message
    step = int(message.split("at step ")[1].split()[0])
    assert step <= 3, "stopped at the first non-finite step, not at the epoch end"
    # Every snapshot that was taken held finite weights.
    assert all(torch.isfinite(v).all() for v in trainer.state.model.values()
               if v.is_floating_point())


def test_a_sane_learning_rate_does_not_trip_the_check():
    trainer = _diverging_trainer(lr=0.5)
    result = trainer.run_epoch()
    assert math.isfinite(result.train_loss)


def test_unreadable_checkpoints_say_why(tmp_path):
    trainer = _diverging_trainer(lr=0.5)
    trainer.run_epoch()
    good = tmp_path / "good"
    checkpoint.save(trainer.snapshot(), good)
    assert checkpoint.load(good).epoch == 1

    truncated = tmp_path / "truncated"
    checkpoint.save(trainer.snapshot(), truncated)
    state_file = truncated / checkpoint.STATE_FILE
    state_file.write_bytes(state_file.read_bytes()[:1000])
    with pytest.raises(checkpoint.UnreadableCheckpoint):
        checkpoint.load(truncated)

    partial = tmp_path / "partial"
    checkpoint.save(trainer.snapshot(), partial)
    (partial / checkpoint.HISTORY_FILE).unlink()
    with pytest.raises(checkpoint.UnreadableCheckpoint, match="history.json is missing"):
        checkpoint.load(partial)

    newer = tmp_path / "newer"
    checkpoint.save(trainer.snapshot(), newer)
    values = torch.load(newer / checkpoint.STATE_FILE, weights_only=True)
    values["format_version"] = checkpoint.FORMAT_VERSION + 1
    torch.save(values, newer / checkpoint.STATE_FILE)
    with pytest.raises(checkpoint.UnreadableCheckpoint, match="newer version"):
        checkpoint.load(newer)


def test_a_cut_short_record_of_checkpoints_is_set_aside_for_the_newest_checkpoint(tmp_path):
    run = RunConfig("run", str(tmp_path))
    assert snapshot_state(run) is Snapshot.MISSING
    folder = tmp_path / "run"
    for name in ("checkpoint_epoch_0001", "checkpoint_epoch_0002_step_000010", "logs"):
        (folder / name).mkdir(parents=True)
    snapshot = folder / "checkpoint_manager_snapshot.json"
    snapshot.write_text('{"checkpoints": []}')
    assert snapshot_state(run) is Snapshot.READABLE
    for cut_short in (b"", b'{"checkpoints": [{"pa', b"\xff\xfe"):
        snapshot.write_bytes(cut_short)
        assert snapshot_state(run) is Snapshot.UNREADABLE
    kept_as, newest = set_aside_snapshot(run)
    assert kept_as == f"{snapshot}{UNREADABLE_SUFFIX}" and not snapshot.exists()
    assert Path(kept_as).read_bytes() == b"\xff\xfe"
    assert newest == f"{tmp_path}/run/checkpoint_epoch_0002_step_000010"
    assert snapshot_state(run) is Snapshot.MISSING


def test_checkpoints_sort_by_age_not_by_name():
    names = ["checkpoint_epoch_0005", "checkpoint_epoch_0005_step_000020",
             "checkpoint_epoch_0004", "checkpoint_epoch_0006_step_000001", "metrics.csv"]
    ordered = sorted((n for n in names if checkpoint.age_order(n)), key=checkpoint.age_order)
    assert ordered == ["checkpoint_epoch_0004", "checkpoint_epoch_0005_step_000020",
                       "checkpoint_epoch_0005", "checkpoint_epoch_0006_step_000001"]


def _worker_group_error(error: Exception) -> WorkerGroupError:
    return WorkerGroupError("worker failed", {0: error})


def test_failure_policy_ends_at_once_on_what_a_restart_cannot_fix():
    policy = AppFailurePolicy(FailureConfig(max_failures=-1))
    for error in (UserError("bad input"), TrainingDiverged("nan"), StorageFailure("full")):
        group_error = _worker_group_error(error)
        assert policy.make_decision(group_error) == FailureDecision.RAISE
        assert not_retryable_cause(group_error) is error


def test_failure_policy_counts_a_death_during_a_restart_as_a_failure():
    policy = AppFailurePolicy(FailureConfig(max_failures=2))
    died = ControllerError(ActorDiedError())
    assert policy.make_decision(died) == FailureDecision.RETRY
    assert policy.make_decision(_worker_group_error(RuntimeError("x"))) == FailureDecision.RETRY
    # The third failure of either kind exceeds max_failures=2.
    assert policy.make_decision(died) == FailureDecision.RAISE
    assert describe_failure(ActorDiedError()) == "its process died"


def test_run_lock_refuses_a_second_holder_and_takes_over_a_dead_ones(tmp_path):
    run = RunConfig(name="locked", storage_path=str(tmp_path))
    with RunLock(run):
        assert oct((tmp_path / "locked").stat().st_mode & 0o777) == "0o700"
        with pytest.raises(UserError, match="is being trained by another command"):
            RunLock(run).acquire()
    assert not (tmp_path / "locked" / RunLock.FILE).exists(), "released on exit"

    # A driver that died without releasing: its pid is gone, so the lock is stale.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    holder = RunLock(run)
    (tmp_path / "locked" / RunLock.FILE).write_text(json.dumps(
        {"host": os.uname().nodename, "pid": int(dead), "token": "x", "heartbeat": 1e12}))
    holder.acquire()
    holder.release()


def test_sweep_outcomes_say_what_happened():
    from app.tune import _check_same_flags, _outcome

    class Result:
        def __init__(self, error=None):
            self.error = error

    assert _outcome(Result(), "TERMINATED", 4, 4) == "completed"
    assert _outcome(Result(), "TERMINATED", 1, 4) == "stopped early by the scheduler"
    assert _outcome(Result(), "PENDING", 0, 4) == "not started"
    assert _outcome(Result(), "RUNNING", 1, 4) == "interrupted"
    failed = _outcome(Result(RuntimeError(UserError("no training worker has run for 20 s"))),
                      "ERROR", 0, 4)
    assert failed == "failed: no training worker has run for 20 s"
    _check_same_flags({"epochs": 4, "num_workers": "1,2"}, {"epochs": 4})
    with pytest.raises(UserError, match="--epochs 5 .the sweep has 4."):
        _check_same_flags({"epochs": 4, "num_workers": "1,2"}, {"epochs": 5})


def test_cluster_watch_survives_a_short_gcs_hiccup(monkeypatch):
    import time

    from app import cluster
    from app.config import WorkersConfig

    answers = iter([RuntimeError("GCS unavailable")] * 3 + [{"n": {"CPU": 2.0}}] * 100)

    def flaky():
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(cluster, "_alive_nodes", flaky)
    watch = cluster.ClusterWatch(WorkersConfig(2, 2), timeout_s=5, poll_s=0)
    for _ in range(6):
        watch.check(last_alive=time.monotonic())  # no error: 3 failed queries, then answers

    monkeypatch.setattr(cluster, "_alive_nodes", lambda: (_ for _ in ()).throw(
        RuntimeError("GCS unavailable")))
    watch = cluster.ClusterWatch(WorkersConfig(2, 2), timeout_s=0.2, poll_s=0)
    watch.check(last_alive=time.monotonic())
    time.sleep(0.3)
    with pytest.raises(UserError, match="has not answered for 0.2 s"):
        watch.check(last_alive=time.monotonic())


def test_a_connection_that_never_comes_gives_up_once_with_the_reason(monkeypatch):
    import threading
    import time

    from app import cluster

    never = threading.Event()
    monkeypatch.setattr(cluster, "_connect", lambda address, verbose: never.wait(30))
    started = time.monotonic()
    with pytest.raises(UserError, match="connecting to Ray took longer than 1 s"):
        with cluster.Connecting(None, verbose=False, deadline_s=1.0) as connection:
            connection.wait()
    # wait() and the exit share the one deadline: the exit adds no second wait.
    assert time.monotonic() - started < 1.8
    never.set()


def test_a_failed_connection_raises_in_the_waiting_thread(monkeypatch):
    from app import cluster

    def refuse(address, verbose):
        raise UserError("no Ray cluster answers at 127.0.0.1:1")

    monkeypatch.setattr(cluster, "_connect", refuse)
    with pytest.raises(UserError, match="no Ray cluster answers"):
        with cluster.Connecting("127.0.0.1:1", verbose=False) as connection:
            connection.wait()
