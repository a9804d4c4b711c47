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
    """Runs in the controller: stores which of torch and scikit-learn it has imported."""

    def after_report(self, run_context, metrics, checkpoint):
        heavy = sorted({name.split(".")[0] for name in sys.modules} & {"torch", "sklearn"})
        internal_kv._internal_kv_put(b"controller-modules", ",".join(heavy).encode(),
                                     namespace="test-lean")


# The controller cannot import this test module: Ray's pickler sends the callback's code along.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_an_embedded_run_starts_only_the_actors_it_needs(tmp_path):
    assert "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER" not in os.environ
    assert cluster.connect(None, verbose=False), "no address: an embedded cluster"
    try:
        assert cluster.is_embedded()
        # Set for the cluster's processes only: a cluster this process starts later keeps
        # Ray Train's preemption watcher.
        assert "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER" not in os.environ
        summary = launcher.launch(
            TrainConfig(data=DataConfig(dataset="digits"), loop=LoopConfig(epochs=1),
                        task=RECORDING_TASK),
            WorkersConfig(min_workers=2, max_workers=2),
            RunConfig("lean", str(tmp_path / "runs")), console=Console(io.StringIO()),
            callbacks=[HeavyModulesInController()],
        )
        controller_modules = internal_kv._internal_kv_get(b"controller-modules",
                                                          namespace="test-lean")
        # Every actor the cluster ever had, from the GCS (no state API needed).
        started = sorted(actor["ActorClassName"] for actor in ray._private.state.actors().values())
        groups = ray.util.placement_group_table().values()
        head_processes = set(ray._private.worker._global_node.all_processes)
        dynamo_at_build = [
            internal_kv._internal_kv_get(f"dynamo-at-build-{rank}".encode(), namespace="test-lean")
            for rank in range(2)
        ]
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
    assert controller_modules == b"", controller_modules
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
