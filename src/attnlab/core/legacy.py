"""Old names, one table: a saved run's config is read the new way (``read_saved``), a user's
config with an old name is refused naming the new one (``renamed``)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from attnlab.core.signatures import parameters
from attnlab.core.specs import is_int
from attnlab.core.targets import target_nodes

log = logging.getLogger(__name__)

# old -> new. "attnlab.x.": a _target_'s module (issue 58); "model.x"/"data.x": a full key, moved
# into a node (issue 58); ".x": a model or data node's key, renamed (issues 28, 58)
NEW_NAMES = {
    "attnlab.tasks.": "attnlab.training.",
    "attnlab.callbacks.": "attnlab.training.callbacks.",
    "attnlab.loggers.": "attnlab.training.loggers.",
    "attnlab.utils.": "attnlab.core.",
    ".n_embd": ".dim",  # GPT
    ".d_model": ".dim",  # Transformer, nn.MultiHeadAttention
    ".emb_dim": ".dim",  # Seq2Seq
    ".n_layer": ".depth",  # GPT
    ".n_enc_layers": ".enc_depth",  # Transformer, Seq2Seq
    ".n_dec_layers": ".dec_depth",  # Transformer
    ".n_heads": ".n_head",  # SwinTransformer (a list, one per stage)
    ".block_size": ".max_len",  # GPT's position table; the language-modelling window
    ".context_length": ".max_len",  # CLIP's TextTransformer; the caption length
    ".d_ff": ".mlp_ratio",  # Transformer
    ".mlp_dim": ".mlp_ratio",  # Bert
    ".pretrained_ckpt": ".init_from",  # TextClassificationTask
    ".corpus": ".source",  # TextDataModule, TranslationDataModule
    ".dataset": ".source",  # ImageClassificationDataModule
    ".bpe_vocab_size": ".vocab_size",  # TextDataModule
    ".val_fraction": ".val_size",  # TextDataModule, MaskedLMDataModule (still a fraction)
    ".test_fraction": ".test_size",
    ".n_train": ".train_size",  # ScenesDataModule
    ".n_val": ".val_size",
    ".n_test": ".test_size",
    ".norm_eps": "",  # VisionTransformer (removed: "" drops it)
    "data.mixup_prob": "data.mixup.prob",
    "data.mixup_switch_prob": "data.mixup.switch_prob",
    "data.shards_dir": "data.source.path",
    "data.pairs_file": "data.source.path",
    "data.captions_file": "data.source.path",
    "data.files": "data.source.names",
    "data.synthetic_size": "data.source.train_size",
}
SIZES = ("val_size", "test_size")
# (data.val_size, which some DataModules still take, is left to their signature: ImageFiles' is
# data.source.val_size, moved when its source is built)
NEW_NAMES |= {
    f"model.{k}": f"model.optim.{k}"
    for k in ("optimizer", "scheduler", "weight_decay", "lr_decay", "freeze", "compile", "compile_mode")
}
NEW_NAMES |= {f"data.{k}": f"data.mixup.{k}" for k in ("mixup_alpha", "cutmix_alpha")}
NEW_NAMES |= {f"data.{k}": f"data.normalize.{k}" for k in ("mean", "std")}
NEW_NAMES |= {
    f"data.{k}": f"data.source.{k}"
    for k in ("on_bad_record", "shuffle_batches", "fit_captions", "url", "sha256", "images_dir")
    + ("image_key", "caption_key", "data_dir", "cache_dir", "train_file", "val_file", "test_file")
}
# still keys of some DataModules (ScenesDataModule's counts): moved only where the node lacks them
NEW_NAMES |= {f"data.{k}": f"data.source.{k}" for k in SIZES}
KEPT = {f"data.{k}" for k in SIZES}
RATIO = " (now a ratio: the MLP is int(mlp_ratio * dim) wide)"
SOURCE = " (now a node: data/source=<name of conf/data/source/*.yaml>, then data.source.<key>=...)"
NOTES = {".d_ff": RATIO, ".mlp_dim": RATIO, ".corpus": SOURCE, ".dataset": SOURCE}
NOTES[".norm_eps"] = ": pre_norm sets the LayerNorms' eps (true: 1e-5, false: 1e-6)"
MODULES = [o for o in NEW_NAMES if o.startswith("attnlab.")]


def _step(key: str, takes: Any) -> tuple[str, str] | None:
    """One look-up: ``key``'s new name and note, by its full name, else by its last name."""
    old = next((o for o in NEW_NAMES if key == o or key.startswith(o + ".")), None)
    if old is not None:
        return None if takes is None and old in KEPT else (NEW_NAMES[old] + key[len(old) :], "")
    parent, _, name = key.rpartition(".")
    if parent.split(".")[0] in ("model", "data") and f".{name}" in NEW_NAMES:
        new = NEW_NAMES[f".{name}"]
        return (parent + new if new else ""), NOTES.get(f".{name}", "")
    return None


def new_name(key: str, takes: Any = None) -> tuple[str, str] | None:
    """The new name of an old ``key`` and the rename's note, or None. ``takes``: the parameters of
    ``key``'s node; a name it does not take is followed on (``data.val_fraction -> data.val_size
    -> data.source.val_size``), or the key is not an old one there."""
    found = _step(key, takes)
    parent = key.rpartition(".")[0]
    while found and takes is not None and found[0].rpartition(".")[0] == parent:
        if found[0].rpartition(".")[2] in takes:
            break
        further = _step(found[0], takes)
        found = further and (further[0], found[1] or further[1])
    return found


def renamed(key: str, takes: Any = None) -> str | None:
    """``"<key> was renamed <new name><note>"`` for an old ``key`` (see ``new_name``), else None."""
    found = None if key.startswith("attnlab.") else new_name(key, takes)
    return found and f"{key} was {f'renamed {found[0]}' if found[0] else 'removed'}{found[1]}"


# ---- a saved run's config ---------------------------------------------------------------------------


def read_saved(config: Mapping[str, Any] | DictConfig | str, where: str) -> DictConfig:
    """A copy of a run's saved ``config`` (YAML, or a mapping) with its old names read the new way;
    one notice line, from ``where``, says what was translated, if anything was."""
    if OmegaConf.is_config(config):
        config = OmegaConf.to_container(config, resolve=False)
    config = OmegaConf.create(config)
    if done := translate(config):
        log.warning("%s was saved by an older attnlab, read as: %s", where, ", ".join(done))
    return config


def translate(config: DictConfig) -> list[str]:
    """Every old name under ``config`` read the new way, in place; what was done, for the notice."""
    done: dict[str, None] = {}
    for path, node in target_nodes(config):
        target = node._target_
        old = next((o for o in MODULES if isinstance(target, str) and target.startswith(o)), None)
        if old is not None:
            node["_target_"] = target = NEW_NAMES[old] + target.removeprefix(old)
            done[f"{old}* -> {NEW_NAMES[old]}*"] = None
        if path.split(".")[0] in ("model", "data") and (params := parameters(target)) is not None:
            done |= dict.fromkeys(_translate_keys(node, path, target, params))
    return list(done)


def _translate_keys(node: DictConfig, path: str, target: str, params: Mapping[str, Any]) -> list[str]:
    """One node's old keys renamed, or moved into the node they now belong to."""
    raw = OmegaConf.to_container(node, resolve=False)
    done = []
    groups = {}
    for key, value in raw.items():
        if f"{path}.{key}" in BUILD and isinstance(value, str):  # data.source=shards
            new = key
        elif key in params or (found := new_name(f"{path}.{key}", params)) is None:
            continue
        elif not found[0]:  # removed
            with open_dict(node):
                del node[key]
            done.append(f"{path}.{key} dropped")
            continue
        else:
            new = found[0].removeprefix(f"{path}.")
        sub, _, rest = new.partition(".")
        if sub not in params:
            continue
        if rest or f"{path}.{sub}" in BUILD:
            groups.setdefault(sub, {})[key] = (rest, value)
            continue
        with open_dict(node):
            node[sub] = _ratio(node, value, target) if NOTES.get(f".{key}") == RATIO else value
            del node[key]
        done.append(f"{path}.{key} -> {path}.{sub}")
    for sub, moved in groups.items():
        current = raw[sub] if isinstance(raw.get(sub), dict) else {}
        built = BUILD.get(f"{path}.{sub}", _plain)(moved, current, raw, target)
        moved |= {k: None for k in built if k in raw and k not in params and k != "_target_"}
        with open_dict(node):
            for key in moved:
                del node[key]
            node[sub] = built
        done.append(f"{path}.{{{','.join(moved)}}} -> {path}.{sub}")
    return done


# (old key: (its name in the node, value)), the node as saved, the saved node above, its target
Moved = dict[str, tuple[str, Any]]


def _plain(moved: Moved, current: dict, raw: dict, target: str) -> dict[str, Any]:
    """The node old keys moved into (``data.mixup_prob`` -> ``data.mixup.prob``)."""
    return current | dict(moved.values())


def _optim(moved: Moved, current: dict, raw: dict, target: str) -> dict[str, Any]:
    return {"_target_": "attnlab.training.optim.Optimization", **_plain(moved, current, raw, target)}


def _source(moved: Moved, current: dict, raw: dict, target: str) -> dict[str, Any]:
    """The ``data.source`` node: the one flat keys described (before issue 58), else the run's;
    with the split sizes its class takes (a source already split had them unused)."""
    sizes = {new: value for new, value in moved.values() if new in SIZES}
    node = _flat_source(raw, target) if len(sizes) < len(moved) else dict(current)
    takes = parameters(node.get("_target_")) or {}
    return node | {k: v for k, v in sizes.items() if k in takes}


def _flat_source(raw: dict[str, Any], target: str) -> dict[str, Any]:
    """The source a saved run's flat data keys named (``data.corpus=pydoc``: ``Builtin(pydoc)``)."""
    kind = raw.get("source") if isinstance(raw.get("source"), str) else None
    keep = lambda *keys: {k: raw[k] for k in keys if k in raw}  # noqa: E731
    new = lambda cls, **keys: {"_target_": f"attnlab.data.sources.{cls}", **keys}  # noqa: E731
    if raw.get("shards_dir") is not None or kind == "shards":
        if target.endswith("ImageFilesDataModule"):
            return new("StreamedShards", path=raw["shards_dir"], **keep("on_bad_record", "shuffle_batches"))
        if target.endswith(("ImageTextDataModule", "CaptionsFolderDataModule")):
            return new("CaptionShards", path=raw["shards_dir"], **keep("on_bad_record", "fit_captions"))
        return new("Shards", path=raw["shards_dir"])
    if kind == "folder":
        return new("Folder", path=raw["data_dir"], **keep("val_size", "on_bad_record"))
    if kind == "pairs":
        keys = keep("test_file", "image_key", "caption_key", "on_bad_record")
        return new("Pairs", path=raw["pairs_file"], **keys)
    if "train_file" in raw:
        return new("SplitFiles", **keep("train_file", "val_file", "test_file", "data_dir", "cache_dir"))
    if "captions_file" in raw:
        return new("Captions", path=raw["captions_file"], **keep("images_dir"))
    if "files" in raw:
        return new("Files", names=raw["files"], **keep("data_dir", "cache_dir"))
    name = raw.get("corpus", raw.get("dataset", kind))
    if name == "synthetic":
        size = {"train_size": raw["synthetic_size"]} if "synthetic_size" in raw else {}
        return new("Generated", name=name, **size, **keep("cache_dir"))
    return new("Builtin", name=name, **keep("data_dir", "cache_dir", "url", "sha256"))


# the nodes old keys moved into that are built otherwise than key by key
BUILD: dict[str, Callable[..., dict[str, Any]]] = {"model.optim": _optim, "data.source": _source}


def _ratio(node: DictConfig, hidden: Any, target: str) -> Any:
    """An MLP's old width as the ratio to the model's width that gives it back."""
    width = next((node[k] for k in ("d_model", "emb_dim", "n_embd", "dim") if k in node), None)
    if width is None and "dim" in (params := parameters(target, static=False) or {}):
        width = params["dim"].default
    return mlp_ratio_for(hidden, width) if is_int(hidden) and is_int(width) else hidden


def mlp_ratio_for(hidden: int, dim: int) -> float:
    """The ``mlp_ratio`` whose ``int(mlp_ratio * dim)`` is ``hidden`` (``hidden / dim`` times
    ``dim`` can land a rounding error below ``hidden``, which ``int`` would cut to one less)."""
    ratio = hidden / dim
    while int(ratio * dim) < hidden:
        ratio = math.nextafter(ratio, math.inf)
    return ratio
