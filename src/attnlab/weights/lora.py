"""LoRA adapters (Hu et al. 2021) put into a net through Hugging Face's PEFT, and merged back into
its weights: ``model.lora`` (``LoRA``). PEFT is imported only where adapters are made or merged."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf
from torch import nn

from attnlab.core.specs import LoRA

log = logging.getLogger(__name__)

# a short name -> the ends of the layer names it means, in our nets and in timm's
SHORT_NAMES = {
    "qkv": ("attn.in_proj", "attn.kv_proj", "attn.qkv"),  # attention's input projections
    "proj": ("attn.out_proj", "attn.proj"),  # attention's output projection
    "mlp": ("mlp.fc1", "mlp.fc2"),  # the feed-forward layers
}
ADAPTABLE = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d)  # what a PEFT LoRA wraps


def lora_spec(lora: LoRA | Mapping[str, Any] | DictConfig) -> dict[str, Any]:
    """``model.lora`` as a plain dict with its defaults filled in."""
    spec = OmegaConf.to_container(lora, resolve=True) if isinstance(lora, DictConfig) else dict(lora)
    return {"alpha": spec["r"], "dropout": 0.0, **spec, "targets": list(spec["targets"])}


def target_layers(net: nn.Module, targets: list[str]) -> list[str]:
    """The dotted names of the layers of ``net`` that ``targets`` name; none is a ``ValueError``."""
    layers = [name for name, m in net.named_modules() if name and isinstance(m, ADAPTABLE)]

    def named(target: str) -> list[str]:
        ends = SHORT_NAMES.get(target, (target,))
        return [n for n in layers if any(n == e or n.endswith(f".{e}") for e in ends)]

    found: list[str] = []
    for target in targets:
        if not (hits := named(target)):
            known = [short for short in SHORT_NAMES if named(short)]
            raise ValueError(
                f"lora.targets: {target!r} names no layer of the {type(net).__name__} (short names it "
                f"has: {', '.join(known) or 'none'}; or the end of a layer's name, e.g. {layers[-1]})"
            )
        found += [n for n in hits if n not in found]
    return found


def add_adapters(net: nn.Module, lora: LoRA | DictConfig) -> list[str]:
    """LoRA adapters put into ``net`` in place (PEFT's ``inject_adapter_in_model``: A random, B zero);
    only the adapters keep their gradients. Returns the layers adapted."""
    layers = target_layers(net, lora_spec(lora)["targets"])
    from peft import inject_adapter_in_model

    # target_modules, a regex: these names exactly
    inject_adapter_in_model(lora_config(lora, target_modules="|".join(map(re.escape, layers))), net)
    return layers


def lora_config(lora: LoRA | Mapping[str, Any] | DictConfig, **options: Any) -> Any:
    """PEFT's ``LoraConfig`` for ``model.lora``, with its other ``options``."""
    from peft import LoraConfig

    spec = lora_spec(lora)
    return LoraConfig(r=spec["r"], lora_alpha=spec["alpha"], lora_dropout=spec["dropout"], **options)


def adapter_layers(net: nn.Module) -> dict[str, nn.Module]:
    """The PEFT layers of ``net`` by name (none: it has no adapters)."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in net.named_modules() if isinstance(m, LoraLayer)}


def remove_adapters(net: nn.Module, merge: bool) -> dict[str, nn.Module]:
    """Each PEFT layer replaced by the layer it adapts, its adapter merged in where ``merge``
    (W + B A alpha/r). Returns the PEFT layers taken out, by name."""
    layers = adapter_layers(net)
    for name, layer in layers.items():
        if merge:
            layer.merge()
        parent, _, child = name.rpartition(".")
        setattr(net.get_submodule(parent), child, layer.get_base_layer())
    if hasattr(net, "peft_config"):  # PEFT's note of the adapters, gone with them
        del net.peft_config
    return layers
