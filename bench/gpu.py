"""The GPU path, measured in one invocation when an accelerator machine is lent: the app against
a plain torchrun DDP script (bench/torchrun_ddp.py) of the same models on the same data.

For 1 GPU and for all GPUs of the machine:

- MNIST, the default task (the book's ConvNet): training samples/s and the training seconds to
  ``--target`` validation accuracy (99 %), on the 10,000 real images (8,000 train, 2,000
  validation; the real set's test split, which is all this project has offline);
- CIFAR-10, the ``cifar10-resnet18`` task: training images/s (on ``--cifar-dir`` when it holds
  ``cifar-10-batches-py``, else on 50,000 random images written in that format: speed only).

Each is run as the torchrun script (NCCL, fp32, eager, DataLoader with 4 processes and pinned
memory), as the app with ``--compile off`` (NCCL, bf16, channels-last, the data resident on the
GPU) and as the app's defaults (the same, compiled: ``--compile auto`` is on on GPUs, its compile
time counted in the first epoch, which the samples/s leave out).

On the lent machine Ray is not installed: ``bash bench/gpu_bundle.sh`` packs it (and the images)
here into the ignored folder .gpu-bundle/; carry that folder and run:

    mkdir -p /tmp/site && tar xJf .gpu-bundle/site.tar.xz -C /tmp/site && \
      PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 python3 bench/gpu.py --mnist-dir .gpu-bundle/mnist

``--cpu-smoke`` runs the same steps on the CPU at a toy size, to check the script itself.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import prepare  # noqa: E402  (the same 8,000 / 2,000 split)

from app import data  # noqa: E402
from app.config import DataConfig, LoopConfig, RunConfig, TrainConfig, WorkersConfig  # noqa: E402
from app.console import Console  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def synthetic_cifar(root: Path, num_train: int, num_val: int) -> None:
    generator = np.random.default_rng(0)
    folder = root / data.CIFAR10_FOLDER
    per_file = -(-num_train // len(data.CIFAR10_TRAIN_FILES))
    for name in data.CIFAR10_TRAIN_FILES:
        data.write_cifar_batch(folder / name,
                               generator.integers(0, 256, (per_file, 3, 32, 32), dtype=np.uint8),
                               generator.integers(0, 10, per_file))
    data.write_cifar_batch(folder / data.CIFAR10_VAL_FILE,
                           generator.integers(0, 256, (num_val, 3, 32, 32), dtype=np.uint8),
                           generator.integers(0, 10, num_val))


def torchrun(task: str, data_dir: Path, gpus: int, epochs: int, batch: int, scratch: Path,
             loader_workers: int) -> list[dict]:
    output = scratch / f"torchrun-{task}-{gpus}.json"
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={gpus}", str(REPO / "bench" / "torchrun_ddp.py"), "--task", task,
         "--data-dir", str(data_dir), "--epochs", str(epochs), "--global-batch-size", str(batch),
         "--loader-workers", str(loader_workers), "--output", str(output)],
        check=True, env={**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"},
    )
    return [{"samples_per_second": row["samples_per_second"],
             "seconds": row["training_seconds"], "val_accuracy": row["val_accuracy"]}
            for row in json.loads(output.read_text())]


def app(task: str, dataset: str, data_dir: Path, gpus: int, epochs: int, batch: int,
        compile: str, scratch: Path, use_gpu: bool) -> list[dict]:
    from app import launcher

    config = TrainConfig(
        task=task, data=DataConfig(dataset=dataset, data_dir=str(data_dir)),
        loop=LoopConfig(epochs=epochs, global_batch_size=batch, compile=compile),
    )
    summary = launcher.launch(
        config, WorkersConfig(min_workers=gpus, max_workers=gpus, use_gpu=use_gpu),
        RunConfig(name=f"{task}-{gpus}-{compile}-{time.time_ns()}", storage_path=str(scratch)),
        console=Console(io.StringIO()),
    )
    seconds, rows = 0.0, []
    for row in summary.history:
        seconds += row["epoch_seconds"]
        rows.append({"samples_per_second": row["samples_per_second"], "seconds": seconds,
                     "val_accuracy": row.get("val_accuracy", float("nan"))})
    return rows


def steady(rows: list[dict]) -> float:
    """The best epoch after the first (which pays warm-up and compiling)."""
    return max(row["samples_per_second"] for row in (rows[1:] or rows))


def time_to(rows: list[dict], target: float) -> str:
    for row in rows:
        if row["val_accuracy"] >= target:
            return f"{row['seconds']:.1f} s"
    return f"not reached (best {100 * max(row['val_accuracy'] for row in rows):.2f}%)"


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--mnist-dir", default=str(REPO.parent / "shared/datasets/mnist"),
                        help="folder with MNIST/raw/t10k-*-ubyte.gz (the real 10,000 images)")
    parser.add_argument("--cifar-dir", default=None,
                        help="folder holding cifar-10-batches-py (default: random images)")
    parser.add_argument("--target", type=float, default=0.99)
    parser.add_argument("--mnist-epochs", type=int, default=8)
    parser.add_argument("--cifar-epochs", type=int, default=3)
    parser.add_argument("--cifar-batch", type=int, default=512)
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="the same steps on the CPU at a toy size (checks this script)")
    args = parser.parse_args()

    import ray

    use_gpu = not args.cpu_smoke
    if use_gpu and not torch.cuda.is_available():
        raise SystemExit("no GPU is visible to torch (run with --cpu-smoke to check the script)")
    all_gpus = torch.cuda.device_count() if use_gpu else 2
    counts = sorted({1, all_gpus})
    device = torch.cuda.get_device_name(0) if use_gpu else "CPU (smoke test)"
    with tempfile.TemporaryDirectory() as temporary:
        scratch = Path(temporary)
        mnist = scratch / "mnist"
        prepare(args.mnist_dir, mnist, 8_000 if use_gpu else 1_000)
        cifar = Path(args.cifar_dir) if args.cifar_dir else scratch / "cifar"
        if not args.cifar_dir:
            synthetic_cifar(cifar, 50_000 if use_gpu else 512, 10_000 if use_gpu else 128)
        mnist_epochs, cifar_epochs = (args.mnist_epochs, args.cifar_epochs) if use_gpu else (2, 1)
        loader_workers = 4 if use_gpu else 0
        ray.init(address="local", num_gpus=all_gpus if use_gpu else 0,
                 num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
                 logging_level="ERROR")
        results: dict[tuple[str, int, str], list[dict]] = {}
        try:
            for gpus in counts:
                for task, dataset, folder, epochs, batch in (
                    ("mnist-convnet", "mnist", mnist, mnist_epochs, 128),
                    ("cifar10-resnet18", "cifar10", cifar, cifar_epochs,
                     args.cifar_batch if use_gpu else 64),
                ):
                    short = "mnist" if dataset == "mnist" else "cifar10"
                    runs = {
                        "torchrun DDP (fp32, eager)": lambda: torchrun(
                            short, folder, gpus, epochs, batch, scratch, loader_workers),
                        "app, --compile off": lambda: app(
                            task, dataset, folder, gpus, epochs, batch, "off", scratch, use_gpu),
                        "app, defaults (compiled on GPU)": lambda: app(
                            task, dataset, folder, gpus, epochs, batch, "auto", scratch,
                            use_gpu),
                    }
                    for label, run in runs.items():
                        rows = run()
                        results[(task, gpus, label)] = rows
                        print(f"{task}, {gpus} GPU(s), {label}: "
                              f"{[round(row['samples_per_second']) for row in rows]}", flush=True)
        finally:
            ray.shutdown()

    print(f"\n{device}, {all_gpus} GPU(s) in the machine")
    print(f"{'task':<18} {'GPUs':>4}  {'configuration':<34} {'samples/s':>10} {'vs torchrun':>11}"
          f"  time to {100 * args.target:g}% (MNIST)")
    for (task, gpus, label), rows in results.items():
        baseline = steady(results[(task, gpus, "torchrun DDP (fp32, eager)")])
        reached = time_to(rows, args.target) if task == "mnist-convnet" else ""
        print(f"{task:<18} {gpus:>4}  {label:<34} {steady(rows):>10,.0f} "
              f"{steady(rows) / baseline:>10.2f}x  {reached}")


if __name__ == "__main__":
    main()
