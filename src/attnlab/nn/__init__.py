"""Attention mechanisms and the blocks built from them."""

from attnlab.nn.attention import (
    KVCache,
    MultiHeadAttention,
    causal_mask,
    scaled_dot_product_attention,
)
from attnlab.nn.rnn_attention import AdditiveAttention, MultiplicativeAttention

__all__ = [
    "AdditiveAttention",
    "KVCache",
    "MultiHeadAttention",
    "MultiplicativeAttention",
    "causal_mask",
    "scaled_dot_product_attention",
]
