"""The parts of Ray Train's start that a run does not need, left out.

Each helper Ray Train starts is an actor, and so a Python process that imports Ray Train: about
a second of CPU, taken from the workers' own start on a small machine (two cores: a process's
second is half a second of everyone's wall time before the first step). Left out, where they
have nothing to do:

- Ray Train's placement group cleaner, on every run. It removes a dead controller's placement
  group, asking the dashboard's state API whether the controller lives. The app's own
  ``PlacementGroupReaper`` already removes a run's earlier groups, and in a sweep (where a
  controller can die before its run ends) its guard removes a dead controller's; outside a
  sweep the controller dies with its driver, and Ray removes the groups of a finished job.
- The dataset manager, when the run has no Ray Data sets (the in-memory path).
- torch in the controller. Ray's ``TorchConfig`` lives in a module that imports torch, so the
  controller imported it (~2.5 s of CPU, before it could ask for a single worker) only to
  unpickle its config and to name the functions it sends to the workers. ``TorchConfig`` here
  is the same configuration and process-group setup, with the torch side run in the workers.
- On the embedded cluster (one machine, started by the command, nothing to add or drain):
  the autoscaling coordinator that a fixed-size run registers its request with (no autoscaler
  can act on it; an elastic run still reads its nodes through it, and Ray Data budgets its
  CPUs from it, so those keep it), and the preemption watcher (no node of it is ever drained;
  ``app.cluster`` switches it off in the embedded cluster's environment, as Ray Train's
  controller reads it from there).

And two things changed:

- Each worker imports torch and its compiler from a thread while Ray Train sets it up
  (``ImportTorchEarly``), in the waits of that set-up instead of after it.
- On the embedded cluster the controller runs without a runtime environment
  (``run_controller``). Ray Train gives it one only to pass on the driver's settings, and an
  actor with a runtime environment of its own cannot take one of the Ray workers that the
  cluster starts with the driver's job (already running, Ray imported and connected): Ray
  starts it a new process, through the runtime-env agent, once the run is launched. The
  embedded cluster's processes inherit those settings from the driver instead
  (``app.cluster.EMBEDDED_CLUSTER_ENV``), and where the driver's differ (changed after the
  cluster started) Ray Train's own way is taken.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence
from typing import Any

import ray
from ray._common.constants import RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR
from ray._private import ray_constants
from ray.exceptions import GetTimeoutError
from ray.train._internal.utils import get_address_and_port, update_env_vars
from ray.train.backend import Backend, BackendConfig
from ray.train.constants import (
    DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
    TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
)
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
from ray.train.v2._internal.callbacks.placement_group_callback import (
    PlacementGroupCleanerCallback,
)
from ray.train.v2._internal.constants import (
    DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE,
    get_env_vars_to_propagate,
)
from ray.train.v2._internal.execution.callback import WorkerCallback
from ray.train.v2._internal.execution.controller import TrainController
from ray.train.v2._internal.execution.scaling_policy.fixed import FixedScalingPolicy
from ray.train.v2._internal.util import TrainingFramework

logger = logging.getLogger(__name__)


def needed_callbacks(callbacks: Sequence[Any], *, has_datasets: bool) -> list[Any]:
    """Ray Train's default controller callbacks without those that have nothing to do."""
    unneeded: tuple[type, ...] = (PlacementGroupCleanerCallback,)
    if not has_datasets:
        unneeded += (DatasetsCallback,)
    return [callback for callback in callbacks if not isinstance(callback, unneeded)]


def controller_env() -> dict[str, str]:
    """The variables Ray Train puts in its controller's runtime environment: those of the
    fitting process's settings that it passes on, and its default for one more (ray 2.60,
    ``DataParallelTrainer._initialize_and_run_controller``)."""
    env = get_env_vars_to_propagate()
    env.setdefault(RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR,
                   DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE)
    return env


def run_controller(trainer: Any, controller_init_kwargs: dict[str, Any]) -> ray.train.Result:
    """``trainer._initialize_and_run_controller(**controller_init_kwargs)`` as Ray Train runs
    it (the controller on the driver's node; Ctrl-C aborts it when fitting from the main
    thread), but with no runtime environment: for a cluster whose processes already have
    ``controller_env()`` in theirs."""
    controller_cls = ray.remote(
        num_cpus=0,
        label_selector={ray._raylet.RAY_NODE_ID_KEY: ray.get_runtime_context().get_node_id()},
    )(TrainController)
    controller = controller_cls.remote(**controller_init_kwargs)
    if threading.current_thread() is threading.main_thread():
        trainer._register_sigint_handler(controller)
    ray.get(controller.run.remote())
    return ray.get(controller.get_result.remote())


class ImportTorchEarly(WorkerCallback):
    """Runs in each new worker as Ray Train sets up its context: imports torch, and the
    ``torch._dynamo`` that the first optimizer built imports (``torch.optim`` wraps its methods
    in ``torch._disable_dynamo``, which imports it on first use: ~2 s of CPU), in a thread.

    A worker otherwise imports them on the way to its first step, one after the other, while
    it also waits on its peers (the process group's rendezvous) and on the controller (the
    calls that set it up): in those waits the imports run instead. Every start pays it, and
    a restart after a lost worker is one."""

    def after_init_train_context(self) -> None:
        threading.Thread(target=_import_torch, name="import-torch", daemon=True).start()


def _import_torch() -> None:
    try:
        import torch._dynamo  # noqa: F401  (imports torch first)
    except Exception:  # noqa: BLE001 - the worker's own import then reports what is wrong
        pass


class LocalFixedScalingPolicy(FixedScalingPolicy):
    """A fixed-size policy that asks no autoscaler for anything: for a cluster that cannot
    grow. Ray's ``FixedScalingPolicy`` registers and refreshes a resource request with the
    autoscaling coordinator actor, which it would start for that."""

    def after_controller_start(self, train_run_context) -> None:
        pass

    def _maybe_send_resource_request(self) -> None:
        pass

    def _send_resource_request(self) -> None:
        pass


@dataclasses.dataclass
class TorchConfig(BackendConfig):
    """``ray.train.torch.TorchConfig`` (``env://`` rendezvous) that the controller can unpickle
    without importing torch. ``TorchTrainer`` fills in ``backend`` (gloo, or nccl on GPUs)."""

    backend: str | None = None
    timeout_s: int = 1800

    @property
    def backend_cls(self):
        return _TorchBackend

    @property
    def train_func_context(self):
        # Used where the training function is built (the driver), which has torch.
        from ray.train.torch.config import TorchConfigContextManager

        return TorchConfigContextManager

    @property
    def framework(self):
        return TrainingFramework.TORCH

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _in_worker(function: str, **kwargs: Any) -> Any:
    """``ray.train.torch.config.<function>(**kwargs)``, sent to a worker by this module's name so
    that the controller never imports the torch module that defines it."""
    from ray.train.torch import config

    return getattr(config, function)(**kwargs)


class _TorchBackend(Backend):
    """Ray's ``_TorchBackend`` for an ``env://`` process group: the same steps, in the same
    order, with every torch call made in the workers."""

    share_cuda_visible_devices: bool = True

    def on_start(self, worker_group, backend_config: TorchConfig) -> None:
        address, port = worker_group.execute_single(0, get_address_and_port)
        worker_group.execute(update_env_vars, {"MASTER_ADDR": address, "MASTER_PORT": port})
        worker_group.execute(_in_worker, "_set_torch_distributed_env_vars")
        ray.get([
            worker_group.execute_single_async(
                rank, _in_worker, "_setup_torch_process_group", backend=backend_config.backend,
                world_rank=rank, world_size=len(worker_group), init_method="env://",
                timeout_s=backend_config.timeout_s,
            )
            for rank in range(len(worker_group))
        ])

    def on_shutdown(self, worker_group, backend_config: TorchConfig) -> None:
        futures = worker_group.execute_async(
            _in_worker, "_shutdown_torch", destroy_process_group=len(worker_group) > 1
        )
        timeout_s = ray_constants.env_integer(
            TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S
        )
        try:
            ray.get(futures, timeout=timeout_s)
        except GetTimeoutError:
            logger.warning("Torch process group shutdown timed out after %s seconds", timeout_s)
