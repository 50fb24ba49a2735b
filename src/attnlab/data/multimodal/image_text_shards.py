"""Image-caption shards (``attnlab-prepare --mode pairs``, kind ``image_text``): CSV or JSONL rows
as tar shards of ``key.jpg`` + ``key.txt`` (a caption), as open_clip reads them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from attnlab.data.multimodal.image_text import read_pairs
from attnlab.data.shards.writer import check_free
from attnlab.data.vision.shards import carved_items, image_items, write_shards


def prepare_image_text(
    pairs_file: str | os.PathLike,
    out_dir: str | os.PathLike,
    val_size: int = 1000,
    test_file: str | os.PathLike | None = None,
    image_key: str = "image",
    caption_key: str = "caption",
    shard_records: int = 10_000,
    on_bad_record: str = "error",
    seed: int = 1337,
) -> dict[str, Any]:
    """Image-caption rows (CSV or JSONL) into shards: ``val_size`` rows carved (seeded), ``test_file``'s
    the test split."""

    def rows(path: Path) -> tuple[list[Path], list[str]]:
        found = read_pairs(path, image_key, caption_key)
        return [path.parent / image for image, _, _ in found], [text for _, text, _ in found]

    check_free(Path(out_dir))
    splits = carved_items(*rows(Path(pairs_file)), "txt", val_size, seed, f"rows of {pairs_file}")
    if test_file is not None:
        splits["test"] = image_items(*rows(Path(test_file)), "txt")
    meta = {"kind": "image_text", "source": str(pairs_file)}
    return write_shards(splits, out_dir, meta, shard_records, on_bad_record)
