"""A training step's "model FLOPs" by hand (PaLM appendix B; MFU divides them by the peak), by
``FlopCounterMode``'s conventions: a multiply-add is 2 FLOPs, only products and convolutions count,
attention counts its whole score matrix (also causal), recomputation is not counted."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from torch import Tensor, nn

from attnlab.nn.attention import MultiHeadAttention
from attnlab.nn.blocks import MLP, TransformerBlock
from attnlab.nn.linear_attention import CHUNK, LinearAttention, elu_feature_map
from attnlab.nn.local_attention import SlidingWindowAttention
from attnlab.nn.window_attention import WindowAttention

# What a part of a net sends backward: "all" (trained: an input and a weight gradient, 2x the
# forward), "input" (frozen, passing gradients to trained layers before it: 1x), "none" (no_grad: 0x)
Grad = Literal["all", "input", "none"]

Count = int | Tensor  # a count read from the data stays a tensor on its device: no host sync


@dataclass(slots=True)
class Flops:
    """The forward and backward FLOPs of a pass; they add up, and scale by a repeat count."""

    forward: Count = 0
    backward: Count = 0

    @property
    def total(self) -> Count:
        return self.forward + self.backward

    def __add__(self, other: Flops) -> Flops:
        return Flops(self.forward + other.forward, self.backward + other.backward)

    def __mul__(self, n: Count) -> Flops:
        return Flops(self.forward * n, self.backward * n)

    __rmul__ = __mul__


NONE = Flops()


def linear(rows: Count, d_in: int, d_out: int, grad: Grad = "all", on_data: bool = False) -> Flops:
    """``rows`` vectors through a linear layer; no input gradient for the data itself (``on_data``)."""
    f = 2 * rows * d_in * d_out
    return Flops(f, f * (int(grad != "none" and not on_data) + int(grad == "all")))


def linear_layer(layer: nn.Linear, rows: Count, grad: Grad = "all", on_data: bool = False) -> Flops:
    return linear(rows, layer.in_features, layer.out_features, grad, on_data)


def product(batch: Count, m: Count, k: Count, n: Count, grad: Grad = "all") -> Flops:
    """(batch, m, k) @ (batch, k, n) of two activations: both need gradients (2x), unless no_grad."""
    f = 2 * batch * m * k * n
    return Flops(f, 2 * f if grad != "none" else 0)


def attention(b: Count, heads: int, t_q: Count, t_k: Count, head_dim: int, grad: Grad = "all") -> Flops:
    """q k^T and its weighted sum of values, each 2 b h T_q T_k d."""
    return product(b * heads, t_q, head_dim, t_k, grad) * 2


# -- the layers of attnlab.nn, read off the modules themselves ------------------------------------
def mlp(layer: MLP, rows: Count, grad: Grad = "all") -> Flops:
    return linear_layer(layer.fc1, rows, grad) + linear_layer(layer.fc2, rows, grad)


def scores(attn: MultiHeadAttention, b: Count, t: int, grad: Grad = "all") -> Flops:
    """The scores and weighted values of ``attn``'s variant over ``t`` tokens."""
    h, d = attn.n_head, attn.dim // attn.n_head
    if isinstance(attn, LinearAttention):
        # the chunked form (nn/linear_attention.py): chunk x chunk inside each chunk, the state of
        # the chunks before it for the rest; f features per head (Taylor's: 1 + d + d(d+1)/2)
        c = CHUNK
        f = d if attn.feature_map is elu_feature_map else 1 + d + d * (d + 1) // 2
        n = b * h * -(-t // c)  # chunks, over batch and heads
        states = product(n, f, c, d, grad) + product(n, c, f, d, grad)  # sum of k v^T; q @ state
        return states + product(n, c, f, c, grad) + product(n, c, c, d, grad)  # q k^T; @ v
    if isinstance(attn, WindowAttention):  # each window of window^2 tokens attends to itself
        n = attn.window**2
        return attention(b * (attn.size // attn.window) ** 2, h, n, n, d, grad)
    if isinstance(attn, SlidingWindowAttention) and t > attn.window:
        # blocks of ``window`` queries against their and the previous block's keys, + the global ones
        w = attn.window
        keys = 2 * w + (min(attn.n_global, t) if attn.n_global else 0)
        return attention(b * -(-t // w), h, w, keys, d, grad)
    return attention(b, h, t, t, d, grad)


def self_attention(attn: MultiHeadAttention, b: Count, t: int, grad: Grad = "all") -> Flops:
    c = attn.dim
    qkv = linear(b * t, c, attn.in_proj.out_features, grad)  # 3 c, less with fewer kv heads
    return qkv + scores(attn, b, t, grad) + linear(b * t, c, c, grad)


def cross_attention(
    attn: MultiHeadAttention,
    b: Count,
    t_q: Count,
    t_kv: Count,
    grad: Grad = "all",
    project_memory: bool = True,
) -> Flops:
    """``t_q`` queries over ``t_kv`` memory rows; ``project_memory=False``: its k, v were made once."""
    c, h = attn.dim, attn.n_head
    f = linear(b * t_q, c, c, grad) + attention(b, h, t_q, t_kv, c // h, grad) + linear(b * t_q, c, c, grad)
    if project_memory:
        kv_in = attn.kv_proj.in_features if attn.kv_proj is not None else c
        f = f + linear(b * t_kv, kv_in, 2 * attn.kv_width, grad)
    return f


def transformer_block(
    block: TransformerBlock, b: Count, t: int, grad: Grad = "all", memory: Count | None = None
) -> Flops:
    f = self_attention(block.attn, b, t, grad) + mlp(block.mlp, b * t, grad)
    if block.cross_attn is not None:
        f = f + cross_attention(block.cross_attn, b, t, memory, grad)
    return f


def blocks(
    layers: Iterable[TransformerBlock], b: Count, t: int, grad: Grad = "all", memory: Count | None = None
) -> Flops:
    return sum((transformer_block(block, b, t, grad, memory) for block in layers), NONE)


def convs(module: nn.Module, images: Count, side: int, grad: Grad = "all") -> tuple[Flops, int]:
    """The FLOPs of a stack's convolutions (run in the order registered) on ``images`` square maps
    of ``side`` pixels, the first on the pixels, and the side of the last map."""
    f, first = NONE, True
    for layer in module.modules():
        if isinstance(layer, nn.Conv2d):
            k, s, p = layer.kernel_size[0], layer.stride[0], layer.padding[0]
            side = (side + 2 * p - k) // s + 1
            # a linear layer of c_in k^2 inputs at each output position
            f = f + linear(
                images * side**2, layer.in_channels // layer.groups * k**2, layer.out_channels, grad, first
            )
            first = False
        elif isinstance(layer, nn.MaxPool2d):
            side = (side - layer.kernel_size) // layer.stride + 1
    return f, side
