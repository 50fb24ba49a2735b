"""Text corpora by name: where each comes from and how to read it."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from attnlab.core.errors import ConfigError, DataError
from attnlab.data.download import fetch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RemoteText:
    filename: str
    url: str
    sha256: str


REMOTE = {
    "tinyshakespeare": RemoteText(
        filename="input.txt",
        url="https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
        sha256="86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
    ),
}
BUILTIN = ("pydoc",)


def python_docs() -> str:
    """Python's reference manual, as shipped with every CPython (``pydoc_data``, ~465k chars)."""
    try:
        from pydoc_data.topics import topics
    except ImportError as e:  # some distributions strip it
        raise DataError(
            "corpus 'pydoc' needs the pydoc_data module of the Python standard library, "
            "which this Python lacks; use data.corpus=tinyshakespeare with data.data_dir"
        ) from e
    return "\n\n".join(topics[k].strip() for k in sorted(topics))


def read_text(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"data file {path} is not UTF-8 text ({e}); is it corrupt?") from e
    if not text.strip():
        raise DataError(f"data file {path} is empty")
    return text


def load_corpus(
    name: str,
    data_dir: str | os.PathLike | None,
    cache_dir: str | os.PathLike,
    url: str | None = None,
    sha256: str | None = None,
) -> str:
    """Text of corpus ``name``; ``url``/``sha256`` override its download source (tests, mirrors)."""
    if name in BUILTIN:
        if data_dir is not None:
            log.warning("corpus %r ships with Python; data.data_dir=%s is not used", name, data_dir)
        return python_docs()
    if name not in REMOTE:
        raise ConfigError(
            f"data.corpus={name!r} is not a known corpus; expected one of {sorted(REMOTE) + list(BUILTIN)}"
        )
    src = REMOTE[name]
    path = fetch(
        src.filename,
        url or src.url,
        src.sha256 if url is None else sha256,
        data_dir,
        Path(cache_dir) / name,
    )
    return read_text(path)
