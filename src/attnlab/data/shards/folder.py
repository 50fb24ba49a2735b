"""Reading a prepared folder: its manifest, and each file it lists checked (inside the folder, its
size) at opening, its sha256 (and token ids below the vocabulary) the first time it is read."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from attnlab.core.errors import DataError
from attnlab.data.remote import RemotePath, file_size, location

MANIFEST = "manifest.json"
SPLITS = ("train", "val", "test")
# kind -> (what its shards hold, the attnlab-prepare --mode that writes them)
KINDS = {
    "tokens": ("token", "lm"),
    "documents": ("document", "bert"),
    "pairs": ("pair", "translation"),
    "images": ("image", "images"),
    "image_text": ("image-caption", "pairs"),
}
# what manifests written before said: token shards nothing, image shards their records' label field
OLD_KINDS = {None: "tokens", "cls": "images", "txt": "image_text"}
SHA256_DIFFERS = "its sha256 differs from the manifest's; corrupt or changed since it was prepared"
Location = Path | RemotePath


@dataclass(frozen=True)
class Shard:
    """One file of a split: ``count`` its records (tar) or tokens (token shards)."""

    path: Location
    count: int
    sha256: str


class ShardFolder:
    """A prepared folder holding shards of one of ``kinds``; ``verified``: the files this process
    has checked, each once."""

    def __init__(self, folder: str | os.PathLike | RemotePath, *kinds: str) -> None:
        self.folder = location(folder)
        self.manifest_path = self.folder / MANIFEST
        if file_size(self.manifest_path) is None:
            copy = f", and copy the folder to {self.folder}" if isinstance(self.folder, RemotePath) else ""
            modes = "|".join(KINDS[k][1] for k in kinds)
            raise DataError(
                f"{self.folder}: no {MANIFEST}; prepare it with attnlab-prepare --mode {modes}{copy}"
            )
        if isinstance(self.folder, RemotePath):
            self.folder.list_folder()  # each shard's size then comes from the listing
        with self.reading():
            self.manifest: dict[str, Any] = json.loads(self.manifest_path.read_text())
            kind = self.manifest.get("kind")
            self.kind: str = OLD_KINDS.get(kind, kind)
        if self.kind not in kinds:
            (what, mode), (want, want_mode) = KINDS.get(self.kind, (self.kind, self.kind)), KINDS[kinds[0]]
            raise DataError(
                f"{self.folder}: holds {what} shards (attnlab-prepare --mode {mode}), not {want} shards "
                f"(--mode {want_mode})"
            )
        self.verified: set[Location] = set()

    @contextmanager
    def reading(self) -> Iterator[None]:
        """A manifest without a key or with a value of the wrong type is one line, not a traceback."""
        try:
            yield
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise DataError(
                f"{self.manifest_path}: not a readable manifest ({type(e).__name__}: {e})"
            ) from None

    def shards(
        self, split: str, parts: tuple[str, ...] = ()
    ) -> Iterator[tuple[dict, dict[str, Location], dict]]:
        """Each shard of ``split`` as (entry, files by part, sha256 by part), inside ``reading``."""
        for i, e in enumerate(self.manifest["splits"].get(split, [])):
            if not parts:
                yield e, {"": self.file(e["file"], f"splits.{split}[{i}].file")}, {"": str(e["sha256"])}
            else:
                where = f"splits.{split}[{i}].name"
                paths = {p: self.file(f"{e['name']}.{p}", where) for p in parts}
                yield e, paths, {p: e["sha256"][p] for p in parts}

    def file(self, name: Any, entry: str) -> Location:
        """``folder / name``, refused unless it stays inside the folder: else a manifest could make
        training read any file of the machine."""
        if isinstance(self.folder, RemotePath):
            if self.folder.inside(name):
                return self.folder / name
            rule = "under its own URL (a relative name: no scheme, absolute path or '..')"
        else:
            path = self.folder / str(name)
            try:
                if isinstance(name, str) and path.resolve().is_relative_to(self.folder.resolve()):
                    return path
            except (OSError, RuntimeError, ValueError):  # a link loop, a NUL byte
                pass
            rule = "in its own folder (no absolute path, '..' or link out)"
        raise DataError(
            f"{self.manifest_path}: {entry} names {str(name)!r}, which leads outside {self.folder}; "
            f"a manifest may name only files {rule}"
        )

    def verify_once(
        self, path: Location, sha256: str, dtype: np.dtype | None = None, vocab: int = 0, keep: bool = False
    ) -> bytes:
        """``verify_file`` unless this process did; with ``keep``, the file's bytes."""
        if path in self.verified:
            return path.read_bytes() if keep else b""
        data = verify_file(path, sha256, dtype, vocab, keep)
        self.verified.add(path)
        return data


def check_file(path: Location, size: int, what: str | None = None) -> None:
    """A file a manifest lists is there, of the size it says (``what``: in what units)."""
    found = file_size(path)
    if found is None:
        raise DataError(f"{path}: a shard the manifest lists is missing")
    if found != size:
        says = f"{what} ({size} bytes)" if what else str(size)
        raise DataError(f"{path}: {found} bytes, but the manifest says {says}; truncated or replaced?")


def verify_file(
    path: Location, sha256: str, dtype: np.dtype | None = None, vocab: int = 0, keep: bool = False
) -> bytes:
    """One pass over a listed file: its sha256 must be the manifest's and token ids (``dtype``) below
    ``vocab`` (past the embedding table they would be an ``IndexError``)."""
    top, kept = -1, []
    with path.open("rb") as raw:
        f = Hashed(raw)
        while block := f.read(-1 if keep else 1 << 24):
            if dtype is not None and (n := len(block) // dtype.itemsize):
                top = max(top, int(np.frombuffer(block, dtype=dtype, count=n).max()))
            if keep:
                kept.append(block)
        f.finish(path, sha256)
    if dtype is not None and top >= vocab:
        raise DataError(
            f"{path}: token id {top} is outside the vocabulary of {vocab} (ids 0..{vocab - 1}) of "
            "the manifest's tokenizer; corrupt, or prepared with another tokenizer"
        )
    return b"".join(kept)


class Hashed:
    """A file read through, its bytes hashed as they pass: the sha256 from the read that training
    makes anyway."""

    def __init__(self, f: Any) -> None:
        self.f, self.h = f, hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.h.update(data)
        return data

    def finish(self, path: Location, sha256: str) -> None:
        """Hash the rest of the file; ``DataError`` unless it is ``sha256``."""
        while self.read(1 << 22):
            pass
        if self.h.hexdigest() != sha256:
            raise DataError(f"{path}: {SHA256_DIFFERS}")

    def __str__(self) -> str:  # webdataset names the stream in its errors
        return str(self.f)
