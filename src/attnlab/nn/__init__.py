"""Attention mechanisms and the blocks built from them."""

from attnlab.nn.attention import (
    KVCache,
    MultiHeadAttention,
    causal_mask,
    scaled_dot_product_attention,
)

__all__ = ["KVCache", "MultiHeadAttention", "causal_mask", "scaled_dot_product_attention"]
