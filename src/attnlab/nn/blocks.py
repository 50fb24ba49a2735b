"""The Transformer block every attention model here is built from, its attention, MLP and norm
injected as in timm."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Literal, NamedTuple

from timm.layers import DropPath, QuickGELU
from torch import Tensor, nn

from attnlab.nn.attention import KVCache, MultiHeadAttention
from attnlab.nn.dropout import Dropout
from attnlab.nn.positions import RelativePositions

# The MLP's activation by name: exact GELU, its tanh approximation (GPT-2's), or OpenAI CLIP's
# sigmoid approximation x * sigmoid(1.702 x)
Activation = Literal["gelu", "gelu_tanh", "quick_gelu"]


def activation(name: Activation) -> Callable[[], nn.Module]:
    return {"gelu": nn.GELU, "gelu_tanh": partial(nn.GELU, approximate="tanh"), "quick_gelu": QuickGELU}[name]


class MLP(nn.Module):
    """Position-wise feed-forward network: fc2(act(fc1(x)))."""

    def __init__(
        self, dim: int, hidden_dim: int, act_layer: Callable[[], nn.Module] = nn.GELU, bias: bool = True
    ) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim, bias=bias)
        self.act = act_layer()
        self.fc2 = nn.Linear(hidden_dim, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class AttentionWeights(NamedTuple):
    """Attention weights (B, H, T_q, T_k) of a block's self- and cross-attention, when asked for."""

    self_attn: Tensor | None = None
    cross_attn: Tensor | None = None


class TransformerBlock(nn.Module):
    """Self-attention, optional cross-attention to a memory (decoders) and an MLP, each a residual
    branch: pre-LN (``norm_first``; GPT, ViT) x + drop_path(dropout(f(norm(x)))) or post-LN (the 2017
    paper, BERT) norm(x + dropout(f(x))). The layers are injected as constructors (timm's way)."""

    def __init__(
        self,
        dim: int,
        n_head: int,
        mlp_dim: int,
        dropout: float = 0.0,
        drop_path: float = 0.0,
        norm_first: bool = True,
        cross_attention: bool = False,
        bias: bool = True,
        attn_layer: Callable[..., nn.Module] = MultiHeadAttention,
        mlp_layer: Callable[..., nn.Module] = MLP,
        norm_layer: Callable[[int], nn.Module] = nn.LayerNorm,
        act_layer: Callable[[], nn.Module] = nn.GELU,
    ) -> None:
        super().__init__()
        self.norm_first = norm_first
        self.norm1 = norm_layer(dim)
        self.attn = attn_layer(dim, n_head, bias=bias)
        self.norm_cross = norm_layer(dim) if cross_attention else None
        self.cross_attn = attn_layer(dim, n_head, bias=bias) if cross_attention else None
        self.norm2 = norm_layer(dim)
        self.mlp = mlp_layer(dim, mlp_dim, act_layer=act_layer, bias=bias)
        self.drop = Dropout(dropout)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def _residual(self, x: Tensor, norm: nn.Module, f: Callable, *args: Any, **kwargs: Any) -> tuple:
        """x plus the branch ``f`` (returning an output and its weights), and those weights."""
        y, weights = f(norm(x) if self.norm_first else x, *args, **kwargs)
        y = x + self.drop_path(self.drop(y))
        return (y if self.norm_first else norm(y)), weights

    def forward(
        self,
        x: Tensor,
        *,
        attn_mask: Tensor | None = None,
        padding_mask: Tensor | None = None,
        causal: bool = False,
        cache: KVCache | None = None,
        memory: Tensor | None = None,
        memory_padding_mask: Tensor | None = None,
        cross_cache: KVCache | None = None,
        need_weights: bool = False,
        positions: RelativePositions | None = None,
    ) -> tuple[Tensor, AttentionWeights]:
        """x (B, T, C) -> (B, T, C), and the attention weights when ``need_weights``; ``memory``
        (B, S, C), or its projection ``cross_cache``, feeds the cross-attention."""
        x, self_weights = self._residual(
            x,
            self.norm1,
            self.attn,
            attn_mask=attn_mask,
            key_padding_mask=padding_mask,
            causal=causal,
            cache=cache,
            need_weights=need_weights,
            positions=positions,
        )
        cross_weights = None
        if self.cross_attn is not None:
            x, cross_weights = self._residual(
                x,
                self.norm_cross,
                self.cross_attn,
                memory,
                key_padding_mask=memory_padding_mask,
                cache=cross_cache,
                need_weights=need_weights,
            )
        x, _ = self._residual(x, self.norm2, lambda h: (self.mlp(h), None))
        return x, AttentionWeights(self_weights, cross_weights)
