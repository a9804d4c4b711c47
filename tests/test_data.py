import gzip

import numpy as np
import pytest
import torch

from app import data
from app.config import DataConfig


def _write_split(root, prefix, images, labels, suffix=""):
    raw = data.raw_folder(root, "mnist")
    data.write_idx(raw / f"{prefix}-images-idx3-ubyte{suffix}", images)
    data.write_idx(raw / f"{prefix}-labels-idx1-ubyte{suffix}", labels)


def _fake_mnist(root, num_train=20, num_val=10, suffix=""):
    rng = np.random.default_rng(0)
    train = rng.integers(0, 256, (num_train, 28, 28), dtype=np.uint8)
    val = rng.integers(0, 256, (num_val, 28, 28), dtype=np.uint8)
    _write_split(root, "train", train, np.arange(num_train, dtype=np.uint8) % 10, suffix)
    _write_split(root, "t10k", val, np.arange(num_val, dtype=np.uint8) % 10, suffix)
    return train, val


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_idx_round_trip(tmp_path, suffix):
    array = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    path = tmp_path / f"a-idx3-ubyte{suffix}"
    data.write_idx(path, array)
    np.testing.assert_array_equal(data.read_idx(path), array)


def test_idx_parses_the_format_byte_by_byte(tmp_path):
    path = tmp_path / "labels"
    path.write_bytes(bytes([0, 0, 8, 1, 0, 0, 0, 3, 7, 8, 9]))
    np.testing.assert_array_equal(data.read_idx(path), [7, 8, 9])


def test_truncated_idx_names_the_file(tmp_path):
    path = tmp_path / "train-images-idx3-ubyte"
    data.write_idx(path, np.zeros((4, 28, 28), dtype=np.uint8))
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(data.DataError, match=f"{path}.*truncated"):
        data.read_idx(path)


def test_corrupt_gzip_and_bad_magic_name_the_file(tmp_path):
    broken = tmp_path / "x.gz"
    broken.write_bytes(gzip.compress(b"\0\0\x08\x01" + b"\0\0\0\x05abcde")[:-6])
    with pytest.raises(data.DataError, match=str(broken)):
        data.read_idx(broken)
    text = tmp_path / "notidx"
    text.write_text("hello world")
    with pytest.raises(data.DataError, match=f"{text}.*magic"):
        data.read_idx(text)


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_load_normalises_once_with_reference_statistics(tmp_path, suffix):
    train, val = _fake_mnist(tmp_path, suffix=suffix)
    dataset = data.load(DataConfig(dataset="mnist", data_dir=str(tmp_path), download=False))
    assert dataset.train.images.shape == (20, 1, 28, 28)
    assert dataset.train.images.dtype == torch.float32
    assert len(dataset.val) == 10
    expected = (train[3].astype(np.float32) / 255 - 0.1307) / 0.3081
    np.testing.assert_allclose(dataset.train.images[3, 0].numpy(), expected, rtol=1e-5)
    assert dataset.train.labels.tolist() == [i % 10 for i in range(20)]


def test_missing_and_mismatched_files_name_the_file(tmp_path):
    config = DataConfig(dataset="mnist", data_dir=str(tmp_path), download=False)
    with pytest.raises(data.DataError, match="train-images-idx3-ubyte: file not found"):
        data.load(config)
    assert not data.is_available(config)
    _fake_mnist(tmp_path)
    raw = data.raw_folder(tmp_path, "mnist")
    data.write_idx(raw / "t10k-labels-idx1-ubyte", np.zeros(3, dtype=np.uint8))
    with pytest.raises(data.DataError, match="t10k-labels-idx1-ubyte: 3 labels for 10 images"):
        data.load(config)


def test_digits_fallback_is_real_and_shaped_like_mnist():
    dataset = data.load(DataConfig(dataset="digits"))
    assert dataset.train.images.shape[1:] == (1, 28, 28)
    assert len(dataset.train) + len(dataset.val) == 1797
    assert set(dataset.val.labels.tolist()) == set(range(10))
    assert abs(dataset.train.images.mean().item()) < 1e-3
