"""Where the GLUE SST-2 files come from when they are not in the data's ``data_dir``."""

from __future__ import annotations

import os
from pathlib import Path

from attnlab.core.errors import DataError
from attnlab.data.download import fetch

_ALPS = (
    "https://raw.githubusercontent.com/forest-snow/alps/3c7ef2c98249fc975a897b27f275695f97d5b7a9/data/SST-2"
)
_GLUE = (
    "https://raw.githubusercontent.com/eyalbd2/Reproducing-AutoPrompt/"
    "6288fb5bec9c572f2492875ae0111df5b6daed11/glue_data/SST-2"
)

# file name -> (url, sha256); alps_* are a re-split of GLUE's SST-2 training set (60,614 + 6,735
# rows), dev.tsv is GLUE's labelled dev set (872 rows, the usual SST-2 report split)
REMOTE = {
    "alps_train.tsv": (
        f"{_ALPS}/train.tsv",
        "920e317b2c52e12cd22db1da2c6708312bd7dc4f3712b9bbf1b50ee6c2c792ba",
    ),
    "alps_dev.tsv": (f"{_ALPS}/dev.tsv", "92353770071a2a889f75d000a38a9e541ea8f0a5499e50f040b17917a5cbf66f"),
    "dev.tsv": (f"{_GLUE}/dev.tsv", "54a9c12c77e402fc14d6a66a506f24d999f596b0176eb777c972cccc2f9cc4b0"),
}


def data_file(name: str, data_dir: str | os.PathLike | None, cache_dir: str | os.PathLike) -> Path:
    """``data_dir/name`` when ``data_dir`` is set, else a known file downloaded (checksummed)."""
    if data_dir is not None or name not in REMOTE:
        if data_dir is None:
            raise DataError(
                f"data file {name} is not a known download ({sorted(REMOTE)}); "
                "set data.source.data_dir to the directory holding it"
            )
        return fetch(name, "", None, data_dir, cache_dir)
    url, sha256 = REMOTE[name]
    return fetch(name, url, sha256, None, Path(cache_dir) / "sst2")
