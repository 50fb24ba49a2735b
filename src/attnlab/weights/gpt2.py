"""GPT-2 (transformers' ``GPT2LMHeadModel``) weights into our GPT, and our GPT out as one. GPT-2 is our
GPT with ``bias: true`` and ``act: gelu_tanh`` (``conf/model/net/gpt2.yaml``); a GPT without biases
exports them as zeros and takes back a file whose biases are all zero."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from attnlab.core.errors import CheckpointError
from attnlab.nn import LearnedPositions, MultiHeadAttention
from attnlab.weights.hf_files import (
    Mapped,
    act_name,
    load_mapped,
    read_folder,
    read_weights,
    renamers,
    write_folder,
)
from attnlab.weights.hf_tokenizer import write_tokenizer

# GPT-2's names (after "transformer.") -> ours; "{}" stands for a layer's number
_from_hf, _to_hf = renamers(
    {
        "wte.weight": "embed.tokens.weight",
        "wpe.weight": "embed.positions.emb.weight",
        "h.{}.ln_1.": "blocks.{}.norm1.",
        "h.{}.attn.c_attn.": "blocks.{}.attn.in_proj.",
        "h.{}.attn.c_proj.": "blocks.{}.attn.out_proj.",
        "h.{}.ln_2.": "blocks.{}.norm2.",
        "h.{}.mlp.c_fc.": "blocks.{}.mlp.fc1.",
        "h.{}.mlp.c_proj.": "blocks.{}.mlp.fc2.",
        "ln_f.": "norm.",
    }
)
# our act -> transformers' activation_function, and back (gelu_pytorch_tanh: the same function)
_HF_ACTIVATIONS = {"gelu_tanh": "gelu_new", "gelu": "gelu", "quick_gelu": "quick_gelu"}
_ACTIVATIONS = {theirs: ours for ours, theirs in _HF_ACTIVATIONS.items()} | {"gelu_pytorch_tanh": "gelu_tanh"}


def _conv1d(ours: str, value: Tensor) -> Tensor:
    """GPT-2's ``Conv1D`` keeps a block's linear weight (in, out), ours (out, in): the transpose."""
    return value.t() if value.ndim == 2 and ours.startswith("blocks.") else value


def state_from_hf(state: dict[str, Tensor]) -> Mapped:
    """A ``GPT2LMHeadModel`` (or ``GPT2Model``) state dict -> ours, each with the name it had."""
    renamed = ((theirs, _from_hf(theirs.removeprefix("transformer.")), v) for theirs, v in state.items())
    return {ours: (theirs, _conv1d(ours, v)) for theirs, ours, v in renamed if ours}


def export_state(net: nn.Module) -> dict[str, Tensor]:
    """Our GPT's state dict as ``GPT2LMHeadModel``'s; a bias ours leaves out is zeros (the same layer)."""
    ours = net.state_dict()
    out = {f"transformer.{_to_hf(name)}": _conv1d(name, value) for name, value in ours.items()}
    for name, value in ours.items():
        bias = name.removesuffix("weight") + "bias"
        if name.endswith(".weight") and bias not in ours and (theirs := _to_hf(bias)):
            out[f"transformer.{theirs}"] = torch.zeros(value.shape[0], dtype=value.dtype)
    return out  # (lm_head.weight is tied: transformers fills it from the token table)


def _require_gpt2_layout(net: nn.Module, field: str) -> None:
    """GPT-2 is learned positions and full attention; other GPTs have no GPT-2 counterpart."""
    learned = isinstance(net.embed.positions, LearnedPositions) and net.positions is None
    if not learned or type(net.blocks[0].attn) is not MultiHeadAttention:
        raise CheckpointError(
            f"{field}: GPT-2 has learned positions and full attention; this GPT has other "
            "positions or attention (model.net.positions=learned, model.net.attention=full)"
        )
    attn = net.blocks[0].attn
    if attn.n_kv_head != attn.n_head or not isinstance(attn.q_norm, nn.Identity):
        raise CheckpointError(
            f"{field}: GPT-2's attention has a key and value head per head and no QK-norm "
            "(model.net.n_kv_head=null, model.net.qk_norm=false)"
        )


def load(net: nn.Module, source: Path) -> None:
    """A transformers GPT-2 folder (or weights file) into ``net``."""
    _require_gpt2_layout(net, f"model.init_from={source}")
    config = read_folder(
        source,
        ("gpt2",),
        "GPT",
        layer_norm_epsilon=(net.norm.eps, f"our GPT's LayerNorm eps is {net.norm.eps}"),
        scale_attn_by_inverse_layer_idx=(False, "our GPT's attention does not do that"),
        reorder_and_upcast_attn=(False, "our GPT's attention does not do that"),
    )
    act = config.get("activation_function", "gelu_new")
    if (wanted := _ACTIVATIONS.get(act, "another activation")) != act_name(net.blocks[0].mlp.act):
        raise CheckpointError(
            f"model.init_from={source}: config.json's activation_function is {act!r}; set "
            f"model.net.act={wanted} (conf/model/net/gpt2.yaml is GPT-2)"
        )
    mapped = state_from_hf(read_weights(source))
    if net.norm.bias is None:
        _require_zero_biases(mapped, source)
    load_mapped(net, mapped, source)


def _require_zero_biases(mapped: Mapped, source: Path) -> None:
    """A GPT without biases takes a GPT-2 whose biases are all zero (what ``export`` writes for one)."""
    for ours, (theirs, value) in mapped.items():
        if ours.endswith(".bias") and bool(value.any()):
            raise CheckpointError(
                f"model.init_from={source}: GPT-2 has biases ({theirs} is not zero); set "
                "model.net.bias=true (conf/model/net/gpt2.yaml is GPT-2)"
            )


def export(net: nn.Module, out_dir: Path, artifacts: dict) -> None:
    """``net`` as a ``GPT2LMHeadModel`` folder: config.json, model.safetensors, the tokenizer."""
    _require_gpt2_layout(net, "attnlab-export")
    config = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": net.vocab_size,
        "n_positions": net.max_len,
        "n_embd": net.norm.normalized_shape[0],
        "n_layer": len(net.blocks),
        "n_head": net.blocks[0].attn.n_head,
        "n_inner": net.blocks[0].mlp.fc1.out_features,
        "activation_function": _HF_ACTIVATIONS[act_name(net.blocks[0].mlp.act)],
        "layer_norm_epsilon": net.norm.eps,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }
    config.update(write_tokenizer(artifacts, out_dir, "gpt2", net.max_len))
    write_folder(out_dir, config, export_state(net))
