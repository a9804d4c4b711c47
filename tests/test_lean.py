"""The lean start (app.lean) on a real embedded cluster: a run starts only the actors it needs,
trains, and leaves no placement group reserved."""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

import pytest
import ray
from ray import cloudpickle
from ray._private import ray_constants
from ray.experimental import internal_kv

from app import cluster, launcher
from app.config import DataConfig, LoopConfig, RunConfig, TrainConfig, WorkersConfig
from app.console import Console

pytestmark = pytest.mark.integration

RECORDING_TASK = f"{Path(__file__).parent / 'lean_task.py'}:task"


class HeavyModulesInController(ray.train.UserCallback):
    """Runs in the controller: stores which of torch and scikit-learn it has imported, when its
    process started and the health-check interval it polls its workers at."""

    def after_report(self, run_context, metrics, checkpoint):
        heavy = sorted({name.split(".")[0] for name in sys.modules} & {"torch", "sklearn"})
        facts = {"modules": ",".join(heavy), "started": str(_process_started()),
                 "interval": os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "")}
        for key, value in facts.items():
            internal_kv._internal_kv_put(f"controller-{key}".encode(), value.encode(),
                                         namespace="test-lean")


def _process_started() -> float:
    """When this process started, in seconds since the machine booted (to 10 ms)."""
    fields = Path("/proc/self/stat").read_text().rpartition(")")[2].split()
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")


def _since_boot() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


def _controller_module_imported() -> bool:
    return "ray.train.v2._internal.execution.controller.controller" in sys.modules


def _controller_fact(key: str) -> str:
    return internal_kv._internal_kv_get(f"controller-{key}".encode(),
                                        namespace="test-lean").decode()


# The controller cannot import this test module: Ray's pickler sends the callback's code along.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_an_embedded_run_starts_only_the_actors_it_needs(tmp_path, monkeypatch):
    assert "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER" not in os.environ
    assert cluster.connect(None, verbose=False), "no address: an embedded cluster"
    try:
        assert cluster.is_embedded()
        # Set for the cluster's processes only: a cluster this process starts later keeps
        # Ray Train's preemption watcher.
        assert "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER" not in os.environ
        launched = _since_boot()
        summary = launcher.launch(
            TrainConfig(data=DataConfig(dataset="digits"), loop=LoopConfig(epochs=1),
                        task=RECORDING_TASK),
            WorkersConfig(min_workers=2, max_workers=2),
            RunConfig("lean", str(tmp_path / "runs")), console=Console(io.StringIO()),
            callbacks=[HeavyModulesInController()],
        )
        controller = {key: _controller_fact(key) for key in ("modules", "started", "interval")}
        # Every actor the cluster ever had, from the GCS (no state API needed).
        started = sorted(actor["ActorClassName"] for actor in ray._private.state.actors().values())
        groups = ray.util.placement_group_table().values()
        head_processes = set(ray._private.worker._global_node.all_processes)
        dynamo_at_build = [
            internal_kv._internal_kv_get(f"dynamo-at-build-{rank}".encode(), namespace="test-lean")
            for rank in range(2)
        ]
        preloaded = ray.get(ray.remote(num_cpus=0)(_controller_module_imported).remote())
        # A setting changed after the cluster started is not in its processes' environment:
        # the controller then gets it the way Ray Train passes it, in a process of its own.
        monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.7")
        relaunched = _since_boot()
        launcher.launch(
            TrainConfig(data=DataConfig(dataset="digits"), loop=LoopConfig(epochs=1),
                        task=RECORDING_TASK),
            WorkersConfig(min_workers=1, max_workers=1),
            RunConfig("lean-changed", str(tmp_path / "runs")), console=Console(io.StringIO()),
            callbacks=[HeavyModulesInController()],
        )
        changed = {key: _controller_fact(key) for key in ("started", "interval")}
    finally:
        cluster.disconnect()
    assert [row["epoch"] for row in summary.history] == [1]
    assert summary.best_metrics["val_accuracy"] > 0.3, "it trained"
    # Ray Train's cleaner, dataset manager, preemption watcher and autoscaling coordinator
    # were not started; the controller, its synchronisation actor, the two workers and the
    # driver's progress queue were.
    assert started == ["RayTrainWorker", "RayTrainWorker", "SynchronizationActor",
                       "TrainController", "_QueueActor"], started
    assert [group["state"] for group in groups] == ["REMOVED"]
    # The controller unpickled its torch config and set up the process group without torch.
    assert controller["modules"] == "", controller
    # The controller ran in one of the Ray workers started with the cluster (before the run was
    # launched), not in a process started for its runtime environment; it still got the app's
    # settings for it.
    assert float(controller["started"]) < launched, (controller, launched)
    assert controller["interval"] == "0.5", controller
    # Every Ray worker of the cluster imported the controller's module as it started.
    assert preloaded
    assert changed["interval"] == "0.7", changed
    assert float(changed["started"]) > relaunched, (changed, relaunched)
    # Each worker had torch's compiler imported (from a thread, while Ray Train set it up) before
    # it built its model; its optimiser would import it otherwise.
    assert dynamo_at_build == [b"True", b"True"], dynamo_at_build
    # The head started no API server, autoscaler monitor nor (without --verbose) log monitor.
    assert head_processes.isdisjoint({
        ray_constants.PROCESS_TYPE_DASHBOARD, ray_constants.PROCESS_TYPE_MONITOR,
        ray_constants.PROCESS_TYPE_LOG_MONITOR,
    }), head_processes
    assert {ray_constants.PROCESS_TYPE_GCS_SERVER, ray_constants.PROCESS_TYPE_RAYLET} \
        <= head_processes, head_processes


@pytest.mark.parametrize("verbose", [False, True])
def test_only_a_verbose_embedded_head_starts_the_log_monitor(verbose):
    """--verbose shows workers' output, which the log monitor sends; the API server and the
    autoscaler monitor are never started, and Ray's own start methods are back after."""
    from ray._private.node import Node

    originals = {name: getattr(Node, name)
                 for name in ("start_api_server", "start_monitor", "start_log_monitor")}
    with cluster.lean_head(log_monitor=verbose):
        assert Node.start_api_server is not originals["start_api_server"]
        assert Node.start_monitor is not originals["start_monitor"]
        assert (Node.start_log_monitor is originals["start_log_monitor"]) == verbose
    assert {name: getattr(Node, name) for name in originals} == originals
