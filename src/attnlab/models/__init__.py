"""Architectures as plain ``nn.Module``s (no Lightning)."""

from attnlab.models.text.gpt import GPT
from attnlab.models.text.seq2seq import Seq2Seq
from attnlab.models.text.transformer import Transformer

__all__ = ["GPT", "Seq2Seq", "Transformer"]
