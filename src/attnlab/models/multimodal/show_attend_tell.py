"""Show, Attend and Tell (Xu et al. 2015): an LSTM writes the caption one word at a time, before
each attending over the S = h * w feature vectors a_1..a_S of the image (a CNN's map or ViT tokens):

    alpha_t = softmax(v^T tanh(W h_{t-1} + U a_s))          additive (Bahdanau) attention, (S,)
    z_t     = sigmoid(f_beta(h_{t-1})) * sum_s alpha_ts a_s   the gated context
    h_t     = LSTM([E y_{t-1}; z_t], h_{t-1})
    p(y_t)  = softmax(L_o(E y_{t-1} + L_h h_t + L_z z_t))     the deep output layer

with h_0, c_0 from the mean feature.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from attnlab.core.specs import DropRate, PositiveInt
from attnlab.models.vision.vit import VisionTransformer
from attnlab.nn import Dropout, flops, health
from attnlab.nn.embedding import conv_bn_relu
from attnlab.nn.flops import Flops
from attnlab.nn.rnn_attention import AdditiveAttention

State = dict[str, Tensor]


class ConvEncoder(nn.Module):
    """``depth`` stages of two 3x3 conv-BN-ReLU layers (the first of stride 2), widths doubling up
    to ``dim``, and a learned embedding of each position, as ViT's: a context vector then says
    where the decoder looked, not only what it saw. (B, C, H, W) -> (B, S, dim)."""

    def __init__(self, img_size: int, in_chans: int, dim: int, depth: int) -> None:
        super().__init__()
        widths = [max(1, dim // 2 ** (depth - 1 - i)) for i in range(depth)]
        stages, chans = [], in_chans
        for width in widths:
            stages += [conv_bn_relu(chans, width, stride=2), conv_bn_relu(width, width)]
            chans = width
        self.stages = nn.Sequential(*stages)
        side = -(-img_size // 2**depth)  # each 3x3 convolution of stride 2 and padding 1: ceil(side / 2)
        self.grid = (side, side)
        self.pos_embed = nn.Parameter(torch.zeros(1, side * side, dim))
        nn.init.trunc_normal_(self.pos_embed, std=0.02)

    def forward(self, images: Tensor) -> Tensor:
        x = self.stages(images.contiguous(memory_format=torch.channels_last))  # (B, D, h, w)
        return x.flatten(2).transpose(1, 2) + self.pos_embed  # (B, h * w, D), row-major

    def flops(self, images: Tensor) -> Flops:
        return flops.convs(self.stages, images.size(0), images.size(-1))[0]


class ViTEncoder(nn.Module):
    """Our ViT, headless: its patch tokens after the last block (the [CLS] token left out)."""

    def __init__(self, img_size: int, in_chans: int, dim: int, depth: int, patch_size: int, n_head: int):
        super().__init__()
        self.vit = VisionTransformer(
            0, img_size, in_chans, patch_size=patch_size, dim=dim, depth=depth, n_head=n_head, stem="conv"
        )
        side = self.vit.patch_embed.grid_size
        self.grid = (side, side)

    def forward(self, images: Tensor) -> Tensor:
        return self.vit.forward_features(images)[:, self.vit.num_prefix_tokens :]  # (B, S, D)

    def flops(self, images: Tensor) -> Flops:
        return self.vit.flops(images, head=False)


class ShowAttendTell(nn.Module):
    """An image captioner: a CNN or ViT feature map (``patch_size`` and ``n_head`` are the ViT's),
    an LSTM decoder with additive attention over it, the output layer tied to the embedding."""

    def __init__(
        self,
        vocab_size: PositiveInt,
        img_size: PositiveInt,
        in_chans: PositiveInt,
        pad_id: int = 0,
        encoder: Literal["cnn", "vit"] = "cnn",
        enc_dim: PositiveInt = 128,
        enc_depth: PositiveInt = 3,
        patch_size: PositiveInt = 8,
        n_head: PositiveInt = 4,
        dim: PositiveInt = 128,
        hidden: PositiveInt = 256,
        attn_dim: PositiveInt = 128,
        dropout: DropRate = 0.2,
    ) -> None:
        super().__init__()
        if encoder == "vit" and enc_dim % n_head:
            raise ValueError(f"enc_dim: must be divisible by n_head ({n_head}), got {enc_dim}")
        self.vocab_size, self.pad_id = vocab_size, pad_id
        if encoder == "cnn":
            self.encoder: nn.Module = ConvEncoder(img_size, in_chans, enc_dim, enc_depth)
        else:
            self.encoder = ViTEncoder(img_size, in_chans, enc_dim, enc_depth, patch_size, n_head)
        self.grid: tuple[int, int] = self.encoder.grid
        self.init_h, self.init_c = nn.Linear(enc_dim, hidden), nn.Linear(enc_dim, hidden)
        self.attn = AdditiveAttention(hidden, enc_dim, attn_dim)
        self.f_beta = nn.Linear(hidden, enc_dim)  # the gate on the context
        self.embed = nn.Embedding(vocab_size, dim, padding_idx=pad_id)
        self.cell = nn.LSTMCell(dim + enc_dim, hidden)
        self.out_h, self.out_z = nn.Linear(hidden, dim), nn.Linear(enc_dim, dim, bias=False)
        self.drop = Dropout(dropout)
        self.out = nn.Linear(dim, vocab_size)
        nn.init.normal_(self.embed.weight, std=dim**-0.5)  # small: tied logits start near uniform
        self.embed.weight.data[pad_id] = 0.0
        self.out.weight = self.embed.weight

    # -- the ``Captioner`` contract (``attnlab.models.contracts``) ---------------------------------
    def start(self, images: Tensor) -> State:
        """Encode (B, C, H, W) images once: features (B, S, D), attention keys, the first state."""
        feats = self.encoder(images)  # (B, S, D)
        mean = feats.mean(1)
        h, c = torch.tanh(self.init_h(mean)), torch.tanh(self.init_c(mean))
        pad = torch.zeros(feats.shape[:2], dtype=torch.bool, device=feats.device)  # every position counts
        return {"feats": feats, "keys": self.attn.prepare(feats), "pad": pad, "h": h, "c": c}

    def step(self, tokens: Tensor, state: State) -> tuple[Tensor, State]:
        """The next word's logits (B, V) after ``tokens`` (B,) and a new state, whose ``attn`` is
        the attention (B, S) that chose it."""
        out, state = self._step(self.drop(self.embed(tokens)), state)
        return self.out(self.drop(out)), state

    def reorder(self, state: State, index: Tensor) -> State:
        return {k: v[index] for k, v in state.items()}

    def forward(self, images: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Teacher forcing over ``tokens`` (B, T) from BOS: logits (B, T, V) and attention (B, T, S)."""
        state = self.start(images)
        emb = self.drop(self.embed(tokens))  # (B, T, E)
        outs, attns = [], []
        for t in range(tokens.size(1)):
            out, state = self._step(emb[:, t], state)
            outs.append(out)
            attns.append(state["attn"])
        attn = torch.stack(attns, 1)  # (B, T, S)
        if health.is_recording():  # the words as the queries of one record; a word has no place
            n = health.rows()
            nowhere = torch.full((tokens.size(1), 1), float("nan"))
            padding = (tokens[:n] == self.pad_id)[:, None, :, None]
            health.record(self.attn, attn[:n, None].masked_fill(padding, float("nan")), q_pos=nowhere)
        # the output layer once over every step: one large matmul instead of T small ones
        return self.out(self.drop(torch.stack(outs, 1))), attn

    def flops(self, images: Tensor, tokens: Tensor) -> Flops:
        """Model FLOPs of a training step on ``images`` and captions (B, T) (``attnlab.nn.flops``)."""
        b, t = tokens.shape
        s = self.grid[0] * self.grid[1]
        attn, cell = self.attn, self.cell
        start = self.encoder.flops(images) + flops.linear_layer(attn.key_proj, b * s)
        start = start + flops.linear_layer(self.init_h, b) + flops.linear_layer(self.init_c, b)
        word = flops.linear_layer(attn.query_proj, b) + flops.linear_layer(attn.v, b * s)
        word = word + flops.product(b, 1, s, attn.key_proj.in_features) + flops.linear_layer(self.f_beta, b)
        word = word + flops.linear(b, cell.input_size, 4 * cell.hidden_size)
        word = word + flops.linear(b, cell.hidden_size, 4 * cell.hidden_size)
        word = word + flops.linear_layer(self.out_h, b) + flops.linear_layer(self.out_z, b)
        return start + word * t + flops.linear_layer(self.out, b * t)

    def _step(self, e: Tensor, state: State) -> tuple[Tensor, State]:
        """One word's input embedding (B, E) -> the deep output (B, E) and the state, its ``attn`` (B, S)."""
        h = state["h"]
        context, alpha = self.attn(h, state["feats"], state["pad"], state["keys"])  # (B, D), (B, S)
        z = torch.sigmoid(self.f_beta(h)) * context
        h, c = self.cell(torch.cat([e, z], -1), (h, state["c"]))
        out = e + self.out_h(h) + self.out_z(z)
        return out, {**state, "h": h, "c": c, "attn": alpha}

    def extra_repr(self) -> str:
        return f"grid={self.grid}"
