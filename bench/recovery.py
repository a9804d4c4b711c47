"""Recovery and scale-up latency of elastic training, on a real multi-node Ray cluster on this
machine (ray.cluster_utils.Cluster), and the accuracy of a disturbed vs an undisturbed run.

Times are from the disturbance (kill, node removal, node join) to the moment the new worker group
is about to take its first training step (the "start" event rank 0 sends before its first step).
Steps: the step the new group resumes from, against the last step the driver saw reported (an
epoch's row or a checkpoint) before the disturbance and, for a join, the step of the checkpoint
the workers took when the join was seen (the run checkpoints first, then grows: the steps redone
are the difference, 0 when it works). After a kill or a removal the steps trained since the last
registered checkpoint are redone (at most the checkpoint interval, 10 steps here); the driver
sees only a lower bound of them.

    python bench/recovery.py --data-dir ../shared/datasets/mnist
        [--baseline-checkout ../old [--rounds 3]]

``--baseline-checkout``: another checkout of the app (an earlier release, from ``git worktree
add``). Instead of the table above, the worker-kill scenario runs ``--rounds`` times for each
checkout, interleaved in one invocation (this machine drifts 10-20 % between runs), each in its
own process that imports that checkout's ``app``; it prints each recovery and the medians' ratio.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import ray
from ray.cluster_utils import Cluster

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import prepare  # noqa: E402

import app  # noqa: E402  (the checkout's on PYTHONPATH when a baseline run set it)
from app import launcher  # noqa: E402
from app.cluster import FAST_RECOVERY_SYSTEM_CONFIG  # noqa: E402
from app.config import (  # noqa: E402
    CheckpointConfig,
    DataConfig,
    FaultToleranceConfig,
    LoopConfig,
    RunConfig,
    TrainConfig,
    WorkersConfig,
)
from app.console import Console  # noqa: E402


def _start_cluster(worker_nodes: list[int]) -> tuple[Cluster, list]:
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False,
                        "_system_config": FAST_RECOVERY_SYSTEM_CONFIG},
    )
    nodes = [cluster.add_node(num_cpus=cpus) for cpus in worker_nodes]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")
    return cluster, nodes


def _launch_in_background(config, workers, name, storage, fault_tolerance):
    console = Console(io.StringIO())
    outcome = {}

    def run():
        try:
            outcome["summary"] = launcher.launch(
                config, workers, RunConfig(name, storage), console=console,
                fault_tolerance=fault_tolerance,
            )
        except BaseException as error:  # reported by the caller
            outcome["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return console, thread, outcome


def _wait(console, predicate, timeout_s=180):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for event in console.events:
            if predicate(event):
                return event
        time.sleep(0.05)
    raise RuntimeError(f"timed out; events so far: {console.events}")


def _finish(thread, outcome):
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["summary"]


def scenario(worker_nodes, workers, config, storage, name, disturb, settle, delay_s=0.0):
    """Start a run, wait for ``settle`` to be seen and ``delay_s`` more, ``disturb`` the
    cluster; returns the seconds until the next worker group starts, its start event, the run's
    summary and the steps (resumed from, last seen before the disturbance, checkpointed at a
    join)."""
    cluster, nodes = _start_cluster(worker_nodes)
    try:
        console, thread, outcome = _launch_in_background(
            config, workers, name, storage,
            FaultToleranceConfig(max_failures=3, resize_interval_s=2),
        )
        _wait(console, settle)
        time.sleep(delay_s)
        disturbed_at = time.time()
        disturb(cluster, nodes)
        restart = _wait(
            console, lambda e: e["event"] == "start" and e["received"] > disturbed_at
        )
        summary = _finish(thread, outcome)
        saved = [e for e in console.events if e["event"] in ("partial", "epoch")]
        before = max((e["step"] for e in saved if e["received"] <= disturbed_at), default=0)
        for_resize = [e["step"] for e in saved
                      if e["event"] == "partial" and e.get("reason") == "resize"]
        steps = {"resumed": restart["step"], "last checkpoint before": before,
                 "resize checkpoint": for_resize[0] if for_resize else None}
        return restart["time"] - disturbed_at, restart, summary, steps
    finally:
        ray.shutdown()
        cluster.shutdown()


def _kill_a_worker(cluster, nodes):
    victims = [
        process for process in psutil.process_iter(["cmdline"])
        if any("RayTrainWorker" in part for part in (process.info["cmdline"] or []))
    ]
    victims[-1].send_signal(signal.SIGKILL)


RESULT = "recovery result: "
"""How a ``--kill-only`` run's line of JSON starts, among what else the run prints."""


def _mnist(data_dir: Path, epochs: int) -> TrainConfig:
    return TrainConfig(
        data=DataConfig(dataset="mnist", data_dir=str(data_dir)),
        loop=LoopConfig(epochs=epochs),
        checkpoint=CheckpointConfig(every_steps=10),
    )


_FIXED_TWO = WorkersConfig(min_workers=2, max_workers=2)


def _first_epoch(event) -> bool:
    return event["event"] == "epoch" and event["epoch"] == 1


def _kill_scenario(mnist: TrainConfig, storage: str):
    return scenario([2], _FIXED_TWO, mnist, storage, "worker-kill", _kill_a_worker,
                    _first_epoch, delay_s=2.0)  # mid-epoch


def kill_only(args) -> None:
    """One worker-kill scenario; its recovery seconds as a line of JSON."""
    with tempfile.TemporaryDirectory() as scratch:
        data_dir = Path(scratch) / "data"
        prepare(args.data_dir, data_dir, 8_000)
        seconds, _, _, steps = _kill_scenario(_mnist(data_dir, args.epochs),
                                              str(Path(scratch) / "runs"))
    print(RESULT + json.dumps({"seconds": seconds, "steps": steps,
                               "app": str(Path(app.__file__).parent)}), flush=True)


def against_baseline(args) -> None:
    """The worker-kill recovery of this checkout and ``--baseline-checkout``, interleaved."""
    checkouts = {"this checkout": Path(__file__).resolve().parent.parent,
                 "baseline": args.baseline_checkout.resolve()}
    if not (checkouts["baseline"] / "app" / "launcher.py").is_file():
        raise SystemExit(f"--baseline-checkout {args.baseline_checkout}: no app/launcher.py "
                         f"there; give a checkout of this repository (git worktree add)")
    seconds: dict[str, list[float]] = {label: [] for label in checkouts}
    for round_ in range(1, args.rounds + 1):
        for label, checkout in checkouts.items():
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                filter(None, [str(checkout), os.environ.get("PYTHONPATH")]))}
            done = subprocess.run(
                [sys.executable, __file__, "--kill-only", "--data-dir",
                 str(Path(args.data_dir).resolve()), "--epochs", str(args.epochs)],
                capture_output=True, text=True, env=env, cwd=checkout, timeout=900,
            )
            lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT)]
            if done.returncode != 0 or not lines:
                raise SystemExit(f"{label}'s kill scenario failed (exit {done.returncode}):\n"
                                 f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
            result = json.loads(lines[-1][len(RESULT):])
            if Path(result["app"]) != checkout / "app":
                raise SystemExit(f"{label}'s run imported the app of {result['app']}, "
                                 f"not {checkout / 'app'}")
            seconds[label].append(result["seconds"])
            print(f"round {round_}, {label} ({checkout}): recovery after kill -9 of a worker "
                  f"{result['seconds']:.1f} s, resumed at step {result['steps']['resumed']}",
                  flush=True)
    ours, theirs = (statistics.median(seconds[label]) for label in checkouts)
    print(f"recovery after kill -9 of a worker, median of {args.rounds}: {ours:.1f} s against "
          f"the baseline's {theirs:.1f} s ({ours / theirs:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--data-dir", default="../shared/datasets/mnist")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--baseline-checkout", type=Path,
                        help="another checkout of the app: compare the worker-kill recovery "
                             "of both, interleaved")
    parser.add_argument("--rounds", type=int, default=3,
                        help="with --baseline-checkout: kill scenarios per checkout")
    parser.add_argument("--kill-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: give at least 1")
    if args.kill_only:
        return kill_only(args)
    if args.baseline_checkout:
        return against_baseline(args)

    with tempfile.TemporaryDirectory() as scratch:
        data_dir = Path(scratch) / "data"
        prepare(args.data_dir, data_dir, 8_000)
        storage = str(Path(scratch) / "runs")
        mnist = _mnist(data_dir, args.epochs)
        elastic = WorkersConfig(min_workers=1, max_workers=2)

        cluster, _ = _start_cluster([2])
        try:
            console, thread, outcome = _launch_in_background(
                mnist, _FIXED_TWO, "undisturbed", storage, FaultToleranceConfig()
            )
            undisturbed = _finish(thread, outcome)
        finally:
            ray.shutdown()
            cluster.shutdown()

        kill_s, _, killed, kill_steps = _kill_scenario(mnist, storage)
        remove_s, _, _, remove_steps = scenario(
            [1, 1], elastic, mnist, storage, "node-removal",
            lambda cluster, nodes: cluster.remove_node(nodes[-1]),
            lambda e: e["event"] == "epoch" and e["world_size"] == 2,
        )
        join_s, grown, _, join_steps = scenario(
            [1], elastic, mnist, storage, "node-join",
            lambda cluster, nodes: cluster.add_node(num_cpus=1),
            _first_epoch,
        )
        assert grown["world_size"] == 2

    calm = undisturbed.history[-1]["val_accuracy"]
    disturbed = killed.history[-1]["val_accuracy"]
    print(f"{'measure':<44} {'value':>9} {'goal':>9}")
    print(f"{'recovery after kill -9 of a worker (s)':<44} {kill_s:>9.1f} {'<= 15':>9}")
    print(f"{'recovery after a node is removed (s)':<44} {remove_s:>9.1f} {'<= 15':>9}")
    print(f"{'scale-up after a node joins (s)':<44} {join_s:>9.1f} {'<= 20':>9}")
    print(f"{'val accuracy, undisturbed (%)':<44} {100 * calm:>9.2f}")
    print(f"{'val accuracy, worker killed (%)':<44} {100 * disturbed:>9.2f}")
    print(f"{'accuracy gap (pp)':<44} {100 * abs(calm - disturbed):>9.2f} {'<= 0.5':>9}")
    print()
    print(f"{'disturbance':<16} {'resumed at step':>16} {'last step seen before':>22} "
          f"{'checkpoint at the join':>23} {'steps redone':>13}")
    for label, steps in (("worker killed", kill_steps), ("node removed", remove_steps),
                         ("node joined", join_steps)):
        resize = steps["resize checkpoint"]
        seen = steps["last checkpoint before"]
        # After a loss, the steps since the last report are not seen: a lower bound.
        redone = (f"{resize - steps['resumed']}" if resize is not None
                  else f">= {max(seen - steps['resumed'], 0)}")
        print(f"{label:<16} {steps['resumed']:>16} {seen:>22} "
              f"{resize if resize is not None else '-':>23} {redone:>13}")


if __name__ == "__main__":
    main()
