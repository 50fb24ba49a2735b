"""The translation data's cached BPE vocabulary: a file it cannot use is trained over, not fatal,
and never used for a vocabulary of another kind."""

from __future__ import annotations

import logging

import pytest

from attnlab.data.sources import Generated
from attnlab.data.text.tokenizers import CharTokenizer, SubwordTokenizer
from attnlab.data.text.translation import TranslationDataModule, cached_tokenizer, synthetic_pairs


def test_a_cached_vocabulary_is_read_back(tmp_path):
    tok = SubwordTokenizer.fit(synthetic_pairs(20, seed=0)[0], 60)
    (path := tmp_path / "bpe.json").write_text(tok.to_json())
    read = cached_tokenizer(path)
    assert isinstance(read, SubwordTokenizer) and read.to_json() == tok.to_json()


@pytest.mark.parametrize(
    "content,why",
    [
        (CharTokenizer("abc").to_json(), "it holds a CharTokenizer, not a BPE vocabulary"),
        ('{"kind": "subword", "tokenizer": "{not json"}', "ignoring unreadable BPE cache"),
        ("", "ignoring unreadable BPE cache"),
    ],
)
def test_a_cache_of_another_kind_or_damaged_is_trained_over(tmp_path, caplog, content, why):
    data = TranslationDataModule(
        Generated("synthetic", train_size=20, cache_dir=str(tmp_path)), vocab_size=60
    )
    src, tgt = synthetic_pairs(20, seed=0)
    path = data._bpe_cache_path(src, tgt)
    path.write_text(content)
    with caplog.at_level(logging.WARNING, logger="attnlab.data.text.translation"):
        tok = data._fit_tokenizer(src, tgt)
    assert isinstance(tok, SubwordTokenizer) and why in caplog.text
    assert cached_tokenizer(path).to_json() == tok.to_json()  # the new one replaced it
