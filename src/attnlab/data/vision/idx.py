"""The IDX format of MNIST and Fashion-MNIST: a magic number (two zero bytes, a type byte, the
number of dimensions), one big-endian uint32 per dimension, then the values, row-major."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from attnlab.core.errors import DataError

# type byte -> big-endian numpy dtype
IDX_TYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | Path, ndim: int | None = None) -> Tensor:
    """The array in an IDX file (gzipped if ``.gz``) of ``ndim`` dimensions; a bad magic number or a
    truncated file is a ``DataError`` naming it."""
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
