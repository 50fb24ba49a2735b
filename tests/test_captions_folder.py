"""data=captions_folder: a Flickr8k token file, a COCO captions json or image-caption tar shards
give caption batches; each bad input is one line and exit status 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from tokenizers import Regex, pre_tokenizers

from attnlab.cli.common import config_dir
from attnlab.data.multimodal.image_text import prepare_image_text as prepare_pairs
from attnlab.data.text.tokenizers import CAPTION_WORDS, WordTokenizer
from conftest import QUIET, run_main, write_coco, write_flickr8k, write_pairs

SIZES = ("data.source.val_size=2", "data.source.test_size=2")


def data_module(tmp: Path, *overrides: str, sizes: tuple[str, ...] = SIZES):
    """``sizes``: the held-out images a captions file is carved into (shards: none, already split)."""
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[
                f"paths.output_dir={tmp}",
                "data=captions_folder",
                *sizes,
                "data.batch_size=4",
                "data.img_size=16",
                "data.num_workers=0",
                *overrides,
            ],
        )
    dm = instantiate(cfg.data)
    dm.setup("fit")
    return dm


def check_batches(dm, references: int) -> None:
    batch = dm.on_after_batch_transfer(next(iter(dm.train_dataloader())), 0)
    assert batch["image"].shape == (4, 3, 16, 16) and batch["image"].dtype == torch.float32
    tokens, tok = batch["tokens"], dm.tokenizer
    words = pre_tokenizers.Split(Regex(CAPTION_WORDS), behavior="removed", invert=True)  # lower-cased
    assert isinstance(tok, WordTokenizer) and (tokens[:, 0] == tok.bos_id).all()
    for row, caption in zip(tokens, batch["captions"], strict=True):
        assert tok.decode(row.tolist()) == " ".join(w for w, _ in words.pre_tokenize_str(caption.lower()))
    val = next(iter(dm.val_dataloader()))
    assert val["idx"].tolist() == [0, 1]
    assert [len(r) for r in val["captions"]] == [references] * 2
    assert set(dm.model_kwargs()) == {"vocab_size", "max_len", "pad_id", "img_size", "in_chans"}


def test_flickr8k_token_file(tmp_path):
    path = write_flickr8k(tmp_path / "f8k")
    dm = data_module(tmp_path, f"data.source.path={path}", f"data.source.images_dir={path.parent / 'images'}")
    assert len(dm.splits["train"]) == 12 and len(dm.splits["val"]) == len(dm.splits["test"]) == 2
    train_images = {p.name for p in dm.splits["train"].paths}
    held = {p.name for s in ("val", "test") for p in dm.splits[s].paths}
    assert not train_images & held  # an image's captions stay in one split
    check_batches(dm, references=2)


@pytest.mark.parametrize("layout", ["coco", "shards"])
def test_coco_json_and_tar_shards(layout, tmp_path):
    if layout == "coco":
        dm = data_module(tmp_path, f"data.source.path={write_coco(tmp_path / 'coco')}")
        check_batches(dm, references=2)
        return
    shards = tmp_path / "shards"
    prepare_pairs(write_pairs(tmp_path / "pairs", n=16), shards, val_size=4, shard_records=8)
    dm = data_module(tmp_path, "data/source=caption_shards", f"data.source.path={shards}", sizes=())
    batch = next(iter(dm.train_dataloader()))
    assert batch["tokens"].shape[0] == 4 and "idx" not in batch  # shard records: one caption each
    assert len(next(iter(dm.val_dataloader()))["captions"]) == 4


BAD = {
    "undecodable image": (
        lambda p: (p.parent / "images" / "3.png").write_bytes(b"not a png"),
        "3.png: not a readable image",
    ),
    "missing image": (
        lambda p: (p.parent / "images" / "5.png").unlink(),
        "Flickr8k.token.txt:11: image 5.png not found",
    ),
    "empty caption": (
        lambda p: p.write_text(p.read_text().replace("a dog number 7 runs on grass 1 .", "  ")),
        "Flickr8k.token.txt:16: empty caption",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_line_and_exit_2(case, tmp_path):
    path = write_flickr8k(tmp_path / "f8k")
    spoil, needle = BAD[case]
    spoil(path)
    args = [f"paths.root_dir={tmp_path}", "data=captions_folder", f"data.source.path={path}"]
    args.append(f"data.source.images_dir={path.parent / 'images'}")
    status, out = run_main("train", [*QUIET, *args])
    assert status == 2 and "Traceback" not in out, out[-3000:]
    (line,) = [ln for ln in out.splitlines() if needle in ln]
    assert len(line) < 300
