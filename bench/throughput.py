"""Steady-state training throughput: the app on Ray Train vs the classic tutorial script and
vs a minimal hand-written Ray Train loop.

Runs, in one invocation on the same data (the real MNIST images, 8,000 for training), all on CPU
with the same global batch:

- the tutorial baseline (bench/tutorial_baseline.py) with 1 and 2 processes;
- the minimal Ray Train V2 loop (bench/minimal_ray_train.py) with 2 workers: the floor of what
  Ray costs, with the app's compute recipe (bf16 where native, channels-last);
- the app with 2 workers, adding one speed option at a time: fp32; bf16 autocast; channels-last
  (the default); compiled (``--compile on``); and the default with 1 worker;

and prints samples/s (the best epoch after the first, which pays the warm-up) and the ratios.

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

import minimal_ray_train  # noqa: E402
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


APP_CONFIGURATIONS = {
    # label: (workers, LoopConfig options), each row adding one speed option to the one above
    "app, 2 workers, fp32": (2, dict(precision="fp32", channels_last=False, compile="off")),
    "app, 2 workers, + bf16 autocast": (2, dict(channels_last=False, compile="off")),
    "app, 2 workers, + channels-last (default)": (2, dict()),
    "app, 2 workers, + compiled": (2, dict(compile="on")),
    "app, 1 worker (default)": (1, dict()),
}


def app_rates(data_dir: Path, storage: Path, workers: int, args, options: dict) -> list[float]:
    from app import launcher

    config = TrainConfig(
        data=DataConfig(dataset="mnist", data_dir=str(data_dir)),
        loop=LoopConfig(epochs=args.epochs, global_batch_size=args.global_batch_size, **options),
    )
    summary = launcher.launch(
        config,
        WorkersConfig(min_workers=workers, max_workers=workers),
        RunConfig(name=f"bench-{len(os.listdir(storage)) if storage.exists() else 0}",
                  storage_path=str(storage)),
        console=Console(io.StringIO()),
    )
    return [row["samples_per_second"] for row in summary.history]


def steady(rates: list[float]) -> float:
    return max(rates[1:]) if len(rates) > 1 else rates[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
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
            rates = minimal_ray_train.rates(str(data_dir), str(Path(scratch) / "minimal"), 2,
                                            args.global_batch_size, args.epochs)
            results["minimal Ray Train loop, 2 workers"] = rates
            print(f"minimal Ray Train loop, 2: {[round(r) for r in rates]}", flush=True)
            for label, (world_size, options) in APP_CONFIGURATIONS.items():
                rates = app_rates(data_dir, Path(scratch) / "runs", world_size, args, options)
                results[label] = rates
                print(f"{label}: {[round(r) for r in rates]}", flush=True)
        finally:
            ray.shutdown()

    baseline = steady(results["tutorial, 2 processes"])
    floor = steady(results["minimal Ray Train loop, 2 workers"])
    print()
    print(f"{'configuration':<44} {'samples/s':>10} {'vs tutorial, 2 proc.':>21} "
          f"{'vs minimal Ray Train':>21}")
    for label, rates in results.items():
        rate = steady(rates)
        print(f"{label:<44} {rate:>10,.0f} {rate / baseline:>20.2f}x {rate / floor:>20.2f}x")
    app2 = steady(results["app, 2 workers, + channels-last (default)"])
    print()
    print(f"app 2 workers (defaults) / tutorial 2 processes: {app2 / baseline:.2f}x (target >= 3x)"
          f"; / minimal Ray Train loop: {app2 / floor:.2f}x (target >= 0.9x)")
    print(f"app 2 workers: {app2:,.0f} samples/s (standing goal 8,500 on 2 cores)")
    print(f"scaling 1 -> 2: tutorial {baseline / steady(results['tutorial, 1 process']):.2f}x, "
          f"app {app2 / steady(results['app, 1 worker (default)']):.2f}x")


if __name__ == "__main__":
    main()
