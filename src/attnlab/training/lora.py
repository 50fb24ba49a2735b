"""LoRA fine-tuning (``model.lora``): adapters put in on top of ``model.init_from``'s weights, and
only they train, with the parts of the net those weights did not fill (a new head)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from attnlab.weights.lora import add_adapters, lora_spec

log = logging.getLogger(__name__)


def weights_before(net: nn.Module) -> dict[str, Tensor]:
    """A copy of ``net``'s parameters before ``model.init_from`` loads, to tell what it filled."""
    return {name: p.detach().clone() for name, p in net.named_parameters()}


def unfilled_parts(net: nn.Module, before: Mapping[str, Tensor]) -> list[str]:
    """The parts of ``net`` (its children, its own tensors) whose every parameter is as it was
    ``before``: those the loaded weights did not fill (a head of another size, a new block)."""
    parts: dict[str, bool] = {}
    for name, p in net.named_parameters():
        part = name.split(".", 1)[0]
        parts[part] = parts.get(part, True) and torch.equal(p.detach(), before[name])
    return [part for part, as_built in parts.items() if as_built]


def train_adapters(net: nn.Module, lora: Mapping[str, Any], before: Mapping[str, Tensor] | None) -> None:
    """``model.lora``: adapters put into ``net``, which alone train with the parts ``model.init_from`` did not
    fill (``before``: the weights before it loaded; None: nothing loaded); logs the share that trains."""
    new = unfilled_parts(net, before) if before is not None else []
    layers = add_adapters(net, lora)
    for name, p in net.named_parameters():
        if name.split(".", 1)[0] in new:
            p.requires_grad_(True)
    trained = sum(p.numel() for p in net.parameters() if p.requires_grad)
    total = sum(p.numel() for p in net.parameters())
    spec = lora_spec(lora)
    log.info(
        f"model.lora: {trained:,} of {total:,} parameters train ({100 * trained / total:.2f}%): adapters of "
        f"rank {spec['r']} on {len(layers)} layers ({', '.join(spec['targets'])})"
        + (f", and {', '.join(new)} (new)" if new else "")
    )
