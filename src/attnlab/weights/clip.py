"""open_clip's CLIP weights into ours, and ours out as open_clip's saved format (``open_clip_config.json``
+ ``open_clip_model.safetensors``, which ``open_clip.create_model("local-dir:<folder>")`` loads); the image
tower fitted as timm's weights are, a longer text position table cut to the net's."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from attnlab.core.errors import CheckpointError
from attnlab.weights.checkpoint import check_fits
from attnlab.weights.hf_files import act_name, read_json, read_weights, renamers
from attnlab.weights.timm_vision import fit_input_channels, fit_positions

log = logging.getLogger(__name__)

CONFIG = "open_clip_config.json"
CLIP_EOT = "<|endoftext|>"  # OpenAI CLIP's end-of-text (open_clip's vocabulary)
CAPTION_EOT_ID = 2  # our caption tokenizer's end-of-text (attnlab.data.text.tokenizers.CaptionTokenizer)
WEIGHT_FILES = ("open_clip_model.safetensors", "open_clip_pytorch_model.bin", "open_clip_pytorch_model.pth")
# open_clip's names inside a residual block -> ours
_BLOCK = {
    "ln_1.": "norm1.",
    "ln_2.": "norm2.",
    "attn.in_proj_weight": "attn.in_proj.weight",
    "attn.in_proj_bias": "attn.in_proj.bias",
    "attn.out_proj.": "attn.out_proj.",
    "mlp.c_fc.": "mlp.fc1.",
    "mlp.c_proj.": "mlp.fc2.",
}
# open_clip's names -> ours ("{}": a block's number); some shapes differ (``_reshape``)
_from_open_clip, _to_open_clip = renamers(
    {
        "visual.conv1.weight": "image.patch_embed.proj.weight",
        "visual.class_embedding": "image.cls_token",
        "visual.positional_embedding": "image.pos_embed",
        "visual.ln_pre.": "image.norm_pre.",
        "visual.ln_post.": "image.norm.",
        "visual.proj": "image_proj.weight",
        "token_embedding.weight": "text.embed.tokens.weight",
        "positional_embedding": "text.embed.positions.emb.weight",
        "ln_final.": "text.norm.",
        "text_projection": "text_proj.weight",
        "logit_scale": "logit_scale",
    }
    | {f"visual.transformer.resblocks.{{}}.{a}": f"image.blocks.{{}}.{b}" for a, b in _BLOCK.items()}
    | {f"transformer.resblocks.{{}}.{a}": f"text.blocks.{{}}.{b}" for a, b in _BLOCK.items()}
)


def _reshape(ours: str, value: Tensor, back: bool = False) -> Tensor:
    """open_clip's tensor in our shape (``back``: ours in open_clip's)."""
    if ours in ("image_proj.weight", "text_proj.weight"):
        return value.t()  # x @ proj (D, E) <-> Linear weight (E, D)
    if ours == "image.cls_token":
        return value.reshape(-1) if back else value.reshape(1, 1, -1)
    if ours == "image.pos_embed":
        return value.squeeze(0) if back else value.unsqueeze(0)
    if ours == "logit_scale":
        return value.reshape(()) if back else value.reshape(1)
    return value


def state_dict_from_open_clip(state: dict[str, Tensor], where: Path) -> dict[str, Tensor]:
    out = {}
    for name, value in state.items():
        if name == "attn_mask" or name.endswith(".attn_mask"):
            continue  # the causal mask, a buffer older open_clip saved
        if (ours := _from_open_clip(name)) is None:
            raise CheckpointError(
                f"model.init_from={where}: {name} has no counterpart in our CLIP "
                "(open_clip's ViT image tower and Transformer text tower are supported)"
            )
        out[ours] = _reshape(ours, value)
    return out


def export_state(net: nn.Module) -> dict[str, Tensor]:
    """Our CLIP's state dict under open_clip's names and shapes."""
    out = {}
    for name, value in net.state_dict().items():
        if (theirs := _to_open_clip(name)) is None:
            raise CheckpointError(f"attnlab-export: the net's {name} has no counterpart in open_clip's CLIP")
        out[theirs] = _reshape(name, value, back=True).detach().contiguous()
    return out


# ---------------------------------------------------------------------------------------------
# the architecture in open_clip's config against ours


# what open_clip's config says and no tensor shows: (its value in our net, our config key that sets it)
_FACTS = {
    "image heads": (lambda net: net.image.blocks[0].attn.n_head, "model.net.image.n_head"),
    "image norm eps": (
        lambda net: net.image.blocks[0].norm1.eps,
        "model.net.image.pre_norm: with it eps 1e-5, else 1e-6",
    ),
    "image act": (lambda net: act_name(net.image.blocks[0].mlp.act), "model.net.image.act"),
    "text heads": (lambda net: net.text.blocks[0].attn.n_head, "model.net.text.n_head"),
    "text norm eps": (
        lambda net: net.text.blocks[0].norm1.eps,
        "(the text tower's LayerNorms have eps 1e-5)",
    ),
    "text act": (lambda net: act_name(net.text.blocks[0].mlp.act), "model.net.text.act"),
    "text pooling": (lambda net: net.text.pool, "model.net.text.pool"),
}


def architecture_of(net: nn.Module) -> dict[str, Any]:
    """The ``_FACTS`` of our net (heads, norms' eps, activations, pooling)."""
    image = net.image
    if type(image).__name__ != "VisionTransformer" or type(image.patch_embed).__name__ != "PatchEmbedding":
        raise CheckpointError(
            f"model.net.image: a {type(image).__name__} (stem {type(image.patch_embed).__name__}); "
            "open_clip's image tower is a VisionTransformer with stem=patch"
        )
    return {fact: value(net) for fact, (value, _) in _FACTS.items()}


# open_clip's defaults (its CLIPVisionCfg, CLIPTextCfg) for what a model_cfg leaves out
_VISION_DEFAULTS = {"image_size": 224, "layers": 12, "width": 768, "head_width": 64, "patch_size": 16}
_VISION_DEFAULTS |= {"mlp_ratio": 4.0, "no_ln_pre": False, "pool_type": "tok"}
_TEXT_DEFAULTS = {"context_length": 77, "vocab_size": 49408, "width": 512, "heads": 8, "layers": 12}
_TEXT_DEFAULTS |= {"mlp_ratio": 4.0, "pad_id": 0, "pool_type": "argmax"}


def towers(model_cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A ``model_cfg``'s ``vision_cfg`` and ``text_cfg``, open_clip's defaults filled in."""
    return _VISION_DEFAULTS | model_cfg.get("vision_cfg", {}), _TEXT_DEFAULTS | model_cfg.get("text_cfg", {})


def architecture_in(model_cfg: dict[str, Any], where: Path) -> dict[str, Any]:
    """The ``_FACTS`` from an ``open_clip_config.json``'s ``model_cfg``, refusing what ours lacks."""
    vision, text = towers(model_cfg)
    for key, what in (
        ("timm_model_name", "a timm image tower"),
        ("attentional_pool", "an attentional pooler"),
        ("hf_model_name", "a transformers text tower"),
        ("embed_cls", "a text [CLS] embedding"),
        ("no_causal_mask", "a text tower without causal mask"),
        ("proj_bias", "a text projection with bias"),
    ):
        if vision.get(key) or text.get(key):
            raise CheckpointError(
                f"model.init_from={where}: open_clip's {what} has no counterpart in our CLIP"
            )
    if vision["pool_type"] != "tok":
        raise CheckpointError(
            f"model.init_from={where}: image pooling {vision['pool_type']!r}; ours reads the class token"
        )
    act = "quick_gelu" if model_cfg.get("quick_gelu") else "gelu"
    pool = text["pool_type"]  # "eos": at the end-of-text token, which ends ours
    pool = "last" if pool == "eos" else pool
    return {
        "image heads": vision["width"] // vision["head_width"],
        "image norm eps": (vision.get("norm_kwargs") or {}).get("eps", 1e-5),
        "image act": act,
        "text heads": text["heads"],
        "text norm eps": (text.get("norm_kwargs") or {}).get("eps", 1e-5),
        "text act": act,
        "text pooling": pool,
    }


def check_architecture(net: nn.Module, model_cfg: dict[str, Any], where: Path) -> None:
    ours, theirs = architecture_of(net), architecture_in(model_cfg, where)
    for fact, value in theirs.items():
        if ours[fact] != value:
            raise CheckpointError(
                f"model.init_from={where}: {fact} {value!r}, the net has {ours[fact]!r} ({_FACTS[fact][1]})"
            )


# ---------------------------------------------------------------------------------------------
# in


def fit_context(net: nn.Module, state: dict[str, Tensor], where: Path) -> None:
    """A longer text position table keeps its first rows (causal: a caption never sees those after it)."""
    key = "text.embed.positions.emb.weight"
    length = net.text.max_len
    table = state.get(key)
    if table is not None and table.shape[0] > length and table.shape[1] == net.text.dim:
        state[key] = table[:length]
        log.warning("model.init_from=%s: text positions cut from %d to %d", where, table.shape[0], length)


def load(net: nn.Module, source: Path) -> None:
    """``model.init_from``: an open_clip folder or state dict copied into our CLIP."""
    if source.is_dir():
        check_architecture(net, read_folder_config(source)["model_cfg"], source)
    state = state_dict_from_open_clip(read_weights(source, WEIGHT_FILES), source)
    image = {k.removeprefix("image."): v for k, v in state.items() if k.startswith("image.")}
    fit_input_channels(image, net.image.state_dict(), source)
    fit_positions(net.image, image, source)
    state |= {f"image.{k}": v for k, v in image.items()}
    fit_context(net, state, source)
    check_fits(net, state, source)
    net.load_state_dict(state)
    log.info("model.init_from=%s: open_clip weights loaded", source)


OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)  # open_clip's OPENAI_DATASET_MEAN / _STD
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)


def read_folder_config(folder: Path) -> dict[str, Any]:
    """``open_clip_config.json`` of an open_clip folder, with its ``model_cfg`` checked."""
    config_file = folder / CONFIG
    if not config_file.is_file():
        raise CheckpointError(f"model.init_from={folder}: no {CONFIG} (not a folder open_clip saved)")
    config = read_json(config_file)
    if not isinstance(config.get("model_cfg"), dict):
        raise CheckpointError(f"model.init_from={config_file}: no 'model_cfg' (not an open_clip config)")
    return config


def preprocess(folder: Path) -> dict[str, Any]:
    """An open_clip folder's inputs as our data's artifacts (normalisation: ``preprocess_cfg``'s)."""
    config = read_folder_config(folder)
    vision, text = towers(config["model_cfg"])
    pre = config.get("preprocess_cfg") or {}
    size = vision["image_size"]
    return {
        "img_size": size if isinstance(size, int) else size[0],
        "in_chans": 3,
        "mean": list(pre.get("mean", OPENAI_MEAN)),
        "std": list(pre.get("std", OPENAI_STD)),
        "context_length": text["context_length"],
    }


def clip_from_open_clip(folder: Path) -> nn.Module:
    """Our CLIP as an open_clip folder's ``model_cfg`` describes it, with its weights."""
    from attnlab.models import CLIP, TextTransformer, VisionTransformer

    model_cfg = read_folder_config(folder)["model_cfg"]
    facts = architecture_in(model_cfg, folder)
    vision, text = towers(model_cfg)
    image = VisionTransformer(
        0,
        preprocess(folder)["img_size"],
        3,
        patch_size=vision["patch_size"],
        dim=vision["width"],
        depth=vision["layers"],
        n_head=facts["image heads"],
        mlp_ratio=vision["mlp_ratio"],
        stem="patch",
        pre_norm=not vision["no_ln_pre"],  # and with it the norms' eps (checked in load)
        patch_bias=False,
        act=facts["image act"],
    )
    captions = TextTransformer(
        text["vocab_size"],
        max_len=text["context_length"],
        dim=text["width"],
        depth=text["layers"],
        n_head=facts["text heads"],
        mlp_ratio=text["mlp_ratio"],
        pad_id=text["pad_id"],
        act=facts["text act"],
        pool=facts["text pooling"],
    )
    net = CLIP(image, captions, embed_dim=model_cfg["embed_dim"])
    load(net, folder)
    return net.eval()


# ---------------------------------------------------------------------------------------------
# out


def model_config(net: nn.Module, artifacts: dict) -> dict[str, Any]:
    """open_clip's ``model_cfg`` rebuilding ``net``; what open_clip cannot say is refused."""
    facts = architecture_of(net)
    image = net.image
    text = net.text
    if image.patch_embed.proj.bias is not None or image.in_chans != 3:
        raise CheckpointError(
            "attnlab-export: open_clip's image tower takes RGB through a patch projection without "
            f"bias (model.net.image: in_chans=3, patch_bias=false); this one takes {image.in_chans}"
            f" channel(s), patch_bias={image.patch_embed.proj.bias is not None}"
        )
    if facts["image act"] != facts["text act"]:
        raise CheckpointError("attnlab-export: open_clip has one activation for both towers; these differ")
    dim, tdim = image.pos_embed.shape[-1], text.dim
    vision = {
        "image_size": image.img_size,
        "layers": len(image.blocks),
        "width": dim,
        "head_width": dim // facts["image heads"],
        "mlp_ratio": image.blocks[0].mlp.fc1.out_features / dim,
        "patch_size": image.patch_embed.patch_size,
        "no_ln_pre": isinstance(image.norm_pre, nn.Identity),
    }
    if facts["image norm eps"] != 1e-5:
        vision["norm_kwargs"] = {"eps": facts["image norm eps"]}
    text_cfg = {
        "context_length": text.max_len,
        "vocab_size": text.vocab_size,
        "width": tdim,
        "heads": facts["text heads"],
        "layers": len(text.blocks),
        "mlp_ratio": text.blocks[0].mlp.fc1.out_features / tdim,
        "pad_id": text.pad_id,
    }
    if text.pool == "last":  # our captions end in end-of-text, then only padding
        vocab = caption_vocab(artifacts)
        text_cfg |= {"pool_type": "eos", "eos_id": vocab.get(CLIP_EOT, vocab.get("<eot>", CAPTION_EOT_ID))}
    return {
        "embed_dim": net.embed_dim,
        "quick_gelu": facts["image act"] == "quick_gelu",
        "vision_cfg": vision,
        "text_cfg": text_cfg,
    }


def caption_vocab(artifacts: dict) -> dict[str, int]:
    """The run's caption vocabulary (token -> id), read from its saved tokenizer; ``{}`` if none."""
    saved = json.loads(artifacts.get("tokenizer") or "{}")
    if saved.get("kind") != "caption":
        return {}
    return json.loads(saved["tokenizer"])["model"]["vocab"]


def export(net: nn.Module, out_dir: Path, artifacts: dict) -> None:
    """``net`` as ``open_clip.push_to_hf_hub`` saves it, with the run's normalisation and tokenizer."""
    from safetensors.torch import save_file

    config: dict[str, Any] = {"model_cfg": model_config(net, artifacts)}
    if "mean" in artifacts and "std" in artifacts:
        config["preprocess_cfg"] = {"mean": list(artifacts["mean"]), "std": list(artifacts["std"])}
    save_file(export_state(net), str(out_dir / "open_clip_model.safetensors"))
    (out_dir / CONFIG).write_text(json.dumps(config, indent=2), encoding="utf-8")
    write_caption_tokenizer(artifacts, out_dir)
    pre = config.get("preprocess_cfg")
    log.info(
        "%s: preprocess_cfg holds %s, the normalisation these weights were last trained with",
        out_dir,
        f"the run's data's mean {pre['mean']} and std {pre['std']}" if pre else "none (open_clip: OpenAI's)",
    )


def write_caption_tokenizer(artifacts: dict, out_dir: Path) -> None:
    """The run's caption tokenizer as ``tokenizer.json`` beside the weights: OpenAI CLIP's is open_clip's
    own; one fitted on the run's captions only attnlab reads back (open_clip's gives OpenAI's ids)."""
    vocab = caption_vocab(artifacts)
    if not vocab:
        log.warning("%s: the run has no caption tokenizer: the weights are exported without one", out_dir)
        return
    from tokenizers import Tokenizer

    Tokenizer.from_str(json.loads(artifacts["tokenizer"])["tokenizer"]).save(str(out_dir / "tokenizer.json"))
    if CLIP_EOT in vocab:
        log.info("%s: the captions' tokenizer is OpenAI CLIP's, open_clip's own (get_tokenizer)", out_dir)
    else:
        log.warning(
            "%s: the run's caption tokenizer (fitted on its captions, %d tokens) is written as "
            "tokenizer.json for attnlab (model.init_from, attnlab-zeroshot init_from); open_clip's "
            "get_tokenizer does not read it: encode captions with it, not with open_clip's",
            out_dir,
            len(vocab),
        )
