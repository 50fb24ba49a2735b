"""Counting a training step's FLOPs by hand: the "model FLOPs" of PaLM (Chowdhery et al. 2022,
appendix B) and nanoGPT's ``estimate_mfu``, which MFU divides by the hardware's peak.

Each net has a ``flops(...)`` method taking what its ``forward`` takes (tensors: their shapes are
read, and where the work depends on the data, e.g. how many tokens are masked, a count that stays
on the device) and returning ``Flops``: the forward and backward FLOPs of one training step on
that input. The conventions, the same as ``torch.utils.flop_counter.FlopCounterMode``'s, against
which ``tests/test_flops.py`` checks every family within 5%:

- a multiply-add is 2 FLOPs; only matrix products and convolutions are counted (norms, softmax,
  activations, the optimizer: a rounding error at any size that matters);
- backward = 2x forward for a product whose two operands need gradients (one product each for
  the input's and the weight's gradient): a trained layer, an attention's ``q k^T`` and
  ``softmax @ v``. A layer on the data itself (pixels, a frozen encoder's features) needs no input
  gradient: 1x. A frozen layer passing gradients back to trained ones before it: 1x. A frozen
  part under ``no_grad`` (a teacher, Flamingo's encoder): 0x. Nets take this as ``grad``.
- attention counts the whole score matrix it forms: T_q x T_k for full attention, also causal
  (PaLM and nanoGPT count the masked half too, and so do the fused kernels' FLOP formulas),
  ``window`` blocks for sliding-window attention (each query against the 2 x window keys of its
  block and the one before), the chunks of linear attention;
- recomputation is not counted: a fused attention kernel's backward recomputes the scores (+0.5x
  of the attention's forward, which ``FlopCounterMode`` adds for ``F.scaled_dot_product_attention``:
  ``attention_recompute``), activation checkpointing a forward (linear attention's chunk sums:
  ``scores(...).forward`` again). MFU is useful work over the peak, as PaLM defines it.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from torch import Tensor, nn

from attnlab.nn.attention import MultiHeadAttention
from attnlab.nn.blocks import MLP, TransformerBlock
from attnlab.nn.linear_attention import LinearAttention, causal_linear_attention, elu_feature_map
from attnlab.nn.local_attention import SlidingWindowAttention
from attnlab.nn.window_attention import WindowAttention

# What a part of a net sends backward: "all" (it is trained), "input" (frozen, but the gradient
# passes through it to trained layers before it), "none" (frozen, run under no_grad)
Grad = Literal["all", "input", "none"]

Count = int | Tensor  # a count read from the data stays a tensor on its device: no host sync


@dataclass(slots=True)
class Flops:
    """The forward and backward FLOPs of a pass; they add up, and scale by a repeat count."""

    forward: Count = 0
    backward: Count = 0

    @property
    def total(self) -> Count:
        """Forward + backward: one training step's."""
        return self.forward + self.backward

    def __add__(self, other: Flops) -> Flops:
        return Flops(self.forward + other.forward, self.backward + other.backward)

    def __mul__(self, n: Count) -> Flops:
        return Flops(self.forward * n, self.backward * n)

    __rmul__ = __mul__


NONE = Flops()

# the chunk length linear attention trains in (``causal_linear_attention``'s default)
LINEAR_ATTENTION_CHUNK: int = inspect.signature(causal_linear_attention).parameters["chunk"].default


def linear(rows: Count, d_in: int, d_out: int, grad: Grad = "all", on_data: bool = False) -> Flops:
    """``rows`` vectors through a ``d_in`` -> ``d_out`` linear layer: 2 rows d_in d_out forward; the
    backward has the weight's gradient if it is trained and the input's unless the input is the
    data (``on_data``) or nothing before needs it."""
    f = 2 * rows * d_in * d_out
    input_grad = grad != "none" and not on_data
    weight_grad = grad == "all"
    return Flops(f, f * (int(input_grad) + int(weight_grad)))


def linear_layer(layer: nn.Linear, rows: Count, grad: Grad = "all", on_data: bool = False) -> Flops:
    """``linear`` with the sizes of ``layer``."""
    return linear(rows, layer.in_features, layer.out_features, grad, on_data)


def conv2d(
    images: Count,
    c_in: int,
    c_out: int,
    kernel: int,
    out_side: int,
    grad: Grad = "all",
    on_data: bool = False,
) -> Flops:
    """A k x k convolution to an ``out_side`` x ``out_side`` map: a linear layer of c_in k^2 inputs
    at each output position."""
    return linear(images * out_side**2, c_in * kernel**2, c_out, grad, on_data)


def product(batch: Count, m: Count, k: Count, n: Count, grad: Grad = "all") -> Flops:
    """(batch, m, k) @ (batch, k, n) of two activations (scores, weighted values): both need
    gradients, so the backward is 2x, unless under no_grad."""
    f = 2 * batch * m * k * n
    return Flops(f, 2 * f if grad != "none" else 0)


def attention(b: Count, heads: int, t_q: Count, t_k: Count, head_dim: int, grad: Grad = "all") -> Flops:
    """Scaled dot-product attention of ``heads`` heads: the scores q k^T and their weighted sum of
    values, each 2 b h T_q T_k d (the full T_q x T_k matrix; see the module's docstring)."""
    return product(b * heads, t_q, head_dim, t_k, grad) * 2


def attention_recompute(b: Count, heads: int, t_q: Count, t_k: Count, head_dim: int) -> Count:
    """What a fused attention kernel's backward adds by recomputing the scores (``FlopCounterMode``
    counts it for ``F.scaled_dot_product_attention``): not model FLOPs."""
    return 2 * b * heads * t_q * t_k * head_dim


# -- the layers of attnlab.nn, read off the modules themselves ------------------------------------
def mlp(layer: MLP, rows: Count, grad: Grad = "all") -> Flops:
    """fc2(act(fc1(x))) over ``rows`` positions."""
    fc1, fc2 = layer.fc1, layer.fc2
    return linear(rows, fc1.in_features, fc1.out_features, grad) + linear(
        rows, fc2.in_features, fc2.out_features, grad
    )


def scores(attn: MultiHeadAttention, b: Count, t: int, grad: Grad = "all") -> Flops:
    """The scores and weighted values of ``attn``'s variant over a sequence of ``t`` tokens."""
    h, d = attn.n_head, attn.dim // attn.n_head
    if isinstance(attn, LinearAttention):
        # the chunked form (nn/linear_attention.py): chunk x chunk inside each chunk, the state of
        # the chunks before it for the rest; f features per head (Taylor's: 1 + d + d(d+1)/2)
        c, f = LINEAR_ATTENTION_CHUNK, d if attn.feature_map is elu_feature_map else 1 + d + d * (d + 1) // 2
        n = b * h * -(-t // c)  # chunks, over batch and heads
        states = product(n, f, c, d, grad) + product(n, c, f, d, grad)  # sum of k v^T; q @ state
        return states + product(n, c, f, c, grad) + product(n, c, c, d, grad)  # q k^T; @ v
    if isinstance(attn, WindowAttention):  # each window of window^2 tokens attends to itself
        windows, n = b * (attn.size // attn.window) ** 2, attn.window**2
        return attention(windows, h, n, n, d, grad)
    if isinstance(attn, SlidingWindowAttention) and t > attn.window:
        # blocks of ``window`` queries against their block's and the previous block's keys, plus
        # the global ones (nn/local_attention.py): O(T window), not O(T^2)
        w = attn.window
        keys = 2 * w + (min(attn.n_global, t) if attn.n_global else 0)
        return attention(b * -(-t // w), h, w, keys, d, grad)
    return attention(b, h, t, t, d, grad)


def self_attention(attn: MultiHeadAttention, b: Count, t: int, grad: Grad = "all") -> Flops:
    """A self-attention layer over (b, t) tokens: the q, k, v and output projections, the scores."""
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
    """``t_q`` queries attending to a memory of ``t_kv`` rows: the q projection, the k and v
    projections of the memory (unless it was projected once for several passes), the scores, the
    output projection."""
    c, h = attn.dim, attn.n_head
    f = linear(b * t_q, c, c, grad) + attention(b, h, t_q, t_kv, c // h, grad) + linear(b * t_q, c, c, grad)
    if project_memory:
        kv_in = attn.kv_proj.in_features if attn.kv_proj is not None else c
        f = f + linear(b * t_kv, kv_in, 2 * attn.kv_width, grad)
    return f


def transformer_block(
    block: TransformerBlock, b: Count, t: int, grad: Grad = "all", memory: Count | None = None
) -> Flops:
    """Self-attention (its variant's), cross-attention to ``memory`` rows when the block has it,
    and the MLP, over (b, t) tokens."""
    f = self_attention(block.attn, b, t, grad) + mlp(block.mlp, b * t, grad)
    if block.cross_attn is not None:
        f = f + cross_attention(block.cross_attn, b, t, memory, grad)
    return f


def blocks(
    layers: Iterable[TransformerBlock], b: Count, t: int, grad: Grad = "all", memory: Count | None = None
) -> Flops:
    return sum((transformer_block(block, b, t, grad, memory) for block in layers), NONE)


def convs(module: nn.Module, images: Count, side: int, grad: Grad = "all") -> tuple[Flops, int]:
    """The convolutions of a stack (``PatchEmbedding``, ``ConvStem``, a convnet's stages: modules
    run in the order they are registered) on ``images`` square maps of ``side`` pixels; the first
    reads the pixels (no input gradient). Returns the FLOPs and the side of the last map."""
    f, first = NONE, True
    for layer in module.modules():
        if isinstance(layer, nn.Conv2d):
            k, s, p = layer.kernel_size[0], layer.stride[0], layer.padding[0]
            side = (side + 2 * p - k) // s + 1
            f = f + conv2d(
                images, layer.in_channels // layer.groups, layer.out_channels, k, side, grad, first
            )
            first = False
        elif isinstance(layer, nn.MaxPool2d):
            side = (side - layer.kernel_size) // layer.stride + 1
    return f, side
