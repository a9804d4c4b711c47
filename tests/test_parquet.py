"""Training from Parquet through Ray Data: real MNIST images, a real local Ray cluster, and a real
S3 API (moto's server on 127.0.0.1) for s3:// data and checkpoints."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pyarrow as pa
import pyarrow.fs
import pyarrow.parquet as pq
import pytest
from localnet import free_port, wait_for_port
from localray import local_ray

from app import parquet, prepare, train
from app.config import UserError

S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class S3Server:
    """moto's S3 server as a child process on 127.0.0.1."""

    def __init__(self, log: Path, **env: str):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._log = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **S3_ENV, **env},
        )
        if not wait_for_port(self.port):
            self.stop()
            raise RuntimeError(f"moto server did not start; see {log}")

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)
        self._log.close()


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A local S3 with buckets 'data' and 'runs'; the environment points pyarrow and Ray at it.

    Set before the module's Ray cluster starts, so its workers inherit it too.
    """
    server = S3Server(tmp_path_factory.mktemp("moto") / "moto.log")
    saved = {key: os.environ.get(key) for key in [*S3_ENV, "AWS_ENDPOINT_URL"]}
    os.environ.update({**S3_ENV, "AWS_ENDPOINT_URL": server.endpoint})
    filesystem = pyarrow.fs.S3FileSystem(endpoint_override=server.endpoint,
                                         allow_bucket_creation=True, **_keys())
    for bucket in ("data", "runs"):
        filesystem.create_dir(bucket)
    yield server
    server.stop()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _keys():
    return {"access_key": S3_ENV["AWS_ACCESS_KEY_ID"], "secret_key": S3_ENV["AWS_SECRET_ACCESS_KEY"]}


@pytest.fixture(scope="module")
def local_parquet(mnist_dir, tmp_path_factory) -> Path:
    """The real MNIST images (8,000 train / 2,000 validation) as app.prepare writes them."""
    output = tmp_path_factory.mktemp("parquet") / "mnist"
    assert prepare.main(["--data-dir", str(mnist_dir), "--output", str(output)]) == 0
    return output


# --- bad input: one line, exit 2, before any worker starts -------------------------------------


@pytest.fixture(autouse=True)
def _runs_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTEST_RUNS", str(tmp_path / "runs"))


def _train_error(capsys, *argv: str) -> str:
    # Refused from the set's manifest and footers alone: no cluster is started around it.
    started = AssertionError("a Ray cluster was started for a refused data set")
    with mock.patch("app.cluster.Connecting", side_effect=started):
        assert train.main(["--storage-path", str(Path(os.environ["PYTEST_RUNS"])), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_a_folder_without_parquet_is_refused(tmp_path, capsys):
    err = _train_error(capsys, "--parquet", str(tmp_path))
    assert f"no Parquet data set at {tmp_path}" in err and "app.prepare" in err


def test_parquet_files_without_a_manifest_are_refused(local_parquet, tmp_path, capsys):
    shutil.copytree(local_parquet / "train", tmp_path / "train")
    err = _train_error(capsys, "--parquet", str(tmp_path))
    assert "has Parquet files but no manifest.json" in err


def test_a_schema_that_is_not_ours_is_refused(local_parquet, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(local_parquet, copy)
    part = copy / "train" / "part-00000.parquet"
    table = pq.read_table(part)
    pq.write_table(table.set_column(2, "target", table.column("target").cast(pa.binary())), part)
    err = _train_error(capsys, "--parquet", str(copy))
    assert "target: binary" in err and "target: fixed_size_binary[8]" in err


def test_a_missing_part_file_is_refused(local_parquet, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(local_parquet, copy)
    (copy / "val" / "part-00001.parquet").unlink()
    err = _train_error(capsys, "--parquet", str(copy))
    assert "is incomplete: 1 file(s)" in err and "part-00001.parquet" in err


def test_dataset_and_parquet_together_are_refused(local_parquet, capsys):
    err = _train_error(capsys, "--parquet", str(local_parquet), "--dataset", "mnist")
    assert "give one of them" in err


def test_a_bucket_that_does_not_exist_is_named(s3, capsys):
    err = _train_error(capsys, "--parquet", "s3://no-such-bucket/mnist")
    assert "the bucket 'no-such-bucket' does not exist" in err


def test_unreachable_s3_is_reported_quickly(s3, monkeypatch, capsys):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    started = time.monotonic()
    err = _train_error(capsys, "--parquet", "s3://data/mnist")
    assert "unreachable" in err and time.monotonic() - started < 30


def test_unauthorised_s3_is_reported(tmp_path, monkeypatch, capsys):
    # moto checks credentials against its IAM when told to: these keys belong to no user.
    server = S3Server(tmp_path / "moto-auth.log", INITIAL_NO_AUTH_ACTION_COUNT="0")
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)
        for key, value in S3_ENV.items():
            monkeypatch.setenv(key, value)
        err = _train_error(capsys, "--parquet", "s3://data/mnist")
        assert "access denied" in err
    finally:
        server.stop()


def test_stream_data_needs_parquet(capsys):
    assert "--stream-data applies to --parquet" in _train_error(capsys, "--stream-data")
    assert "--verify-data applies to --parquet" in _train_error(capsys, "--verify-data")


def _rewrite_part(copy: Path, part: Path, table: pa.Table) -> None:
    """Replace a part file and record its new checksum, as a consistent but wrong set."""
    pq.write_table(table, part)
    manifest_path = copy / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    relative = str(part.relative_to(copy))
    for split in manifest["splits"].values():
        for entry in split["files"]:
            if entry["path"] == relative:
                entry["sha256"] = hashlib.sha256(part.read_bytes()).hexdigest()
    manifest_path.write_text(json.dumps(manifest))


def test_every_part_file_is_checked_not_just_the_first(local_parquet, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(local_parquet, copy)
    part = copy / "val" / "part-00001.parquet"
    table = pq.read_table(part)
    _rewrite_part(copy, part, table.set_column(2, "target", pa.array(
        [row[:4] for row in table.column("target").to_pylist()], type=pa.binary(4))))
    err = _train_error(capsys, "--parquet", str(copy))
    assert "val/part-00001.parquet has columns" in err and "target: fixed_size_binary[4]" in err


def test_a_set_prepared_for_another_task_is_refused(local_parquet, tmp_path, capsys):
    err = _train_error(capsys, "--parquet", str(local_parquet), "--task", "mnist-examples")
    assert "was prepared for the task 'mnist-convnet', not 'mnist-examples'" in err


def test_manifest_paths_outside_the_set_are_refused(local_parquet, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(local_parquet, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["splits"]["train"]["files"][0]["path"] = "../../elsewhere/part-00000.parquet"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    err = _train_error(capsys, "--parquet", str(copy))
    assert "lists a file outside the data set's folder" in err


def test_verify_data_catches_changed_bytes(local_parquet, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(local_parquet, copy)
    part = copy / "train" / "part-00002.parquet"
    table = pq.read_table(part)
    # The same schema and labels, other images: only the checksum tells.
    pq.write_table(table.set_column(1, "input", table.column("input").take(
        pa.array(list(reversed(range(len(table))))))), part)
    err = _train_error(capsys, "--parquet", str(copy), "--verify-data", "--epochs", "0")
    assert "epochs must be >= 1" in err  # flags are checked first
    err = _train_error(capsys, "--parquet", str(copy), "--verify-data")
    assert "1 file(s) differ from the manifest, e.g. train/part-00002.parquet" in err
    assert "app.prepare" in err


# --- on a real Ray cluster ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(s3):
    """A 2-CPU local cluster that can reach the local S3 (started after its environment)."""
    with local_ray() as address:
        yield address


def _collect_ids(config):
    """A worker loop that iterates its shard like training does and reports the ids it saw."""
    import ray.train

    context = ray.train.get_context()
    shard = parquet.ShardData(
        ray.train.get_dataset_shard("train"), ray.train.get_dataset_shard("val"),
        config["stats"], config["global_batch_size"], context.get_world_size(),
        context.get_world_rank(), seed=0,
    )
    for epoch in range(2):
        shard.seen_ids = []
        batches = [len(batch.targets) for batch in shard.train_batches(epoch, start_step=0)]
        val = sum(len(targets) for _, targets in shard.val_batches(500))
        seen = {"epoch": epoch, "batches": batches, "val_rows": val,
                "ids": [int(i) for ids in shard.seen_ids for i in ids]}
        out = Path(config["out_dir"]) / f"epoch{epoch}-rank{context.get_world_rank()}.json"
        out.write_text(json.dumps(seen))


def test_shards_are_equal_and_cover_the_split_once_per_epoch(cluster, local_parquet, tmp_path):
    import ray.cloudpickle
    import ray.train
    from ray.train.torch import TorchTrainer

    from app.config import DataConfig

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    manifest = parquet.open_manifest(str(local_parquet))
    trainer = TorchTrainer(
        _collect_ids,
        train_loop_config={"stats": manifest.to_dict(), "global_batch_size": 128,
                           "out_dir": str(tmp_path)},
        datasets=parquet.ray_datasets(manifest, DataConfig(parquet=manifest.uri), verbose=False),
        dataset_config=parquet.data_config(),
        scaling_config=ray.train.ScalingConfig(num_workers=2),
        run_config=ray.train.RunConfig(storage_path=str(tmp_path), name="ids"),
    )
    trainer.fit()
    orders = []
    for epoch in range(2):
        rank0, rank1 = (json.loads((tmp_path / f"epoch{epoch}-rank{rank}.json").read_text())
                        for rank in (0, 1))
        # Same number of steps on each rank, each step 64 rows from each (the last may be less).
        assert len(rank0["batches"]) == len(rank1["batches"]) == 63
        assert rank0["batches"] == rank1["batches"]
        seen = rank0["ids"] + rank1["ids"]
        assert sorted(seen) == list(range(8_000)), "each training sample exactly once"
        assert rank0["val_rows"] + rank1["val_rows"] == 2_000
        orders.append(seen)
    assert orders[0] != orders[1], "the order changes from epoch to epoch"


def test_trains_from_parquet_to_the_in_memory_accuracy_bar(cluster, local_parquet, tmp_path):
    import io

    from app import launcher
    from app.config import DataConfig, LoopConfig, RunConfig, TrainConfig, WorkersConfig
    from app.console import Console

    manifest = parquet.open_manifest(str(local_parquet))
    console = Console(io.StringIO())
    summary = launcher.launch(
        TrainConfig(data=DataConfig(dataset=manifest.dataset, parquet=manifest.uri),
                    loop=LoopConfig(epochs=4)),
        WorkersConfig(min_workers=2, max_workers=2), RunConfig("parquet", str(tmp_path)),
        console=console, manifest=manifest,
    )
    assert [row["epoch"] for row in summary.history] == [1, 2, 3, 4]
    assert all(row["world_size"] == 2 for row in summary.history)
    assert summary.best_metrics["val_accuracy"] >= 0.97, summary.history
    start = next(event for event in console.events if event["event"] == "start")
    assert (start["source"], start["num_train"], start["num_val"]) == ("parquet", 8_000, 2_000)


def test_streaming_rereads_every_epoch_and_needs_a_spare_cpu(cluster, local_parquet, tmp_path):
    import io

    from app import launcher
    from app.config import DataConfig, LoopConfig, RunConfig, TrainConfig, WorkersConfig
    from app.console import Console

    manifest = parquet.open_manifest(str(local_parquet))
    data = DataConfig(dataset=manifest.dataset, parquet=manifest.uri, stream=True)
    console = Console(io.StringIO())
    # 2 CPUs: one worker, and one for Ray Data's readers.
    summary = launcher.launch(
        TrainConfig(data=data, loop=LoopConfig(epochs=2)), WorkersConfig(),
        RunConfig("stream", str(tmp_path)), console=console, manifest=manifest,
    )
    assert [row["epoch"] for row in summary.history] == [1, 2]
    assert summary.best_metrics["val_accuracy"] >= 0.95, summary.history
    assert "Streaming" in console.stream.getvalue()
    with pytest.raises(UserError, match="needs a CPU for Ray Data beside the 2 worker"):
        launcher.launch(
            TrainConfig(data=data), WorkersConfig(min_workers=2, max_workers=2),
            RunConfig("stream2", str(tmp_path)), console=console, manifest=manifest,
        )


def _s3_json(path: str):
    filesystem = pyarrow.fs.S3FileSystem(endpoint_override=os.environ["AWS_ENDPOINT_URL"],
                                         **_keys())
    try:
        with filesystem.open_input_stream(path) as stream:
            return json.loads(stream.read())
    except (OSError, ValueError):
        return None


def _wait_until_the_job_has_ended(driver_pid: int, timeout_s: float = 60) -> None:
    """Waits until Ray has ended a killed driver's job and the actors that die with it."""
    from ray._private import state

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        jobs = [job for job in state.jobs() if job["DriverPid"] == driver_pid]
        if jobs and all(job["IsDead"] for job in jobs):
            ids = {job["JobID"] for job in jobs}
            # Ray Data's detached actors (its stats) outlive every job by design.
            if all(actor["State"] == "DEAD" for actor in state.actors().values()
                   if actor["JobID"] in ids and not actor["IsDetached"]):
                return
        time.sleep(0.5)
    raise AssertionError(f"Ray did not end the killed driver's job within {timeout_s:.0f} s")


def test_s3_data_and_checkpoints_survive_a_killed_driver(cluster, mnist_dir, tmp_path):
    assert prepare.main(["--data-dir", str(mnist_dir), "--output", "s3://data/mnist"]) == 0
    command = [
        sys.executable, "-m", "app.train", "--address", cluster, "--parquet", "s3://data/mnist",
        "--storage-path", "s3://runs/team", "--name", "s3run", "--num-workers", "2",
        "--epochs", "2", "--checkpoint-every-steps", "10",
    ]
    with open(tmp_path / "first.log", "w") as log:
        driver = subprocess.Popen(command, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    snapshot_path = "runs/team/s3run/checkpoint_manager_snapshot.json"
    deadline = time.monotonic() + 180
    latest = None
    while time.monotonic() < deadline and driver.poll() is None:
        snapshot = _s3_json(snapshot_path)
        if snapshot and snapshot.get("latest_checkpoint_result"):
            latest = snapshot["latest_checkpoint_result"]["metrics"]
            break
        time.sleep(0.5)
    assert latest is not None, (tmp_path / "first.log").read_text()
    driver.send_signal(signal.SIGKILL)
    driver.wait(timeout=30)
    # The killed driver's controller lives on until Ray sees the driver gone and ends its job;
    # it may record a newer checkpoint meanwhile. Read the snapshot once it is gone.
    _wait_until_the_job_has_ended(driver.pid)
    latest = _s3_json(snapshot_path)["latest_checkpoint_result"]["metrics"]

    rerun = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "Run 's3run' exists in s3://runs/team: resuming it." in rerun.stdout
    where = (f"at step {latest['epoch_step']} of epoch {latest['epoch'] + 1}"
             if latest["kind"] == "partial" else f"after epoch {latest['epoch']}")
    assert f"Resumed from the checkpoint {where} of 2" in rerun.stdout, rerun.stdout
    assert "Checkpoints: s3://runs/team/s3run" in rerun.stdout
    # Ray Data's progress bars and execution logs stay out of the console.
    assert "Dataset" not in rerun.stdout + rerun.stderr, rerun.stdout + rerun.stderr
    filesystem = pyarrow.fs.S3FileSystem(endpoint_override=os.environ["AWS_ENDPOINT_URL"],
                                         **_keys())
    with filesystem.open_input_stream("runs/team/s3run/metrics.csv") as stream:
        rows = stream.read().decode().splitlines()[1:]
    assert [int(row.split(",")[0]) for row in rows] == [1, 2]
    final = filesystem.get_file_info("runs/team/s3run/checkpoint_epoch_0002/state.pt")
    assert final.type == pyarrow.fs.FileType.File
    # The run's record, timeline and TensorBoard files are on S3 too, across both drivers.
    assert "warning:" not in rerun.stdout, rerun.stdout
    record = _s3_json("runs/team/s3run/run.json")
    assert [session["status"] for session in record["sessions"]] == ["lost", "finished"]
    assert "Timeline:    s3://runs/team/s3run/timeline.png" in rerun.stdout
    events = filesystem.get_file_info(pyarrow.fs.FileSelector("runs/team/s3run/tensorboard"))
    assert any("tfevents" in info.base_name for info in events), events
    # app.evaluate reads the checkpoint and the run's Parquet data from S3 and gets the run's
    # own validation numbers.
    scored = subprocess.run(
        [sys.executable, "-m", "app.evaluate", "--checkpoint",
         "s3://runs/team/s3run/checkpoint_epoch_0002", "--json"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert scored.returncode == 0, scored.stderr
    recorded = dict(zip(["epoch", "step", "world_size", "train_loss", "val_loss",
                         "val_accuracy"], rows[1].split(",")[:6]))
    values = json.loads(scored.stdout)
    assert values["num_samples"] == 2_000
    assert values["val_accuracy"] == pytest.approx(float(recorded["val_accuracy"]), abs=1e-3)
    assert values["val_loss"] == pytest.approx(float(recorded["val_loss"]), rel=2e-3)


def test_open_manifest_reads_what_prepare_wrote(local_parquet):
    manifest = parquet.open_manifest(str(local_parquet))
    assert (manifest.dataset, manifest.num_train, manifest.num_val) == ("mnist", 8_000, 2_000)
    assert len(manifest.train_files) == 8 and len(manifest.val_files) == 2
    with pytest.raises(UserError, match="not an app.prepare manifest"):
        bad = local_parquet.parent / "bad"
        bad.mkdir(exist_ok=True)
        (bad / "manifest.json").write_text(json.dumps({"format": "other/1"}))
        parquet.open_manifest(str(bad))


def test_storage_errors_are_named_by_their_cause_not_by_digits_in_the_endpoint():
    from app.parquet import _storage_error

    refused = OSError("When reading information for key 'mnist/manifest.json' in bucket 'data': "
                      "AWS Error NETWORK_CONNECTION during HeadObject operation: curlCode: 7, "
                      "Couldn't connect to server (http://127.0.0.1:44039)")
    assert "unreachable" in str(_storage_error("s3://data/mnist", refused))
    denied = OSError("AWS Error UNKNOWN (HTTP status 403) during HeadObject operation")
    assert "access denied" in str(_storage_error("s3://data/mnist", denied))
