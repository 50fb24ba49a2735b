"""Causal linear attention (Katharopoulos et al. 2020, "Transformers are RNNs").

Softmax attention weighs key j for query i by exp(q_i . k_j / sqrt(d)); linear attention by a
kernel phi(q_i) . phi(k_j) of a positive feature map: elu(x) + 1 (Katharopoulos et al.), or the
second-order Taylor features of exp (Based, Arora et al. 2024), whose kernel 1 + s + s^2 / 2 of
s = q . k / sqrt(d) is softmax's own, cut after three terms. The output

    y_i = sum_{j<=i} phi(q_i) . phi(k_j) v_j  /  sum_{j<=i} phi(q_i) . phi(k_j)
        = phi(q_i) S_i / phi(q_i) . z_i,   S_i = sum_{j<=i} phi(k_j) v_j^T,  z_i = sum_{j<=i} phi(k_j)

needs only the running sums (S, z): a recurrent state of fixed size instead of a KV cache, and a
cost linear in the length. Training computes it in chunks: the quadratic form inside each chunk,
the state of the chunks before it for the rest (one prefix sum over chunk states).

There is no score matrix, so no bias can be added to it: ALiBi and T5 do not apply. RoPE turns q
and k before the feature map: with Taylor features the kernel is a function of q . k, so the
positions stay relative, as in softmax attention; elu + 1 features give each token its position,
not a purely relative one.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from attnlab.nn import health
from attnlab.nn.attention import MultiHeadAttention
from attnlab.nn.positions import RelativePositions

State = tuple[Tensor, Tensor]  # S (B, H, D, E), z (B, H, D)


def elu_feature_map(x: Tensor) -> Tensor:
    """phi(x) = elu(x) + 1 > 0."""
    return F.elu(x) + 1


def taylor_feature_map(x: Tensor) -> Tensor:
    """Features (..., 1 + d + d(d+1)/2) of (..., d) with phi(q) . phi(k) = 1 + s + s^2 / 2, s = q . k
    / sqrt(d): exp(s) to its second order, which has no real root, so every weight is > 0.
    s^2 / 2 = sum_i q_i^2 k_i^2 / 2 + sum_{i<j} q_i q_j k_i k_j: each pair i <= j once, the
    squares weighted by sqrt(1/2)."""
    d = x.size(-1)
    x = x * d**-0.25  # so that the scaled pair's product is q . k / sqrt(d)
    i, j = torch.triu_indices(d, d, device=x.device)
    pairs = x[..., i] * x[..., j] * torch.where(i == j, 0.5**0.5, 1.0).to(x.dtype)
    return torch.cat([torch.ones_like(x[..., :1]), x, pairs], dim=-1)


FeatureMap = Literal["elu", "taylor"]
FEATURE_MAPS = {"elu": elu_feature_map, "taylor": taylor_feature_map}


def causal_linear_attention(
    q: Tensor, k: Tensor, v: Tensor, state: State | None = None, chunk: int = 64, eps: float = 1e-6
) -> tuple[Tensor, State]:
    """Causal linear attention of features ``q``, ``k`` (B, H, T, D) (already phi'd) over values
    ``v`` (B, H, T, E), continuing from ``state`` (the sums of the keys before; zeros when None).
    Returns the outputs (B, H, T, E) and the state after the last position."""
    b, h, t, d = q.shape
    e = v.size(-1)
    dtype = v.dtype
    q, k, v = q.float(), k.float(), v.float()  # running sums in float32 under any autocast
    n = -(-t // chunk)
    pad = n * chunk - t  # zero features: padded keys add nothing
    qc, kc, vc = (F.pad(z, (0, 0, 0, pad)).view(b, h, n, chunk, -1) for z in (q, k, v))  # (B, H, n, c, .)
    kv = kc.transpose(-1, -2) @ vc  # (B, H, n, D, E): each chunk's sum of k v^T
    ksum = kc.sum(-2)  # (B, H, n, D)
    s0, z0 = state if state is not None else (q.new_zeros(b, h, d, e), q.new_zeros(b, h, d))
    # the state before each chunk: the start state plus the sums of the chunks before it
    s_before = s0[:, :, None] + torch.cat([torch.zeros_like(kv[:, :, :1]), kv.cumsum(2)[:, :, :-1]], dim=2)
    z_before = z0[:, :, None] + torch.cat(
        [torch.zeros_like(ksum[:, :, :1]), ksum.cumsum(2)[:, :, :-1]], dim=2
    )
    scores = (qc @ kc.transpose(-1, -2)).tril()  # (B, H, n, c, c): inside the chunk, causal
    num = scores @ vc + qc @ s_before  # (B, H, n, c, E)
    den = scores.sum(-1) + (qc * z_before[..., None, :]).sum(-1)  # (B, H, n, c)
    y = num / (den[..., None] + eps)
    new_state = (s_before[:, :, -1] + kv[:, :, -1], z_before[:, :, -1] + ksum[:, :, -1])
    return y.reshape(b, h, n * chunk, e)[:, :, :t].to(dtype), new_state


class LinearAttentionState:
    """The recurrent state of one linear-attention layer across decoding steps (its "KV cache"):
    S (B, H, D, E) and z (B, H, D), and how many positions went through it."""

    def __init__(self) -> None:
        self.state: State | None = None
        self.seen = 0

    def reorder(self, index: Tensor) -> None:
        """Keep the rows at ``index`` (beam search)."""
        if self.state is not None:
            self.state = (self.state[0][index], self.state[1][index])


class LinearAttention(MultiHeadAttention):
    """Causal multi-head linear attention with ``MultiHeadAttention``'s projections; decodes from a
    ``LinearAttentionState``. ``feature_map``: "elu" (elu + 1, d features per head) or "taylor"
    (1 + d + d(d+1)/2 features: closer to softmax, dearer per token). ``dropout`` is unused:
    there are no attention weights to drop."""

    def __init__(self, dim: int, n_head: int, *args, feature_map: FeatureMap = "elu", **kwargs) -> None:
        super().__init__(dim, n_head, *args, **kwargs)
        self.feature_map = FEATURE_MAPS[feature_map]

    def new_cache(self) -> LinearAttentionState:
        return LinearAttentionState()

    def kernel_weights(self, q: Tensor, k: Tensor) -> Tensor:
        """The (B, H, T, T) weights linear attention implies: phi(q) phi(k)^T, causal, each row
        normalised (the quadratic form the chunks compute)."""
        att = (self.feature_map(q) @ self.feature_map(k).transpose(-1, -2)).tril()
        return att / att.sum(-1, keepdim=True)

    def attend_features(
        self, q: Tensor, k: Tensor, v: Tensor, state: State | None = None
    ) -> tuple[Tensor, State]:
        """Causal linear attention of queries and keys through the feature map (B, H, T, E)."""
        return causal_linear_attention(self.feature_map(q), self.feature_map(k), v, state)

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        *,
        key_padding_mask: Tensor | None = None,
        attn_mask: Tensor | None = None,
        causal: bool = False,
        cache: LinearAttentionState | None = None,
        need_weights: bool = False,
        positions: RelativePositions | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """x (B, T, C) -> (B, T, C); with ``need_weights`` (no cache) also the (B, H, T, T) weights
        of the quadratic form, phi(q) phi(k)^T masked and normalised per row."""
        if memory is not None or key_padding_mask is not None or attn_mask is not None or not causal:
            raise ValueError("linear attention here is causal self-attention: no memory or masks")
        b, t, c = x.shape
        start = cache.seen if cache is not None else 0
        q, k, v = self._qkv(x, None, None, positions, start)  # RoPE applied
        k, v = self.repeat_kv(k, v)  # (B, H, T, D)
        if cache is None and torch.is_grad_enabled():
            # training: the features and chunk sums are recomputed in the backward pass, not
            # kept, so a layer holds less than full attention's fused kernel
            y, state = checkpoint(self.attend_features, q, k, v, use_reentrant=False)
        else:
            y, state = self.attend_features(q, k, v, cache.state if cache is not None else None)
        if cache is not None:
            cache.state, cache.seen = state, cache.seen + t
        weights = self.kernel_weights(q, k) if need_weights and cache is None else None
        if health.is_recording() and cache is None:
            n = health.rows()
            health.record(self, self.kernel_weights(q[:n].float(), k[:n].float()))
        return self.out_proj(y.transpose(1, 2).reshape(b, t, c)), weights
