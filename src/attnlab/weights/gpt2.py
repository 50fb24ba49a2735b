"""GPT-2 (transformers' ``GPT2LMHeadModel``) weights into our GPT, and our GPT out as one.

The layouts are the same network: GPT-2 keeps its linear layers as ``Conv1D`` (weights stored
(in, out), ours (out, in): transposed), packs q, k, v into one ``c_attn`` as ours packs them into
``in_proj``, and ties its output layer to the token table as ours does. Our GPT is GPT-2 with
``bias: true`` and ``act: gelu_tanh`` (``conf/model/net/gpt2.yaml``); any of ours exports (a GPT without
biases has them zero, an exact GELU is transformers' ``gelu``) and comes back in (a GPT without
biases takes a file whose biases are all zero).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import Tensor, nn

from attnlab.core.errors import CheckpointError
from attnlab.nn import LearnedPositions, MultiHeadAttention
from attnlab.weights.hf_files import (
    Mapped,
    load_mapped,
    read_config,
    read_weights,
    require_architecture,
    require_value,
    weights_file,
    write_folder,
)
from attnlab.weights.hf_tokenizer import write_tokenizer

# GPT-2's names (after "transformer."), ours, and whether GPT-2 stores the weight transposed
_NAMES = (
    ("wte.weight", "embed.tokens.weight", False),
    ("wpe.weight", "embed.positions.emb.weight", False),
    ("h.{i}.ln_1.{p}", "blocks.{i}.norm1.{p}", False),
    ("h.{i}.attn.c_attn.{p}", "blocks.{i}.attn.in_proj.{p}", True),
    ("h.{i}.attn.c_proj.{p}", "blocks.{i}.attn.out_proj.{p}", True),
    ("h.{i}.ln_2.{p}", "blocks.{i}.norm2.{p}", False),
    ("h.{i}.mlp.c_fc.{p}", "blocks.{i}.mlp.fc1.{p}", True),
    ("h.{i}.mlp.c_proj.{p}", "blocks.{i}.mlp.fc2.{p}", True),
    ("ln_f.{p}", "norm.{p}", False),
)
_ACTIVATIONS = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu": "gelu",
    "quick_gelu": "quick_gelu",
}


def _pattern(template: str) -> re.Pattern:
    return re.compile(
        re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{p\}", r"(?P<p>weight|bias)")
    )


_FROM_HF = [(_pattern(theirs), ours, t) for theirs, ours, t in _NAMES]
_TO_HF = [(_pattern(ours), theirs, t) for theirs, ours, t in _NAMES]


def _rename(name: str, table: list) -> tuple[str, bool] | None:
    for pattern, template, transposed in table:
        if m := pattern.fullmatch(name):
            return template.format(**m.groupdict()), transposed
    return None


def state_from_hf(state: dict[str, Tensor]) -> Mapped:
    """A ``GPT2LMHeadModel`` (or ``GPT2Model``) state dict -> ours, each with the name it had."""
    out: Mapped = {}
    for theirs, value in state.items():
        if renamed := _rename(theirs.removeprefix("transformer."), _FROM_HF):
            ours, transposed = renamed
            out[ours] = (theirs, value.t() if transposed else value)
    return out


def state_to_hf(net: nn.Module) -> dict[str, Tensor]:
    """Our GPT's state dict as ``GPT2LMHeadModel``'s; a bias ours leaves out (``bias: false``) is
    written as zeros, which is the same layer."""
    ours = net.state_dict()
    out: dict[str, Tensor] = {}
    for name, value in ours.items():
        theirs, transposed = _rename(name, _TO_HF)
        out[f"transformer.{theirs}"] = value.t() if transposed else value
        bias = name.removesuffix("weight") + "bias"
        if name.endswith(".weight") and bias not in ours and (renamed := _rename(bias, _TO_HF)):
            out[f"transformer.{renamed[0]}"] = torch.zeros(value.shape[0], dtype=value.dtype)
    out["lm_head.weight"] = ours["embed.tokens.weight"]
    return out


def _act(net: nn.Module) -> str:
    """The ``model.net.act`` of ``net``'s MLPs."""
    act = net.blocks[0].mlp.act
    if not isinstance(act, nn.GELU):
        return "quick_gelu"
    return "gelu_tanh" if act.approximate == "tanh" else "gelu"


def _require_gpt2_layout(net: nn.Module, field: str) -> None:
    """GPT-2 is learned positions and full attention; a GPT with other positions or another
    pattern has no GPT-2 counterpart."""
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
    weights_file(source)  # a folder without weights says so before what its config lacks
    config = read_config(source)
    require_architecture(config, source, ("gpt2",), "GPT")
    wanted = _ACTIVATIONS.get(config.get("activation_function", "gelu_new"), "another activation")
    if wanted != _act(net):
        raise CheckpointError(
            f"model.init_from={source}: config.json's activation_function is "
            f"{config.get('activation_function', 'gelu_new')!r}; set model.net.act={wanted} "
            "(conf/model/net/gpt2.yaml is GPT-2)"
        )
    require_value(
        config, source, "layer_norm_epsilon", net.norm.eps, f"our GPT's LayerNorm eps is {net.norm.eps}"
    )
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        require_value(config, source, key, False, "our GPT's attention does not do that")
    mapped = state_from_hf(read_weights(source))
    if net.norm.bias is None:
        _require_zero_biases(mapped, source)
    load_mapped(net, mapped, source)


def _require_zero_biases(mapped: Mapped, source: Path) -> None:
    """A GPT without biases takes a GPT-2 whose biases are all zero (what ``export`` writes for
    one: the same layers); GPT-2's own are refused, naming the first that is not zero."""
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
        "activation_function": {"gelu_tanh": "gelu_new", "gelu": "gelu", "quick_gelu": "quick_gelu"}[
            _act(net)
        ],
        "layer_norm_epsilon": net.norm.eps,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }
    tokenizer = write_tokenizer(artifacts, out_dir, "gpt2", net.max_len)
    if tokenizer:
        config.update(tokenizer)
    state = state_to_hf(net)
    del state["lm_head.weight"]  # tied: transformers fills it from the token table
    write_folder(out_dir, config, state)
