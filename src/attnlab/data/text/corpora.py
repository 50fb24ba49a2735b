"""Text by name: the corpora (tinyshakespeare, pydoc) and the GLUE SST-2 files, where each comes
from when it is not in the data's ``data_dir``, and how to read it."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from attnlab.core.errors import ConfigError, DataError
from attnlab.data.download import fetch
from attnlab.data.sources import Builtin

log = logging.getLogger(__name__)


# corpus -> (file name, url, sha256)
REMOTE = {
    "tinyshakespeare": (
        "input.txt",
        "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt",
        "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
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
    filename, url, sha256 = REMOTE[name]
    if source.url is not None:
        url, sha256 = source.url, source.sha256
    return read_text(fetch(filename, url, sha256, data_dir, Path(source.cache_dir) / name))


_ALPS = (
    "https://raw.githubusercontent.com/forest-snow/alps/3c7ef2c98249fc975a897b27f275695f97d5b7a9/data/SST-2"
)
_GLUE = (
    "https://raw.githubusercontent.com/eyalbd2/Reproducing-AutoPrompt/"
    "6288fb5bec9c572f2492875ae0111df5b6daed11/glue_data/SST-2"
)

# file name -> (url, sha256); alps_* are a re-split of GLUE's SST-2 training set (60,614 + 6,735
# rows), dev.tsv is GLUE's labelled dev set (872 rows, the usual SST-2 report split)
SST2 = {
    "alps_train.tsv": (
        f"{_ALPS}/train.tsv",
        "920e317b2c52e12cd22db1da2c6708312bd7dc4f3712b9bbf1b50ee6c2c792ba",
    ),
    "alps_dev.tsv": (f"{_ALPS}/dev.tsv", "92353770071a2a889f75d000a38a9e541ea8f0a5499e50f040b17917a5cbf66f"),
    "dev.tsv": (f"{_GLUE}/dev.tsv", "54a9c12c77e402fc14d6a66a506f24d999f596b0176eb777c972cccc2f9cc4b0"),
}


def data_file(name: str, data_dir: str | os.PathLike | None, cache_dir: str | os.PathLike) -> Path:
    """``data_dir/name`` when ``data_dir`` is set, else a known file downloaded (checksummed)."""
    if data_dir is not None or name not in SST2:
        if data_dir is None:
            raise DataError(
                f"data file {name} is not a known download ({sorted(SST2)}); "
                "set data.source.data_dir to the directory holding it"
            )
        return fetch(name, "", None, data_dir, cache_dir)
    url, sha256 = SST2[name]
    return fetch(name, url, sha256, None, Path(cache_dir) / "sst2")
