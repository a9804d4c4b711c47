"""Steady-state training throughput: the app on Ray Train vs the classic tutorial script.

Runs, in one invocation on the same data (the real MNIST images, 8,000 for training), the
tutorial baseline (bench/tutorial_baseline.py) with 1 and 2 processes and the app with 1 and 2
workers on an embedded Ray cluster, in fp32 and in its default precision (auto: bf16 autocast
where the CPU has native bf16), all on CPU with the same global batch, and prints samples/s
(the best epoch after the first, which pays the warm-up) and the ratios.

    python bench/throughput.py --data-dir ../shared/datasets/mnist [--epochs 3]
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tutorial_baseline  # noqa: E402

from app import data  # noqa: E402
from app.config import DataConfig, LoopConfig, RunConfig, TrainConfig, WorkersConfig  # noqa: E402
from app.console import Console  # noqa: E402


def prepare(source: str, target: Path, num_train: int) -> None:
    """The shared 10,000 real images as a train/validation data dir both programs can read."""
    raw = Path(source) / "MNIST" / "raw"
    images = data.read_idx(raw / "t10k-images-idx3-ubyte.gz")
    labels = data.read_idx(raw / "t10k-labels-idx1-ubyte.gz")
    out = data.raw_folder(target, "mnist")
    data.write_idx(out / "train-images-idx3-ubyte", images[:num_train])
    data.write_idx(out / "train-labels-idx1-ubyte", labels[:num_train])
    data.write_idx(out / "t10k-images-idx3-ubyte", images[num_train:])
    data.write_idx(out / "t10k-labels-idx1-ubyte", labels[num_train:])


def app_rates(data_dir: Path, storage: Path, workers: int, args, precision: str) -> list[float]:
    from app import launcher

    config = TrainConfig(
        data=DataConfig(dataset="mnist", data_dir=str(data_dir)),
        loop=LoopConfig(
            epochs=args.epochs, global_batch_size=args.global_batch_size, precision=precision
        ),
    )
    summary = launcher.launch(
        config,
        WorkersConfig(min_workers=workers, max_workers=workers),
        RunConfig(name=f"bench-{workers}-{precision}", storage_path=str(storage)),
        console=Console(io.StringIO()),
    )
    return [row["samples_per_second"] for row in summary.history]


def steady(rates: list[float]) -> float:
    return max(rates[1:]) if len(rates) > 1 else rates[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="../shared/datasets/mnist",
                        help="folder with MNIST/raw/t10k-*-ubyte.gz (the real 10,000 images)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--global-batch-size", type=int, default=128)
    parser.add_argument("--num-train", type=int, default=8_000)
    args = parser.parse_args()

    import ray

    with tempfile.TemporaryDirectory() as scratch:
        data_dir = Path(scratch) / "data"
        prepare(args.data_dir, data_dir, args.num_train)
        results = {}
        for world_size in (1, 2):
            rates = tutorial_baseline.run(
                world_size, str(data_dir), args.global_batch_size, args.epochs
            )
            results[f"tutorial, {world_size} process{'es' if world_size > 1 else ''}"] = rates
            print(f"tutorial baseline, {world_size}: {[round(r) for r in rates]}", flush=True)
        ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False,
                 log_to_driver=False, logging_level="ERROR")
        try:
            for world_size, precision in ((1, "fp32"), (2, "fp32"), (1, "auto"), (2, "auto")):
                rates = app_rates(data_dir, Path(scratch) / "runs", world_size, args, precision)
                label = f"app, {world_size} worker{'s' if world_size > 1 else ''}"
                results[f"{label} ({precision})"] = rates
                print(f"app {world_size} {precision}: {[round(r) for r in rates]}", flush=True)
        finally:
            ray.shutdown()

    baseline = steady(results["tutorial, 2 processes"])
    print()
    print(f"{'configuration':<28} {'samples/s':>10} {'vs tutorial, 2 processes':>26}")
    for label, rates in results.items():
        print(f"{label:<28} {steady(rates):>10,.0f} {steady(rates) / baseline:>25.2f}x")
    app2 = steady(results["app, 2 workers (auto)"])
    app2_fp32 = steady(results["app, 2 workers (fp32)"])
    print()
    print(f"app 2 workers (default precision) / tutorial 2 processes: {app2 / baseline:.2f}x "
          f"(target >= 3x); in fp32: {app2_fp32 / baseline:.2f}x")
    print(f"app 2 workers: {app2:,.0f} samples/s (standing goal 8,500 on 2 cores)")
    print(f"scaling 1 -> 2: tutorial {baseline / steady(results['tutorial, 1 process']):.2f}x, "
          f"app {app2 / steady(results['app, 1 worker (auto)']):.2f}x")


if __name__ == "__main__":
    main()
