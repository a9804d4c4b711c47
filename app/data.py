"""The built-in tasks' data sets as in-memory tensors: IDX parsing, MNIST/Fashion-MNIST lookup and
download, the offline fallback (scikit-learn's bundled 8x8 digits), and CIFAR-10. No Ray here.

Images are parsed once into uint8 tensors and normalised once into float32; batches are then
plain tensor indexing, with no per-sample transforms.
"""

from __future__ import annotations

import contextlib
import gzip
import importlib.util
import os
import socket
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from app.config import UserError


class DataError(UserError):
    """A data file is missing, truncated or not what it claims to be."""


# torchvision's folder names and the per-pixel statistics of each training split.
_TORCHVISION = {
    "mnist": ("MNIST", (0.1307, 0.3081)),
    "fashion-mnist": ("FashionMNIST", (0.2860, 0.3530)),
}
_SPLIT_PREFIX = {"train": "train", "val": "t10k"}
_IDX_DTYPES = {
    0x08: np.uint8,
    0x09: np.int8,
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def read_idx(path: Path) -> np.ndarray:
    """Parse an IDX file (optionally gzip-compressed) into an array; errors name the file."""
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except (OSError, EOFError, zlib.error) as error:
        raise DataError(f"{path}: cannot read ({error}); delete it and download again") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise DataError(f"{path}: not an IDX file (bad magic number)")
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    num_dims = raw[3]
    header_size = 4 + 4 * num_dims
    if len(raw) < header_size:
        raise DataError(f"{path}: truncated IDX header")
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=num_dims, offset=4))
    expected = int(np.prod(shape)) * dtype.itemsize
    found = len(raw) - header_size
    if found != expected:
        raise DataError(
            f"{path}: IDX data is {found} bytes but its header {shape} needs {expected}; "
            "the file is truncated or corrupt"
        )
    return np.frombuffer(raw, dtype=dtype, offset=header_size).reshape(shape)


def write_idx(path: Path, array: np.ndarray) -> None:
    """Write a uint8 array as IDX (gzip-compressed when the name ends in .gz)."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    header = bytes([0, 0, 0x08, array.ndim]) + np.array(array.shape, dtype=">u4").tobytes()
    payload = header + array.tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(payload) if path.suffix == ".gz" else payload)


def raw_folder(data_dir: str | Path, dataset: str) -> Path:
    return Path(data_dir) / _TORCHVISION[dataset][0] / "raw"


def _idx_path(folder: Path, stem: str) -> Path | None:
    for candidate in (folder / stem, folder / f"{stem}.gz"):
        if candidate.exists():
            return candidate
    return None


def _idx_stems(split: str) -> tuple[str, str]:
    prefix = _SPLIT_PREFIX[split]
    return f"{prefix}-images-idx3-ubyte", f"{prefix}-labels-idx1-ubyte"


def missing_files(data_dir: str | Path, dataset: str) -> list[Path]:
    """The IDX files of ``dataset`` that are not in ``data_dir`` (either plain or .gz)."""
    folder = raw_folder(data_dir, dataset)
    stems = [stem for split in _SPLIT_PREFIX for stem in _idx_stems(split)]
    return [folder / stem for stem in stems if _idx_path(folder, stem) is None]


@contextlib.contextmanager
def _torchvision_download(data_dir: str | Path, what: str, where: Path, timeout_s: float):
    """Around a torchvision download into ``data_dir``: a socket timeout (torchvision's urllib
    calls have none of their own; an unreachable mirror would hang), a file lock (workers
    sharing a node share data_dir; one downloads while the others wait), its prints silenced,
    and any failure as one DataError saying where to put the files instead."""
    from filelock import FileLock

    Path(data_dir).mkdir(parents=True, exist_ok=True)
    previous_timeout = socket.getdefaulttimeout()
    socket.setdefaulttimeout(timeout_s)
    try:
        with FileLock(str(Path(data_dir) / ".download.lock")), open(
            os.devnull, "w"
        ) as devnull, contextlib.redirect_stdout(devnull):
            yield
    except Exception as error:  # torchvision raises RuntimeError/URLError/OSError variously
        raise DataError(
            f"could not download {what} into {data_dir} ({type(error).__name__}); put its files "
            f"in {where} or run where the internet is reachable"
        ) from None
    finally:
        socket.setdefaulttimeout(previous_timeout)


def download(data_dir: str | Path, dataset: str, timeout_s: float = 15.0) -> None:
    """Fetch ``dataset`` with torchvision into ``data_dir``; raises DataError when offline."""
    import torchvision

    cls = {"mnist": torchvision.datasets.MNIST, "fashion-mnist": torchvision.datasets.FashionMNIST}
    with _torchvision_download(data_dir, dataset, raw_folder(data_dir, dataset), timeout_s):
        for train in (True, False):
            cls[dataset](root=str(data_dir), train=train, download=True)


def normalise(images: np.ndarray, mean: float, std: float) -> torch.Tensor:
    """uint8 N x H x W -> float32 N x 1 x H x W with the given pixel statistics (0-1 scale)."""
    # astype copies: the parsed arrays are read-only views of the file bytes.
    pixels = torch.from_numpy(images.astype(np.float32)).div_(255.0)
    return ((pixels - mean) / std).unsqueeze(1).contiguous()


@dataclass(frozen=True)
class RawSplit:
    """One split as stored: uint8 images N x 28 x 28 and uint8 labels."""

    images: np.ndarray
    labels: np.ndarray


@dataclass(frozen=True)
class RawDataset:
    name: str
    train: RawSplit
    val: RawSplit
    mean: float
    """Pixel mean of the training images on the 0-1 scale (the reference value for MNIST)."""
    std: float


def _read_idx_split(folder: Path, split: str) -> RawSplit:
    images_stem, labels_stem = _idx_stems(split)
    images_path = _idx_path(folder, images_stem) or folder / images_stem
    labels_path = _idx_path(folder, labels_stem) or folder / labels_stem
    images = read_idx(images_path)
    labels = read_idx(labels_path)
    if images.ndim != 3 or images.shape[1:] != (28, 28) or images.dtype != np.uint8:
        raise DataError(f"{images_path}: expected N x 28 x 28 uint8 images, found {images.shape}")
    if labels.ndim != 1 or labels.shape[0] != images.shape[0]:
        raise DataError(
            f"{labels_path}: {labels.shape[0] if labels.ndim else 0} labels for "
            f"{images.shape[0]} images in {images_path.name}"
        )
    if labels.size and labels.max() > 9:
        raise DataError(f"{labels_path}: labels must be 0-9, found {int(labels.max())}")
    return RawSplit(images=images, labels=labels.astype(np.uint8))


def _sklearn_digits() -> tuple[np.ndarray, np.ndarray]:
    """The file behind ``sklearn.datasets.load_digits()``, read as it does: (1,797 x 8 x 8
    images of 0-16, their labels). Importing ``sklearn.datasets`` costs ~1.8 s of CPU in each
    process that loads the set (the driver and every worker), for one small CSV."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the digits data set ships with scikit-learn, which is not installed "
                        "(pip install scikit-learn)")
    csv = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    if not csv.is_file():
        raise DataError(f"{csv}: file not found (scikit-learn's digits; reinstall scikit-learn)")
    with gzip.open(csv, "rt", encoding="utf-8") as rows:
        table = np.loadtxt(rows, delimiter=",")
    return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(int)


def _digits() -> RawDataset:
    """scikit-learn's 1,797 bundled 8x8 digits, resized to 28x28: real data with no download."""
    digit_images, digit_labels = _sklearn_digits()
    small = torch.from_numpy(digit_images.astype(np.float32) / 16.0).unsqueeze(1)
    resized = torch.nn.functional.interpolate(
        small, size=(28, 28), mode="bilinear", align_corners=False
    )
    images = (resized.squeeze(1).clamp(0, 1) * 255).round().to(torch.uint8).numpy()
    labels = digit_labels.astype(np.uint8)
    # A fixed permutation, independent of --seed, so validation is the same images in every run.
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0)).numpy()
    num_val = len(labels) // 5
    val_index, train_index = order[:num_val], order[num_val:]
    train_pixels = images[train_index].astype(np.float64) / 255.0
    return RawDataset(
        name="digits",
        train=RawSplit(images[train_index], labels[train_index]),
        val=RawSplit(images[val_index], labels[val_index]),
        mean=float(train_pixels.mean()),
        std=float(train_pixels.std()),
    )


def load_raw(dataset: str, data_dir: str | Path, download_missing: bool = True) -> RawDataset:
    """``dataset`` (mnist, fashion-mnist, digits) as stored (uint8), downloading it first if
    allowed and needed. Raises DataError naming the file at fault."""
    if dataset == "digits":
        return _digits()
    missing = missing_files(data_dir, dataset)
    if missing and download_missing:
        download(data_dir, dataset)
        missing = missing_files(data_dir, dataset)
    if missing:
        raise DataError(f"{missing[0]}: file not found (nor {missing[0].name}.gz)")
    folder = raw_folder(data_dir, dataset)
    mean, std = _TORCHVISION[dataset][1]
    return RawDataset(
        name=dataset,
        train=_read_idx_split(folder, "train"),
        val=_read_idx_split(folder, "val"),
        mean=mean,
        std=std,
    )


def load(dataset: str, data_dir: str | Path,
         download_missing: bool = True) -> tuple[TensorDataset, TensorDataset]:
    """``dataset`` in memory, normalised once: (training, validation) sets of
    (float32 1 x 28 x 28 image, int64 label)."""
    raw = load_raw(dataset, data_dir, download_missing)

    def ready(split: RawSplit) -> TensorDataset:
        return TensorDataset(normalise(split.images, raw.mean, raw.std),
                             torch.from_numpy(split.labels.astype(np.int64)))

    return ready(raw.train), ready(raw.val)


# --- CIFAR-10 (torchvision's "cifar-10-batches-py" layout) --------------------------------------

CIFAR10_FOLDER = "cifar-10-batches-py"
CIFAR10_TRAIN_FILES = tuple(f"data_batch_{number}" for number in range(1, 6))
CIFAR10_VAL_FILE = "test_batch"
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 N x 3 x 32 x 32, int64 N) from one of CIFAR-10's pickled batch files.

    Read with a restricted unpickler: the files hold only dicts, lists, bytes and numpy arrays,
    and a data folder is not a place to run code from."""
    import pickle

    class _Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if module.startswith("numpy") and name in (
                "_reconstruct", "ndarray", "dtype", "scalar", "_frombuffer"
            ):
                return super().find_class(module, name)
            raise pickle.UnpicklingError(f"unexpected {module}.{name} in a CIFAR-10 batch file")

    try:
        with open(path, "rb") as stream:
            batch = _Unpickler(stream, encoding="latin1").load()
        images = np.asarray(batch["data"], dtype=np.uint8)
        labels = np.asarray(batch["labels"], dtype=np.int64)
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except (OSError, EOFError, KeyError, TypeError, ValueError, pickle.UnpicklingError) as error:
        raise DataError(f"{path}: not a CIFAR-10 batch file ({error}); delete it and download "
                        "again") from None
    if images.ndim != 2 or images.shape[1] != 3 * 32 * 32 or len(labels) != len(images):
        raise DataError(f"{path}: expected N x 3072 pixels and N labels, found "
                        f"{images.shape} and {labels.shape}")
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise DataError(f"{path}: labels must be 0-9")
    return images.reshape(-1, 3, 32, 32), labels


def write_cifar_batch(path: Path, images: np.ndarray, labels: np.ndarray) -> None:
    """Write uint8 N x 3 x 32 x 32 images and their labels as a CIFAR-10 batch file."""
    import pickle

    path.parent.mkdir(parents=True, exist_ok=True)
    batch = {"data": np.ascontiguousarray(images, dtype=np.uint8).reshape(len(images), -1),
             "labels": [int(label) for label in labels]}
    path.write_bytes(pickle.dumps(batch))


def _download_cifar10(data_dir: str | Path, timeout_s: float = 60.0) -> None:
    import torchvision

    with _torchvision_download(data_dir, "CIFAR-10", Path(data_dir) / CIFAR10_FOLDER, timeout_s):
        torchvision.datasets.CIFAR10(root=str(data_dir), train=True, download=True)


def load_cifar10(data_dir: str | Path,
                 download_missing: bool = True) -> tuple[TensorDataset, TensorDataset]:
    """CIFAR-10 from ``<data_dir>/cifar-10-batches-py`` (downloaded there when missing and
    allowed), normalised once: (float32 3 x 32 x 32 image, int64 label) sets."""
    folder = Path(data_dir) / CIFAR10_FOLDER
    names = (*CIFAR10_TRAIN_FILES, CIFAR10_VAL_FILE)
    if download_missing and not all((folder / name).exists() for name in names):
        _download_cifar10(data_dir)
    train = [_read_cifar_batch(folder / name) for name in CIFAR10_TRAIN_FILES]
    val_images, val_labels = _read_cifar_batch(folder / CIFAR10_VAL_FILE)
    mean = torch.tensor(CIFAR10_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(CIFAR10_STD).view(1, 3, 1, 1)

    def ready(images: np.ndarray, labels: np.ndarray) -> TensorDataset:
        pixels = torch.from_numpy(images.astype(np.float32)).div_(255.0)
        return TensorDataset(((pixels - mean) / std).contiguous(), torch.from_numpy(labels))

    return (ready(np.concatenate([images for images, _ in train]),
                  np.concatenate([labels for _, labels in train])),
            ready(val_images, val_labels))
