"""Text generation from a trained language model and its tokenizer."""

from __future__ import annotations

import torch

from attnlab.data.text.tokenizers import BPETokenizer, CharTokenizer
from attnlab.inference.decoding import generate
from attnlab.models.text.gpt import GPT


def generate_text(
    net: GPT,
    tokenizer: CharTokenizer | BPETokenizer,
    prompt: str,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    num_samples: int = 1,
    seed: int | None = None,
    use_cache: bool = True,
) -> list[str]:
    """Continue ``prompt`` ``num_samples`` times; returns prompt + continuation for each."""
    ids = tokenizer.encode(prompt or "\n")  # an empty prompt starts from a newline
    if not ids:
        raise ValueError("prompt encodes to no tokens")
    device = next(net.parameters()).device
    idx = torch.tensor([ids] * num_samples, dtype=torch.long, device=device)
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    was_training = net.training
    net.eval()
    try:
        out = generate(net, idx, max_new_tokens, temperature, top_k, top_p, use_cache, gen)
    finally:
        net.train(was_training)
    return [tokenizer.decode(row.tolist()) for row in out]
