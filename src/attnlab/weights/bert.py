"""transformers' BERT (``BertModel``, ``...ForPreTraining``, ``...ForSequenceClassification``,
``...ForTokenClassification``) into ours and out again: names renamed, q, k, v packed into ``in_proj``."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import Tensor, nn

from attnlab.models.text.bert import BertClassifier
from attnlab.weights.hf_files import Mapped, load_mapped, read_folder, read_weights, renamers, write_folder
from attnlab.weights.hf_tokenizer import write_tokenizer

# transformers' names (after "bert.") -> ours; "{}" stands for a layer's number
_from_hf, _to_hf = renamers(
    {
        "embeddings.word_embeddings.": "embed.tokens.tokens.",
        "embeddings.position_embeddings.": "embed.tokens.positions.emb.",
        "embeddings.token_type_embeddings.": "embed.segments.",
        "embeddings.LayerNorm.": "embed.norm.",
        "encoder.layer.{}.attention.output.dense.": "blocks.{}.attn.out_proj.",
        "encoder.layer.{}.attention.output.LayerNorm.": "blocks.{}.norm1.",
        "encoder.layer.{}.intermediate.dense.": "blocks.{}.mlp.fc1.",
        "encoder.layer.{}.output.dense.": "blocks.{}.mlp.fc2.",
        "encoder.layer.{}.output.LayerNorm.": "blocks.{}.norm2.",
        "pooler.dense.": "pooler.",
    }
)
_heads_from_hf, _heads_to_hf = renamers(  # (not under "bert.")
    {
        "classifier.": "head.",
        "cls.predictions.transform.dense.": "mlm.dense.",
        "cls.predictions.transform.LayerNorm.": "mlm.norm.",
        "cls.predictions.bias": "mlm.bias",
        "cls.seq_relationship.": "nsp.",
    }
)
_QKV = re.compile(r"^encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)\.(weight|bias)$")
_IN_PROJ = re.compile(r"^blocks\.(\d+)\.attn\.in_proj\.(weight|bias)$")
# our net's class -> transformers' class, and the prefix our encoder's names have in it
_CLASSES = {
    "Bert": ("BertModel", ""),
    "BertPreTraining": ("BertForPreTraining", "encoder."),
    "BertSequenceClassifier": ("BertForSequenceClassification", "encoder."),
    "BertTokenClassifier": ("BertForTokenClassification", "encoder."),
}


def mapped_from_hf(state: dict[str, Tensor], prefix: str) -> Mapped:
    """A transformers BERT state dict -> ours, each with its name in the file (q, k, v packed under the
    query's); ``prefix``: where our net keeps the encoder."""
    out: Mapped = {}
    qkv: dict[tuple[str, str], dict[str, tuple[str, Tensor]]] = {}
    for theirs, value in state.items():
        # Google's original checkpoints (bert-base-uncased's files) name LayerNorm's gamma and beta
        name = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", theirs.removeprefix("bert."))
        name = re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", name)
        if m := _QKV.match(name):
            qkv.setdefault((m[1], m[3]), {})[m[2]] = (theirs, value)
        elif (ours := _from_hf(name)) is not None:
            out[prefix + ours] = (theirs, value)
        elif prefix and (ours := _heads_from_hf(name)) is not None:
            out[ours] = (theirs, value)
    for (layer, kind), parts in qkv.items():
        if len(parts) == 3:
            value = torch.cat([parts[p][1] for p in ("query", "key", "value")])
            out[f"{prefix}blocks.{layer}.attn.in_proj.{kind}"] = (parts["query"][0], value)
    return out


def load_hf_weights(model: nn.Module, hf_model: nn.Module) -> nn.Module:
    """Copy a transformers ``BertModel`` or ``BertForPreTraining`` into our net of the same configuration."""
    mapped = mapped_from_hf(hf_model.state_dict(), _CLASSES[type(model).__name__][1])
    model.load_state_dict({ours: value for ours, (_, value) in mapped.items()})
    return model


def export_state(net: nn.Module) -> dict[str, Tensor]:
    """Our BERT net's state dict named as its transformers class names it."""
    hf_class, prefix = _CLASSES[type(net).__name__]
    base = "" if hf_class == "BertModel" else "bert."
    out: dict[str, Tensor] = {}
    for name, value in net.state_dict().items():
        if prefix and not name.startswith(prefix):  # a head
            if (theirs := _heads_to_hf(name)) is not None:
                out[theirs] = value
            continue
        name = name.removeprefix(prefix)
        if m := _IN_PROJ.match(name):
            for part, chunk in zip(("query", "key", "value"), value.chunk(3), strict=True):
                out[f"{base}encoder.layer.{m[1]}.attention.self.{part}.{m[2]}"] = chunk
        elif name.startswith("pooler.") and hf_class == "BertForTokenClassification":
            continue  # transformers' token classifier has no pooler
        elif (theirs := _to_hf(name)) is not None:
            out[base + theirs] = value
    return out


def load(net: nn.Module, source: Path) -> None:
    """A transformers BERT folder (or weights file) into ``net``; heads of another size start fresh."""
    read_folder(
        source,
        ("bert",),
        type(net).__name__,
        hidden_act=("gelu", "our BERT uses the exact GELU ('gelu')"),
        layer_norm_eps=(1e-12, "our BERT's LayerNorm eps is 1e-12"),
        position_embedding_type=("absolute", "our BERT has absolute positions"),
    )
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
    write_folder(out_dir, config, export_state(net))
