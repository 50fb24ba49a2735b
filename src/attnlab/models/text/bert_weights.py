"""Load the weights of Hugging Face's ``BertModel`` / ``BertForPreTraining`` into ours.

The layouts match except that HF keeps q, k and v as three projections where ours packs them
into one ``in_proj`` (as ``nn.MultiheadAttention``), and the names differ. Used to check our
encoder against transformers' to 1e-5 with random weights, and to start from HF's pretrained ones.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor, nn

# HF name pattern -> ours (after the "bert." prefix is dropped)
_RENAMES = (
    (r"^embeddings\.word_embeddings\.", "embed.tokens.tokens."),
    (r"^embeddings\.position_embeddings\.", "embed.tokens.positions.emb."),
    (r"^embeddings\.token_type_embeddings\.", "embed.segments."),
    (r"^embeddings\.LayerNorm\.", "embed.norm."),
    (r"^encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"blocks.\1.attn.out_proj."),
    (r"^encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.", r"blocks.\1.norm1."),
    (r"^encoder\.layer\.(\d+)\.intermediate\.dense\.", r"blocks.\1.mlp.fc1."),
    (r"^encoder\.layer\.(\d+)\.output\.dense\.", r"blocks.\1.mlp.fc2."),
    (r"^encoder\.layer\.(\d+)\.output\.LayerNorm\.", r"blocks.\1.norm2."),
    (r"^pooler\.dense\.", "pooler."),
)
_HEADS = (
    (r"^cls\.predictions\.transform\.dense\.", "mlm.dense."),
    (r"^cls\.predictions\.transform\.LayerNorm\.", "mlm.norm."),
    (r"^cls\.predictions\.bias$", "mlm.bias"),
    (r"^cls\.seq_relationship\.", "nsp."),
)
_QKV = re.compile(r"^encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)\.(weight|bias)$")


def encoder_state_from_hf(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A ``transformers.BertModel`` state dict (or its ``bert.*`` part) -> ``Bert``'s."""
    out: dict[str, Tensor] = {}
    qkv: dict[tuple[str, str], dict[str, Tensor]] = {}
    for name, value in state.items():
        name = name.removeprefix("bert.")
        if m := _QKV.match(name):
            qkv.setdefault((m[1], m[3]), {})[m[2]] = value
            continue
        for pattern, new in _RENAMES:
            if re.match(pattern, name):
                out[re.sub(pattern, new, name)] = value
                break
    for (layer, kind), parts in qkv.items():
        out[f"blocks.{layer}.attn.in_proj.{kind}"] = torch.cat([parts["query"], parts["key"], parts["value"]])
    return out


def pretraining_state_from_hf(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A ``transformers.BertForPreTraining`` state dict -> ``BertPreTraining``'s."""
    out = {f"encoder.{k}": v for k, v in encoder_state_from_hf(state).items()}
    for name, value in state.items():
        for pattern, new in _HEADS:
            if re.match(pattern, name):
                out[re.sub(pattern, new, name)] = value
    return out


def load_hf_weights(model: nn.Module, hf_model: nn.Module) -> nn.Module:
    """Copy a transformers ``BertModel`` or ``BertForPreTraining`` into our ``Bert`` or
    ``BertPreTraining`` of the same configuration (every tensor must fit)."""
    convert = pretraining_state_from_hf if hasattr(model, "mlm") else encoder_state_from_hf
    model.load_state_dict(convert(hf_model.state_dict()))
    return model
