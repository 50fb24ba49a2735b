"""Attention health: while ``recording(net)``, each attention module in ``net`` records the weights of
its batch's first rows through the math path, beside its kernel (the outputs do not change); per layer
and head: ``entropy`` (nats), ``distance`` (query to keys), ``first_token`` (sinks), ``max_weight``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

METRICS = ("entropy", "distance", "first_token", "max_weight")


@dataclass
class AttentionRecord:
    """One call's weights (B, H, T_q, T_k) with its queries' and keys' positions (T, d); a layer is
    its module's dotted name in the net (``blocks.0.attn``)."""

    layer: str
    weights: Tensor
    q_pos: Tensor
    k_pos: Tensor


@dataclass
class _Recording:
    names: dict[nn.Module, str]
    rows: int
    records: list[AttentionRecord]


_active: _Recording | None = None


def is_recording() -> bool:
    return _active is not None


def rows() -> int:
    return _active.rows if _active is not None else 0


@contextmanager
def recording(net: nn.Module, rows: int = 8) -> Iterator[list[AttentionRecord]]:
    """Record the attention of the first ``rows`` rows of every batch that goes through ``net``."""
    global _active
    # a layer's name as its module's in net (torch.compile's wrapper left out)
    names = {m: n.replace("_orig_mod.", "") or type(m).__name__ for n, m in net.named_modules()}
    _active = _Recording(names, rows, [])
    try:
        yield _active.records
    finally:
        _active = None


def give_positions(module: nn.Module, q_pos: Tensor, k_pos: Tensor | None = None) -> None:
    """Where the queries and keys of every attention inside ``module`` lie: (T, d) coordinates,
    NaN where a token has none (``k_pos`` defaults to ``q_pos``). They replace the token indices
    an attention module records (a ViT gives its patches' centres in pixels)."""
    for m in module.modules():
        m.health_positions = (q_pos, q_pos if k_pos is None else k_pos)


def record(
    module: nn.Module, weights: Tensor, q_pos: Tensor | None = None, k_pos: Tensor | None = None
) -> None:
    """Keep ``weights`` (B, H, T_q, T_k; B <= rows) of ``module`` if it is part of the recorded net;
    positions (T,) or (T, d) default to the token indices."""
    name = _active.names.get(module) if _active is not None else None
    if name is None:
        return
    q_pos, k_pos = getattr(module, "health_positions", (q_pos, k_pos))
    t_q, t_k = weights.shape[-2:]
    q_pos, k_pos = (
        (torch.arange(t) if p is None else p).reshape(t, -1).to(weights.device, torch.float32)
        for p, t in ((q_pos, t_q), (k_pos, t_k))
    )
    _active.records.append(AttentionRecord(name, weights.detach().float(), q_pos, k_pos))


def _sums(r: AttentionRecord) -> dict[str, tuple[Tensor, Tensor]]:
    """Per head (H,): each metric's sum over the record's query rows, and how many rows: a query row
    of NaN weights (padding) is left out; of ``distance`` a query at a NaN position (a class token, a
    latent) too, and keys at one from each row's mean."""
    w = r.weights
    ok = ~w.isnan().any(-1)  # (B, H, T_q)
    w = w.nan_to_num(0.0)
    dist = (r.q_pos[:, None] - r.k_pos[None]).norm(dim=-1)  # (T_q, T_k), NaN where no position
    placed = dist.isfinite()
    mass = (w * placed).sum(-1)
    row_dist = (w * dist.nan_to_num(0.0)).sum(-1) / mass.clamp_min(1e-12)
    placed_q = ok & (mass > 0) & r.q_pos.isfinite().all(-1)
    values = {
        "entropy": (-torch.special.xlogy(w, w).sum(-1), ok),
        "distance": (row_dist, placed_q),
        "first_token": (w[..., 0], ok),
        "max_weight": (w.amax(-1), ok),
    }
    return {k: ((v * m).sum((0, 2)), m.sum((0, 2))) for k, (v, m) in values.items()}


def per_head(records: list[AttentionRecord]) -> dict[str, dict[str, Tensor]]:
    """``{metric: {layer: (H,) values}}``, a layer's calls pooled row by row; a mean over the queries
    of the recorded rows, NaN for a head with no row that counts."""
    totals: dict[str, dict[str, list[Tensor]]] = {k: {} for k in METRICS}
    for r in records:
        for k, (s, n) in _sums(r).items():
            acc = totals[k].setdefault(r.layer, [torch.zeros_like(s), torch.zeros_like(n)])
            acc[0], acc[1] = acc[0] + s, acc[1] + n
    return {k: {layer: (s / n).cpu() for layer, (s, n) in layers.items()} for k, layers in totals.items()}


def flat(values: dict[str, dict[str, Tensor]]) -> dict[str, float]:
    """``per_head``'s values as logged: ``attn/<metric>/<layer>/h<head>``, ``attn/<metric>/<layer>``
    (mean over heads) and ``attn/<metric>`` (mean over every layer's heads); NaN values left out."""
    out: dict[str, float] = {}
    for metric, layers in values.items():
        every = []
        for layer, heads in layers.items():
            for h, v in enumerate(heads.tolist()):
                if v == v:  # not NaN
                    out[f"attn/{metric}/{layer}/h{h}"] = v
            if heads.isfinite().any():
                out[f"attn/{metric}/{layer}"] = heads[heads.isfinite()].mean().item()
                every.append(heads[heads.isfinite()])
        if every:
            out[f"attn/{metric}"] = torch.cat(every).mean().item()
    return out
