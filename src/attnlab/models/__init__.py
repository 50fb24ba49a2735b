"""Architectures as plain ``nn.Module``s (no Lightning)."""

from attnlab.models.gpt import GPT

__all__ = ["GPT"]
