"""timm's ViT, DeiT (distilled) and Swin weights into ours, and ours out as timm saves them (a folder of
``model.safetensors`` + ``config.json``, or a bare state dict). A head of another size starts fresh; another
image size, window or channel count is fitted with timm's own functions; each with a notice."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from attnlab.core.errors import CheckpointError
from attnlab.weights.checkpoint import check_fits, fit_heads
from attnlab.weights.hf_files import read_json, read_weights

log = logging.getLogger(__name__)

# timm's names -> ours, wherever they occur
_RENAMES = {".attn.qkv.": ".attn.in_proj.", ".attn.proj.": ".attn.out_proj."}
# buffers older timm and Microsoft's Swin checkpoints carry; rebuilt by the model
_REBUILT = re.compile(r"(relative_position_index|attn_mask)$")
# the timm module each of our nets has its counterpart in, and that class's name
TIMM_CLASS = {
    "VisionTransformer": "VisionTransformer",
    "DistilledVisionTransformer": "VisionTransformerDistilled",
    "SwinTransformer": "SwinTransformer",
}
HEADS = ("head.", "head_dist.")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "pytorch_model.pth", "model.pth")


def state_dict_from_timm(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A timm ``vit_*``, ``deit_*distilled*`` or ``swin_*`` state dict, renamed for our models."""
    out = {}
    for name, value in state.items():
        for theirs, ours in _RENAMES.items():
            name = name.replace(theirs, ours)
        if not _REBUILT.search(name):
            out[re.sub(r"^head\.fc\.", "head.", name)] = value  # Swin's head is timm's ClassifierHead
    return out


def export_state(net: nn.Module) -> dict[str, Tensor]:
    """Our net's state dict under timm's names (contiguous tensors, as safetensors wants)."""
    swin = type(net).__name__ == "SwinTransformer"
    out = {}
    for name, value in net.state_dict().items():
        for theirs, ours in _RENAMES.items():
            name = name.replace(ours, theirs)
        out[re.sub(r"^head\.", "head.fc.", name) if swin else name] = value.detach().contiguous()
    return out


def load_timm_weights(model: nn.Module, timm_model: nn.Module) -> nn.Module:
    """Copy ``timm_model``'s weights into ``model`` (same configuration; every tensor must fit)."""
    model.load_state_dict(state_dict_from_timm(timm_model.state_dict()))
    return model


# ---------------------------------------------------------------------------------------------
# reading a saved model


def timm_config(folder: Path) -> dict[str, Any]:
    """The ``config.json`` of a folder timm saved."""
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"model.init_from={folder}: no config.json (not a folder timm saved)")
    config = read_json(config_file)
    if "architecture" not in config and "architecture" not in config.get("pretrained_cfg", {}):
        raise CheckpointError(f"model.init_from={config_file}: no 'architecture' (not a timm config)")
    return config


def timm_reference(config: dict[str, Any], where: Path) -> nn.Module:
    """timm's model that ``config`` describes, on the meta device (no memory, no init)."""
    import timm

    arch = config.get("architecture") or config["pretrained_cfg"]["architecture"]
    if not timm.is_model(arch):
        raise CheckpointError(f"model.init_from={where}: architecture {arch!r} is not a timm model")
    try:
        with torch.device("meta"):
            return timm.create_model(arch, pretrained=False, **config.get("model_args", {}))
    except (TypeError, ValueError, AssertionError, RuntimeError) as e:  # model_args timm refuses
        raise CheckpointError(
            f"model.init_from={where}: timm cannot build {arch} from its config ({e})"
        ) from e


def check_architecture(net: nn.Module, reference: nn.Module, where: Path) -> None:
    """The family and head counts (which no tensor shape shows) must be ours."""
    ours, theirs = type(net).__name__, type(reference).__name__
    if TIMM_CLASS[ours] != theirs:
        raise CheckpointError(
            f"model.init_from={where}: a timm {theirs} ({reference.pretrained_cfg.get('architecture')}), "
            f"but this run configures a {ours}; choose the matching model/net"
        )
    if ours == "SwinTransformer":
        heads = [stage.blocks[0].attn.num_heads for stage in reference.layers]
        mine = [stage.blocks[0].attn.n_head for stage in net.layers]
    else:  # the head reads [CLS] or the mean token, with no norm of its own
        pool = reference.global_pool + (
            " then fc_norm" if not isinstance(reference.fc_norm, nn.Identity) else ""
        )
        if pool != net.global_pool:
            raise CheckpointError(
                f"model.init_from={where}: timm's head reads global_pool={pool!r}, the net's reads "
                f"{net.global_pool!r} (model.net.global_pool: token or avg, which has no fc_norm)"
            )
        heads = reference.blocks[0].attn.num_heads
        mine = net.blocks[0].attn.n_head
    if heads != mine:
        raise CheckpointError(
            f"model.init_from={where}: {heads} attention heads, the net has {mine} (model.net.n_head)"
        )


# ---------------------------------------------------------------------------------------------
# fitting it to the configured net


def fit_input_channels(state: dict[str, Tensor], expected: dict[str, Tensor], where: Path) -> None:
    from timm.models import adapt_input_conv

    key = "patch_embed.proj.weight"
    if key in state and key in expected and state[key].shape[1] != expected[key].shape[1]:
        c_in, c_out = state[key].shape[1], expected[key].shape[1]
        state[key] = adapt_input_conv(c_out, state[key])
        log.warning(
            "model.init_from=%s: %d input channels adapted to %d (timm's adapt_input_conv)",
            where,
            c_in,
            c_out,
        )


def fit_positions(net: nn.Module, state: dict[str, Tensor], where: Path) -> None:
    """ViT/DeiT: position embeddings of another grid resampled (bicubic) to the net's grid."""
    from timm.layers import resample_abs_pos_embed

    pos = state.get("pos_embed")
    prefix = net.num_prefix_tokens
    if pos is None or pos.shape == net.pos_embed.shape or pos.shape[-1] != net.pos_embed.shape[-1]:
        return
    old = round((pos.shape[1] - prefix) ** 0.5)
    if old * old + prefix != pos.shape[1]:
        return  # not a square grid behind the prefix tokens: check_fits names it
    grid = net.patch_embed.grid_size
    state["pos_embed"] = resample_abs_pos_embed(
        pos, new_size=[grid, grid], old_size=[old, old], num_prefix_tokens=prefix
    )
    log.warning(
        "model.init_from=%s: position embeddings resampled from a %dx%d to a %dx%d grid",
        where,
        old,
        old,
        grid,
        grid,
    )


def fit_windows(net: nn.Module, state: dict[str, Tensor], where: Path) -> None:
    """Swin: relative-position-bias tables of another window (a small image shrinks the last
    stages' windows) resized to the net's with timm's ``resize_rel_pos_bias_table``."""
    from timm.layers import resize_rel_pos_bias_table

    resized = set()
    for name, table in net.state_dict().items():
        if not name.endswith("relative_position_bias_table") or name not in state:
            continue
        if state[name].shape != table.shape and state[name].shape[1] == table.shape[1]:  # else check_fits
            window = round((table.shape[0] ** 0.5 + 1) / 2)
            state[name] = resize_rel_pos_bias_table(state[name], (window, window), tuple(table.shape))
            resized.add(window)
    if resized:
        log.warning(
            "model.init_from=%s: relative-position-bias tables resized to windows of %s",
            where,
            sorted(resized),
        )


def load(net: nn.Module, source: Path) -> None:
    """``model.init_from``: a timm folder or state dict copied into ``net``, fitted with notices."""
    if source.is_dir():
        check_architecture(net, timm_reference(timm_config(source), source), source)
    state = state_dict_from_timm(read_weights(source, WEIGHT_FILES))
    expected = net.state_dict()
    resized, missing, extra = fit_heads(state, expected, HEADS)
    if resized or missing or extra:  # heads of another size (or on one side) start as the net has them
        classes = next((tuple(v.shape) for k, v in expected.items() if k.startswith(HEADS)), "none")
        log.warning(
            "model.init_from=%s: the classification head does not fit (checkpoint %s, net %s): "
            "it starts freshly initialised",
            source,
            ", ".join(resized + extra) or "none",
            classes,
        )
    fit_input_channels(state, expected, source)
    if type(net).__name__ == "SwinTransformer":
        fit_windows(net, state, source)
    else:
        fit_positions(net, state, source)
    check_fits(net, state, source)
    net.load_state_dict(state)
    log.info("model.init_from=%s: timm weights loaded", source)


# ---------------------------------------------------------------------------------------------
# writing ours as timm's


def timm_args(net: nn.Module) -> tuple[str, dict[str, Any]]:
    """The timm architecture and ``model_args`` that rebuild ``net`` exactly."""
    name = type(net).__name__
    if type(net.patch_embed).__name__ != "PatchEmbedding":
        raise CheckpointError(
            f"attnlab-export: a {name} with a conv stem has no timm counterpart (stem=patch has)"
        )
    args: dict[str, Any] = {
        "num_classes": net.num_classes,
        "img_size": net.img_size,
        "in_chans": net.in_chans,
        "patch_size": net.patch_embed.patch_size,
    }
    if name == "SwinTransformer":
        first = net.layers[0].blocks[0]
        dim = first.attn.in_proj.in_features
        return "swin_tiny_patch4_window7_224", {
            **args,
            "embed_dim": dim,
            "depths": [len(stage.blocks) for stage in net.layers],
            "num_heads": [stage.blocks[0].attn.n_head for stage in net.layers],
            "window_size": max(stage.blocks[0].attn.window for stage in net.layers),
            "mlp_ratio": first.mlp.fc1.out_features / dim,
        }
    block = net.blocks[0]
    dim = net.pos_embed.shape[-1]
    if block.norm1.eps != 1e-6 or net.patch_embed.proj.bias is None:
        raise CheckpointError(
            f"attnlab-export: timm's ViT config cannot say LayerNorm eps {block.norm1.eps} (pre_norm: true) "
            "or patch_bias=false (export CLIP's image tower with its CLIP instead)"
        )
    if block.attn.n_kv_head != block.attn.n_head or isinstance(block.attn.q_norm, nn.RMSNorm):
        raise CheckpointError(
            "attnlab-export: timm's ViT has a key and value head per head and LayerNorm QK-norm "
            "(model.net.n_kv_head=null, model.net.qk_norm=false or layernorm)"
        )
    if isinstance(block.attn.q_norm, nn.LayerNorm):  # timm's norm_layer: eps 1e-6, as ours
        args["qk_norm"] = True
    args |= {
        "embed_dim": dim,
        "depth": len(net.blocks),
        "num_heads": block.attn.n_head,
        "mlp_ratio": block.mlp.fc1.out_features / dim,
        "pre_norm": not isinstance(net.norm_pre, nn.Identity),
    }
    if net.global_pool == "avg":  # the mean of the normalised tokens: timm's without fc_norm
        args |= {"global_pool": "avg", "fc_norm": False}
    if type(block.mlp.act).__name__ == "QuickGELU":
        args["act_layer"] = "quick_gelu"
    distilled = name == "DistilledVisionTransformer"
    return "deit_tiny_distilled_patch16_224" if distilled else "vit_tiny_patch16_224", args


def export(net: nn.Module, out_dir: Path, artifacts: dict) -> None:
    """``net`` as timm saves it (``timm.create_model("local-dir:<out_dir>", pretrained=True)``)."""
    from safetensors.torch import save_file
    from timm.models._hub import save_config_for_hf

    arch, args = timm_args(net)
    reference = timm_reference({"architecture": arch, "model_args": args}, out_dir)
    state = export_state(net)
    check_fits(reference, state, Path(f"{type(net).__name__} (timm's {arch})"))
    data: dict[str, Any] = {"input_size": (net.in_chans, net.img_size, net.img_size), "crop_pct": 1.0}
    if "mean" in artifacts and "std" in artifacts:
        data |= {"mean": tuple(artifacts["mean"]), "std": tuple(artifacts["std"])}
    model_config: dict[str, Any] = (
        {"label_names": list(artifacts["classes"])} if artifacts.get("classes") else {}
    )
    save_file(state, str(out_dir / "model.safetensors"))
    save_config_for_hf(
        reference, out_dir / "config.json", model_config=model_config, model_args=args, data_config=data
    )
