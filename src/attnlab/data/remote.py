"""Shards read from an ``s3://``, ``gs://`` or ``https://`` folder through fsspec, as a local folder
is read from disk. Credentials come from each library's environment (``AWS_ENDPOINT_URL``,
``GOOGLE_APPLICATION_CREDENTIALS``, ``FSSPEC_S3_ANON=true``, ...)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from attnlab.core.errors import ConfigError, DataError

URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# scheme -> (the package fsspec needs for it, the fsspec protocol)
SCHEMES = {
    "s3": ("s3fs", "s3"),
    "gs": ("gcsfs", "gs"),
    "gcs": ("gcsfs", "gs"),
    "http": ("aiohttp", "http"),
    "https": ("aiohttp", "https"),
}
HINTS = {  # by protocol; else (http, https) the server
    "s3": (
        "the endpoint (AWS_ENDPOINT_URL) and credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY "
        "or AWS_PROFILE)"
    ),
    "gs": "the credentials (GOOGLE_APPLICATION_CREDENTIALS)",
}
# a streamed object is read ahead in blocks this large: a tar's headers come 512 bytes at a time,
# each would otherwise be a request of its own
STREAM_BLOCK = 8 << 20
UNSAFE = re.compile(r"[?#\\\x00-\x1f]")  # would change the URL's query, fragment or path


def is_url(value: Any) -> bool:
    return isinstance(value, str) and URL.match(value) is not None


def location(folder: str | os.PathLike | RemotePath, key: str | None = None) -> Path | RemotePath:
    """A local path, or a ``RemotePath`` for a URL whose package is installed (else one line naming
    ``key``, the config key that gave it)."""
    if isinstance(folder, Path | RemotePath):
        return folder
    if not is_url(folder):
        return Path(folder)
    given = f"{key}={folder}" if key else folder
    scheme = URL.match(folder).group(1).lower()
    if not folder[len(scheme) + 3 :].strip("/"):
        raise ConfigError(f"{given}: names no bucket or host; give {scheme}://<bucket or host>/<folder>")
    if scheme not in SCHEMES:
        raise ConfigError(
            f"{given}: {scheme}:// is not a storage shards are read from; give a local folder or an "
            "s3://, gs:// or https:// URL"
        )
    package = SCHEMES[scheme][0]
    if importlib.util.find_spec(package) is None:
        raise ConfigError(
            f"{given}: reading {scheme}:// URLs needs the {package} package, which is not installed "
            f"(uv add {package}, or pip install {package})"
        )
    return RemotePath(folder)


@dataclass(frozen=True, order=True)
class RemotePath:
    """A file or folder at a URL, with what the shard readers use of ``Path``. Its filesystem is
    made in the process that uses it: fsspec's async filesystems refuse to cross a fork."""

    url: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", self.url.rstrip("/"))

    def __str__(self) -> str:
        return self.url

    def __truediv__(self, name: str) -> RemotePath:
        return RemotePath(f"{self.url}/{name}")

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def protocol(self) -> str:
        return SCHEMES[URL.match(self.url).group(1).lower()][1]

    def inside(self, name: Any) -> bool:
        """``name`` is a plain relative name under this URL (no scheme, absolute path, ``..``, query)."""
        if not isinstance(name, str) or not name or is_url(name) or UNSAFE.search(name):
            return False
        return not name.startswith(("/", "~")) and all(p not in ("", ".", "..") for p in name.split("/"))

    def fs(self):
        import fsspec

        return fsspec.filesystem(self.protocol)  # fsspec's cache: one per process and options

    def _io(self, fn, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args)``; what the storage raises is one ``DataError`` naming the URL (a missing object
        stays ``FileNotFoundError``)."""
        try:
            return fn(*args, **kwargs)
        except DataError:
            raise
        except FileNotFoundError as e:
            if no_bucket(e) or no_bucket(e.__cause__):
                raise DataError(f"{self}: no such bucket ({first_line(e)}); check its name") from None
            cause = e.__cause__  # fsspec's HTTP reads any failure as a missing file: say which
            if self.protocol.startswith("http") and cause and getattr(cause, "status", None) != 404:
                raise DataError(unreadable(self, cause)) from None
            raise
        except Exception as e:  # noqa: BLE001 (no common base class across the backends)
            if no_bucket(e):
                raise DataError(f"{self}: no such bucket ({first_line(e)}); check its name") from None
            raise DataError(unreadable(self, e)) from None

    def size(self) -> int | None:
        """The object's size in bytes; ``None`` if there is none."""
        try:
            info = self._io(self.fs().info, self.url)
        except FileNotFoundError:
            return None
        if info.get("type") == "directory":
            return None
        if info.get("size") is None:  # a server that sends no Content-Length
            raise DataError(f"{self}: the server gives no size for it; serve it with its Content-Length")
        return int(info["size"])

    def read_bytes(self) -> bytes:
        return self._io(self.fs().cat_file, self.url)

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def open(self, mode: str = "rb") -> contextlib.closing[Stream]:
        """The object as a stream read ahead in ``STREAM_BLOCK`` pieces (closed by ``with``)."""
        if mode != "rb":
            raise ValueError(f"remote shards are read only, not opened {mode!r}")
        f = self._io(self.fs().open, self.url, "rb", block_size=STREAM_BLOCK, cache_type="readahead")
        return contextlib.closing(Stream(self, f))

    def list_folder(self) -> None:
        """List the folder once, so s3fs and gcsfs answer each shard's size from it (best effort: a
        store that allows reading but not listing is read all the same)."""
        if self.protocol in ("s3", "gs"):
            try:
                self.fs().ls(self.url, detail=False)
            except Exception:  # noqa: BLE001, S110 (any failure here shows again, named, on reading)
                pass


@dataclass
class Stream:
    """An open remote object: ``read`` raises one ``DataError`` naming the URL."""

    path: RemotePath
    f: Any

    def read(self, n: int = -1) -> bytes:
        return self.path._io(self.f.read, n)

    def close(self) -> None:
        self.f.close()

    def __str__(self) -> str:
        return str(self.path)


def no_bucket(e: BaseException | None) -> bool:
    """``e`` says the bucket does not exist (s3fs raises it as one of several types)."""
    text = f"{type(e).__name__} {e}".lower()
    return "nosuchbucket" in text or "bucket does not exist" in text


def first_line(e: BaseException) -> str:
    return (str(e).strip() or type(e).__name__).splitlines()[0]


def unreadable(path: RemotePath, e: BaseException) -> str:
    hint = HINTS.get(path.protocol, "the URL, and that the server is up and lets it be read")
    return f"{path}: cannot be read ({type(e).__name__}: {first_line(e)}); check {hint}"


def file_size(path: Path | RemotePath) -> int | None:
    """The size of a file a manifest lists; ``None`` if it is not there (or not a file)."""
    if isinstance(path, RemotePath):
        return path.size()
    return path.stat().st_size if path.is_file() else None


def read_arrays(windows: list[tuple[Path | RemotePath, int, int]], dtype: np.dtype) -> list[np.ndarray]:
    """For each ``(file, offset, count)``, ``count`` items of ``dtype`` from byte ``offset``:
    ``numpy.fromfile``, or one concurrent batch of ranged requests (the files of one folder)."""
    if windows and isinstance(windows[0][0], RemotePath):
        data = cat_ranges([(path, offset, count * dtype.itemsize) for path, offset, count in windows])
        return [np.frombuffer(d, dtype=dtype) for d in data]
    return [np.fromfile(path, dtype=dtype, count=count, offset=offset) for path, offset, count in windows]


def cat_ranges(ranges: list[tuple[RemotePath, int, int]]) -> list[bytes]:
    """The bytes at each ``(url, offset, size)``, in one concurrent batch of ranged requests."""
    first = ranges[0][0]
    urls, starts, ends = zip(*((str(p), o, o + n) for p, o, n in ranges), strict=True)
    return first._io(first.fs().cat_ranges, list(urls), list(starts), list(ends), on_error="raise")


def read_ranges(path: Path | RemotePath, ranges: list[tuple[int, int]]) -> list[bytes]:
    """The bytes at each ``(offset, size)`` of a file: one open and seeks, or ``cat_ranges``."""
    if isinstance(path, RemotePath):
        return cat_ranges([(path, o, n) for o, n in ranges])
    out = []
    with open(path, "rb") as f:
        for offset, size in ranges:
            f.seek(offset)
            out.append(f.read(size))
    return out
