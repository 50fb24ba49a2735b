"""Writing a prepared folder: everything into ``<out>.partial``, moved into place with its manifest
last (a folder with a manifest is whole), under a ``flock`` that refuses a second writer."""

from __future__ import annotations

import errno
import functools
import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from multiprocessing import get_all_start_methods, get_context
from pathlib import Path
from typing import Any

import numpy as np

from attnlab.core.errors import ConfigError, DataError
from attnlab.core.run_record import sha256_file
from attnlab.data.shards.folder import MANIFEST


def check_free(out: Path) -> None:
    """``out`` may become a prepared folder: absent, or an empty folder."""
    if (out / MANIFEST).exists():
        raise DataError(f"{out}: already holds prepared shards; choose another folder or remove it")
    if out.exists() and any(out.iterdir()):
        raise DataError(f"{out}: exists and is not empty; choose another folder")


def start_partial(out: Path) -> Path:
    """A clean ``<out>.partial`` folder (a link there is unlinked, never followed)."""
    partial = _beside(out, ".partial")
    if partial.is_symlink() or partial.is_file():
        partial.unlink()
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    return partial


def publish(partial: Path, out: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest written last, then the folder renamed: a folder with a manifest is whole."""
    (partial / MANIFEST).write_text(json.dumps(manifest, indent=1))
    if out.exists():
        out.rmdir()  # empty, checked by check_free
    os.replace(partial, out)
    return manifest


def check_count(name: str, value: Any, least: int = 1, why: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        expected = "an integer >= 0" if least == 0 else f"a positive integer{why}"
        raise ConfigError(f"{name} must be {expected}, got {value!r}")


def prepares(fn: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """``fn(inputs, partial, ...) -> manifest`` as ``prepare(inputs, out_dir, ...)``, run under
    ``writing`` into a clean ``<out_dir>.partial``, then ``publish``-ed."""

    @functools.wraps(fn)
    def run(inputs: Any, out_dir: str | os.PathLike, *args: Any, **kwargs: Any) -> dict[str, Any]:
        out = Path(out_dir)
        with writing(out):
            check_free(out)
            partial = start_partial(out)
            return publish(partial, out, fn(inputs, partial, *args, **kwargs))

    return run


@contextmanager
def writing(out: Path) -> Iterator[None]:
    """Held while a prepare writes ``out``: another prepare into it is refused in one line, whatever
    ends this one early (an error, a full disk, Ctrl-C) removes ``<out>.partial``."""
    with _lock(out):
        try:
            yield
        except BaseException as e:
            shutil.rmtree(_beside(out, ".partial"), ignore_errors=True)
            if isinstance(e, OSError):
                raise DataError(_write_error(e, out)) from None
            raise


def _write_error(e: OSError, out: Path) -> str:
    if e.errno in (errno.ENOSPC, errno.EDQUOT) or e.errno is None:  # numpy's short write has none
        what = f" {e.filename}" if e.filename else ""
        return (
            f"{out}: could not write{what} ({e.strerror or e}); is the disk full? Nothing was kept: "
            "free some space or choose another --out"
        )
    return f"{e.filename or out}: {e.strerror or e}"


@contextmanager
def _lock(out: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``<out>.lock`` (the kernel releases it when its holder dies),
    removed by its holder at the end."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): one prepare at a time is up to the user
        yield
        return
    path = _beside(out, ".lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise DataError(
                    f"{out}: another attnlab-prepare is writing it; wait for its end or choose another --out"
                ) from None
            if _same_file(fd, path):  # not the file of a holder that removed it as we opened it
                break
            os.close(fd)
    except OSError as e:
        why = (
            f"{e.filename} is not a folder"
            if isinstance(e, FileExistsError | NotADirectoryError)
            else e.strerror
        )
        raise DataError(f"{out}: cannot write there ({why}); choose another --out") from None
    try:
        yield
    finally:
        path.unlink(missing_ok=True)  # before the lock goes: a waiting opener retries (_same_file)
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _beside(out: Path, suffix: str) -> Path:
    """``<out><suffix>`` in ``out``'s parent (``out`` made absolute where it has no name: ``.``)."""
    if out.name in ("", ".", ".."):
        out = out.resolve()
    return out.with_name(out.name + suffix)


class ShardWriter:
    """One split's shards in turn: shard ``k`` a file ``<name>.<part>`` per part, its manifest entry
    in ``shards`` (counts kept by the caller, each file's sha256 and size checked once closed)."""

    def __init__(
        self,
        folder: Path,
        split: str,
        parts: Sequence[str],
        pattern: str = "{split}_{k:05d}",
        opener: Callable[[Path], Any] = lambda p: open(p, "wb"),  # noqa: SIM115 (closed in close())
    ) -> None:
        self.folder, self.split, self.parts, self.pattern, self.opener = folder, split, parts, pattern, opener
        self.shards: list[dict[str, Any]] = []
        self.paths: dict[str, Path] = {}
        self.files: dict[str, Any] = {}
        self.written: dict[str, int] = {}

    def open(self, **counts: Any) -> None:
        """Close the shard open and start the next, its entry holding ``counts``."""
        self.close()
        name = self.pattern.format(split=self.split, k=len(self.shards))
        self.paths = {p: self.folder / f"{name}.{p}" for p in self.parts}
        self.files = {p: self.opener(path) for p, path in self.paths.items()}
        key = {"file": self.paths[self.parts[0]].name} if len(self.parts) == 1 else {"name": name}
        self.shards.append({**key, **counts})

    def write(self, part: str, array: np.ndarray) -> None:
        array.tofile(self.files[part])
        self.written[part] = self.written.get(part, 0) + array.nbytes

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        for part, size in self.written.items():  # tofile can lose a short write (full disk) silently
            if (found := self.paths[part].stat().st_size) != size:
                raise OSError(errno.ENOSPC, f"{found} of {size} bytes written", str(self.paths[part]))
        if self.files:
            sha256 = {p: sha256_file(path) for p, path in self.paths.items()}
            self.shards[-1]["sha256"] = sha256 if len(self.parts) > 1 else sha256[self.parts[0]]
        self.files, self.written = {}, {}


def counted(items: Iterable[tuple[Any, int]], advance: Callable[[int], Any]) -> Iterator[Any]:
    """The items of ``(item, bytes read for it)``, the progress advanced by each's bytes."""
    for item, n in items:
        advance(n)
        yield item


@contextmanager
def parallel(workers: int) -> Iterator[Callable[..., Iterator[Any]]]:
    """``imap`` in ``workers`` processes (forked where possible: spawning re-imports torch), or
    ``map`` here for 1."""
    check_count("workers", workers)
    if workers == 1:
        yield map
        return
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with get_context("fork" if "fork" in get_all_start_methods() else "spawn").Pool(workers) as pool:
        yield pool.imap  # consumed whole inside the block: the pool is then terminated


@contextmanager
def progress_bar(enabled: bool, total: int) -> Iterator[Callable[[int], Any]]:
    """``advance(n)`` of a rich progress bar over the source bytes, on stderr (or nothing)."""
    if not enabled:
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    columns = (BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress("tokenising", *columns, console=Console(stderr=True)) as bar:
        task = bar.add_task("tokenising", total=total)
        yield lambda n: bar.advance(task, n)
