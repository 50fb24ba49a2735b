"""Language modelling on a captioning data set's captions: the text a Flamingo's frozen GPT is
trained on before the captioner is."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from attnlab.data.base import DataModule
from attnlab.data.sources import Source
from attnlab.data.text.language_modeling import TextDataModule


class CaptionTextDataModule(TextDataModule):
    """A captioning DataModule's captions (its ``tokenizer``, ``caption_texts(split)``), ``<bos> words
    <eos>`` each, as one stream of ``TextDataModule`` windows: contexts of several captions are a
    Flamingo's few-shot prompts. The artifacts are the captions' own (the tokenizer goes on)."""

    def __init__(
        self,
        captions: DataModule,
        max_len: int = 128,
        batch_size: int = 64,
        val_batches: int = 20,
        test_stride: int | None = None,
        num_workers: int = 0,
        seed: int = 1337,
    ) -> None:
        super().__init__(
            source=Source(f"captions of {type(captions).__name__}"),
            max_len=max_len,
            batch_size=batch_size,
            val_batches=val_batches,
            test_stride=test_stride,
            num_workers=num_workers,
            seed=seed,
        )
        self.captions = captions

    def artifacts(self) -> dict[str, Any]:
        return self.captions.artifacts()

    def load_artifacts(self, artifacts: dict[str, Any]) -> None:
        self.captions.load_artifacts(artifacts)

    def prepare_data(self) -> None:
        self.captions.prepare_data()

    def setup(self, stage: str | None = None) -> None:
        if self.train_tokens is not None:
            return
        self.captions.setup("fit")
        self.tokenizer = self.captions.tokenizer
        self.train_tokens, self.val_tokens, self.test_tokens = (
            self.stream(self.captions.caption_texts(split)) for split in ("train", "val", "test")
        )
        self._check_lengths([("train", len(self.train_tokens)), ("validation", len(self.val_tokens))])
        self.log_tokens(self.source.where, len(self.train_tokens), " (words)")

    def stream(self, texts: list[str]) -> Tensor:
        tokens, _ = self.tokenizer.encode_captions(texts, max_len=1 << 30)  # (captions, T), padded
        return tokens[tokens != self.tokenizer.pad_id]  # row by row: the captions in order
