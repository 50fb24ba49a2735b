"""The contracts the nets follow, which tasks and inference are written against
(docs/code-layout.md#contracts)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torch import Tensor

# Each decoder's own: a dict of tensors, attention caches, a dataclass. Only the decoder reads it.
State = Any


@runtime_checkable
class Decoder(Protocol):
    """One token per row at a time: a search starts once, then steps; beam search reorders. A step
    or reorder may change its state in place (caches grow): use the state returned."""

    def start(self, src: Tensor) -> State:
        """Read what the output is conditioned on once: source ids (B, S), images (B, C, H, W),
        or a language model's context (B, T)."""

    def step(self, tokens: Tensor, state: State) -> tuple[Tensor, State]:
        """The newest token of each row (B,) -> the next token's logits (B, V) and the state."""

    def reorder(self, state: State, index: Tensor) -> State:
        """Keep the rows at ``index`` (B',), copied or dropped (beam search)."""


@runtime_checkable
class ImageBackbone(Protocol):
    """An image classifier split as timm splits it."""

    num_features: int  # the width of ``forward_head(x, pre_logits=True)``

    def forward_features(self, images: Tensor) -> Tensor:
        """Images (B, C, H, W) -> features: tokens (B, N, D) or a map (B, D, h, w)."""

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        """Features -> logits (B, num_classes), or the pooled features (B, num_features)."""


@runtime_checkable
class PatchAttention(Protocol):
    """An image classifier whose attention can be drawn over its input."""

    def patch_attention(self, images: Tensor) -> dict[str, Tensor]:
        """Images (B, C, H, W) -> named maps (B, h, w) of where the class decision looked."""


@runtime_checkable
class Alignments(Protocol):
    """An encoder-decoder whose attention over the source can be drawn."""

    def alignments(self, src: Tensor, tgt_in: Tensor) -> dict[str, Tensor]:
        """Teacher-forced source (B, S) and target (B, T) -> named weights (B, H, T, S)."""


@runtime_checkable
class Captioner(Decoder, Protocol):
    """A decoder over images whose every word attends to the image's ``grid`` of positions."""

    grid: tuple[int, int]

    def forward(self, images: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Teacher forcing over ``tokens`` (B, T): logits (B, T, V) and attention (B, T, S)."""


@runtime_checkable
class DistillationHeads(Protocol):
    """A student with a class token's head and a distillation token's head (DeiT)."""

    def forward_heads(self, images: Tensor) -> tuple[Tensor, Tensor]:
        """Images -> the class head's and the distillation head's logits, (B, K) each."""
