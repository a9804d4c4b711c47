"""Training on a real local Ray cluster (2 CPUs): accuracy, DDP in sync, resume."""

from __future__ import annotations

import io
import json
import os
import sys
import time

import pytest
import ray.cloudpickle
import ray.train
from ray.train.v2._internal.execution.callback import WorkerGroupCallback

from app import checkpoint, launcher
from app.config import (
    DataConfig, FaultToleranceConfig, LoopConfig, RunConfig, TrainConfig, WorkersConfig,
)
from app.console import Console

pytestmark = pytest.mark.integration
# The recording callback runs in the Train controller, which cannot import this test module.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class RecordReports(ray.train.UserCallback):
    """Appends what every rank reported, one JSON list per report, to a file."""

    def __init__(self, path):
        self.path = str(path)

    def after_report(self, run_context, metrics, checkpoint):
        with open(self.path, "a") as stream:
            stream.write(json.dumps(metrics) + "\n")


def _reports(path):
    if not path.exists():  # no report at all
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


class KillAWorkerInTheFirstStart(WorkerGroupCallback):
    """Kills rank 1 while the first worker group runs its start callbacks, as a kill -9
    between the workers' creation and their first step does."""

    def __init__(self):
        self.killed = False

    def after_worker_group_start(self, worker_group):
        if self.killed:
            return
        self.killed = True
        victim = worker_group.get_workers()[1].actor
        ray.kill(victim)
        ray.get(victim.__ray_ready__.remote())  # raises RayActorError: the start fails


def _launch(tmp_path, config, name, num_workers=2, callbacks=(), fault_tolerance=None):
    output = io.StringIO()
    record = tmp_path / f"{name}-reports-{len(list(tmp_path.glob('*.jsonl')))}.jsonl"
    summary = launcher.launch(
        config,
        WorkersConfig(min_workers=num_workers, max_workers=num_workers),
        RunConfig(name=name, storage_path=str(tmp_path / "runs")),
        console=Console(output),
        callbacks=[RecordReports(record), *callbacks],
        fault_tolerance=fault_tolerance,
    )
    return summary, output.getvalue(), _reports(record)


def test_the_books_convnet_reaches_96_5_percent_on_real_mnist_with_ranks_in_sync(
    ray_cluster, mnist_dir, tmp_path
):
    """The default task: the book's network and recipe, 2 workers, 5 epochs, 8,000 real
    images to train on and 2,000 to validate on."""
    config = TrainConfig(data=DataConfig(data_dir=str(mnist_dir)), loop=LoopConfig(epochs=5))
    summary, output, reports = _launch(tmp_path, config, "mnist-ddp")

    assert summary.best_metrics["val_accuracy"] >= 0.965, output
    assert [row["epoch"] for row in summary.history] == [1, 2, 3, 4, 5]
    assert all(row["world_size"] == 2 for row in summary.history)
    # Every rank reported every epoch, and their parameters are bit-identical.
    assert len(reports) == 5
    for per_rank in reports:
        assert len(per_rank) == 2
        assert per_rank[0]["param_checksum"] == per_rank[1]["param_checksum"]
        assert per_rank[0]["val_accuracy"] == per_rank[1]["val_accuracy"]
    assert reports[0][0]["param_checksum"] != reports[-1][0]["param_checksum"]

    assert "Training mnist-convnet on mnist: 8,000 train / 2,000 validation samples" in output
    rows = [line.split() for line in output.splitlines()]
    rows = [row for row in rows if row[:1] in (["1"], ["2"], ["3"], ["4"], ["5"])]
    assert [(row[0], row[1]) for row in rows] == [(str(e), "2") for e in range(1, 6)]
    metrics = (tmp_path / "runs" / "mnist-ddp" / "metrics.csv").read_text().splitlines()
    assert metrics[0].startswith("epoch,step,world_size,train_loss,val_loss,val_accuracy")
    assert len(metrics) == 6
    assert (tmp_path / "runs" / "mnist-ddp" / "curves.png").read_bytes()[:4] == b"\x89PNG"
    kept = sorted(p.name for p in (tmp_path / "runs" / "mnist-ddp").glob("checkpoint_epoch_*"))
    assert len(kept) <= config.checkpoint.num_to_keep + 1
    best_epoch = summary.best_metrics["epoch"]
    assert f"checkpoint_epoch_{best_epoch:04d}" in kept
    assert summary.best_metrics["val_accuracy"] == max(r["val_accuracy"] for r in summary.history)
    # The checkpoint holds the book's network: its parameter names and shapes.
    state = checkpoint.load(tmp_path / "runs" / "mnist-ddp" / f"checkpoint_epoch_{best_epoch:04d}")
    assert {name: tuple(value.shape) for name, value in state.model.items()} == {
        "cn1.weight": (16, 1, 3, 3), "cn1.bias": (16,), "cn2.weight": (32, 16, 3, 3),
        "cn2.bias": (32,), "fc1.weight": (64, 4608), "fc1.bias": (64,),
        "fc2.weight": (10, 64), "fc2.bias": (10,),
    }
    assert state.settings["task"] == "mnist-convnet" and state.settings["optimizer"] == "Adadelta"


def test_rerun_with_the_same_name_resumes_at_the_next_epoch(ray_cluster, tmp_path):
    def config(epochs):
        return TrainConfig(data=DataConfig(dataset="digits"), loop=LoopConfig(epochs=epochs))

    first, _, first_reports = _launch(tmp_path, config(1), "resume")
    assert [row["epoch"] for row in first.history] == [1]

    second, output, second_reports = _launch(tmp_path, config(3), "resume")
    assert "exists" in output and "Resumed from the checkpoint after epoch 1" in output
    assert [per_rank[0]["epoch"] for per_rank in second_reports] == [2, 3]
    assert [row["epoch"] for row in second.history] == [1, 2, 3]
    assert second.history[0] == first.history[0]
    assert second.history[1]["step"] == 2 * first.history[0]["step"]

    third, output, third_reports = _launch(tmp_path, config(3), "resume")
    assert "All 3 epochs were already trained" in output
    assert third_reports == []  # nothing retrained
    assert third.history == second.history


def test_a_worker_killed_during_the_start_callbacks_leaves_nothing_reserved(ray_cluster, tmp_path):
    """Ray marks a worker group started before its start callbacks run, and leaves its
    placement group reserved when one fails: without the reaper recording it first, the
    restart waits for 2 CPUs that group holds until the run gives up."""
    from ray.util.placement_group import placement_group_table

    config = TrainConfig(data=DataConfig(dataset="digits"), loop=LoopConfig(epochs=1))
    killer = KillAWorkerInTheFirstStart()
    summary, output, reports = _launch(
        tmp_path, config, "killed-in-start", callbacks=[killer],
        fault_tolerance=FaultToleranceConfig(max_failures=2, placement_timeout_s=60),
    )
    assert "restarting" in output, output  # the kill happened and cost one retry
    assert [row["epoch"] for row in summary.history] == [1]
    assert len(reports) == 1 and len(reports[0]) == 2
    assert all(entry["state"] == "REMOVED" for entry in placement_group_table().values())


def test_every_fit_polls_its_workers_twice_a_second(ray_cluster, monkeypatch):
    """A sweep's trials fit through ``fit_watched`` as a single run does: Ray Train's controller
    takes in one report per poll (2 s by default), so each must get the 0.5 s poll, set where
    Ray Train reads it (the fitting process's environment, when the trainer is built)."""
    names = ("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S")
    for name in names:  # unset here, and as before once the test is over
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)
    seen = {}

    class Built(Exception):
        pass

    def build(progress):
        seen.update({name: os.environ.get(name) for name in names})
        raise Built

    with pytest.raises(Built):
        launcher.fit_watched(build, WorkersConfig(), 60, Console(io.StringIO()))
    assert seen == dict(zip(names, ("0.5", "20")))


def test_reaper_releases_earlier_groups_and_the_guard_a_dead_controllers(ray_cluster):
    """ray-project/ray#54305: a placement group a worker group left reserved is removed before
    the next group starts; one whose controller was killed is removed by the guard."""
    from ray.util.placement_group import placement_group, placement_group_table

    from app.placement import PlacementGroupReaper

    left_behind = placement_group([{"CPU": 1}])
    ray.get(left_behind.ready())
    reaper = PlacementGroupReaper()
    reaper.record(left_behind)  # as after_worker_group_start does
    reaper.before_worker_group_start(None)
    assert placement_group_table(left_behind)["state"] == "REMOVED"

    @ray.remote(num_cpus=0)
    class Controller:
        """Stands in for Ray Train's controller: the reaper's hooks run inside it."""

        def start(self):
            from app.placement import PlacementGroupReaper

            self.reaper = PlacementGroupReaper(guard=True)
            self.reaper.after_controller_start(None)
            self.group = placement_group([{"CPU": 1}])
            ray.get(self.group.ready())
            self.reaper.record(self.group)
            return self.group.id.hex()

    controller = Controller.remote()
    group_id = ray.get(controller.start.remote())
    ray.kill(controller)  # as Tune kills a stopped trial, and its controller with it
    deadline = time.monotonic() + 30
    while placement_group_table().get(group_id, {}).get("state") != "REMOVED":
        assert time.monotonic() < deadline, "the guard did not release the dead run's group"
        time.sleep(0.2)
