"""A storm of worker kills: does every run still finish, with the undisturbed run's accuracy?

Each run is the real command line (``python -m app.train``, an embedded cluster of this
machine) with a fixed world size. While it trains, ``--kills`` random training workers are
killed with SIGKILL at random intervals; a kill may land mid-step, mid-checkpoint or while the
group is restarting. A run is "finished" (exit 0), "failed" (any other exit) or "hung" (no exit
``--deadline`` seconds after the last kill; it is then sent SIGTERM, which must end it too).
An undisturbed run with the same seed comes first: finished runs should match its accuracy.

    python bench/storm.py --data-dir ../shared/datasets/mnist --runs 4 --kills 5
"""

from __future__ import annotations

import argparse
import csv
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import prepare  # noqa: E402


def _train_workers() -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"])
            if any("RayTrainWorker" in part for part in (p.info["cmdline"] or []))]


def _final_accuracy(run_dir: Path) -> float | None:
    try:
        rows = list(csv.DictReader((run_dir / "metrics.csv").read_text().splitlines()))
    except FileNotFoundError:
        return None
    return float(rows[-1]["val_accuracy"]) if rows else None


def _one_run(name: str, args, data_dir: Path, storage: Path, kills: int, rng) -> dict:
    command = [
        sys.executable, "-m", "app.train", "--dataset", "mnist", "--data-dir", str(data_dir),
        "--num-workers", str(args.workers), "--epochs", str(args.epochs),
        "--checkpoint-every-steps", str(args.checkpoint_every), "--max-failures",
        str(args.max_failures), "--storage-path", str(storage), "--name", name,
    ]
    log = storage / f"{name}.log"
    with open(log, "w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
        started = time.monotonic()
        done_kills = 0
        # Kills start once training does (the table header is printed before the first step).
        while "epoch  workers" not in log.read_text() and process.poll() is None:
            time.sleep(0.2)
        for _ in range(kills):
            time.sleep(rng.uniform(args.min_interval, args.max_interval))
            victims = _train_workers()
            if process.poll() is not None or not victims:
                break
            try:
                rng.choice(victims).send_signal(signal.SIGKILL)
                done_kills += 1
            except psutil.NoSuchProcess:
                pass
        try:
            code = process.wait(timeout=args.deadline)
            outcome = "finished" if code == 0 else "failed"
        except subprocess.TimeoutExpired:
            outcome = "hung"
            process.send_signal(signal.SIGTERM)
            try:
                code = process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                code = process.wait()
    text = log.read_text()
    errors = [line for line in text.splitlines() if line.startswith(("error:", "terminated:"))]
    return {
        "name": name, "outcome": outcome, "exit": code, "kills": done_kills,
        "restarts": text.count("restarting"),
        "accuracy": _final_accuracy(storage / name),
        "seconds": time.monotonic() - started, "error": errors[-1] if errors else "",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", required=True, help="folder with MNIST/raw/t10k-* (real)")
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--kills", type=int, default=5, help="kills per run")
    parser.add_argument("--min-interval", type=float, default=4.0)
    parser.add_argument("--max-interval", type=float, default=10.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--max-failures", type=int, default=10)
    parser.add_argument("--num-train", type=int, default=8_000)
    parser.add_argument("--deadline", type=float, default=300.0,
                        help="seconds after the last kill before a run counts as hung")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)

    with tempfile.TemporaryDirectory() as folder:
        data_dir, storage = Path(folder) / "data", Path(folder) / "runs"
        storage.mkdir()
        prepare(args.data_dir, data_dir, args.num_train)
        baseline = _one_run("calm", args, data_dir, storage, 0, rng)
        print(f"undisturbed: {baseline['outcome']}, accuracy {baseline['accuracy']}, "
              f"{baseline['seconds']:.0f} s", flush=True)
        results = []
        for index in range(args.runs):
            result = _one_run(f"storm-{index}", args, data_dir, storage, args.kills, rng)
            results.append(result)
            same = (result["accuracy"] is not None and baseline["accuracy"] is not None
                    and abs(result["accuracy"] - baseline["accuracy"]) < 0.005)
            print(f"{result['name']}: {result['outcome']} (exit {result['exit']}), "
                  f"{result['kills']} kills, {result['restarts']} restarts, accuracy "
                  f"{result['accuracy']} ({'same as' if same else 'differs from'} undisturbed), "
                  f"{result['seconds']:.0f} s {result['error']}", flush=True)
    counts = {kind: sum(r["outcome"] == kind for r in results)
              for kind in ("finished", "failed", "hung")}
    print(f"\n{args.runs} runs x {args.kills} kills ({args.min_interval:g}-{args.max_interval:g} s "
          f"apart), {args.workers} workers: " + ", ".join(f"{n} {k}" for k, n in counts.items()))


if __name__ == "__main__":
    main()
