"""Token shards (``attnlab-prepare``, ``data.source.path``): a corpus tokenised once onto disk, read
a window at a time, resumable, shared out between ranks and workers; bad input gets one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from attnlab.core.errors import DataError
from attnlab.data.sources import Shards
from attnlab.data.text.corpora import python_docs
from attnlab.data.text.shards import MANIFEST, ShardWindows, TokenShards, prepare
from attnlab.data.text.tokenizers import CharTokenizer
from conftest import QUIET, assert_ok, read_metrics, run_cli
from test_resume import train

TEXT = python_docs()[:60_000]


def corpus(tmp: Path, parts: int = 3) -> list[str]:
    """The text in ``parts`` files (a corpus of several files, each cut at a line)."""
    lines = TEXT.splitlines(keepends=True)
    step = -(-len(lines) // parts)
    files = []
    for i in range(parts):
        path = tmp / "corpus" / f"part{i}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(lines[i * step : (i + 1) * step]), encoding="utf-8")
        files.append(str(path))
    return files


def make(tmp: Path, name: str = "shards", **kwargs) -> TokenShards:
    options = {"val_tokens": 3000, "test_tokens": 2000, "shard_tokens": 20_000, "progress": False}
    prepare(corpus(tmp), tmp / name, **{**options, **kwargs})
    return TokenShards(tmp / name)


def train_ids(shards: TokenShards) -> list[torch.Tensor]:
    """Each training shard's token ids, whole."""
    return [
        torch.from_numpy(shards.read_windows([(s, 0)], s.count)[0].astype(np.int64))
        for s in shards.splits["train"]
    ]


def test_shards_hold_the_corpus_tokens_in_order_split_as_asked(tmp_path):
    shards = make(tmp_path, chunk_bytes=4096)  # many chunks: boundaries inside the corpus
    tokenizer = shards.tokenizer()
    assert isinstance(tokenizer, CharTokenizer) and tokenizer.chars == "".join(sorted(set(TEXT)))
    want = torch.tensor(tokenizer.encode(TEXT))
    train = torch.cat(train_ids(shards))
    got = torch.cat([shards.read_split("val"), shards.read_split("test"), train])
    assert torch.equal(got, want)
    assert [len(shards.read_split(s)) for s in ("val", "test")] == [3000, 2000]
    assert max(s.count for s in shards.splits["train"]) == 20_000 and len(shards.splits["train"]) == 3
    assert shards.dtype == np.uint16


def test_parallel_and_bpe_prepares(tmp_path):
    one = make(tmp_path, "one", chunk_bytes=8192)
    two = make(tmp_path, "two", chunk_bytes=8192, workers=2)
    for a, b in zip(one.splits["train"], two.splits["train"], strict=True):
        assert a.path.read_bytes() == b.path.read_bytes()
    bpe = make(tmp_path, "bpe", tokenizer="bpe", vocab_size=400, val_tokens=100, test_tokens=100)
    ids = torch.cat([bpe.read_split("val"), bpe.read_split("test"), *train_ids(bpe)])
    assert bpe.tokenizer().decode(ids.tolist()) == TEXT  # byte-level BPE: the text comes back whole


def test_windows_are_slices_of_the_shards_and_a_stream_restarts_at_any_batch(tmp_path):
    shards = make(tmp_path)
    train = train_ids(shards)
    stream = ShardWindows(shards, max_len=32, batch_size=4, seed=7)
    batches = [b for b, _ in zip(stream, range(6), strict=False)]
    for x, y in batches:
        assert x.shape == (4, 32) and torch.equal(x[:, 1:], y[:, :-1])
        for row, target in zip(x, y, strict=True):  # a window of one shard, its next tokens the targets
            window = torch.cat([row, target[-1:]])
            assert any((t.unfold(0, 33, 1) == window).all(1).any() for t in train), (
                "a window that is no slice of a shard"
            )
    resumed = ShardWindows(shards, max_len=32, batch_size=4, seed=7)
    resumed.start = 4
    again = [b for b, _ in zip(resumed, range(2), strict=False)]
    for (x, y), (x2, y2) in zip(batches[4:], again, strict=True):
        assert torch.equal(x, x2) and torch.equal(y, y2)


def test_two_ranks_of_two_workers_share_the_stream_out_once(tmp_path, monkeypatch):
    shards = make(tmp_path)
    stream = ShardWindows(shards, max_len=16, batch_size=2, seed=3)
    reference = {i: stream.batch(i)[0] for i in range(16)}
    seen = []
    for rank in range(2):
        for worker in range(2):
            monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
            monkeypatch.setattr(torch.distributed, "get_rank", lambda r=rank: r)
            monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
            info = type("Info", (), {"id": worker, "num_workers": 2})()
            monkeypatch.setattr("attnlab.data.sampling.get_worker_info", lambda i=info: i)
            seen += [x for (x, _), _ in zip(stream, range(4), strict=False)]
    matches = [[i for i, r in reference.items() if torch.equal(r, x)] for x in seen]
    assert sorted(i for m in matches for i in m) == list(range(16))  # each of batches 0-15 once


def test_a_gpt_trains_from_shards_and_resumes_mid_run_exactly(tmp_path):
    make(tmp_path)
    extra = ["data=token_shards", "data/source=shards", f"data.source.path={tmp_path / 'shards'}"]
    full = train("gpt_pydoc_char", tmp_path, *extra)
    losses = [v for _, v in read_metrics(full)["val/loss"]]
    assert losses[-1] < losses[0]
    (mid,) = (full / "checkpoints").glob("step_000015.ckpt")
    resumed = train("gpt_pydoc_char", tmp_path, *extra, f"ckpt_path={mid}")
    want, got = read_metrics(full), read_metrics(resumed)
    for key in ("train/loss", "val/loss", "test/loss"):
        assert [s for s, _ in got[key]] == [s for s, _ in want[key]], key
        assert [v for _, v in got[key]] == pytest.approx([v for _, v in want[key]], rel=1e-4), key


# ---- bad input ------------------------------------------------------------------------------------


def test_bad_inputs_name_the_file(tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.txt: not UTF-8 text near byte 3"):
        prepare([str(bad)], tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    with pytest.raises(DataError, match="no file matches"):
        prepare([str(tmp_path / "none/*.txt")], tmp_path / "out2", progress=False)

    shards = make(tmp_path)
    with pytest.raises(DataError, match="already holds prepared shards"):
        prepare(corpus(tmp_path), shards.folder, progress=False)
    first = shards.splits["train"][0].path
    first.write_bytes(first.read_bytes()[:-2])
    with pytest.raises(DataError, match=rf"{first.name}: .* truncated or replaced"):
        TokenShards(shards.folder)
    (shards.folder / MANIFEST).write_text("{not json")
    with pytest.raises(DataError, match="not a readable manifest"):
        TokenShards(shards.folder)
    with pytest.raises(DataError, match="no manifest.json; prepare it with attnlab-prepare"):
        TokenShards(tmp_path)


def test_an_interrupted_prepare_leaves_nothing_and_the_next_starts_clean(tmp_path):
    partial = tmp_path / "shards.partial"
    partial.mkdir()
    (partial / "train_00000.bin").write_bytes(b"\x00" * 10)  # what a killed prepare left
    shards = make(tmp_path)
    assert not partial.exists() and shards.tokens("train") == len(TEXT) - 5000


def test_shards_of_another_tokenizer_than_the_checkpoint_s_are_refused(tmp_path):
    from attnlab.data import TextDataModule

    make(tmp_path)
    dm = TextDataModule(Shards(str(tmp_path / "shards")), max_len=16)
    dm.load_artifacts({"tokenizer": CharTokenizer("abc").to_json()})
    with pytest.raises(DataError, match="made with another tokenizer"):
        dm.setup("fit")


def test_shards_bring_their_tokenizer_and_a_conflicting_key_is_refused(tmp_path):
    from attnlab.core.errors import ConfigError
    from attnlab.data import TextDataModule

    shards = make(tmp_path)
    path = str(tmp_path / "shards")
    dm = TextDataModule(Shards(path), tokenizer="char", vocab_size=shards.vocab_size, max_len=16)
    dm.setup("fit")  # the shards' own, named: accepted
    assert dm.tokenizer.to_json() == shards.tokenizer_json
    for key, value in (("tokenizer", "bpe"), ("vocab_size", 1024)):
        with pytest.raises(ConfigError, match=rf"^data.{key}={value!r}: the shards at .* have {key} "):
            TextDataModule(Shards(path), max_len=16, **{key: value}).setup("fit")


def test_the_prepare_command_reports_and_refuses_in_one_line(tmp_path):
    files = corpus(tmp_path)
    proc = run_cli(
        "prepare", [*files, "--out", "shards", "--val-tokens", "500", "--test-tokens", "500"], tmp_path
    )
    assert_ok(proc)
    assert "train /" in proc.stdout and "MB/s" in proc.stdout
    manifest = json.loads((tmp_path / "shards" / MANIFEST).read_text())
    assert manifest["sources"][0]["bytes"] > 0 and len(manifest["tokenizer_sha256"]) == 64
    again = run_cli("prepare", [*files, "--out", "shards"], tmp_path)
    assert again.returncode == 2 and again.stderr.strip().splitlines() == [
        "error: shards: already holds prepared shards; choose another folder or remove it"
    ]
    quiet = [*QUIET, "trainer.max_steps=2", "trainer.val_check_interval=2", "test=false", "sample=null"]
    trained = run_cli(
        "train",
        [
            "experiment=gpt_pydoc_char",
            "data=token_shards",
            "data.source.path=shards",
            "model.net.depth=1",
            *quiet,
        ],
        tmp_path,
    )
    assert_ok(trained)
