"""Ray Data ingestion into the training loop: Parquet (app.prepare + --parquet) vs in memory.

On the same real MNIST images (8,000 train / 2,000 validation), at 1 and 2 workers on an embedded
Ray cluster, measures samples/s
  - with the model step replaced by a no-op (the loop only pulls and normalises batches), and
  - with the real step (full training runs through app.launcher, as `python -m app.train` does),
for the in-memory path, Parquet read once into Ray's object store (the default) and, at 1 worker
(it needs a CPU beside the workers), Parquet re-read every epoch (--stream-data). Reports the
mean over the epochs after the first, and the ratio to in-memory.

    python bench/ingest.py --data-dir ../shared/datasets/mnist [--epochs 4]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import prepare as prepare_idx  # noqa: E402

from app import parquet, prepare  # noqa: E402
from app.config import DataConfig, LoopConfig, RunConfig, TrainConfig, WorkersConfig  # noqa: E402
from app.console import Console  # noqa: E402


def _ingest_loop(config: dict) -> None:
    """Pull every batch of every epoch, as training does, without a model."""
    import ray.train
    import torch

    from app import data
    from app.batching import InMemoryData
    from app.worker import PARQUET_KEY

    torch.set_num_threads(1)
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    if config.get(PARQUET_KEY):
        source = parquet.ShardData(
            ray.train.get_dataset_shard("train"), ray.train.get_dataset_shard("val"),
            config[PARQUET_KEY], config["global_batch_size"], world_size, rank, seed=0,
        )
    else:
        train, val = data.load("mnist", config["data_dir"], download_missing=False)
        source = InMemoryData(train, val, config["global_batch_size"], world_size, rank, seed=0)
    rates = []
    for epoch in range(config["epochs"]):
        started = time.perf_counter()
        samples = sum(batch.global_size for batch in source.train_batches(epoch, 0))
        rates.append(samples / (time.perf_counter() - started))
    if rank == 0:  # Ray Train V2's Result keeps metrics only with a checkpoint: a file instead
        Path(config["out"]).write_text(json.dumps(rates))


def ingest_only(data_dir: Path, manifest, stream: bool, workers: int, args, storage: Path):
    import ray.cloudpickle
    import ray.train
    from ray.train.torch import TorchTrainer

    from app.worker import PARQUET_KEY

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    storage.mkdir(parents=True, exist_ok=True)
    out = storage / f"rates-{workers}-{manifest is not None}-{stream}.json"
    config = {"data_dir": str(data_dir), "global_batch_size": args.global_batch_size,
              "epochs": args.epochs, "out": str(out)}
    datasets = None
    if manifest is not None:
        config[PARQUET_KEY] = manifest.to_dict()
        datasets = parquet.ray_datasets(
            manifest, DataConfig(parquet=manifest.uri, stream=stream), verbose=False
        )
    trainer = TorchTrainer(
        _ingest_loop, train_loop_config=config, datasets=datasets,
        dataset_config=parquet.data_config(),
        scaling_config=ray.train.ScalingConfig(num_workers=workers),
        run_config=ray.train.RunConfig(storage_path=str(storage),
                                       name=f"ingest-{workers}-{manifest is not None}-{stream}"),
    )
    trainer.fit()
    return json.loads(out.read_text())


def real_step(data_dir: Path, manifest, stream: bool, workers: int, args, storage: Path):
    from app import launcher

    data = DataConfig(dataset="mnist", data_dir=str(data_dir))
    if manifest is not None:
        data = DataConfig(dataset="mnist", parquet=manifest.uri, stream=stream)
    summary = launcher.launch(
        TrainConfig(data=data, loop=LoopConfig(epochs=args.epochs,
                                               global_batch_size=args.global_batch_size)),
        WorkersConfig(min_workers=workers, max_workers=workers),
        RunConfig(name=f"real-{workers}-{manifest is not None}-{stream}",
                  storage_path=str(storage)),
        console=Console(io.StringIO()), manifest=manifest,
    )
    return [row["samples_per_second"] for row in summary.history]


def steady(rates: list[float]) -> float:
    return statistics.mean(rates[1:]) if len(rates) > 1 else rates[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default="../shared/datasets/mnist",
                        help="folder with MNIST/raw/t10k-*-ubyte.gz (the real 10,000 images)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--global-batch-size", type=int, default=128)
    args = parser.parse_args()

    import ray

    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        data_dir = scratch / "data"
        prepare_idx(args.data_dir, data_dir, 8_000)
        assert prepare.main(["--data-dir", str(data_dir), "--output",
                             str(scratch / "parquet")]) == 0
        manifest = parquet.open_manifest(str(scratch / "parquet"))
        ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False,
                 log_to_driver=False, logging_level="ERROR")
        sources = {"in memory": (None, False), "Parquet, cached": (manifest, False),
                   "Parquet, streamed": (manifest, True)}
        table = []
        try:
            for workers in (1, 2):
                # Streaming needs a CPU beside the workers.
                labels = [label for label in sources
                          if not (sources[label][1] and workers + 1 > os.cpu_count())]
                noop = {label: steady(ingest_only(data_dir, *sources[label], workers, args,
                                                  scratch / "runs")) for label in labels}
                # Real steps in A B B A order (each path twice, streaming once): this machine's
                # speed drifts between runs by more than the effect measured.
                order = ["in memory", "Parquet, cached", "Parquet, cached", "in memory"]
                order += [label for label in labels if label not in order]
                real: dict[str, list[float]] = {}
                for label in order:
                    runs = len(real.get(label, []))
                    folder = f"{label.replace(' ', '').replace(',', '-')}-{runs}"
                    rates = real_step(data_dir, *sources[label], workers, args,
                                      scratch / "runs" / folder)
                    real.setdefault(label, []).append(steady(rates))
                    print(f"{workers} worker(s), {label}: real step {[round(r) for r in rates]}",
                          flush=True)
                for label in labels:
                    table.append((workers, label, noop[label], statistics.mean(real[label])))
        finally:
            ray.shutdown()

    print()
    print(f"{'workers':>7}  {'source':<18} {'no-op step':>11} {'ratio':>6} "
          f"{'real step':>10} {'ratio':>6}")
    baseline = {workers: (noop, real) for workers, label, noop, real in table
                if label == "in memory"}
    for workers, label, noop, real in table:
        base_noop, base_real = baseline[workers]
        print(f"{workers:>7}  {label:<18} {noop:>11,.0f} {noop / base_noop:>5.2f}x "
              f"{real:>10,.0f} {real / base_real:>5.2f}x")
    print("\nno-op and real step: samples/s, mean of the epochs after the first (real step: mean "
          "of the runs)")
    print("goal: Parquet with the real step within 10% of in memory (ratio >= 0.90x)")


if __name__ == "__main__":
    main()
