"""Where a run's fixed cost goes: command start to exit, minus the epochs' training seconds.

Runs, in one invocation on the same data (the real MNIST images, 8,000 for training), a
1-epoch, 2-worker ``python -m app.train`` on an embedded cluster as a person would (its wall
time, the training seconds it reports, and when its first step came after the command
started, from the run's record), then the same run phase by phase in this process:

    interpreter and imports | ray.init | launch -> workers running | data | model and process
    group | first step | training | last epoch row -> results written | shutdown

and, as the baseline, how long Ray Train itself takes from ``TorchTrainer.fit()`` to the first
line of a no-op training function, and to the end of ``fit()``, on the same cluster.

    python bench/startup.py --data-dir ../shared/datasets/mnist [--workers 2] [--repeats 2]
        [--baseline-checkout ../old]

``--baseline-checkout``: another checkout of the app (an earlier release, from ``git worktree
add``), whose command runs interleaved with this one's, on the same data, so that the ratio of
their fixed costs comes from one invocation (this machine drifts 10-20 % between runs).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
REPO = Path(__file__).resolve().parent.parent

from throughput import prepare  # noqa: E402  (the same 8,000 / 2,000 split)


def cli_run(data_dir: Path, workers: int, storage: Path, name: str,
            checkout: Path = REPO) -> tuple[float, float, float]:
    """(wall seconds of the whole command, training seconds it reported, seconds from the
    command's start to its first step), with the app of ``checkout`` (``python -m`` from there
    imports its ``app``, and Ray's workers get the driver's path)."""
    launched = time.time()
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "app.train", "--num-workers", str(workers), "--epochs", "1",
         "--data-dir", str(data_dir), "--storage-path", str(storage), "--name", name],
        capture_output=True, text=True, cwd=checkout,
    )
    wall = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"app.train failed:\n{result.stdout}\n{result.stderr}")
    rows = list(csv.DictReader((storage / name / "metrics.csv").open()))
    # Rank 0 records the group's start just before its first step, in the run's record.
    events = json.loads((storage / name / "run.json").read_text())["events"]
    first_step = next(event["time"] for event in events if event["event"] == "start")
    return wall, sum(float(row["epoch_seconds"]) for row in rows), first_step - launched


def imports_seconds() -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import app.train, app.launcher, app.cluster"],
                   check=True)
    return time.perf_counter() - started


def phases(data_dir: Path, workers: int, storage: Path, name: str) -> dict[str, float]:
    """The same run in this process, timed phase by phase (seconds)."""
    from app import cluster, launcher
    from app.config import DataConfig, LoopConfig, RunConfig, TrainConfig, WorkersConfig
    from app.console import Console

    started = time.time()
    cluster.connect(None, verbose=False)
    connected = time.time()
    console = Console(io.StringIO())
    try:
        launcher.launch(
            TrainConfig(data=DataConfig(data_dir=str(data_dir)), loop=LoopConfig(epochs=1)),
            WorkersConfig(min_workers=workers, max_workers=workers),
            RunConfig(name, str(storage)), console=console, verbose=False,
        )
        returned = time.time()
    finally:
        cluster.disconnect()
    ended = time.time()
    start = next(event for event in console.events if event["event"] == "start")
    epoch = next(event for event in console.events if event["event"] == "epoch")
    launched = connected  # launch() begins right after connecting
    marks = start["phases"]
    return {
        "ray.init": connected - started,
        "launch -> workers running": marks["worker_entry"] - launched,
        "data": marks["data_loaded"] - marks["worker_entry"],
        "model and process group": marks["model_ready"] - marks["data_loaded"],
        "-> first step": start["time"] - marks["model_ready"],
        "epoch (training, validation, checkpoint)": epoch["received"] - start["time"],
        "  of which training": epoch["epoch_seconds"],
        "last epoch row -> results written": returned - epoch["received"],
        "shutdown": ended - returned,
    }


def _bare_loop(config: dict) -> None:
    config["queue"].put(time.time())


def bare_ray_train(workers: int, storage: Path) -> tuple[float, float]:
    """(seconds from fit() to the no-op loop's first line, seconds of the whole fit())."""
    import ray
    import ray.cloudpickle
    import ray.train
    from ray.train.torch import TorchTrainer
    from ray.util.queue import Queue

    from app import cluster

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cluster.connect(None, verbose=False)
    try:
        queue = Queue(actor_options={"num_cpus": 0})
        started = time.time()
        TorchTrainer(
            _bare_loop, train_loop_config={"queue": queue},
            scaling_config=ray.train.ScalingConfig(num_workers=workers),
            run_config=ray.train.RunConfig(storage_path=str(storage), name="bare"),
        ).fit()
        ended = time.time()
        entered = queue.get(timeout=10)
    finally:
        cluster.disconnect()
    return entered - started, ended - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True,
                        help="folder with MNIST/raw/t10k-*.gz (the 10,000 real images)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--baseline-checkout", type=Path,
                        help="another checkout of the app to run interleaved, as the baseline")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temporary:
        root = Path(temporary)
        data_dir = root / "data"
        prepare(args.data_dir, data_dir, 8_000)
        os.chdir(root)
        checkouts = {"this checkout": REPO}
        if args.baseline_checkout:
            checkouts["baseline"] = args.baseline_checkout.resolve()
        fixed: dict[str, list[float]] = {label: [] for label in checkouts}
        first: dict[str, list[float]] = {label: [] for label in checkouts}
        for repeat in range(args.repeats):
            for label, checkout in checkouts.items():
                wall, training, first_step = cli_run(data_dir, args.workers, root / "runs",
                                                     f"cli-{label.split()[-1]}-{repeat}", checkout)
                fixed[label].append(wall - training)
                first[label].append(first_step)
                print(f"{label}: python -m app.train, 1 epoch, {args.workers} workers: "
                      f"{wall:.1f} s wall, {training:.1f} s training -> fixed cost "
                      f"{wall - training:.1f} s; first step at {first_step:.1f} s", flush=True)
        for what, figures in (("fixed cost", fixed), ("first step", first)):
            medians = [statistics.median(figures[label]) for label in checkouts]
            line = f"{what}, median of {args.repeats}: {medians[0]:.1f} s"
            if args.baseline_checkout:
                line += (f" against the baseline's {medians[1]:.1f} s "
                         f"({medians[0] / medians[1]:.2f}x)")
            print(line)
        print(f"interpreter and imports: {imports_seconds():.1f} s")
        measured = phases(data_dir, args.workers, root / "runs", "phases")
        for phase, seconds in measured.items():
            print(f"{phase:<42} {seconds:6.1f} s")
        to_entry, whole = bare_ray_train(args.workers, root / "runs")
        print(f"baseline, Ray Train alone (a no-op loop, {args.workers} workers): fit() -> loop "
              f"entered {to_entry:.1f} s, whole fit() {whole:.1f} s; the app's launch -> workers "
              f"running is {measured['launch -> workers running'] / to_entry:.2f}x that")


if __name__ == "__main__":
    main()
