"""Data sets as in-memory tensors: IDX parsing, MNIST/Fashion-MNIST lookup and download, and the
offline fallback (scikit-learn's bundled 8x8 digits). No Ray here.

Images are parsed once into uint8 tensors and normalised once into float32; batches are then
plain tensor indexing, with no per-sample transforms.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import socket
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from app.config import DataConfig, UserError


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


@dataclass(frozen=True)
class Split:
    """One split, ready for the model: normalised images N x 1 x 28 x 28 and int64 labels."""

    images: torch.Tensor
    labels: torch.Tensor

    def __post_init__(self):
        assert self.images.shape[0] == self.labels.shape[0]

    def __len__(self) -> int:
        return self.labels.shape[0]


@dataclass(frozen=True)
class Dataset:
    name: str
    train: Split
    val: Split
    num_classes: int = 10


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


def download(data_dir: str | Path, dataset: str, timeout_s: float = 15.0) -> None:
    """Fetch ``dataset`` with torchvision into ``data_dir``; raises DataError when offline."""
    import torchvision

    cls = {"mnist": torchvision.datasets.MNIST, "fashion-mnist": torchvision.datasets.FashionMNIST}
    from filelock import FileLock

    Path(data_dir).mkdir(parents=True, exist_ok=True)
    previous_timeout = socket.getdefaulttimeout()
    # torchvision's urllib calls have no timeout of their own; an unreachable mirror would hang.
    socket.setdefaulttimeout(timeout_s)
    # Workers sharing a node share data_dir; one downloads while the others wait.
    try:
        with FileLock(str(Path(data_dir) / ".download.lock")), open(
            os.devnull, "w"
        ) as devnull, contextlib.redirect_stdout(devnull):
            for train in (True, False):
                cls[dataset](root=str(data_dir), train=train, download=True)
    except Exception as error:  # torchvision raises RuntimeError/URLError/OSError variously
        raise DataError(
            f"could not download {dataset} into {data_dir} ({type(error).__name__}); "
            f"put its IDX files in {raw_folder(data_dir, dataset)} or run where the internet "
            "is reachable"
        ) from None
    finally:
        socket.setdefaulttimeout(previous_timeout)


def is_available(config: DataConfig) -> bool:
    """Whether ``config.dataset`` can be loaded, downloading it first if allowed and needed."""
    if config.dataset == "digits":
        return True
    if not missing_files(config.data_dir, config.dataset):
        return True
    if not config.download:
        return False
    try:
        download(config.data_dir, config.dataset)
    except DataError:
        return False
    return not missing_files(config.data_dir, config.dataset)


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


def _digits() -> RawDataset:
    """scikit-learn's 1,797 bundled 8x8 digits, resized to 28x28: real data with no download."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    small = torch.from_numpy(bunch.images.astype(np.float32) / 16.0).unsqueeze(1)
    resized = torch.nn.functional.interpolate(
        small, size=(28, 28), mode="bilinear", align_corners=False
    )
    images = (resized.squeeze(1).clamp(0, 1) * 255).round().to(torch.uint8).numpy()
    labels = bunch.target.astype(np.uint8)
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


def load_raw(config: DataConfig) -> RawDataset:
    """The data set as stored (uint8), downloading it first if allowed and needed. Raises
    DataError naming the file at fault."""
    if config.dataset == "digits":
        return _digits()
    missing = missing_files(config.data_dir, config.dataset)
    if missing and config.download:
        download(config.data_dir, config.dataset)
        missing = missing_files(config.data_dir, config.dataset)
    if missing:
        raise DataError(f"{missing[0]}: file not found (nor {missing[0].name}.gz)")
    folder = raw_folder(config.data_dir, config.dataset)
    mean, std = _TORCHVISION[config.dataset][1]
    return RawDataset(
        name=config.dataset,
        train=_read_idx_split(folder, "train"),
        val=_read_idx_split(folder, "val"),
        mean=mean,
        std=std,
    )


def load(config: DataConfig) -> Dataset:
    """Load ``config.dataset`` into memory, normalised once, ready for the model."""
    raw = load_raw(config)

    def ready(split: RawSplit) -> Split:
        return Split(
            images=normalise(split.images, raw.mean, raw.std),
            labels=torch.from_numpy(split.labels.astype(np.int64)),
        )

    return Dataset(name=raw.name, train=ready(raw.train), val=ready(raw.val))
