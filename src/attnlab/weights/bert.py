"""Hugging Face's BERT weights (``BertModel``, ``BertForPreTraining``,
``BertForSequenceClassification``, ``BertForTokenClassification``) into ours, and ours out as them.

The layouts match except that HF keeps q, k and v as three projections where ours packs them
into one ``in_proj`` (as ``nn.MultiheadAttention``), and the names differ. Our ``Bert``,
``BertPreTraining``, ``BertSequenceClassifier`` and ``BertTokenClassifier`` are those four
transformers classes (``CONVERTERS`` in ``attnlab.weights.pretrained``); the encoder must fit
tensor for tensor, a head the file lacks or has for another number of classes starts fresh.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import Tensor, nn

from attnlab.models.text.bert import BertClassifier, BertPreTraining
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
    convert = pretraining_state_from_hf if isinstance(model, BertPreTraining) else encoder_state_from_hf
    model.load_state_dict(convert(hf_model.state_dict()))
    return model


# our net's class -> transformers' class, and the prefix our encoder's names have in it
_CLASSES = {
    "Bert": ("BertModel", ""),
    "BertPreTraining": ("BertForPreTraining", "encoder."),
    "BertSequenceClassifier": ("BertForSequenceClassification", "encoder."),
    "BertTokenClassifier": ("BertForTokenClassification", "encoder."),
}
_HEAD_NAMES = ((r"^classifier\.", "head."), *_HEADS)


def mapped_from_hf(state: dict[str, Tensor], prefix: str) -> Mapped:
    """A transformers BERT state dict (any of the four classes) -> ours, each with its name in
    the file (q, k and v packed into ``in_proj`` under the query's name); ``prefix``: where our net
    keeps the encoder (``encoder.``, or nothing for ``Bert`` itself)."""
    out: Mapped = {}
    qkv: dict[tuple[str, str], dict[str, tuple[str, Tensor]]] = {}
    for theirs, value in state.items():
        # Google's original checkpoints (bert-base-uncased's files) name LayerNorm's gamma and beta
        name = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", theirs.removeprefix("bert."))
        name = re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", name)
        if m := _QKV.match(name):
            qkv.setdefault((m[1], m[3]), {})[m[2]] = (theirs, value)
            continue
        for pattern, new in _RENAMES:
            if re.match(pattern, name):
                out[prefix + re.sub(pattern, new, name)] = (theirs, value)
                break
        for pattern, new in _HEAD_NAMES if prefix else ():
            if re.match(pattern, name):
                out[re.sub(pattern, new, name)] = (theirs, value)
    for (layer, kind), parts in qkv.items():
        if len(parts) == 3:
            value = torch.cat([parts[p][1] for p in ("query", "key", "value")])
            out[f"{prefix}blocks.{layer}.attn.in_proj.{kind}"] = (parts["query"][0], value)
    return out


# ours -> transformers' (after "bert."), the reverse of _RENAMES and _HEADS
_TO_HF = (
    (r"^embed\.tokens\.tokens\.", "embeddings.word_embeddings."),
    (r"^embed\.tokens\.positions\.emb\.", "embeddings.position_embeddings."),
    (r"^embed\.segments\.", "embeddings.token_type_embeddings."),
    (r"^embed\.norm\.", "embeddings.LayerNorm."),
    (r"^blocks\.(\d+)\.attn\.out_proj\.", r"encoder.layer.\1.attention.output.dense."),
    (r"^blocks\.(\d+)\.norm1\.", r"encoder.layer.\1.attention.output.LayerNorm."),
    (r"^blocks\.(\d+)\.mlp\.fc1\.", r"encoder.layer.\1.intermediate.dense."),
    (r"^blocks\.(\d+)\.mlp\.fc2\.", r"encoder.layer.\1.output.dense."),
    (r"^blocks\.(\d+)\.norm2\.", r"encoder.layer.\1.output.LayerNorm."),
    (r"^pooler\.", "pooler.dense."),
)
_HEADS_TO_HF = (
    (r"^head\.", "classifier."),
    (r"^mlm\.dense\.", "cls.predictions.transform.dense."),
    (r"^mlm\.norm\.", "cls.predictions.transform.LayerNorm."),
    (r"^mlm\.bias$", "cls.predictions.bias"),
    (r"^nsp\.", "cls.seq_relationship."),
)
_IN_PROJ = re.compile(r"^blocks\.(\d+)\.attn\.in_proj\.(weight|bias)$")


def state_to_hf(net: nn.Module) -> dict[str, Tensor]:
    """Our BERT net's state dict named as its transformers class names it."""
    hf_class, prefix = _CLASSES[type(net).__name__]
    base = "" if hf_class == "BertModel" else "bert."
    out: dict[str, Tensor] = {}
    for name, value in net.state_dict().items():
        if prefix and not name.startswith(prefix):  # a head
            for pattern, new in _HEADS_TO_HF:
                if re.match(pattern, name):
                    out[re.sub(pattern, new, name)] = value
            continue
        name = name.removeprefix(prefix)
        if m := _IN_PROJ.match(name):
            for part, chunk in zip(("query", "key", "value"), value.chunk(3), strict=True):
                out[f"{base}encoder.layer.{m[1]}.attention.self.{part}.{m[2]}"] = chunk
        elif not (name.startswith("pooler.") and hf_class == "BertForTokenClassification"):
            for pattern, new in _TO_HF:  # (transformers' token classifier has no pooler)
                if re.match(pattern, name):
                    out[base + re.sub(pattern, new, name)] = value
                    break
    return out


def load(net: nn.Module, source: Path) -> None:
    """A transformers BERT folder (or weights file) into ``net``: the encoder tensor for tensor,
    the heads where the file has them at our size (else fresh, with a notice)."""
    weights_file(source)  # a folder without weights says so before what its config lacks
    config = read_config(source)
    require_architecture(config, source, ("bert",), type(net).__name__)
    require_value(config, source, "hidden_act", "gelu", "our BERT uses the exact GELU ('gelu')")
    require_value(config, source, "layer_norm_eps", 1e-12, "our BERT's LayerNorm eps is 1e-12")
    require_value(config, source, "position_embedding_type", "absolute", "our BERT has absolute positions")
    _, prefix = _CLASSES[type(net).__name__]
    mapped = mapped_from_hf(read_weights(source), prefix)
    heads = ("head.", "mlm.", "nsp.", f"{prefix}pooler.")
    load_mapped(net, mapped, source, fresh=heads, what="the heads")


def export(net: nn.Module, out_dir: Path, artifacts: dict) -> None:
    """``net`` as its transformers class's folder: config.json, model.safetensors, the tokenizer."""
    hf_class, _ = _CLASSES[type(net).__name__]
    encoder = net if hf_class == "BertModel" else net.encoder
    block = encoder.blocks[0]
    config = {
        "architectures": [hf_class],
        "model_type": "bert",
        "vocab_size": encoder.vocab_size,
        "hidden_size": encoder.dim,
        "num_hidden_layers": len(encoder.blocks),
        "num_attention_heads": block.attn.n_head,
        "intermediate_size": block.mlp.fc1.out_features,
        "hidden_act": "gelu",
        "hidden_dropout_prob": float(block.drop.p),
        "attention_probs_dropout_prob": float(block.attn.dropout),
        "max_position_embeddings": encoder.max_len,
        "type_vocab_size": encoder.embed.segments.num_embeddings,
        "layer_norm_eps": 1e-12,
        "pad_token_id": encoder.pad_id,
        "position_embedding_type": "absolute",
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }
    if isinstance(net, BertClassifier):
        classes = artifacts.get("classes") or [str(i) for i in range(net.num_classes)]
        config["id2label"] = {str(i): str(c) for i, c in enumerate(classes)}
        config["label2id"] = {str(c): i for i, c in enumerate(classes)}
        config["classifier_dropout"] = float(net.drop.p)
    config.update(write_tokenizer(artifacts, out_dir, "bert", encoder.max_len))
    write_folder(out_dir, config, state_to_hf(net))
