"""Causal attention with ALiBi's or T5's bias on a CPU's flash kernel, in pieces merged by their
log-sum-exps (as split-KV attention), each piece's backward the kernel's own: its bias as an (H, T, T)
float mask would be read in full and kept for the backward, many times full attention's cost."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import groupby

import torch
from torch import Tensor

from attnlab.nn.positions import ALiBi, RelativePositions, T5RelativeBias, t5_bucket

BLOCK = 256  # queries per block

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


@dataclass
class Piece:
    """Queries ``q0:q1`` over keys ``k0:k1``; the scores get ``mask`` (broadcast to (B, H, Q, K)),
    or ``offsets``' bias, an (H, Q + K - 1) vector over the offsets ``j - i`` (``-inf`` past the
    query), ``row`` (H, Q) and ``const`` (H,); ``causal``: top-left aligned. ``mask``, ``offsets`` and
    ``const`` index the tensors given to the Function: the last two may need gradients (T5's)."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool = False
    mask: int | None = None
    offsets: int | None = None
    row: Tensor | None = None
    const: int | None = None

    def relative(self, device: torch.device) -> Tensor:
        """(Q, K) index of each pair's offset into ``offsets``' vector, past its end (the ``-inf``
        appended there) for a key after the query."""
        return _toeplitz(self.q1 - self.q0, self.k1 - self.k0, self.q0 - self.k0, device)

    def dense_mask(self, tensors: tuple[Tensor, ...]) -> Tensor | None:
        if self.offsets is None:
            return tensors[self.mask] if self.mask is not None else None
        vector = tensors[self.offsets]
        vector = torch.cat([vector, vector.new_full((vector.size(0), 1), float("-inf"))], dim=1)
        return vector[:, self.relative(vector.device)][None]  # (1, H, Q, K)


@lru_cache(maxsize=8)
def _toeplitz(n_q: int, n_k: int, start: int, device: torch.device) -> Tensor:
    relative = torch.arange(n_k, device=device)[None, :] - torch.arange(n_q, device=device)[:, None] - start
    size = n_q + n_k - 1
    return torch.where(relative > 0, size, relative + n_q - 1 + start)


def pieces_apply(
    q: Tensor, k: Tensor, mask: Tensor | None, causal: bool, positions: RelativePositions, dropout: float
) -> bool:
    """Whether a call goes in pieces: a causal ALiBi or T5 bias over a whole sequence (no cache)
    longer than a block on a CPU, and nothing else."""
    alibi = isinstance(positions, ALiBi) and not positions.symmetric
    t5 = isinstance(positions, T5RelativeBias) and positions.causal
    whole = q.size(-2) == k.size(-2) > BLOCK
    return q.device.type == "cpu" and whole and causal and mask is None and dropout == 0 and (alibi or t5)


def t5_reach(positions: T5RelativeBias) -> int:
    """The distance from which T5's bucket (so its bias) no longer changes."""
    distance = torch.arange(4 * positions.max_distance)
    bucket = t5_bucket(-distance, False, positions.num_buckets, positions.max_distance)
    return int((bucket < bucket[-1]).sum())


def plan(positions: RelativePositions, t: int, device: torch.device) -> tuple[list[Piece], list[Tensor]]:
    """The pieces of causal attention over ``t`` positions, and the tensors they index. Each block
    of queries attends the near keys (the diagonal block; for T5 those within its reach) with their
    bias as a small dense mask, the far ones with a per-key mask and a per-query term (ALiBi's
    ``slope * (j - i)``) or T5's far constant alone; positions from the block's middle keep the
    added terms small."""
    pieces, tensors = [], []
    reach = t5_reach(positions) if isinstance(positions, T5RelativeBias) else 0
    if isinstance(positions, T5RelativeBias):
        tensors.append(positions.bias(torch.tensor([-reach], device=device))[:, 0])  # (H,): the far constant
    for q0 in range(0, t, BLOCK):
        q1 = min(t, q0 + BLOCK)
        q_rel = torch.arange(q1 - q0, device=device)
        near = max(0, q0 - reach)
        if isinstance(positions, ALiBi):  # slope * (j - i): a per-key mask, a per-query term
            slopes = positions.slopes[:, None]  # (H, 1)
            middle = (q1 - q0) // 2
            q_rel = q_rel - middle
            for k0, k1, causal in ((0, q0, False), (q0, q1, True)):  # the far keys, the diagonal block
                if k1 > k0:
                    k_rel = torch.arange(k0 - q0, k1 - q0, device=device) - middle
                    tensors.append((slopes * k_rel)[None, :, None, :])  # (1, H, 1, K)
                    pieces.append(Piece(q0, q1, k0, k1, causal, mask=len(tensors) - 1, row=-slopes * q_rel))
            continue
        if near:  # T5: keys farther than its reach from every query here: the constant alone
            pieces.append(Piece(q0, q1, 0, near, const=0))
        offsets = torch.arange(near - (q1 - 1), q1 - q0, device=device)  # j - i, smallest first
        tensors.append(positions.bias(offsets))  # (H, Q + K - 1)
        pieces.append(Piece(q0, q1, near, q1, offsets=len(tensors) - 1))
    return pieces, tensors


def _scores_shift(piece: Piece, tensors: tuple[Tensor, ...]) -> Tensor | None:
    """What the piece adds to every score of a row beyond its mask: (H, Q) or None (``plan`` sets
    ``row`` or ``const``, never both)."""
    return tensors[piece.const][:, None] if piece.const is not None else piece.row


class FlashPieces(torch.autograd.Function):
    """Attention of (B, H, T, D) ``q``, ``k``, ``v`` as ``pieces`` through the CPU flash kernel."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, pieces: list[Piece], *tensors: Tensor) -> Tensor:
        out, lse = torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)
        kept = {}  # piece -> (output, lse) where a constant needs its gradient
        for q0, block in groupby(pieces, key=lambda p: p.q0):  # planned block by block
            q1 = q0 + min(BLOCK, q.size(-2) - q0)
            outs, lses = [], []
            for p in block:
                mask = p.dense_mask(tensors)
                o, l = _flash(
                    q[:, :, q0:q1], k[:, :, p.k0 : p.k1], v[:, :, p.k0 : p.k1], 0.0, p.causal, attn_mask=mask
                )
                shift = _scores_shift(p, tensors)
                if shift is not None:
                    l = l + shift  # (B, H, Q)
                outs.append(o)
                lses.append(l)
                if p.const is not None and tensors[p.const].requires_grad:
                    kept[id(p)] = (o, l)
            total = torch.logsumexp(torch.stack(lses), dim=0)  # (B, H, Q)
            merged = sum((l - total).exp()[..., None] * o.float() for o, l in zip(outs, lses, strict=True))
            out[:, :, q0:q1] = merged.to(q.dtype)
            lse[:, :, q0:q1] = total
        ctx.pieces, ctx.kept = pieces, kept
        ctx.save_for_backward(q, k, v, out, lse, *tensors)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, out, lse, *tensors = ctx.saved_tensors
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dtensors = [torch.zeros_like(t) if t.requires_grad else None for t in tensors]
        grad_out = grad_out.contiguous()
        # rowsum(dO * O), once for all pieces: only the bias gradients formed here need it
        delta = (grad_out.float() * out.float()).sum(-1) if any(d is not None for d in dtensors) else None
        for p in ctx.pieces:
            qs, ks = slice(p.q0, p.q1), slice(p.k0, p.k1)
            mask = p.dense_mask(tensors)
            shift = _scores_shift(p, tensors)
            piece_lse = lse[:, :, qs] if shift is None else lse[:, :, qs] - shift  # the kernel's share
            g, o = grad_out[:, :, qs], out[:, :, qs]
            args = (g, q[:, :, qs], k[:, :, ks], v[:, :, ks], o, piece_lse.contiguous(), 0.0, p.causal)
            gq, gk, gv = _flash_backward(*args, attn_mask=mask)
            dq[:, :, qs] += gq
            dk[:, :, ks] += gk
            dv[:, :, ks] += gv
            if p.offsets is not None and dtensors[p.offsets] is not None:  # its scores again
                scale = q.size(-1) ** -0.5
                s = (q[:, :, qs].float() @ k[:, :, ks].float().transpose(-1, -2)) * scale + mask
                prob = (s - piece_lse[..., None]).exp()  # (B, H, Q, K)
                dp = g.float() @ v[:, :, ks].float().transpose(-1, -2)
                ds = (prob * (dp - delta[:, :, qs, None])).sum(0)  # (H, Q, K)
                grad = torch.zeros(ds.size(0), dtensors[p.offsets].size(1) + 1, device=ds.device)
                grad.index_add_(1, p.relative(q.device).flatten(), ds.flatten(1))
                dtensors[p.offsets] += grad[:, :-1]  # the appended -inf has none
            if id(p) in ctx.kept:  # a constant's gradient: sum_i w_i (dO_i . o_i - delta_i)
                o_piece, l_piece = ctx.kept[id(p)]
                weight = (l_piece - lse[:, :, qs]).exp()
                share = weight * ((g.float() * o_piece.float()).sum(-1) - delta[:, :, qs])
                dtensors[p.const] += share.sum(dim=(0, 2))
        return dq, dk, dv, None, *dtensors


def flash_pieces(q: Tensor, k: Tensor, v: Tensor, positions: RelativePositions) -> Tensor:
    """Causal attention of (B, H, T, D) tensors with ``positions``' bias (see the module docstring)."""
    pieces, tensors = plan(positions, q.size(-2), q.device)
    return FlashPieces.apply(q, k, v, pieces, *tensors)
