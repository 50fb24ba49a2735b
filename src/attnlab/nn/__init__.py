"""Attention and the blocks built from it, written once for every model."""

from attnlab.nn.attention import (
    AttentionSpec,
    KVCache,
    MultiHeadAttention,
    attention_layer,
    causal_mask,
    scaled_dot_product_attention,
)
from attnlab.nn.blocks import MLP, AttentionWeights, TransformerBlock
from attnlab.nn.dropout import Dropout, byte_dropout
from attnlab.nn.embedding import (
    ConvStem,
    LearnedPositions,
    PatchEmbedding,
    SinusoidalPositions,
    Stem,
    TokenEmbedding,
    conv_bn_relu,
    fourier_features,
    patch_embedding,
)
from attnlab.nn.linear_attention import LinearAttention, LinearAttentionState
from attnlab.nn.local_attention import GlobalLocalAttention, LocalKVCache, SlidingWindowAttention
from attnlab.nn.positions import ALiBi, RelativePositions, Rotary, T5RelativeBias
from attnlab.nn.rnn_attention import AdditiveAttention, MultiplicativeAttention
from attnlab.nn.window_attention import WindowAttention

__all__ = [
    "MLP",
    "ALiBi",
    "GlobalLocalAttention",
    "LinearAttention",
    "LinearAttentionState",
    "LocalKVCache",
    "RelativePositions",
    "Rotary",
    "SlidingWindowAttention",
    "T5RelativeBias",
    "AdditiveAttention",
    "AttentionSpec",
    "AttentionWeights",
    "ConvStem",
    "Dropout",
    "KVCache",
    "LearnedPositions",
    "MultiHeadAttention",
    "MultiplicativeAttention",
    "PatchEmbedding",
    "SinusoidalPositions",
    "Stem",
    "TokenEmbedding",
    "TransformerBlock",
    "WindowAttention",
    "attention_layer",
    "byte_dropout",
    "causal_mask",
    "conv_bn_relu",
    "fourier_features",
    "patch_embedding",
    "scaled_dot_product_attention",
]
