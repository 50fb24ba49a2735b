import functools
import hashlib
import http.server
import itertools
import threading
from pathlib import Path

import pytest
import torch

from attnlab.core.errors import AttnlabError, ConfigError, DataError
from attnlab.data import TextDataModule
from attnlab.data.download import download, fetch
from attnlab.data.sources import Builtin
from attnlab.data.text.language_modeling import RandomWindows
from attnlab.data.text.tokenizers import BPETokenizer, CharTokenizer, tokenizer_from_json
from conftest import needs_shared, spec_refusal

TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\n" * 40).encode()


@pytest.fixture
def server(tmp_path):
    """A loopback HTTP server over a directory holding ``input.txt``; yields its base URL."""
    root = tmp_path / "www"
    root.mkdir()
    (root / "input.txt").write_bytes(TEXT)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_port}"
    httpd.shutdown()
    httpd.server_close()


SHA = hashlib.sha256(TEXT).hexdigest()


def test_download_checks_the_checksum(server, tmp_path):
    dest = tmp_path / "cache" / "input.txt"
    assert download(f"{server}/input.txt", dest, SHA).read_bytes() == TEXT


def test_checksum_mismatch_keeps_nothing(server, tmp_path):
    dest = tmp_path / "cache" / "input.txt"
    with pytest.raises(DataError, match="checksum mismatch.*expected sha256 0{64}"):
        download(f"{server}/input.txt", dest, "0" * 64)
    assert list(dest.parent.iterdir()) == []


def test_unreachable_source_suggests_data_dir(server, tmp_path):
    with pytest.raises(DataError, match="data.source.data_dir"):
        fetch("input.txt", f"{server}/missing.txt", SHA, None, tmp_path / "cache")


def test_cached_download_is_reused_and_a_corrupt_cache_refetched(server, tmp_path):
    cache = tmp_path / "cache"
    path = fetch("input.txt", f"{server}/input.txt", SHA, None, cache)
    path.write_bytes(b"truncated")
    assert fetch("input.txt", f"{server}/input.txt", SHA, None, cache).read_bytes() == TEXT


def test_datamodule_downloads_from_its_url(server, tmp_path):
    source = Builtin(
        "tinyshakespeare", cache_dir=str(tmp_path / "cache"), url=f"{server}/input.txt", sha256=SHA
    )
    dm = TextDataModule(source, max_len=8, batch_size=2)
    dm.prepare_data()
    dm.setup()
    assert dm.tokenizer.decode(dm.train_tokens[:14].tolist()) == "First Citizen:"


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda d: None, "has no file input.txt"),
        (lambda d: (d / "input.txt").write_bytes(b""), "is empty"),
        (lambda d: (d / "input.txt").write_bytes(b"\xff\xfe\x00bad" * 10), "not UTF-8"),
    ],
)
def test_bad_data_dir_is_named(tmp_path, make, match):
    make(tmp_path)
    dm = TextDataModule(Builtin("tinyshakespeare", data_dir=str(tmp_path)))
    with pytest.raises(DataError, match=match):
        dm.setup()


def test_data_dir_that_is_not_a_directory(tmp_path):
    with pytest.raises(DataError, match="not a directory"):
        TextDataModule(Builtin("tinyshakespeare", data_dir=str(tmp_path / "nope"))).setup()


def test_too_short_corpus_is_refused(tmp_path):
    (tmp_path / "input.txt").write_text("tiny text")
    with pytest.raises(DataError, match="max_len"):
        TextDataModule(Builtin("tinyshakespeare", data_dir=str(tmp_path)), max_len=64).setup()


@pytest.mark.parametrize(
    "kw",
    [
        {"tokenizer": "words"},
        {"val_size": 1.5},
        {"test_size": 0},
        {"test_size": 0.6, "val_size": 0.5},
        {"test_stride": 65},
    ],
)
def test_bad_data_values(kw):
    sizes = {k: v for k, v in kw.items() if k.endswith("_size")}  # the source's (issue 58)
    with pytest.raises(ConfigError, match=next(iter(kw))):
        TextDataModule(Builtin("pydoc", **sizes), **{k: v for k, v in kw.items() if k not in sizes})


def test_a_character_vocabulary_must_fit_in_vocab_size():
    TextDataModule(Builtin("pydoc"), vocab_size=None).setup()  # null: any size
    with pytest.raises(ConfigError, match=r"data.vocab_size=10: corpus 'pydoc' has \d+ characters"):
        TextDataModule(Builtin("pydoc"), vocab_size=10).setup()


def test_a_length_must_be_positive():
    assert "max_len=0: must be greater than 0" in spec_refusal("attnlab.data.TextDataModule", max_len=0)


def test_unknown_corpus():
    with pytest.raises(ConfigError, match="data.source"):
        TextDataModule(Builtin("wikipedia")).setup()


@pytest.fixture(scope="module")
def pydoc_dm():
    dm = TextDataModule(Builtin("pydoc"), max_len=32, batch_size=5, val_batches=3)
    dm.setup()
    return dm


def test_builtin_corpus_windows_are_shifted_by_one(pydoc_dm):
    x, y = next(iter(pydoc_dm.train_dataloader()))
    assert x.shape == y.shape == (5, 32)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert len(pydoc_dm.val_dataloader()) == 3
    assert pydoc_dm.vocab_size == len(set(pydoc_dm.tokenizer.chars)) > 60


@pytest.mark.parametrize("stride", [None, 32, 7])
def test_test_split_scores_every_test_token_once(stride):
    dm = TextDataModule(Builtin("pydoc"), max_len=32, batch_size=5, test_stride=stride)
    dm.setup()
    loaders = dm.test_dataloader()
    assert len(loaders) == (1 if stride is None else 2)
    for loader in loaders:
        scored = torch.cat([y[y != -100] for _, y in loader])
        assert torch.equal(scored, dm.test_tokens[1:])
    if stride:  # past the first window every scored target has >= T - stride tokens of context
        x, y = next(iter(loaders[1]))
        assert (y[1:, : 32 - stride] == -100).all() and (y[1:, 32 - stride :] != -100).all()


def test_train_validation_and_test_are_consecutive_disjoint_parts_of_the_text(pydoc_dm):
    text = pydoc_dm.tokenizer.decode
    whole = torch.cat([pydoc_dm.train_tokens, pydoc_dm.val_tokens, pydoc_dm.test_tokens])
    assert len(pydoc_dm.val_tokens) == pytest.approx(0.05 * len(whole), abs=1)
    assert len(pydoc_dm.test_tokens) == pytest.approx(0.05 * len(whole), abs=1)
    assert text(pydoc_dm.test_tokens[:50].tolist()) not in text(pydoc_dm.val_tokens.tolist())


def test_training_stream_is_deterministic_and_resumable(pydoc_dm):
    ds = RandomWindows(pydoc_dm.train_tokens, 8, 2, seed=3)
    first = [b[0] for b in itertools.islice(ds, 6)]
    ds.start = 4
    resumed = [b[0] for b in itertools.islice(ds, 2)]
    assert torch.equal(first[4], resumed[0]) and torch.equal(first[5], resumed[1])
    assert not torch.equal(first[0], first[1])


def test_char_tokenizer_round_trip_and_unknown_characters():
    tok = CharTokenizer.fit("hello world")
    assert tok.decode(tok.encode("low")) == "low"
    with pytest.raises(AttnlabError, match=r"\['Z'\]"):
        tok.encode("hello Z")
    assert tokenizer_from_json(tok.to_json()).encode("hold") == tok.encode("hold")


def test_bpe_tokenizer_round_trip():
    tok = BPETokenizer.fit(TEXT.decode(), vocab_size=300)
    text = "Before we proceed, Zebra! ünïcode"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) < len(text)  # merges were learned
    assert tokenizer_from_json(tok.to_json()).encode(text) == ids


def test_tinyshakespeare_from_shared_data():
    data_dir = needs_shared("tinyshakespeare")
    dm = TextDataModule(Builtin("tinyshakespeare", data_dir=str(data_dir)))
    dm.setup()
    assert dm.vocab_size == 65
    assert len(dm.train_tokens) + len(dm.val_tokens) + len(dm.test_tokens) == 1115394


def test_bpe_datamodule_from_shared_data():
    data_dir: Path = needs_shared("tinyshakespeare")
    dm = TextDataModule(Builtin("tinyshakespeare", data_dir=str(data_dir)), tokenizer="bpe", vocab_size=512)
    dm.setup()
    assert dm.vocab_size == 512
    assert len(dm.train_tokens) < 0.6 * 1115394 * 0.9
