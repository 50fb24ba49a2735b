"""Attention mechanisms and the blocks built from them."""

from attnlab.nn.attention import (
    KVCache,
    MultiHeadAttention,
    causal_mask,
    scaled_dot_product_attention,
)
from attnlab.nn.dropout import Dropout, byte_dropout
from attnlab.nn.rnn_attention import AdditiveAttention, MultiplicativeAttention

__all__ = [
    "AdditiveAttention",
    "Dropout",
    "KVCache",
    "MultiHeadAttention",
    "MultiplicativeAttention",
    "byte_dropout",
    "causal_mask",
    "scaled_dot_product_attention",
]
