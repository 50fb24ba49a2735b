"""Image-caption shards (``attnlab-prepare --mode pairs``, kind ``image_text``): CSV or JSONL rows
as tar shards of ``key.jpg`` + ``key.txt`` (a caption), as open_clip reads them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from attnlab.core.errors import ConfigError
from attnlab.data.multimodal.image_text import read_pairs
from attnlab.data.shards.writer import carve, check_free
from attnlab.data.vision.shards import image_items, write_shards


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
    """Image-caption rows (CSV with a header, or JSONL; image paths relative to the file) into
    shards: ``val_size`` rows carved out (seeded) as the val split, ``test_file``'s rows (if any)
    the test split."""

    def rows(path: Path) -> tuple[list[Path], list[str]]:
        found = read_pairs(path, image_key, caption_key)
        return [path.parent / image for image, _, _ in found], [text for _, text, _ in found]

    check_free(Path(out_dir))
    files, texts = rows(Path(pairs_file))
    if val_size >= len(files):
        raise ConfigError(
            f"--val-size ({val_size}) must be smaller than the {len(files)} rows of {pairs_file}"
        )
    pick = lambda idx: image_items([files[i] for i in idx], [texts[i] for i in idx], "txt")  # noqa: E731
    train, val = carve(len(files), val_size, seed)
    splits = {"train": pick(train), "val": pick(val)}
    if test_file is not None:
        splits["test"] = image_items(*rows(Path(test_file)), "txt")
    meta = {"kind": "image_text", "source": str(pairs_file)}
    return write_shards(splits, out_dir, meta, shard_records, on_bad_record)
