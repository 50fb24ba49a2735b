"""Fetch a data file once, check its sha256, and keep it in a cache directory."""

from __future__ import annotations

import gzip
import logging
import os
import shutil
import tempfile
import urllib.request
from pathlib import Path

from attnlab.core.errors import DataError
from attnlab.core.run_record import sha256_file

log = logging.getLogger(__name__)


def download(url: str, dest: Path, sha256: str | None, timeout: float = 30.0, gunzip: bool = False) -> Path:
    """Download ``url`` to ``dest`` atomically, never keeping a file that fails ``sha256`` (of the
    decompressed file with ``gunzip``)."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    log.info("downloading %s -> %s", url, dest)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as resp:
            shutil.copyfileobj(gzip.GzipFile(fileobj=resp) if gunzip else resp, out)
        got = sha256_file(Path(tmp))
        if sha256 is not None and got != sha256:
            raise DataError(
                f"checksum mismatch for {url}: expected sha256 {sha256}, got {got}; "
                "the download was discarded"
            )
        os.replace(tmp, dest)
    except (OSError, EOFError) as e:  # URLError, timeouts and bad gzip streams are OSErrors
        raise DataError(f"could not download {url}: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dest


def fetch(
    filename: str,
    url: str,
    sha256: str | None,
    data_dir: str | os.PathLike | None,
    cache_dir: str | os.PathLike,
    gunzip: bool = False,
) -> Path:
    """``filename`` from ``data_dir`` (offline, the user's own: not checksummed), else cached or
    downloaded (checksummed)."""
    if data_dir is not None:
        path = Path(data_dir).expanduser() / filename
        if not Path(data_dir).expanduser().is_dir():
            raise DataError(
                f"data.source.data_dir={data_dir} is not a directory (expected it to hold {filename})"
            )
        if not path.is_file():
            raise DataError(f"data.source.data_dir={data_dir} has no file {filename} (expected {path})")
        if path.stat().st_size == 0:
            raise DataError(f"data file {path} is empty")
        return path
    path = Path(cache_dir).expanduser() / filename
    if path.is_file() and (sha256 is None or sha256_file(path) == sha256):
        return path
    try:
        return download(url, path, sha256, gunzip=gunzip)
    except DataError as e:
        raise DataError(f"{e}. Offline? Set data.source.data_dir to a directory holding {filename}") from e
