"""Image classification datasets decoded once into uint8 tensors (N, C, H, W) and labels."""

from __future__ import annotations

import gzip
import io
import pickle
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torchvision.transforms.v2.functional as TF
from PIL import Image, UnidentifiedImageError
from torch import Tensor
from torchvision.datasets import CIFAR10, FashionMNIST

from attnlab.core.errors import DataError
from attnlab.data.download import fetch
from attnlab.data.sources import Builtin

KEY = "data.source.data_dir"  # where a built-in set's files are read from instead of downloaded


@dataclass
class ImageSplits:
    """A labelled training split and a labelled test split, with the class names."""

    train_images: Tensor  # (N, C, H, W) uint8
    train_labels: Tensor  # (N,) int64
    test_images: Tensor
    test_labels: Tensor
    classes: list[str]


# type byte -> big-endian numpy dtype
IDX_TYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | Path, ndim: int | None = None) -> Tensor:
    """The array in an IDX file (MNIST's format, gzipped if ``.gz``) of ``ndim`` dimensions: a magic
    number (0, 0, a type byte, the number of dimensions), a big-endian uint32 per dimension, values."""
    path = Path(path)
    try:
        data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError) as e:
        raise DataError(f"{path}: cannot be read as {'gzip' if path.suffix == '.gz' else 'IDX'}: {e}") from e
    if len(data) < 4 or data[:2] != b"\x00\x00" or data[2] not in IDX_TYPES:
        raise DataError(
            f"{path}: not an IDX file (magic number 0x{data[:4].hex()}; expected 0x0000, "
            "a type byte and the number of dimensions)"
        )
    dtype, dims = np.dtype(IDX_TYPES[data[2]]), data[3]
    if ndim is not None and dims != ndim:
        raise DataError(f"{path}: IDX file of {dims} dimensions (magic 0x{data[:4].hex()}), expected {ndim}")
    header = 4 + 4 * dims
    if len(data) < header:
        raise DataError(f"{path}: truncated IDX header")
    shape = struct.unpack(f">{dims}I", data[4:header])
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(data) - header != expected:
        raise DataError(
            f"{path}: truncated or padded: {len(data) - header} bytes of values, expected "
            f"{expected} for shape {tuple(shape)}"
        )
    array = np.frombuffer(data, dtype=dtype, offset=header).reshape(shape)
    return torch.from_numpy(array.astype(dtype.newbyteorder("=")))


# file -> sha256 of the gzipped original
IDX_DATASETS = {
    "mnist": {
        "url": "https://ossci-datasets.s3.amazonaws.com/mnist/",
        "classes": [str(i) for i in range(10)],
        "files": {
            "train-images-idx3-ubyte.gz": "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
            "train-labels-idx1-ubyte.gz": "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
            "t10k-images-idx3-ubyte.gz": "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
            "t10k-labels-idx1-ubyte.gz": "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
        },
    },
    "fashion_mnist": {
        "url": "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
        "classes": FashionMNIST.classes,
        "files": {
            "train-images-idx3-ubyte.gz": "3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84",
            "train-labels-idx1-ubyte.gz": "a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845",
            "t10k-images-idx3-ubyte.gz": "346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073",
            "t10k-labels-idx1-ubyte.gz": "67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5",
        },
    },
}


def load_idx_dataset(name: str, data_dir: str | None, cache_dir: str, url: str | None = None) -> ImageSplits:
    """MNIST or Fashion-MNIST from the four original IDX ``.gz`` files: read from ``data_dir``,
    or downloaded (checksummed) into ``cache_dir/name``."""
    spec = IDX_DATASETS[name]
    base = url or spec["url"]
    paths = {f: fetch(f, base + f, sha, data_dir, Path(cache_dir) / name) for f, sha in spec["files"].items()}

    def split(prefix: str) -> tuple[Tensor, Tensor]:
        images = read_idx(paths[f"{prefix}-images-idx3-ubyte.gz"], ndim=3)
        labels = read_idx(paths[f"{prefix}-labels-idx1-ubyte.gz"], ndim=1).long()
        if len(images) != len(labels):
            raise DataError(f"{name}: {len(images)} {prefix} images but {len(labels)} labels")
        if labels.min() < 0 or labels.max() >= len(spec["classes"]):
            raise DataError(f"{name}: {prefix} labels outside 0..{len(spec['classes']) - 1}")
        return images[:, None].contiguous(), labels  # (N, 1, H, W)

    train, test = split("train"), split("t10k")
    return ImageSplits(*train, *test, list(spec["classes"]))


CIFAR10_FOLDER = "cifar-10-batches-py"


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles dicts, lists, strings and numpy arrays only: a batch file cannot run code."""

    ALLOWED = {
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
    }

    def find_class(self, module: str, name: str) -> object:
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing {module}.{name}")
        return super().find_class(module, name)


def read_cifar_batches(folder: Path) -> ImageSplits:
    """CIFAR-10's python version: pickles ``data_batch_1..5``, ``test_batch`` (``data``: N x 3072
    uint8 rows, ``labels``) and ``batches.meta`` (``label_names``)."""

    def unpickle(name: str) -> dict:
        path = folder / name
        try:
            with open(path, "rb") as f:
                return _ArrayUnpickler(f, encoding="latin1").load()
        except FileNotFoundError:
            raise DataError(f"{path}: missing (expected CIFAR-10's python version in {folder})") from None
        except (pickle.UnpicklingError, EOFError, ValueError) as e:
            raise DataError(f"{path}: not a CIFAR-10 batch ({e})") from e

    def split(names: list[str]) -> tuple[Tensor, Tensor]:
        batches = [unpickle(n) for n in names]
        try:
            data = np.concatenate([b["data"] for b in batches]).reshape(-1, 3, 32, 32)
            labels = torch.tensor([y for b in batches for y in b["labels"]])
        except (KeyError, ValueError) as e:
            raise DataError(f"{folder}: CIFAR-10 batches without 3072-byte rows and labels ({e})") from e
        return torch.from_numpy(data.copy()), labels

    train = split([f"data_batch_{i}" for i in range(1, 6)])
    test = split(["test_batch"])
    return ImageSplits(*train, *test, list(unpickle("batches.meta")["label_names"]))


def load_cifar10(data_dir: str | None, cache_dir: str) -> ImageSplits:
    """CIFAR-10 from ``data_dir/cifar-10-batches-py`` (offline), or downloaded by torchvision
    (which checks the archive's MD5) into ``cache_dir``."""
    if data_dir is not None:
        folder = Path(data_dir).expanduser() / CIFAR10_FOLDER
        if not folder.is_dir():
            raise DataError(f"{KEY}={data_dir} has no {CIFAR10_FOLDER}/ folder (expected {folder})")
        return read_cifar_batches(folder)
    try:
        CIFAR10(cache_dir, train=True, download=True)
    except (RuntimeError, OSError) as e:
        raise DataError(
            f"could not download CIFAR-10 into {cache_dir}: {e}. Offline? Set {KEY} to "
            f"a directory holding {CIFAR10_FOLDER}/"
        ) from e
    return read_cifar_batches(Path(cache_dir) / CIFAR10_FOLDER)


def load_builtin(source: Builtin) -> ImageSplits:
    """A ``Builtin`` image set: CIFAR-10 (torchvision's files) or an IDX set."""
    if source.name == "cifar10":
        return load_cifar10(source.data_dir, source.cache_dir)
    return load_idx_dataset(source.name, source.data_dir, source.cache_dir, source.url)


IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}


def decode_image(data: bytes | Path | None, where: str, mode: str | None) -> Image.Image:
    """Image bytes (or a file) -> a PIL image in ``mode`` ("L" or "RGB"; ``None``: as stored); the
    one-line ``DataError`` naming ``where`` drops the in-memory file's address PIL puts in it."""
    if data is None:
        raise DataError(f"{where}: no image (expected a .jpg, .png, .jpeg or .webp file)")
    try:
        with Image.open(io.BytesIO(data) if isinstance(data, bytes) else data) as im:
            im.load()
            return im.convert(mode) if mode else im.copy()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        reason = re.sub(r" <_io\.\w+ object at 0x[0-9a-f]+>", "", str(e)) or type(e).__name__
        raise DataError(f"{where}: not a readable image ({reason})") from None


def read_image(path: Path, channels: int | None = None) -> Tensor:
    """One image file -> (C, H, W) uint8 in ``channels`` (1: grayscale, 3: RGB; None: as stored)."""
    img = decode_image(path, str(path), None)
    mode = {1: "L", 3: "RGB"}.get(channels or 0, "L" if img.mode in ("L", "I;16") else "RGB")
    return TF.pil_to_tensor(img if img.mode == mode else img.convert(mode))  # decoded is already a copy


def square(image: Tensor, img_size: int) -> Tensor:
    """(C, H, W) uint8 -> (C, S, S): the shorter side resized to S, the centre cropped."""
    image = TF.resize(image, img_size, antialias=True)
    return TF.center_crop(image, [img_size, img_size])


def scan_image_folder(root: str | None) -> tuple[dict[str, tuple[list[Path], list[int]]], list[str]]:
    """The files and labels of an ImageFolder tree: ``root/train/<class>/<image>`` and, optionally,
    ``root/test/<class>/...`` (whose class folders must be among train's); nothing decoded."""
    if root is None:
        raise DataError("data.source.path must name an ImageFolder directory (root/train/<class>/<image>)")
    base = Path(root).expanduser()
    train_dir = base / "train"
    if not train_dir.is_dir():
        raise DataError(f"data.source.path={root}: no train/ folder (expected {train_dir}/<class>/<image>)")
    classes = sorted(p.name for p in train_dir.iterdir() if p.is_dir())
    if not classes:
        raise DataError(f"{train_dir}: no class folders")

    def split(folder: Path) -> tuple[list[Path], list[int]]:
        files, labels = [], []
        for label, name in enumerate(classes):
            # a folder named like an image (x.png/) is not one: left out
            images = (folder / name).glob("*")
            found = sorted(f for f in images if f.suffix.lower() in IMAGE_SUFFIXES and not f.is_dir())
            if not found and folder == train_dir:
                raise DataError(
                    f"{folder / name}: a class folder without images (a class that cannot be "
                    "learnt); add images or remove it"
                )
            files += found
            labels += [label] * len(found)
        if not files:
            raise DataError(f"{folder}: no images in its class folders")
        return files, labels

    splits = {"train": split(train_dir)}
    test_dir = base / "test"
    if test_dir.is_dir():
        extra = sorted(p.name for p in test_dir.iterdir() if p.is_dir() and p.name not in classes)
        if extra:
            raise DataError(f"{test_dir}: class folders {extra} are not in {train_dir}")
        splits["test"] = split(test_dir)
    return splits, classes
