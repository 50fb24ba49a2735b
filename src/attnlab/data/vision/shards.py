"""Image shards (kind ``images``): an ImageFolder tree as tar shards of ``key.jpg`` (or ``.png``) +
``key.cls``, the class names in the manifest; written from image files, each checked to decode."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from attnlab.core.errors import DataError
from attnlab.data.sampling import carve
from attnlab.data.shards.tar import Item, Record, write_tar_shards
from attnlab.data.shards.writer import check_free
from attnlab.data.vision.datasets import decode_image, scan_image_folder

IMAGE_EXTS = ("jpg", "png", "jpeg", "webp")


def image_ext(path: Path) -> str:
    ext = path.suffix.lower().lstrip(".")
    return "jpg" if ext == "jpeg" else ext


def image_bytes(record: Record) -> bytes | None:
    return next((record[e] for e in IMAGE_EXTS if e in record), None)


def image_items(files: list[Path], values: list[Any], field: str) -> Iterator[Item]:
    """``(image file, {ext: its bytes, field: value})`` for each file, or the one line that says why
    it cannot be read (returned, not raised: the writer refuses it or, with ``on_bad_record=skip``,
    goes on without it)."""
    for path, value in zip(files, values, strict=True):
        try:
            yield path, {image_ext(path): path.read_bytes(), field: str(value).encode()}
        except FileNotFoundError:
            yield path, DataError(f"{path}: no such file (listed, but missing)")
        except IsADirectoryError:
            yield path, DataError(f"{path}: a folder, not an image file")
        except OSError as e:
            yield path, DataError(f"{path}: cannot be read ({e.strerror or e})")


def carved_items(files: list[Path], values: list[Any], field: str, val_size: int, seed: int) -> dict:
    """The train and val splits' items, ``val_size`` carved (seeded)."""
    val, train = carve(len(files), [val_size], seed, "--val-size")
    pick = lambda idx: image_items([files[i] for i in idx], [values[i] for i in idx], field)  # noqa: E731
    return {"train": pick(train), "val": pick(val)}


def write_shards(
    splits: dict[str, Iterable[Item]],
    out_dir: str | os.PathLike,
    meta: dict[str, Any],
    shard_records: int = 10_000,
    on_bad_record: str = "error",
) -> dict[str, Any]:
    """Image records into tar shards (``write_tar_shards``), each image checked to decode."""
    check = lambda fields, path: decode_image(fields[image_ext(path)], str(path), None)  # noqa: E731
    return write_tar_shards(splits, out_dir, meta, check, shard_records, on_bad_record)


def prepare_images(
    folder: str | os.PathLike,
    out_dir: str | os.PathLike,
    val_size: int = 1000,
    shard_records: int = 10_000,
    on_bad_record: str = "error",
    seed: int = 1337,
) -> dict[str, Any]:
    """An ImageFolder tree (``folder/train/<class>/<image>``, optional ``folder/test/...``) into
    classification shards: ``val_size`` training images carved out (seeded) as the val split."""
    check_free(Path(out_dir))
    found, classes = scan_image_folder(str(folder))
    splits = carved_items(*found["train"], "cls", val_size, seed)
    if "test" in found:
        splits["test"] = image_items(*found["test"], "cls")
    meta = {"kind": "images", "classes": classes, "source": str(folder)}
    return write_shards(splits, out_dir, meta, shard_records, on_bad_record)
