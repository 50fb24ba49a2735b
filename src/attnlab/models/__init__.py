"""Architectures as plain ``nn.Module``s (no Lightning)."""

from attnlab.models.gpt import GPT
from attnlab.models.seq2seq import Seq2Seq
from attnlab.models.transformer import Transformer

__all__ = ["GPT", "Seq2Seq", "Transformer"]
