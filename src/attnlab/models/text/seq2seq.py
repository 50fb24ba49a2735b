"""RNN encoder-decoder with attention (Bahdanau et al. 2015; Luong et al. 2015). Additive
(Bahdanau): attend with the previous decoder state, feed the context into the RNN, read out from
[state; context; input embedding]. General or dot (Luong): step the RNN first, attend with the new
state, read out tanh(W [state; context]) and feed that to the next step's input."""

from __future__ import annotations

import random
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from attnlab.core.specs import DropRate, PositiveInt, Probability
from attnlab.nn import flops, health
from attnlab.nn.dropout import Dropout
from attnlab.nn.flops import Flops
from attnlab.nn.rnn_attention import AdditiveAttention, MultiplicativeAttention


class Encoder(nn.Module):
    """Bidirectional RNN over the source; returns all states (B, S, 2E) and the final ones."""

    def __init__(self, emb: nn.Embedding, rnn: str, hidden: int, n_layers: int, dropout: float) -> None:
        super().__init__()
        self.emb, self.drop = emb, Dropout(dropout)
        rnn_cls = nn.GRU if rnn == "gru" else nn.LSTM
        between = dropout if n_layers > 1 else 0.0  # torch's RNNs drop only between layers
        self.rnn = rnn_cls(
            emb.embedding_dim, hidden, n_layers, batch_first=True, bidirectional=True, dropout=between
        )

    def forward(self, src: Tensor, pad: Tensor) -> tuple[Tensor, Tensor]:
        lengths = (~pad).sum(1).cpu()
        # packed, so the backward direction starts at each sentence's last real token
        x = self.drop(self.emb(src))
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, h = self.rnn(packed)
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=src.size(1))
        h = h[0] if isinstance(h, tuple) else h  # LSTM: (h, c)
        final = torch.cat([h[-2], h[-1]], dim=-1)  # top layer, forward and backward (B, 2E)
        return out, final


class Seq2Seq(nn.Module):
    """Attention-based RNN translation model over a joint vocabulary. ``dim``: the embeddings' and
    the read-out's width; ``enc_hidden``: per direction; ``teacher_forcing``: the probability of
    feeding the true previous token in training (else the model's own greedy guess)."""

    def __init__(
        self,
        vocab_size: PositiveInt,
        pad_id: int = 0,
        attention: Literal["additive", "general", "dot"] = "additive",
        rnn: Literal["gru", "lstm"] = "gru",
        dim: PositiveInt = 256,
        enc_hidden: PositiveInt = 512,
        dec_hidden: PositiveInt = 512,
        attn_dim: PositiveInt = 512,
        enc_depth: PositiveInt = 1,
        dropout: DropRate = 0.3,
        teacher_forcing: Probability = 1.0,
        share_embeddings: bool = True,
    ) -> None:
        super().__init__()
        if attention == "dot" and dec_hidden != 2 * enc_hidden:
            raise ValueError(
                f"dec_hidden: dot attention needs the encoder's output size 2 * enc_hidden "
                f"({2 * enc_hidden}), got {dec_hidden}; use general attention or change the sizes"
            )
        self.pad_id, self.rnn_type, self.teacher_forcing = pad_id, rnn, teacher_forcing
        self.src_emb = nn.Embedding(vocab_size, dim, padding_idx=pad_id)
        self.tgt_emb = self.src_emb if share_embeddings else nn.Embedding(vocab_size, dim, padding_idx=pad_id)
        self.encoder = Encoder(self.src_emb, rnn, enc_hidden, enc_depth, dropout)
        ctx = 2 * enc_hidden
        self.bridge = nn.Linear(ctx, dec_hidden)  # final encoder states -> initial decoder state
        self.bahdanau = attention == "additive"
        if self.bahdanau:
            self.attn: nn.Module = AdditiveAttention(dec_hidden, ctx, attn_dim)
            cell_in, readout_in = dim + ctx, dec_hidden + ctx + dim
        else:
            self.attn = MultiplicativeAttention(dec_hidden, ctx, attention)
            cell_in, readout_in = dim + dim, dec_hidden + ctx
        self.cell = nn.GRUCell(cell_in, dec_hidden) if rnn == "gru" else nn.LSTMCell(cell_in, dec_hidden)
        self.readout = nn.Linear(readout_in, dim)
        self.drop = Dropout(dropout)
        self.out = nn.Linear(dim, vocab_size, bias=False)
        for emb in {self.src_emb, self.tgt_emb}:  # small, so tied output logits start near uniform
            nn.init.normal_(emb.weight, std=dim**-0.5)
        if share_embeddings:
            self.out.weight = self.tgt_emb.weight

    # -- decoding (the ``Decoder`` contract; also what training runs) ---------------------------
    def start(self, src: Tensor) -> dict[str, Any]:
        pad = src == self.pad_id
        memory, final = self.encoder(src, pad)
        h = torch.tanh(self.bridge(final))
        state = {"memory": memory, "pad": pad, "keys": self.attn.prepare(memory), "h": h}
        if self.rnn_type == "lstm":
            state["c"] = torch.zeros_like(h)
        if not self.bahdanau:
            state["feed"] = h.new_zeros(h.size(0), self.readout.out_features)
        return state

    def _cell(self, x: Tensor, state: dict[str, Any]) -> Tensor:
        if self.rnn_type == "lstm":
            state["h"], state["c"] = self.cell(x, (state["h"], state["c"]))
        else:
            state["h"] = self.cell(x, state["h"])
        return state["h"]

    def _step(self, e: Tensor, state: dict[str, Any]) -> Tensor:
        """One output step from the input embedding (B, E); returns the read-out (B, E)."""
        attend = lambda q: self.attn(q, state["memory"], state["pad"], state["keys"])  # noqa: E731
        if self.bahdanau:
            ctx, state["weights"] = attend(state["h"])
            h = self._cell(torch.cat([e, ctx], -1), state)
            out = torch.tanh(self.readout(torch.cat([h, ctx, e], -1)))
        else:
            h = self._cell(torch.cat([e, state["feed"]], -1), state)
            ctx, state["weights"] = attend(h)
            out = torch.tanh(self.readout(torch.cat([h, ctx], -1)))
            state["feed"] = out
        return out

    def step(self, tokens: Tensor, state: dict[str, Any]) -> tuple[Tensor, dict[str, Any]]:
        """Logits (B, V) after ``tokens`` (B,); ``state`` is updated in place, its ``weights`` the
        attention (B, S) of this step."""
        return self.out(self._step(self.tgt_emb(tokens), state)), state

    def reorder(self, state: dict[str, Any], index: Tensor) -> dict[str, Any]:
        return {key: value[index] for key, value in state.items()}

    # -- training ------------------------------------------------------------------------------
    def _run(self, src: Tensor, tgt_in: Tensor, need_weights: bool = False) -> tuple[Tensor, Tensor | None]:
        state = self.start(src)
        emb = self.drop(self.tgt_emb(tgt_in))  # (B, T, E)
        forced = not self.training or self.teacher_forcing >= 1.0
        keep = need_weights or health.is_recording()
        outs, weights, logits = [], [], []
        for t in range(tgt_in.size(1)):
            if t > 0 and not forced and random.random() >= self.teacher_forcing:
                e = self.drop(self.tgt_emb(logits[-1].argmax(-1)))  # the model's own guess
            else:
                e = emb[:, t]
            outs.append(self._step(e, state))
            if not forced:
                logits.append(self.out(self.drop(outs[-1])))
            if keep:
                weights.append(state["weights"])
        # with teacher forcing the output layer runs once over all steps: one big matmul
        y = self.out(self.drop(torch.stack(outs, 1))) if forced else torch.stack(logits, 1)
        if health.is_recording():  # the steps as the queries of one record, padding's left out
            n = health.rows()
            padding = (tgt_in[:n] == self.pad_id)[:, None, :, None]
            health.record(self.attn, torch.stack(weights, 1)[:n, None].masked_fill(padding, float("nan")))
        return y, torch.stack(weights, 1) if need_weights else None  # (B, T, V), (B, T, S)

    def forward(self, src: Tensor, tgt_in: Tensor, scored: Tensor | None = None) -> Tensor:
        """Logits (B, T, V), teacher-forced with probability ``teacher_forcing``; or (N, V) at
        the N positions where ``scored`` (B, T) is True."""
        if scored is None:
            return self._run(src, tgt_in)[0]
        t = int(scored.sum(1).max())  # no steps over trailing padding: each one is a loop iteration
        return self._run(src, tgt_in[:, :t])[0][scored[:, :t]]

    def flops(self, src: Tensor, tgt_in: Tensor, scored: Tensor | None = None) -> Flops:
        """Model FLOPs of a training step (``attnlab.nn.flops``): the encoder over the real source
        tokens, as many decoder steps as the longest scored target (counts stay on the device)."""
        (b, s), t = src.shape, tgt_in.size(1)
        if scored is not None:
            t = scored.sum(1).max()
        return self._encoder_flops(src) + self._step_flops(b, s) * t + flops.linear_layer(self.out, b * t)

    def _encoder_flops(self, src: Tensor) -> Flops:
        rnn = self.encoder.rnn
        b, s = src.shape
        tokens = (src != self.pad_id).sum()
        gates = rnn.weight_ih_l0.size(0)  # 3 H (GRU) or 4 H (LSTM)
        f = flops.NONE
        for layer in range(rnn.num_layers):
            d_in = rnn.input_size if layer == 0 else 2 * rnn.hidden_size
            f = f + 2 * (flops.linear(tokens, d_in, gates) + flops.linear(tokens, rnn.hidden_size, gates))
        f = f + flops.linear_layer(self.bridge, b)  # the decoder's first state
        if isinstance(self.attn.key_proj, nn.Linear):  # U h (Bahdanau) or W h (Luong) of each position
            f = f + flops.linear_layer(self.attn.key_proj, b * s)
        return f

    def _step_flops(self, b: int, s: int) -> Flops:
        """One output step of ``b`` sentences over ``s`` source positions."""
        cell = self.cell
        if self.bahdanau:  # v^T tanh(W s + U h) at every position
            scores = flops.linear_layer(self.attn.query_proj, b) + flops.linear_layer(self.attn.v, b * s)
        else:  # (W h) . s at every position
            scores = flops.product(b, s, cell.hidden_size, 1)
        context = flops.product(b, 1, s, 2 * self.encoder.rnn.hidden_size)
        recurrence = flops.linear(b, cell.input_size, cell.weight_ih.size(0))
        recurrence = recurrence + flops.linear(b, cell.hidden_size, cell.weight_hh.size(0))
        return scores + context + recurrence + flops.linear_layer(self.readout, b)

    def alignments(self, src: Tensor, tgt_in: Tensor) -> dict[str, Tensor]:
        """Attention weights (B, 1, T, S)."""
        return {"attention": self._run(src, tgt_in, need_weights=True)[1][:, None]}
