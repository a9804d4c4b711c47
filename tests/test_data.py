import gzip
import subprocess
import sys

import numpy as np
import pytest
import torch

from app import data


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
    train_set, val_set = data.load("mnist", tmp_path, download_missing=False)
    images, labels = train_set.tensors
    assert images.shape == (20, 1, 28, 28)
    assert images.dtype == torch.float32
    assert len(val_set) == 10
    expected = (train[3].astype(np.float32) / 255 - 0.1307) / 0.3081
    np.testing.assert_allclose(images[3, 0].numpy(), expected, rtol=1e-5)
    assert labels.tolist() == [i % 10 for i in range(20)]


def test_missing_and_mismatched_files_name_the_file(tmp_path):
    with pytest.raises(data.DataError, match="train-images-idx3-ubyte: file not found"):
        data.load("mnist", tmp_path, download_missing=False)
    _fake_mnist(tmp_path)
    raw = data.raw_folder(tmp_path, "mnist")
    data.write_idx(raw / "t10k-labels-idx1-ubyte", np.zeros(3, dtype=np.uint8))
    with pytest.raises(data.DataError, match="t10k-labels-idx1-ubyte: 3 labels for 10 images"):
        data.load("mnist", tmp_path, download_missing=False)


def test_digits_fallback_is_real_and_shaped_like_mnist():
    train, val = data.load("digits", "unused")
    assert train.tensors[0].shape[1:] == (1, 28, 28)
    assert len(train) + len(val) == 1797
    assert set(val.tensors[1].tolist()) == set(range(10))
    assert abs(train.tensors[0].mean().item()) < 1e-3


def test_digits_are_read_as_scikit_learn_loads_them_without_importing_it():
    """app.data reads scikit-learn's bundled file itself: the same images and labels as
    load_digits(), and no sklearn module is imported for it (~1.8 s in every process)."""
    script = ("import sys\nfrom app import data\nimages, labels = data._sklearn_digits()\n"
              "print(sorted(name for name in sys.modules if name.startswith('sklearn')))")
    imported = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              check=True)
    assert imported.stdout.strip() == "[]", imported.stdout
    from sklearn.datasets import load_digits

    images, labels = data._sklearn_digits()
    bunch = load_digits()
    np.testing.assert_array_equal(images, bunch.images)
    np.testing.assert_array_equal(labels, bunch.target)


def test_a_scikit_learn_without_its_digits_file_is_a_data_error(tmp_path, monkeypatch):
    import importlib.machinery

    package = tmp_path / "sklearn"
    package.mkdir()
    spec = importlib.machinery.ModuleSpec("sklearn", None, is_package=True)
    spec.submodule_search_locations = [str(package)]
    monkeypatch.setattr(data.importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(data.DataError, match="digits.csv.gz: file not found"):
        data.load("digits", "unused")


def test_cifar10_batches_in_torchvision_layout_load_normalised(tmp_path):
    generator = np.random.default_rng(0)
    folder = tmp_path / data.CIFAR10_FOLDER
    for name in data.CIFAR10_TRAIN_FILES:
        data.write_cifar_batch(folder / name, generator.integers(0, 256, (6, 3, 32, 32)),
                               generator.integers(0, 10, 6))
    val_images = generator.integers(0, 256, (4, 3, 32, 32))
    data.write_cifar_batch(folder / data.CIFAR10_VAL_FILE, val_images, [1, 2, 3, 4])
    train, val = data.load_cifar10(tmp_path, download_missing=False)
    assert len(train) == 30 and train.tensors[0].shape == (30, 3, 32, 32)
    assert val.tensors[1].tolist() == [1, 2, 3, 4]
    expected = (val_images[2, 1] / 255 - data.CIFAR10_MEAN[1]) / data.CIFAR10_STD[1]
    np.testing.assert_allclose(val.tensors[0][2, 1].numpy(), expected, rtol=1e-4, atol=1e-6)
    (folder / "data_batch_3").write_bytes(b"cos\nsystem\n(S'echo pwned'\ntR.")
    with pytest.raises(data.DataError, match="data_batch_3: not a CIFAR-10 batch file"):
        data.load_cifar10(tmp_path, download_missing=False)
