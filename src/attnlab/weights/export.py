"""A trained run written for use outside attnlab: in its counterpart library's format
(``attnlab.weights.pretrained``), or as an ONNX graph (torch's dynamo exporter) with what its
inputs need beside it (``attnlab.json``: classes, image size and normalisation; the tokenizer)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnlab.core.errors import CheckpointError
from attnlab.models.text.bert import BertClassifier

log = logging.getLogger(__name__)

# the tasks whose nets export to ONNX, and the name of their input
ONNX_TASKS = {
    "ImageClassificationTask": "images",
    "TextClassificationTask": "ids",
    "LanguageModelTask": "ids",
}


def example_input(task: str, net: nn.Module, artifacts: dict[str, Any]) -> torch.Tensor:
    """An input of the shape ``net`` takes: (2, C, H, W) normalised images, or (2, T) token ids."""
    if task == "ImageClassificationTask":
        size = artifacts["img_size"]
        return torch.randn(2, artifacts["in_chans"], size, size)
    return torch.randint(1, text_model(net).vocab_size, (2, 8))


def text_model(net: nn.Module) -> nn.Module:
    """What sets a text net's vocabulary and length: a BERT classifier's encoder, or the net."""
    return net.encoder if isinstance(net, BertClassifier) else net


def export_onnx(net: nn.Module, task: str, artifacts: dict[str, Any], out_dir: Path) -> Path:
    """``net`` as ``out_dir/model.onnx`` (batch, and for text the length, dynamic) with
    ``attnlab.json`` (its input and what preparing it needs) and a text model's ``tokenizer.json``."""
    if task not in ONNX_TASKS:
        raise CheckpointError(
            f"--format onnx: a {task} does not export to ONNX (these do: {', '.join(ONNX_TASKS)})"
        )
    name = ONNX_TASKS[task]
    x = example_input(task, net, artifacts)
    batch = torch.export.Dim("batch", min=1, max=1024)
    dims = {0: batch}
    if name == "ids":
        dims[1] = torch.export.Dim("length", min=2, max=text_model(net).max_len)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "model.onnx"
    program = torch.onnx.export(
        net.eval(),
        (x,),
        dynamo=True,
        input_names=[name],
        output_names=["logits"],
        dynamic_shapes=({0: batch} if name == "images" else dims,),
        verbose=False,
    )
    program.save(str(path))
    info = {"task": task, "input": name, "output": "logits"}
    info.update(
        {k: v for k, v in artifacts.items() if k in ("classes", "img_size", "in_chans", "mean", "std")}
    )
    if "tokenizer" in artifacts:
        state = json.loads(artifacts["tokenizer"])
        info["tokenizer"] = state["kind"]
        if "tokenizer" in state:
            (out_dir / "tokenizer.json").write_text(state["tokenizer"], encoding="utf-8")
    (out_dir / "attnlab.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return path
