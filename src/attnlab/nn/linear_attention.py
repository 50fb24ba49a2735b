"""Causal linear attention (Katharopoulos et al. 2020): key j weighs for query i by phi(q_i) . phi(k_j)
of a positive feature map (elu + 1, or Based's Taylor features of exp), so y_i = phi(q_i) S_i /
phi(q_i) . z_i needs only running sums S_i = sum_j<=i phi(k_j) v_j^T, z_i = sum_j<=i phi(k_j)."""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from attnlab.nn import health
from attnlab.nn.attention import MultiHeadAttention
from attnlab.nn.positions import RelativePositions

State = tuple[Tensor, Tensor]  # S (B, H, D, E), z (B, H, D)
CHUNK = 64  # the chunk length training computes in


def elu_feature_map(x: Tensor) -> Tensor:
    return F.elu(x) + 1


def taylor_feature_map(x: Tensor) -> Tensor:
    """Features (..., 1 + d + d(d+1)/2) with phi(q) . phi(k) = 1 + s + s^2 / 2, s = q . k / sqrt(d):
    exp(s) to second order (no real root: every weight > 0); s^2 / 2 as each pair i <= j once, the
    squares weighted by sqrt(1/2)."""
    d = x.size(-1)
    x = x * d**-0.25  # so that the scaled pair's product is q . k / sqrt(d)
    i, j = torch.triu_indices(d, d, device=x.device)
    pairs = x[..., i] * x[..., j] * torch.where(i == j, 0.5**0.5, 1.0).to(x.dtype)
    return torch.cat([torch.ones_like(x[..., :1]), x, pairs], dim=-1)


FeatureMap = Literal["elu", "taylor"]
FEATURE_MAPS = {"elu": elu_feature_map, "taylor": taylor_feature_map}


def causal_linear_attention(
    q: Tensor, k: Tensor, v: Tensor, state: State | None = None, chunk: int = CHUNK, eps: float = 1e-6
) -> tuple[Tensor, State]:
    """Features ``q``, ``k`` (B, H, T, D) over values (B, H, T, E), continuing from ``state`` (zeros
    when None): the outputs (B, H, T, E) and the state after the last position. In chunks: the
    quadratic form inside each, the state of the chunks before (a prefix sum) for the rest."""
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
    before = [torch.cat([torch.zeros_like(x[:, :, :1]), x.cumsum(2)[:, :, :-1]], dim=2) for x in (kv, ksum)]
    s_before, z_before = s0[:, :, None] + before[0], z0[:, :, None] + before[1]
    scores = (qc @ kc.transpose(-1, -2)).tril()  # (B, H, n, c, c): inside the chunk, causal
    num = scores @ vc + qc @ s_before  # (B, H, n, c, E)
    den = scores.sum(-1) + (qc * z_before[..., None, :]).sum(-1)  # (B, H, n, c)
    y = num / (den[..., None] + eps)
    new_state = (s_before[:, :, -1] + kv[:, :, -1], z_before[:, :, -1] + ksum[:, :, -1])
    return y.reshape(b, h, n * chunk, e)[:, :, :t].to(dtype), new_state


class LinearAttentionState:
    """One layer's recurrent state across decoding steps (its "KV cache"), and its positions seen."""

    def __init__(self) -> None:
        self.state: State | None = None
        self.seen = 0

    def reorder(self, index: Tensor) -> None:
        if self.state is not None:
            self.state = (self.state[0][index], self.state[1][index])


class LinearAttention(MultiHeadAttention):
    """Causal multi-head linear attention with ``MultiHeadAttention``'s projections. ``feature_map``
    "taylor" is closer to softmax, dearer per token; ``dropout`` is unused (no weights to drop). RoPE
    turns q and k before the feature map (relative with Taylor's, not purely with elu + 1's); a bias
    (ALiBi, T5) has no score matrix to go to."""

    def __init__(self, dim: int, n_head: int, *args, feature_map: FeatureMap = "elu", **kwargs) -> None:
        super().__init__(dim, n_head, *args, **kwargs)
        self.feature_map = FEATURE_MAPS[feature_map]

    def new_cache(self) -> LinearAttentionState:
        return LinearAttentionState()

    def kernel_weights(self, q: Tensor, k: Tensor) -> Tensor:
        """The (B, H, T, T) weights it implies: phi(q) phi(k)^T, causal, each row normalised."""
        att = (self.feature_map(q) @ self.feature_map(k).transpose(-1, -2)).tril()
        return att / att.sum(-1, keepdim=True)

    def attend_features(
        self, q: Tensor, k: Tensor, v: Tensor, state: State | None = None
    ) -> tuple[Tensor, State]:
        return causal_linear_attention(self.feature_map(q), self.feature_map(k), v, state)

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        *,
        causal: bool = False,
        cache: LinearAttentionState | None = None,
        need_weights: bool = False,
        positions: RelativePositions | None = None,
        **unset: Any,
    ) -> tuple[Tensor, Tensor | None]:
        """Causal self-attention; a ``TransformerBlock``'s masks must be unset."""
        if memory is not None or self._any_set(unset) or not causal:
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
