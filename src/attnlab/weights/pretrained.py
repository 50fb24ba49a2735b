"""Weights in from other libraries' saved models and out to their formats: each net with a counterpart
names its converter module (``CONVERTERS``): ``load(net, source)``, ``export(net, out, artifacts)``."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

from torch import nn

from attnlab.core.errors import CheckpointError

# our net's class name -> the module converting it
CONVERTERS = {
    "Bert": "attnlab.weights.bert",
    "BertPreTraining": "attnlab.weights.bert",
    "BertSequenceClassifier": "attnlab.weights.bert",
    "BertTokenClassifier": "attnlab.weights.bert",
    "GPT": "attnlab.weights.gpt2",
    "VisionTransformer": "attnlab.weights.timm_vision",
    "DistilledVisionTransformer": "attnlab.weights.timm_vision",
    "SwinTransformer": "attnlab.weights.timm_vision",
    "CLIP": "attnlab.weights.clip",
}


def converter(net: nn.Module, field: str) -> ModuleType:
    name = type(net).__name__
    if name not in CONVERTERS:
        known = ", ".join(sorted(set(CONVERTERS)))
        raise CheckpointError(f"{field}: a {name} has no counterpart in another library (these do: {known})")
    return importlib.import_module(CONVERTERS[name])


def load_pretrained(net: nn.Module, source: str | Path) -> nn.Module:
    """``model.init_from``: another library's saved model at ``source`` copied into ``net``."""
    path = Path(source).expanduser()
    if not path.exists():
        raise CheckpointError(f"model.init_from={source}: no such file or directory")
    if path.is_dir() and not any(path.iterdir()):
        raise CheckpointError(f"model.init_from={source}: an empty folder (no weights, no config)")
    converter(net, "model.init_from").load(net, path)
    return net


def export_pretrained(net: nn.Module, out_dir: str | Path, artifacts: dict) -> Path:
    """``net`` written in its counterpart library's format under ``out_dir``."""
    convert = converter(net, "attnlab-export")  # refuses a net with no counterpart before writing
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    convert.export(net, out, artifacts)
    return out
