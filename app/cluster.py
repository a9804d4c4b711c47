"""Connecting to Ray (an embedded local cluster or an existing one) and checking, before any
worker is asked for, that the cluster can host the workers at all.

Ray Train would otherwise retry starting a worker group that can never be placed, forever.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import signal
import socket
import threading
import time

import ray
from ray.experimental import internal_kv

from app.config import UserError, WorkersConfig

# Ray's defaults take 15-30 s to declare a lost node dead (5 missed checks, 3 s apart, after a
# 5 s delay); training waits for that before it can resume. These settings make it ~3 s.
# Joining an existing cluster, pass the same to `ray start --system-config`.
FAST_RECOVERY_SYSTEM_CONFIG = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}


TRAIN_CONTROLLER_ENV = {
    # The controller polls workers every 2 s by default, and takes in at most one report per
    # poll: a lost worker, each epoch's report and the end of the run are seen sooner at 0.5 s.
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
    # A restart sized before Ray noticed a lost node (one that vanished without a word, until
    # the health checks give up on it) waits for that node's share of the placement group;
    # give up on it after 20 s (Ray's default 60 s) and size it again.
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "20",
}
"""Ray Train's settings for its controller, which it reads from the environment of the process
that fits (a run's driver, a sweep's trial) and passes on; a variable the user set wins."""


EMBEDDED_CLUSTER_ENV = {
    # No node of the embedded cluster is ever drained, so Ray Train's preemption watcher (a
    # process per worker group, switched by its controller's environment) has nothing to
    # watch; see app.lean.
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    # What Ray Train would give its controller in a runtime environment, inherited instead, so
    # that the controller can take one of the Ray workers started with the cluster
    # (``app.lean.run_controller``).
    **TRAIN_CONTROLLER_ENV,
    "RAY_WARN_BLOCKING_GET_INSIDE_ASYNC": "0",
    # Ray's workers import the controller's module (~0.5 s of CPU) as they start, so the one
    # that becomes the controller has done it, beside the driver's preparation, before the run
    # is launched. The training workers and the synchronisation actor import it anyway.
    "RAY_preload_python_modules": "ray.train.v2._internal.execution.controller.controller",
}
"""Set in the embedded cluster's processes (a variable the user set is left as it is)."""


_KV_NAMESPACE = "ray-elastic-train"
_EMBEDDED_KEY = b"embedded"
"""Set in the GCS of an embedded cluster: ``is_embedded()`` for any process on it."""


def connect(address: str | None, verbose: bool) -> bool:
    """Join the cluster at ``address``, or start an embedded one; True when embedded.

    Keeps the process's own SIGTERM and SIGINT handlers: ray.init installs Ray's, which on
    SIGTERM dumps a C++ stack and exits 134 instead of letting the app stop cleanly.
    """
    handlers = _signal_handlers()
    try:
        return _connect(address, verbose)
    finally:
        _restore(handlers)


def _signal_handlers() -> dict[int, object]:
    """The Python SIGTERM and SIGINT handlers, when called in the main thread (the only one
    that can set them again)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGINT)}


def _restore(handlers: dict[int, object]) -> None:
    # signal.signal sets the OS-level handler again even when the Python one is unchanged.
    for number, handler in handlers.items():
        if handler is not None:
            signal.signal(number, handler)


class Connecting:
    """``connect()`` made in a background thread while the command prepares (its imports, the
    data set's load and the task's check): an embedded cluster's start is several processes of
    its own, so on a small machine it runs beside the command's single-process preparation
    instead of after it. ``wait()`` returns what ``connect()`` does, or raises what it raised.

    As a context manager it disconnects on exit; an exit before the connection was made (a
    bad data set, Ctrl-C) waits for it first, so that nothing it started is left running.

    The thread lives until then: Ray starts the cluster's processes with the parent-death
    signal set, which the kernel sends when the *thread* that started them ends.
    """

    def __init__(self, address: str | None, verbose: bool, deadline_s: float = 120.0):
        self._deadline_s = deadline_s
        # One deadline for wait() and the exit together: an exit after wait() gave up adds none.
        self._deadline = time.monotonic() + deadline_s
        self._outcome: dict[str, object] = {}
        self._made = threading.Event()
        self._done = threading.Event()
        # ray.init in another thread installs no Python signal handler, but Ray's core worker
        # still installs its C++ failure handler (a stack dump on SIGTERM) for the whole
        # process: wait() and the exit put the command's own handlers back, as connect() does.
        self._handlers = _signal_handlers()
        self._thread = threading.Thread(
            target=self._connect, args=(address, verbose), name="ray-connect", daemon=True
        )
        self._thread.start()

    def _connect(self, address: str | None, verbose: bool) -> None:
        try:
            self._outcome["embedded"] = _connect(address, verbose)
        except BaseException as error:  # noqa: BLE001 - re-raised in the waiting thread
            self._outcome["error"] = error
        self._made.set()
        self._done.wait()

    def wait(self) -> bool:
        made = self._made.wait(self._left_s())
        _restore(self._handlers)
        if not made:
            raise UserError(
                f"connecting to Ray took longer than {self._deadline_s:.0f} s; rerun with "
                "--verbose to see Ray's own messages"
            )
        if "error" in self._outcome:
            raise self._outcome["error"]  # type: ignore[misc]
        return bool(self._outcome["embedded"])

    def _left_s(self) -> float:
        return max(0.0, self._deadline - time.monotonic())

    def __enter__(self) -> Connecting:
        return self

    def __exit__(self, *exc_info) -> None:
        try:
            self._made.wait(self._left_s())
            _restore(self._handlers)
            if ray.is_initialized():
                disconnect()
        finally:
            self._done.set()
            if self._made.is_set():  # else it is stuck in Ray, and a daemon
                self._thread.join(1.0)


def disconnect(timeout_s: float = 8.0) -> None:
    """ray.shutdown(), but never for longer than ``timeout_s``: a stop (Ctrl-C, SIGTERM) must
    end the command promptly even when the cluster no longer answers."""
    stopper = threading.Thread(target=ray.shutdown, name="ray-shutdown", daemon=True)
    stopper.start()
    stopper.join(timeout_s)
    if stopper.is_alive():
        # Ray calls ray.shutdown() again at interpreter exit, which would wait just the same.
        atexit.unregister(ray.shutdown)


def _connect(address: str | None, verbose: bool) -> bool:
    options = dict(
        logging_level=logging.INFO if verbose else logging.ERROR,
        # Worker output (Ray Train's own logs among it) reaches the console only with --verbose;
        # progress reaches it through the driver's progress queue either way.
        log_to_driver=verbose,
        configure_logging=True,
    )
    if address:
        _check_reachable(address)
        try:
            ray.init(address=address, **options)
        except (ConnectionError, RuntimeError, ValueError) as error:
            if _is_authentication_error(error):
                raise UserError(
                    f"the Ray cluster at {address!r} refused the connection: it uses token "
                    "authentication; set RAY_AUTH_MODE=token and make its token available "
                    "(~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN)"
                ) from None
            raise UserError(
                f"cannot reach the Ray cluster at {address!r} ({error}); start one with "
                "'ray start --head', fix --address/RAY_ADDRESS, or leave both unset to run on an "
                "embedded local cluster"
            ) from None
        return False
    # address="local" always starts a fresh cluster: a bare ray.init() would try to join whatever
    # /tmp/ray/ray_current_cluster names, even a cluster that is long gone.
    global _embedded_environment
    with _embedded_cluster_environment(), lean_head(log_monitor=verbose):
        inherited = dict(os.environ)
        ray.init(
            address="local",
            include_dashboard=False,
            _system_config=FAST_RECOVERY_SYSTEM_CONFIG,
            **options,
        )
    _embedded_environment = (ray.get_runtime_context().gcs_address, inherited)
    internal_kv._internal_kv_put(_EMBEDDED_KEY, b"1", namespace=_KV_NAMESPACE)
    return True


_embedded_environment: tuple[str, dict[str, str]] | None = None
"""The GCS address of the embedded cluster this process last started, and the environment that
its processes inherited."""


def embedded_environment() -> dict[str, str] | None:
    """The environment every process of the connected cluster inherited, when this process
    started it (an embedded cluster; None otherwise, and in a sweep's trials)."""
    if _embedded_environment is None or not ray.is_initialized():
        return None
    address, environment = _embedded_environment
    return environment if ray.get_runtime_context().gcs_address == address else None


@contextlib.contextmanager
def lean_head(log_monitor: bool):
    """The embedded cluster's head without the processes a command's own cluster never uses.

    ray.init starts them all on every head it makes and has no option for any of them: the
    API server (with the dashboard off it only reports usage statistics, and importing its
    dependencies costs this process a second first), the autoscaler's monitor (one machine,
    nothing to scale) and, without --verbose, the log monitor (it sends workers' output to a
    driver that does not ask for it). Each is a Python process of about a second of CPU,
    taken from the workers' start on a small machine. Ray skips a head's API server that
    failed to start just the same way. The tests start their own clusters with it too.
    """
    from ray._private.node import Node

    skipped = {"start_monitor": lambda self: None,
               "start_api_server": lambda self, **kwargs: None}
    if not log_monitor:
        skipped["start_log_monitor"] = lambda self: None
    originals = {name: getattr(Node, name) for name in skipped}
    for name, replacement in skipped.items():
        setattr(Node, name, replacement)
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(Node, name, original)


@contextlib.contextmanager
def _embedded_cluster_environment():
    """Every process of the cluster ray.init starts inherits this process's environment as it
    is then; this process's own is restored after (a later cluster it starts is not embedded).
    A variable the user set is left as it is."""
    added = {name: value for name, value in EMBEDDED_CLUSTER_ENV.items()
             if name not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def is_embedded() -> bool:
    """Whether the connected cluster is an embedded one (a command's own, one machine that
    never grows); asked from any process on it, a sweep's trials too."""
    return internal_kv._internal_kv_get(_EMBEDDED_KEY, namespace=_KV_NAMESPACE) == b"1"


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail in seconds on an address nothing listens at: ray.init would retry for minutes.

    ``auto`` (the cluster this machine belongs to) is left to Ray.
    """
    scheme, _, rest = address.rpartition("://")
    if scheme in ("http", "https"):
        raise UserError(
            f"--address {address!r} is a dashboard (HTTP) URL; give the cluster's GCS address "
            "instead (host:6379, or 'auto' on a node of the cluster); to run through the "
            "dashboard use 'ray job submit --address URL -- python -m app.train ...'"
        )
    if scheme not in ("", "ray"):
        raise UserError(f"--address {address!r}: expected host:port, ray://host:port or auto")
    if rest == "auto" and not scheme:
        return
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"--address {address!r}: expected host:port (e.g. 10.0.0.1:6379) or auto")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as error:
        raise UserError(
            f"cannot reach the Ray cluster at {address!r} ({error.strerror or error}); start one "
            "with 'ray start --head', fix --address/RAY_ADDRESS, or leave both unset to run on an "
            "embedded local cluster"
        ) from None


def _is_authentication_error(error: BaseException | None) -> bool:
    seen = 0
    while error is not None and seen < 10:
        if type(error).__name__ == "AuthenticationError" or "InvalidAuthToken" in str(error):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def _alive_nodes() -> dict[str, dict[str, float]]:
    return {node["NodeID"]: node["Resources"] for node in ray.nodes() if node.get("Alive")}


def live_node_resources() -> list[dict[str, float]]:
    return list(_alive_nodes().values())


def refresh_autoscaling_view() -> None:
    """Make Ray Train's elastic policy see node changes now rather than in up to 20 s.

    The policy learns about nodes from Ray's AutoscalingCoordinator actor, which re-reads the
    cluster on a fixed 20 s tick; asking it for a recomputed reservation re-reads at once.
    Best effort on an internal actor: if it is absent or its API changed, Ray's tick remains.
    """
    try:
        coordinator = ray.get_actor("AutoscalingCoordinator", namespace="AutoscalingCoordinator")
        coordinator.get_reserved_resources.remote("app.cluster.refresh", recompute=True)
    except Exception:  # noqa: BLE001 - any failure just means waiting for Ray's own tick
        pass


def local_resources() -> list[dict[str, float]]:
    """What an embedded cluster on this machine will have: known before paying for its start."""
    import torch

    return [{"CPU": float(os.cpu_count() or 1), "GPU": float(torch.cuda.device_count())}]


def workers_that_fit(nodes: list[dict[str, float]], workers: WorkersConfig) -> int:
    """How many workers fit on these nodes at most (each worker must fit on one node)."""
    total = 0
    for resources in nodes:
        fits = math.floor(resources.get("CPU", 0) / workers.cpus_per_worker)
        if workers.use_gpu:
            fits = min(fits, math.floor(resources.get("GPU", 0)))
        total += fits
    return total


def describe(nodes: list[dict[str, float]]) -> str:
    cpus = sum(resources.get("CPU", 0) for resources in nodes)
    gpus = sum(resources.get("GPU", 0) for resources in nodes)
    return f"{cpus:g} CPUs and {gpus:g} GPUs on {len(nodes)} node{'s' if len(nodes) != 1 else ''}"


def _worker_shape(workers: WorkersConfig) -> str:
    shape = f"{workers.cpus_per_worker} CPU{'s' if workers.cpus_per_worker > 1 else ''}"
    return shape + (" and 1 GPU" if workers.use_gpu else "")


def check_capacity(
    workers: WorkersConfig, wait_s: float = 0.0, nodes: list[dict[str, float]] | None = None
) -> None:
    """Raise UserError unless ``min_workers`` workers fit on ``nodes`` (default: the connected
    cluster's live nodes, polled for up to ``wait_s`` while an autoscaler may add some)."""
    deadline = time.monotonic() + wait_s
    requested = False
    try:
        while True:
            current = nodes if nodes is not None else live_node_resources()
            if workers_that_fit(current, workers) >= workers.min_workers:
                return
            if nodes is not None or time.monotonic() >= deadline:
                break
            if not requested:
                # An autoscaler adds nodes only for demand it sees: show it the minimum group.
                # (Without an autoscaler this does nothing.) Ray Train asks for its own
                # resources once it starts, so the request is withdrawn below either way.
                _request_workers(workers)
                requested = True
            time.sleep(1.0)
    finally:
        if requested:
            from ray.autoscaler.sdk import request_resources

            request_resources(bundles=[])
    nodes = current
    fix = (
        "drop --use-gpu or run on a cluster with GPUs"
        if workers.use_gpu and not any(r.get("GPU", 0) for r in nodes)
        else "use fewer --num-workers or --cpus-per-worker, or add nodes"
    )
    raise UserError(
        f"the cluster can never host {workers.min_workers} worker(s) of {_worker_shape(workers)} "
        f"each: it has {describe(nodes)} (at most {workers_that_fit(nodes, workers)} such "
        f"worker(s)); {fix}"
    )


def _request_workers(workers: WorkersConfig) -> None:
    from ray.autoscaler.sdk import request_resources

    bundle = {"CPU": workers.cpus_per_worker} | ({"GPU": 1} if workers.use_gpu else {})
    request_resources(bundles=[bundle] * workers.min_workers)


class ClusterWatch:
    """Watches a job while it runs; ``check`` is called often and raises UserError to end it.

    - Nodes joined: has Ray Train notice at once. Nodes left: the restart must not plan for them.
    - The cluster has had room for fewer than ``min_workers`` workers for ``timeout_s``: Ray
      Train would wait for them forever.
    - No worker has run for ``timeout_s`` (``last_alive``, the time of rank 0's last sign of
      life) and the run's placement group waits: the worker group cannot be placed although the
      cluster is big enough, e.g. its resources are reserved by another job's placement group.
    - A failed node query (a GCS hiccup) is retried; only ``timeout_s`` of them in a row fail.
    """

    def __init__(self, workers: WorkersConfig, timeout_s: float, poll_s: float = 0.5):
        self.workers = workers
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self._last_poll = float("-inf")
        self._short_since: float | None = None
        self._unanswered_since: float | None = None
        self._node_ids: set[str] | None = None

    def check(self, last_alive: float | None = None) -> None:
        now = time.monotonic()
        if now - self._last_poll < self.poll_s:
            return
        self._last_poll = now
        try:
            alive = _alive_nodes()
        except Exception as error:  # noqa: BLE001 - Ray raises various types while GCS restarts
            self._unanswered_since = self._unanswered_since or now
            if now - self._unanswered_since > self.timeout_s:
                raise UserError(
                    f"the Ray cluster has not answered for {self.timeout_s:g} s ({error}); the "
                    "latest checkpoint is kept, rerun with the same --name"
                ) from None
            return
        self._unanswered_since = None
        if self._node_ids is not None and alive.keys() != self._node_ids:
            refresh_autoscaling_view()
        self._node_ids = set(alive)
        nodes = list(alive.values())
        if workers_that_fit(nodes, self.workers) >= self.workers.min_workers:
            self._short_since = None
            # Room enough, yet no worker has run and this run's workers wait for resources:
            # something else holds them. (Workers that got their resources and start slowly
            # are not stalled.)
            if last_alive is not None and now - last_alive > self.timeout_s:
                from app.placement import waiting_for_resources

                try:
                    waiting = waiting_for_resources()
                except Exception:  # noqa: BLE001 - a GCS hiccup: ask again at the next poll
                    waiting = False
                if waiting:
                    self._stalled()
            return
        # Too few nodes: that is the reason to give, after its own timeout.
        if self._short_since is None:
            self._short_since = now
        elif now - self._short_since > self.timeout_s:
            raise UserError(
                f"for {self.timeout_s:g} s the cluster has had room for fewer than the minimum "
                f"{self.workers.min_workers} worker(s) of {_worker_shape(self.workers)}: it has "
                f"{describe(nodes)}; the latest checkpoint is kept, rerun with the same --name "
                "once nodes are back (or lower the minimum of --num-workers)"
            )

    def _stalled(self) -> None:
        from app.placement import describe_reservations

        try:
            reservations = describe_reservations()
        except Exception as error:  # noqa: BLE001 - the message matters more than its detail
            reservations = f"the cluster did not say what it holds ({error})"
        raise UserError(
            f"no training worker has run for {self.timeout_s:g} s: {self.workers.min_workers} "
            f"worker(s) of {_worker_shape(self.workers)} cannot be placed ({reservations}); the "
            "latest checkpoint is kept, rerun with the same --name once resources are free "
            "(or raise --placement-timeout)"
        )


def check_data_cpus(workers: WorkersConfig) -> None:
    """Ray Data's readers need a CPU that the training workers do not hold.

    Ray Train reserves the workers' CPUs first; without one left over, the first read task
    waits forever (ray-project/ray#44687).
    """
    total = sum(node.get("CPU", 0) for node in live_node_resources())
    needed = workers.min_workers * workers.cpus_per_worker + 1
    if total < needed:
        raise UserError(
            f"streaming from Parquet needs a CPU for Ray Data beside the {workers.min_workers} "
            f"worker(s) x {workers.cpus_per_worker} CPU, and the cluster has {total:g} CPUs: "
            "drop --stream-data (the data is then read once into the object store), use fewer "
            "workers, or add a node"
        )
