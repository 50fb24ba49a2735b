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
from attnlab.weights.pretrained import converter, export_pretrained

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
    """``net`` as ``out_dir/model.onnx`` (dynamic batch and text length) with ``attnlab.json``."""
    if task not in ONNX_TASKS:
        raise CheckpointError(
            f"--format onnx: a {task} does not export to ONNX (these do: {', '.join(ONNX_TASKS)})"
        )
    name = ONNX_TASKS[task]
    dims = {0: torch.export.Dim("batch", min=1, max=1024)}
    if name == "ids":
        dims[1] = torch.export.Dim("length", min=2, max=text_model(net).max_len)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "model.onnx"
    program = torch.onnx.export(
        net.eval(),
        (example_input(task, net, artifacts),),
        dynamo=True,
        input_names=[name],
        output_names=["logits"],
        dynamic_shapes=(dims,),
        verbose=False,
    )
    program.save(str(path))
    info = {"task": task, "input": name, "output": "logits"}
    info |= {k: v for k, v in artifacts.items() if k in ("classes", "img_size", "in_chans", "mean", "std")}
    if "tokenizer" in artifacts:
        state = json.loads(artifacts["tokenizer"])
        info["tokenizer"] = state["kind"]
        if "tokenizer" in state:
            (out_dir / "tokenizer.json").write_text(state["tokenizer"], encoding="utf-8")
    (out_dir / "attnlab.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return path


def library_layer_names(net: nn.Module, layers: list[str]) -> dict[str, tuple[str, bool]]:
    """Each of ``layers`` by the counterpart library's name for it, and whether it keeps the weight
    transposed (GPT-2's ``Conv1D``); a layer with none (BERT's packed q, k, v) is refused."""
    module = converter(net, "attnlab-export merge=false")
    theirs = module.export_state(net)
    names: dict[str, tuple[str, bool]] = {}
    for layer in layers:
        ours = net.get_submodule(layer).weight
        same = [
            (k, not v.is_contiguous())
            for k, v in theirs.items()
            if k.endswith(".weight") and v.data_ptr() == ours.data_ptr() and v.numel() == ours.numel()
        ]
        if len(same) != 1:
            raise CheckpointError(
                f"attnlab-export merge=false: the adapted layer {layer} has no one counterpart in "
                f"{module.__name__.rsplit('.', 1)[-1]}'s model (export with merge=true, or train "
                "without that target)"
            )
        names[layer] = (same[0][0].removesuffix(".weight"), same[0][1])
    return names


def export_adapters(net: nn.Module, lora: Any, out_dir: Path, artifacts: dict[str, Any]) -> None:
    """A LoRA net kept apart (``merge=false``): its base weights as ``export_pretrained`` writes them,
    its adapters beside them as a PEFT adapter folder under the library's layer names."""
    from safetensors.torch import save_file

    from attnlab.weights.lora import lora_config, remove_adapters

    adapters = remove_adapters(net, merge=False)  # net: the base net
    names = library_layer_names(net, list(adapters))
    export_pretrained(net, out_dir, artifacts)
    state = {}
    for layer, peft_layer in adapters.items():
        for part in ("lora_A", "lora_B"):
            weight = getattr(peft_layer, part)["default"].weight
            state[f"base_model.model.{names[layer][0]}.{part}.weight"] = weight.detach().contiguous()
    save_file(state, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    lora_config(
        lora,
        target_modules=sorted(name for name, _ in names.values()),
        fan_in_fan_out=any(transposed for _, transposed in names.values()),
    ).save_pretrained(str(out_dir))
    log.info("attnlab-export merge=false: %d adapters beside the base weights", len(adapters))
