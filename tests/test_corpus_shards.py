"""BERT document shards (``attnlab-prepare --mode bert``, ``data=bert_shards``) and translation pair
shards (``--mode translation``, ``data=translation_shards``): the corpus on disk gives what the
in-memory path gives, resumes exactly, is shared out once; bad input gets one line."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from attnlab.core.errors import DataError
from attnlab.data import MaskedLMDataModule, TranslationDataModule
from attnlab.data.batching import TokenBatchSampler
from attnlab.data.sources import Files, Shards
from attnlab.data.text.formats import read_corpus
from attnlab.data.text.masked_lm import N_SPECIALS, NOT_NEXT, PairStream
from attnlab.data.text.shards import (
    MANIFEST,
    DocumentShards,
    PairShards,
    ShardDocuments,
    prepare,
    prepare_documents,
    prepare_pairs,
)
from attnlab.data.text.tokenizers import SubwordTokenizer, WordPieceTokenizer
from attnlab.data.text.translation import synthetic_pairs
from conftest import QUIET, assert_ok, read_metrics, run_cli
from test_resume import train

WORDS = "the a film cast plot dog ran quickly over slow red house tree was good bad and".split()


def write_documents(folder: Path, files: int = 2, docs: int = 120) -> list[Path]:
    """Plain-text corpora: one sentence per line, documents of 1-5 sentences between blank lines."""
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k in range(files):

        def doc() -> str:
            n = rng.randint(1, 5)
            return "\n".join(" ".join(rng.choices(WORDS, k=rng.randint(1, 9))) + " ." for _ in range(n))

        path = folder / f"part{k}.txt"
        path.write_text("\n\n".join(doc() for _ in range(docs)) + "\n\n\n", encoding="utf-8")
        paths.append(path)
    return paths


def documents(tmp: Path, name: str = "docs", **kwargs) -> DocumentShards:
    write_documents(tmp / "corpus")
    options = {"vocab_size": 100, "val_docs": 10, "test_docs": 10, "shard_tokens": 2000, "progress": False}
    prepare_documents([str(tmp / "corpus" / "*.txt")], tmp / name, **{**options, **kwargs})
    return DocumentShards(tmp / name)


def in_memory(paths: list[Path], tokenizer: WordPieceTokenizer) -> list:
    """The documents as the in-memory path reads and encodes them (``MaskedLMDataModule._encode``)."""
    dm = MaskedLMDataModule(Files(["unused"]))
    dm.tokenizer = tokenizer
    return dm._encode([d for p in paths for d in read_corpus(p)])


# ---- BERT ---------------------------------------------------------------------------------------


def test_document_shards_hold_the_documents_the_in_memory_path_reads(tmp_path):
    shards = documents(tmp_path, chunk_bytes=256)  # many chunks: documents cut between reads
    want = in_memory(sorted((tmp_path / "corpus").glob("*.txt")), shards.tokenizer())
    got = [*shards.read_split("val"), *shards.read_split("test"), *ShardDocuments(shards)]
    assert got == want and len(shards.splits["train"]) > 1
    assert [len(shards.read_split(s)) for s in ("val", "test")] == [10, 10]
    two = documents(tmp_path, "two", chunk_bytes=256, workers=2)
    for a, b in zip(shards.splits["train"], two.splits["train"], strict=True):
        assert all(
            a.path(p).read_bytes() == b.path(p).read_bytes() for p in ("tokens", "sentences", "documents")
        )


def test_batches_from_shards_are_the_in_memory_batches_and_mask_as_bert_does(tmp_path):
    shards = documents(tmp_path)
    docs = list(ShardDocuments(shards))
    vocab = shards.tokenizer().vocab_size
    on_disk, held = (PairStream(d, 32, 256, vocab, 0.15, seed=5) for d in (ShardDocuments(shards), docs))
    chosen = ordinary = not_next = pairs = 0
    for n in range(12):
        a, b = on_disk.batch(n), held.batch(n)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert a["ids"].shape[1] <= 32 and a["ids"].numel() <= 256
        originals = torch.where(a["mlm_labels"] >= 0, a["mlm_labels"], a["ids"])
        assert (a["mlm_labels"][originals < N_SPECIALS] == -100).all()  # specials never chosen
        chosen += int((a["mlm_labels"] >= 0).sum())
        ordinary += int((originals >= N_SPECIALS).sum())
        not_next += int((a["nsp_labels"] == NOT_NEXT).sum())
        pairs += len(a["nsp_labels"])
    assert 0.10 < chosen / ordinary < 0.20 and 0.3 < not_next / pairs < 0.7
    assert not torch.equal(on_disk.batch(0)["ids"], on_disk.batch(1)["ids"])


def test_two_ranks_of_two_workers_share_the_bert_stream_out_once(tmp_path, monkeypatch):
    stream = PairStream(ShardDocuments(documents(tmp_path)), 32, 256, 100, 0.15, seed=3)
    reference = {i: stream.batch(i)["ids"] for i in range(16)}
    seen = []
    for rank in range(2):
        for worker in range(2):
            monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
            monkeypatch.setattr(torch.distributed, "get_rank", lambda r=rank: r)
            monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
            info = type("Info", (), {"id": worker, "num_workers": 2})()
            monkeypatch.setattr("attnlab.data.sampling.get_worker_info", lambda i=info: i)
            seen += [b["ids"] for b, _ in zip(stream, range(4), strict=False)]
    matches = [[i for i, r in reference.items() if r.shape == x.shape and torch.equal(r, x)] for x in seen]
    assert sorted(i for m in matches for i in m) == list(range(16))  # each of batches 0-15 once


def test_a_bert_trains_from_document_shards_and_resumes_mid_run_exactly(tmp_path):
    documents(tmp_path, vocab_size=120)
    extra = ["data=bert_shards", f"data.source.path={tmp_path / 'docs'}", "data.max_len=32"]
    full = train("bert_pretrain_sst2", tmp_path, *extra, source=False)
    (mid,) = (full / "checkpoints").glob("step_000015.ckpt")
    resumed = train("bert_pretrain_sst2", tmp_path, *extra, f"ckpt_path={mid}", source=False)
    want, got = read_metrics(full), read_metrics(resumed)
    assert want["val/loss"][-1][1] < want["val/loss"][0][1]
    for key in ("train/loss", "val/loss", "test/loss"):
        assert [s for s, _ in got[key]] == [s for s, _ in want[key]], key
        assert [v for _, v in got[key]] == pytest.approx([v for _, v in want[key]], rel=1e-4), key


# ---- translation --------------------------------------------------------------------------------


def write_parallel(folder: Path, n: int = 400) -> dict[str, Path]:
    """The same pairs as a TSV, a JSONL and two aligned files."""
    de, en = synthetic_pairs(n, 0)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "c.tsv").write_text("".join(f"{a}\t{b}\n" for a, b in zip(de, en, strict=True)))
    rows = [json.dumps({"de": a, "en": b}, ensure_ascii=False) for a, b in zip(de, en, strict=True)]
    (folder / "c.jsonl").write_text("\n".join(rows) + "\n")
    (folder / "c.de").write_text("\n".join(de) + "\n")
    (folder / "c.en").write_text("\n".join(en) + "\n")
    return {"tsv": folder / "c.tsv", "jsonl": folder / "c.jsonl", "aligned": folder / "c"}


PAIRS = {"vocab_size": 120, "val_pairs": 20, "test_pairs": 30, "shard_tokens": 3000, "progress": False}


def test_pair_shards_hold_the_pairs_of_any_source_format(tmp_path):
    sources = write_parallel(tmp_path / "corpus")
    for kind, path in sources.items():
        prepare_pairs([str(path)], tmp_path / kind, "de", "en", block_pairs=64, **PAIRS)
    de, en = synthetic_pairs(400, 0)
    shards = PairShards(tmp_path / "tsv")
    tok = shards.tokenizer()
    assert len(shards.train) > 1 and int(shards.ends[-1]) == 350
    assert [shards.sentence("de", i) for i in range(350)] == tok.encode_batch(de[50:])
    assert [shards.sentence("en", i) for i in range(350)] == tok.encode_batch(en[50:])
    assert shards.text_files("test", "de", "en")[1].read_text().splitlines() == en[20:50]
    for kind in ("jsonl", "aligned"):
        other = PairShards(tmp_path / kind)
        files = sorted(p.name for p in (tmp_path / kind).iterdir() if p.name != MANIFEST)
        assert files == sorted(p.name for p in (tmp_path / "tsv").iterdir() if p.name != MANIFEST)
        assert all((tmp_path / kind / f).read_bytes() == (tmp_path / "tsv" / f).read_bytes() for f in files)
        assert other.tokenizer_json == shards.tokenizer_json


def test_the_translation_data_reads_either_direction_and_batches_as_in_memory(tmp_path):
    prepare_pairs([str(write_parallel(tmp_path / "c")["tsv"])], tmp_path / "s", "de", "en", **PAIRS)
    dm = TranslationDataModule(Shards(str(tmp_path / "s")), src_lang="en", tgt_lang="de", max_len=32)
    dm.setup()
    de, en = synthetic_pairs(400, 0)
    assert dm.references("val") == de[:20] and dm.sources("test") == en[20:50]
    batch = next(iter(dm.train_dataloader()))
    tok = dm.tokenizer
    for row, i in zip(batch["src"], batch["idx"].tolist(), strict=True):  # idx: of the training pairs
        assert row[row != tok.pad_id].tolist() == tok.encode(en[50 + i]) + [tok.eos_id]
    lengths = dm.train_lengths
    assert isinstance(lengths, np.ndarray)
    for shuffle in (False, True):  # a numpy array batches as the list would (and resumes the same)
        whole = TokenBatchSampler(lengths, 256, shuffle, seed=3)
        as_list = TokenBatchSampler(lengths.tolist(), 256, shuffle, seed=3)
        assert len(whole) == len(as_list)
        if not shuffle:
            assert [b.tolist() for b in whole] == list(as_list)
        else:
            assert sorted(i for b in whole for i in b.tolist()) == list(range(len(lengths)))
            assert max(int(lengths[b].max()) * len(b) for b in whole) <= 256
        resumed = TokenBatchSampler(lengths, 256, shuffle, seed=3)
        resumed.resume(len(whole) + 2)  # into the second epoch
        whole.set_epoch(1)
        assert [b.tolist() for b in resumed] == [b.tolist() for b in whole][2:]


def test_a_transformer_trains_from_pair_shards_and_scores_every_test_pair(tmp_path):
    files = write_parallel(tmp_path / "corpus", n=300)
    args = ["--mode", "translation", "--src-lang", "de", "--tgt-lang", "en", "--val-pairs", "12"]
    proc = run_cli("prepare", [str(files["aligned"]), "--out", "s", *args, "--test-pairs", "16"], tmp_path)
    assert_ok(proc)
    assert "272 train / 12 val / 16 test pairs" in proc.stdout
    proc = run_cli(
        "train",
        [
            "experiment=nmt_synthetic",
            "data=translation_shards",
            "data.source.path=s",
            "data.max_len=32",
            "data.max_tokens=256",
            "data.num_workers=0",
            "model.net.dim=32",
            "model.net.enc_depth=1",
            "model.net.dec_depth=1",
            "model.plot_sentences=1",
            "model.beam_size=2",
            "model.compile_loss=false",
            "trainer.max_steps=6",
            "trainer.val_check_interval=3",
            *QUIET,
        ],
        tmp_path,
    )
    assert_ok(proc)
    (run,) = (tmp_path / "logs" / "nmt_synthetic" / "runs").iterdir()
    metrics = read_metrics(run)
    assert "test/bleu" in metrics and len(metrics["val/bleu"]) == 2
    translations = next(run.rglob("test_translations.txt")).read_text().splitlines()
    assert len(translations) == 16  # every test pair translated once


# ---- bad input ------------------------------------------------------------------------------------


def test_bad_text_is_named_with_its_byte_offset_or_line(tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("a good film .\ncaf\xe9 au lait .\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.txt: not UTF-8 text near byte 17"):
        prepare_documents([str(bad)], tmp_path / "out", val_docs=1, test_docs=1, progress=False)
    assert not (tmp_path / "out").exists()
    (tmp_path / "p.de").write_bytes("ein hund .\nein caf\xe9 .\n".encode("latin-1"))
    (tmp_path / "p.en").write_text("a dog .\na cafe .\n")
    with pytest.raises(DataError, match=r"p.de: not UTF-8 text near byte 18 \(line 2"):
        prepare_pairs([str(tmp_path / "p")], tmp_path / "out", "de", "en", progress=False)
    (tmp_path / "p.de").write_text("ein hund .\n")
    with pytest.raises(DataError, match=r"differ in length: .*p.de has 1 lines, .*p.en has 2"):
        prepare_pairs([str(tmp_path / "p")], tmp_path / "out", "de", "en", progress=False)
    (tmp_path / "c.tsv").write_text("ein hund .\ta dog .\nno tab here\n")
    with pytest.raises(DataError, match=r"c.tsv:2: no tab; expected source<TAB>target"):
        prepare_pairs([str(tmp_path / "c.tsv")], tmp_path / "out", "de", "en", progress=False)
    (tmp_path / "c.jsonl").write_text('{"de": "ein hund ."}\n')
    with pytest.raises(DataError, match=r'c.jsonl:1: expected a JSON object \{"de": "...", "en": "..."\}'):
        prepare_pairs([str(tmp_path / "c.jsonl")], tmp_path / "out", "de", "en", progress=False)
    (tmp_path / "few.tsv").write_text("ein hund .\ta dog .\n" * 3)
    with pytest.raises(DataError, match=r"few.tsv: too few pairs for 1000 validation and 1000 test pairs"):
        prepare_pairs([str(tmp_path / "few.tsv")], tmp_path / "out", "de", "en", progress=False)
    assert not (tmp_path / "out").exists()  # only out.partial: the next prepare removes it


def test_damaged_or_mismatched_shards_are_refused_in_one_line(tmp_path):
    shards = documents(tmp_path)
    first = shards.splits["train"][0]
    first.path("tokens").write_bytes(b"")  # an emptied shard
    with pytest.raises(DataError, match=rf"{first.entry['name']}.tokens: 0 bytes, but the manifest says"):
        DocumentShards(shards.folder)
    manifest = json.loads((shards.folder / MANIFEST).read_text())
    manifest["splits"]["train"][0].update(tokens=0, sentences=0, documents=0)
    (shards.folder / MANIFEST).write_text(json.dumps(manifest))
    first.path("sentences").write_bytes(bytes(8))
    first.path("documents").write_bytes(bytes(8))
    with pytest.raises(DataError, match=rf"{first.entry['name']}.documents: an empty shard"):
        DocumentShards(shards.folder)

    documents(tmp_path, "ok")
    dm = MaskedLMDataModule(Shards(str(tmp_path / "ok")))
    dm.load_artifacts({"tokenizer": WordPieceTokenizer.fit(["another text"], 50).to_json()})
    with pytest.raises(DataError, match="made with another tokenizer than the checkpoint's"):
        dm.setup("fit")
    prepare_pairs([str(write_parallel(tmp_path / "c")["tsv"])], tmp_path / "pairs", "de", "en", **PAIRS)
    dm = TranslationDataModule(Shards(str(tmp_path / "pairs")), src_lang="de", tgt_lang="en")
    dm.load_artifacts({"tokenizer": SubwordTokenizer.fit(["ein hund", "a dog"], 50).to_json()})
    with pytest.raises(DataError, match="made with another tokenizer than the checkpoint's"):
        dm.setup("fit")
    with pytest.raises(DataError, match="holds de-en pairs; data.src_lang and data.tgt_lang must be"):
        TranslationDataModule(Shards(str(tmp_path / "pairs")), src_lang="fr", tgt_lang="en").setup()
    (tmp_path / "pairs" / "test.en").write_text("a replaced test set\n")
    with pytest.raises(DataError, match=r"test.en: 20 bytes, but the manifest says 30 lines of text"):
        TranslationDataModule(Shards(str(tmp_path / "pairs"))).setup()
    (tmp_path / "gpt.txt").write_text("some text for a language model\n" * 50)
    prepare([str(tmp_path / "gpt.txt")], tmp_path / "gpt", val_tokens=10, test_tokens=10, progress=False)
    with pytest.raises(
        DataError, match=r"holds token shards \(attnlab-prepare --mode lm\), not document shards"
    ):
        MaskedLMDataModule(Shards(str(tmp_path / "gpt"))).setup()


def test_the_prepare_command_refuses_in_one_line(tmp_path):
    files = write_documents(tmp_path / "corpus", files=1)
    cases = [
        (["--mode", "bert", "--val-tokens", "5"], "error: --val-tokens is for --mode lm, not --mode bert"),
        (["--mode", "translation"], "error: --mode translation needs --src-lang (e.g. de, en)"),
        (["--mode", "bert", "--val-docs", "500"], "none left for training after 500 validation"),
    ]
    for args, message in cases:
        proc = run_cli("prepare", [str(files[0]), "--out", "out", "--no-progress", *args], tmp_path)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert message in proc.stderr
    proc = run_cli(
        "prepare",
        [str(files[0]), "--out", "out", "--mode", "bert", "--val-docs", "5", "--test-docs", "5"],
        tmp_path,
    )
    assert_ok(proc)
    assert "documents (uint16, vocab" in proc.stdout and not (tmp_path / "out.partial").exists()
