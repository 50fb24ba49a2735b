"""Text corpora by name: where each comes from and how to read it."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from attnlab.core.errors import ConfigError, DataError
from attnlab.data.download import fetch
from attnlab.data.sources import Builtin

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
            "which this Python lacks; use data/source=tinyshakespeare with data.source.data_dir"
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


def load_corpus(source: Builtin) -> str:
    """Text of the corpus ``source`` names; its ``url``/``sha256`` override the download (tests,
    mirrors)."""
    name, data_dir = source.name, source.data_dir
    if name in BUILTIN:
        if data_dir is not None:
            log.warning("corpus %r ships with Python; data.source.data_dir=%s is not used", name, data_dir)
        return python_docs()
    if name not in REMOTE:
        raise ConfigError(
            f"data.source.name={name!r} is not a known corpus; "
            f"expected one of {sorted(REMOTE) + list(BUILTIN)}"
        )
    src = REMOTE[name]
    url = source.url
    path = fetch(
        src.filename,
        url or src.url,
        src.sha256 if url is None else source.sha256,
        data_dir,
        Path(source.cache_dir) / name,
    )
    return read_text(path)
