"""Load the weights of timm's ViT, DeiT (distilled) and Swin models into ours.

The layouts match (a packed q/k/v projection, the same norms and MLPs, the same token and
position parameters); only some names differ. Used to check our models against timm's to 1e-5
with random weights, and to start from timm's pretrained ones.
"""

from __future__ import annotations

import re

from torch import Tensor, nn

# timm name pattern -> ours
_RENAMES = (
    (re.compile(r"\.attn\.qkv\."), ".attn.in_proj."),
    (re.compile(r"\.attn\.proj\."), ".attn.out_proj."),
    (re.compile(r"^head\.fc\."), "head."),  # Swin's ClassifierHead
)


def state_dict_from_timm(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A timm ``vit_*``, ``deit_*distilled*`` or ``swin_*`` state dict, renamed for our models."""
    out = {}
    for name, value in state.items():
        for pattern, new in _RENAMES:
            name = pattern.sub(new, name)
        out[name] = value
    return out


def load_timm_weights(model: nn.Module, timm_model: nn.Module) -> nn.Module:
    """Copy ``timm_model``'s weights into ``model`` (same configuration; every tensor must fit)."""
    model.load_state_dict(state_dict_from_timm(timm_model.state_dict()))
    return model
