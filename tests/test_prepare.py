"""python -m app.prepare: real MNIST images into sharded Parquet with a manifest."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pyarrow.parquet as pq
import pyarrow.fs
import pytest

import torch

from app import data, prepare
from app.config import UserError


def test_prepare_round_trips_every_image_with_checksums(small_mnist_dir, tmp_path, capsys):
    output = tmp_path / "parquet"
    assert prepare.main(["--data-dir", str(small_mnist_dir), "--output", str(output),
                         "--train-files", "3"]) == 0
    assert "2,000 train / 500 validation samples in 3 + 2 Parquet files" in \
        capsys.readouterr().out
    manifest = json.loads((output / "manifest.json").read_text())
    assert (manifest["task"], manifest["dataset"]) == ("mnist-convnet", "mnist")
    assert manifest["input"] == {"dtype": "float32", "shape": [1, 28, 28]}
    assert manifest["target"] == {"dtype": "int64", "shape": []}
    train, val = data.load("mnist", small_mnist_dir)
    for split_name, split in (("train", train), ("val", val)):
        images, labels = split.tensors
        entry = manifest["splits"][split_name]
        assert entry["rows"] == len(labels)
        assert sum(f["rows"] for f in entry["files"]) == entry["rows"]
        for file in entry["files"]:
            path = output / file["path"]
            assert hashlib.sha256(path.read_bytes()).hexdigest() == file["sha256"]
        table = pq.read_table(output / split_name)
        ids = table["id"].to_numpy()
        order = np.argsort(ids)
        assert (ids[order] == np.arange(len(labels))).all(), "each image once, by id"
        spec = prepare.TensorSpec("float32", (1, 28, 28))
        torch.testing.assert_close(spec.decode(table["input"])[order], images, rtol=0, atol=0)
        targets = prepare.TensorSpec("int64", ()).decode(table["target"])
        assert targets[order].tolist() == labels.tolist()


def test_same_data_is_a_no_op_and_a_different_data_set_is_refused(small_mnist_dir, tmp_path):
    output = str(tmp_path / "parquet")
    def splits(name, data_dir):
        train, val = data.load(name, data_dir)
        return {"train": train.tensors, "val": val.tensors}

    mnist = splits("mnist", small_mnist_dir)
    first, done = prepare.prepare("mnist-convnet", "mnist", mnist, output, {"train": 2, "val": 1})
    assert done == "written"
    again, done = prepare.prepare("mnist-convnet", "mnist", mnist, output, {"train": 2, "val": 1})
    assert done == "unchanged" and again == first
    with pytest.raises(UserError, match="already holds a different data set"):
        prepare.prepare("mnist-convnet", "digits", splits("digits", "-"), output,
                        {"train": 2, "val": 1})
    assert json.loads((tmp_path / "parquet" / "manifest.json").read_text()) == first


def test_bad_output_is_one_line_exit_2(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert prepare.main(["--dataset", "digits", "--output", str(blocker / "out")]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: cannot write to") and error.count("\n") == 1
    assert not (blocker.parent / "out").exists()
    assert prepare.main(["--dataset", "digits", "--output", str(tmp_path / "x"),
                         "--train-files", "0"]) == 2


def test_a_set_with_a_missing_or_changed_part_is_repaired(small_mnist_dir, tmp_path, capsys):
    output = tmp_path / "parquet"
    args = ["--dataset", "mnist", "--data-dir", str(small_mnist_dir), "--output", str(output),
            "--train-files", "2", "--val-files", "1"]
    assert prepare.main(args) == 0
    intact = {path.name: path.read_bytes() for path in output.glob("*/*.parquet")}
    (output / "train" / "part-00001.parquet").unlink()
    corrupt = output / "val" / "part-00000.parquet"
    corrupt.write_bytes(corrupt.read_bytes()[:-10] + b"0123456789")
    capsys.readouterr()
    assert prepare.main(args) == 0
    said = capsys.readouterr().out
    assert "2 file(s) missing or changed" in said and "rewrote it" in said
    assert {path.name: path.read_bytes() for path in output.glob("*/*.parquet")} == intact
    manifest = json.loads((output / "manifest.json").read_text())
    assert prepare.changed_files(pyarrow.fs.LocalFileSystem(), str(output), manifest) == []
    assert prepare.main(args) == 0
    assert "every file intact; nothing to do" in capsys.readouterr().out


def test_manifest_paths_must_stay_inside_the_set():
    assert prepare.is_inside("train/part-00000.parquet")
    for outside in ("../elsewhere/part.parquet", "/etc/passwd", "s3://other/part.parquet",
                    "train/../../x.parquet", ""):
        assert not prepare.is_inside(outside), outside
