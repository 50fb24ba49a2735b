"""Printing, saving and checking the composed Hydra config.

Imported before the command line's config is checked, so torch and Lightning are imported only
inside the functions that need them (``check_config(cfg, imports=False)`` needs neither).
"""

from __future__ import annotations

import difflib
import inspect
import json
import logging
import math
import re
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import MissingMandatoryValue

from attnlab.core.errors import AttnlabError, ConfigError
from attnlab.core.signatures import evaluate, static_signature, unseen
from attnlab.core.specs import is_int
from attnlab.core.targets import moved_key

if TYPE_CHECKING:
    import lightning as L

log = logging.getLogger(__name__)

PRINT_ORDER = ("data", "model", "callbacks", "logger", "trainer", "paths", "extras")


def rank_zero() -> bool:
    """Whether this is the process that prints and saves (Lightning's rank 0)."""
    from lightning.pytorch.utilities import rank_zero_only  # only called while training

    return rank_zero_only.rank == 0


def print_config_tree(cfg: DictConfig) -> None:
    """Print the resolved config as a rich tree, main groups first."""
    if not rank_zero():
        return
    import rich
    import rich.syntax
    import rich.tree

    tree = rich.tree.Tree("CONFIG", style="dim", guide_style="dim")
    keys = [k for k in PRINT_ORDER if k in cfg] + [k for k in cfg if k not in PRINT_ORDER]
    for key in keys:
        branch = tree.add(str(key), style="bold")
        value = cfg[key]
        text = OmegaConf.to_yaml(value, resolve=True) if isinstance(value, DictConfig) else str(value)
        branch.add(rich.syntax.Syntax(text, "yaml"))
    rich.print(tree)


def save_config(cfg: DictConfig, path: Path) -> None:
    """The resolved config as YAML (Hydra's ``.hydra/config.yaml`` keeps the unresolved one)."""
    if not rank_zero():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(OmegaConf.to_yaml(cfg, resolve=True))


def resolve(cfg: DictConfig) -> None:
    """Resolve every interpolation now, naming the key that fails."""
    try:
        OmegaConf.resolve(cfg)
    except Exception as e:  # omegaconf raises several types, all with the key in the message
        raise ConfigError(f"config cannot be resolved: {e}") from e


def fill_missing(node: DictConfig, values: Mapping[str, Any], where: str) -> None:
    """Set the ``???`` fields of ``node`` from ``values`` (e.g. the data's vocab_size), recursing
    into nested mappings (``{"text": {"vocab_size": 8000}}`` fills ``<where>.text.vocab_size``)."""
    with open_dict(node):
        for key, value in values.items():
            if key not in node.keys():
                continue
            if isinstance(value, Mapping) and isinstance(node[key], DictConfig):
                fill_missing(node[key], value, f"{where}.{key}")
            elif OmegaConf.is_missing(node, key):
                node[key] = value
                log.info("%s.%s = %s (from the data)", where, key, value)
            elif node[key] is not None and node[key] < value:
                raise ConfigError(f"{where}.{key}={node[key]} is smaller than the data's {key} {value}")


def container(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


def instantiate_trainer(node: DictConfig, **kwargs: Any) -> L.Trainer:
    """``instantiate(node, **kwargs)`` for the ``trainer`` node, under ``constructor_errors``.

    ``val_check_interval`` counts optimizer steps, as ``max_steps`` does, so gradient accumulation
    keeps a recipe's validation schedule; Lightning counts batches, hence the scaling."""
    every, accumulate = node.get("val_check_interval"), node.get("accumulate_grad_batches", 1)
    if is_int(every) and is_int(accumulate) and accumulate > 1:
        kwargs.setdefault("val_check_interval", every * accumulate)
    with constructor_errors("trainer"):
        return instantiate(node, **kwargs)


@contextmanager
def constructor_errors(key: str) -> Iterator[None]:
    """Turn a constructor's complaint about a value (Lightning's ``MisconfigurationException``,
    ``ValueError``: ``trainer.max_steps=-5``, ``callbacks.model_checkpoint.save_top_k=-5``) into
    one ``ConfigError`` line naming the config ``key`` (see ``refusal``)."""
    try:
        yield
    except Exception as e:
        err = refusal(e, key)
        if err is None:
            raise
        raise err from e


def refusal(e: BaseException, key: str = "") -> ConfigError | None:
    """The one-line ``ConfigError`` for the ``ValueError`` (or Lightning's refusal) behind ``e``,
    named by the key of the node whose constructor raised it: ``key``, or the nested node's that
    Hydra's ``InstantiationException`` carries (``full_key: model.net.image``); a message starting
    with one of that constructor's arguments (``dim: must be ...``) names its key
    (``model.net.image.dim: must be ...``). None where ``e`` is no such refusal (a bug)."""
    exceptions = sys.modules.get("lightning.fabric.utilities.exceptions")  # loaded where Lightning is
    refusals = (ValueError, *([exceptions.MisconfigurationException] if exceptions else []))
    where, target = key, None
    while e is not None and not isinstance(e, AttnlabError):
        if isinstance(e, InstantiationException):
            target = next(iter(re.findall(r"target '([^']+)'", str(e))), target)
            if found := re.search(r"\nfull_key: (\S+)", str(e)):  # from the root, or from the node given
                where = found[1] if not key or f"{found[1]}.".startswith(f"{key}.") else f"{key}.{found[1]}"
        elif isinstance(e, refusals):
            name, _, rest = (message := one_line(e)).partition(": ")
            if (
                rest
                and re.fullmatch(r"\w+(\.\w+|\[\d+\])*", name)
                and re.split(r"[.[]", name)[0] in _params(target)
            ):
                return ConfigError(f"{where}.{name}: {rest}")
            return ConfigError(f"{where}: {message}" if where else message)
        e = e.__cause__
    return None


def _params(target: str | None) -> Mapping[str, Any]:
    try:
        return inspect.signature(get_object(target)).parameters if target else {}
    except Exception:  # not importable or no signature: the message names the node alone
        return {}


# ---- the model hyper-parameters' old names -------------------------------------------------------

# One vocabulary across the model families (issue 28): the name each constructor took before, the
# name it takes now and what changed beyond the name. An old name in a user's config is an error
# naming the new one (a silent alias would keep two spellings alive in configs, sweeps and
# ``attnlab-compare`` tables); a saved run's config is translated (``translate_renamed``).
RATIO = " (now a ratio: the MLP is int(mlp_ratio * dim) wide)"
SOURCE = " (now a node: data/source=<name of conf/data/source/*.yaml>, then data.source.<key>=...)"
RENAMED: dict[str, tuple[str, str]] = {
    "n_embd": ("dim", ""),  # GPT
    "d_model": ("dim", ""),  # Transformer, nn.MultiHeadAttention
    "emb_dim": ("dim", ""),  # Seq2Seq
    "n_layer": ("depth", ""),  # GPT
    "n_enc_layers": ("enc_depth", ""),  # Transformer, Seq2Seq
    "n_dec_layers": ("dec_depth", ""),  # Transformer
    "n_heads": ("n_head", ""),  # SwinTransformer (a list, one per stage)
    "block_size": ("max_len", ""),  # GPT's position table; the language-modelling window
    "context_length": ("max_len", ""),  # CLIP's TextTransformer; the caption length
    "d_ff": ("mlp_ratio", RATIO),  # Transformer
    "mlp_dim": ("mlp_ratio", RATIO),  # Bert
    "pretrained_ckpt": ("init_from", ""),  # TextClassificationTask
    # the data keys (issue 58): one name for the source, one for each split's size
    "corpus": ("source", SOURCE),  # TextDataModule, TranslationDataModule
    "dataset": ("source", SOURCE),  # ImageClassificationDataModule
    "bpe_vocab_size": ("vocab_size", ""),  # TextDataModule
    "val_fraction": ("val_size", ""),  # TextDataModule, MaskedLMDataModule (still a fraction)
    "test_fraction": ("test_size", ""),
    "n_train": ("train_size", ""),  # ScenesDataModule
    "n_val": ("val_size", ""),
    "n_test": ("test_size", ""),
}


def refuse_renamed_overrides(overrides: list[str]) -> None:
    """Raise naming the new name for a command-line override of a model hyper-parameter by its
    old name (``model.net.n_embd=64``), which Hydra would otherwise refuse as a key the config
    lacks, with no word of the new one. (An old name set in a config file, or added with ``+``,
    is caught by ``check_types`` against the constructor.)"""
    for override in overrides:
        if override.startswith("-") or "=" not in override:
            continue
        key = override.split("=", 1)[0].lstrip("+~")
        if moved := moved_key(key):
            raise ConfigError(f"{key} was renamed {moved}")
        parent, _, name = key.rpartition(".")
        if parent.split(".")[0] in ("model", "data") and name in RENAMED:
            new, note = RENAMED[name]
            raise ConfigError(f"{key} was renamed {parent}.{new}{note}")


def translate_renamed(cfg: DictConfig, where: str) -> list[str]:
    """Rename the old hyper-parameter names in every ``_target_`` node under ``cfg`` (a saved
    run's config, written before the rename) to the new ones, in place, and return what was
    renamed (``model.net.n_embd -> model.net.dim``). Only keys the target no longer takes and
    whose new name it does take are touched; an MLP
    width becomes the ratio to the model width that gives the same width back."""
    done: list[str] = []
    for path, node in _target_nodes(cfg, where):
        try:
            params = inspect.signature(get_object(str(node._target_))).parameters
        except Exception:  # not importable or no signature: left to whoever builds it
            continue
        old_keys = [
            k for k in map(str, node.keys()) if k not in params and RENAMED.get(k, ("",))[0] in params
        ]
        if not old_keys:
            continue
        width = next((node[k] for k in ("d_model", "emb_dim", "n_embd", "dim") if k in node), None)
        if width is None and "dim" in params:
            width = params["dim"].default
        with open_dict(node):
            for old in old_keys:
                new, note = RENAMED[old]
                value = node[old]
                if note == RATIO and is_int(value) and is_int(width):
                    value = mlp_ratio_for(value, width)
                node[new] = value
                del node[old]
                done.append(f"{path}.{old} -> {path}.{new}")
    return done


def mlp_ratio_for(hidden: int, dim: int) -> float:
    """The ``mlp_ratio`` whose ``int(mlp_ratio * dim)`` is ``hidden``: ``hidden / dim`` times
    ``dim`` can land a rounding error below ``hidden``, which ``int`` would cut to one less."""
    ratio = hidden / dim
    while int(ratio * dim) < hidden:
        ratio = math.nextafter(ratio, math.inf)
    return ratio


def _target_nodes(node: Any, path: str) -> Iterator[tuple[str, DictConfig]]:
    """Every ``_target_`` node under ``node`` (itself included), with its dotted path."""
    if isinstance(node, DictConfig) and not node._is_none() and not node._is_missing():
        if "_target_" in node:
            yield path, node
        for key in node.keys():
            child = node._get_node(key)
            if isinstance(child, (DictConfig, ListConfig)):
                yield from _target_nodes(child, f"{path}.{key}")
    elif isinstance(node, ListConfig) and not node._is_none() and not node._is_missing():
        for i in range(len(node)):
            yield from _target_nodes(node._get_node(i), f"{path}[{i}]")


# ---- checking values against the constructors they are passed to ---------------------------------

HYDRA_KEYS = ("_target_", "_partial_", "_recursive_", "_convert_", "_args_")
# values of ours that a constructor does not know: resolved before it is called
EXTRA_CHOICES = {"trainer.precision": ("auto",)}  # attnlab.core.hardware.resolve_precision


def check_config(cfg: DictConfig, imports: bool = True) -> None:
    """Check every ``_target_`` node's keys and values against its constructor's signature (see
    ``check_types``), before anything is built, so ``model.optim.optimizer.lr=abc`` is one line naming
    the key instead of a traceback from inside torch; then the data's sequence length against the
    model's position table (``check_lengths``). The trainer and the model come first: other nodes
    take values from them by interpolation (``total_steps: ${trainer.max_steps}``), and the error
    should name the key the user set. Missing (``???``) values are left for later.

    ``imports=False``: the quick check of an entry point before torch loads, each signature read
    from its source (``attnlab.core.signatures``); it refuses only what the full check refuses."""
    first = [k for k in ("trainer", "model") if k in cfg]
    for key in [*first, *(str(k) for k in cfg.keys() if k not in first)]:
        if key not in HYDRA_KEYS and key != "hydra":
            for path, node in _target_nodes(cfg._get_node(key), key):
                check_types(node, path, imports)
    check_lengths(cfg)


# (the data's longest sequence, the model's position table that must cover it): the data modules
# cut or drop sequences at the first key, the nets raise at the first batch longer than the second
POSITION_TABLES = (
    ("data.max_len", "model.net.max_len"),  # GPT, the translation Transformer (Seq2Seq has no table)
    ("data.max_len", "model.net.encoder.max_len"),  # BERT: pre-training, classifier, tagger
    ("data.max_len", "model.net.text.max_len"),  # CLIP (filled from the data unless set)
)


def check_lengths(cfg: DictConfig) -> None:
    """Refuse a data sequence length the model has no positions for, before anything is loaded
    (else the run fails at the first long batch, after the data and the model are built)."""
    for data_key, model_key in POSITION_TABLES:
        longest, table = (
            OmegaConf.select(cfg, k, default=None, throw_on_missing=False) for k in (data_key, model_key)
        )
        if is_int(longest) and is_int(table) and longest > table:
            raise ConfigError(
                f"{data_key}={longest} is longer than {model_key}={table} (the model's position "
                f"table): lower {data_key} or raise {model_key}"
            )


def check_types(node: DictConfig, path: str, imports: bool = True) -> None:
    """Check one ``_target_`` node against its target's signature: a key it does not take (an old
    name: the new one), a value its annotation refuses (``mismatch``); a value a nested
    ``_target_`` builds is checked on its own. ``imports=False``: the signature read from the
    source (``attnlab.core.signatures``), or nothing checked."""
    target = node._target_
    if not isinstance(target, str):
        return
    if (found := signature(target, path) if imports else static_signature(target)) is None:
        return
    sig, hints = found
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    params = {n: p for n, p in sig.parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    for key in (str(k) for k in node.keys() if k not in HYDRA_KEYS):
        value = _get(node, key)
        shown = "" if value is _MISSING else f"={show(value)}"
        if key not in params:
            if RENAMED.get(key, ("",))[0] in params:
                raise ConfigError(f"{path}.{key} was renamed {path}.{RENAMED[key][0]}{RENAMED[key][1]}")
            if moved := moved_key(f"{path}.{key}"):
                raise ConfigError(f"{path}.{key} was renamed {moved}")
            if not takes_kwargs:
                close = difflib.get_close_matches(key, list(params), n=1)
                listed = f" (its parameters: {', '.join(params)})" if len(params) <= 15 else ""
                hint = f" (did you mean {close[0]}?)" if close else listed
                raise ConfigError(f"{path}.{key}{shown}: {target} has no parameter {key!r}{hint}")
        elif not (value is _MISSING or key not in hints or (value is None and params[key].default is None)):
            if value not in EXTRA_CHOICES.get(f"{path}.{key}", ()) and (
                expected := mismatch(hints[key], value)
            ):
                raise ConfigError(f"{path}.{key}{shown}: {expected} ({target})")


def mismatch(annotation: Any, value: Any) -> str | None:
    """What ``annotation`` expects, in words (``must be greater than 0``), where the config value
    does not fit it (pydantic, strict: ``2.5`` is no int, ``"3"`` no number); else None."""
    from pydantic import ValidationError

    plain = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    try:
        if (adapter := _adapter(annotation)) is None or _built(plain):
            return None
        adapter.validate_json(json.dumps(plain), strict=True)
        return None
    except ValidationError as e:
        errors = e.errors()
    except (TypeError, ValueError):  # an unhashable annotation, a value JSON cannot hold: unjudged
        return None
    words: list[str] = []
    for err in errors:  # an object (an instance, a callable) only a nested _target_ node builds
        if err["type"] not in ("needs_python_object", "callable_type", "is_instance_of"):
            text = err["msg"].removeprefix("Input should be ").replace("valid array", "valid list")
            at = "".join(f"[{i}]" for i in err["loc"] if isinstance(i, int))
            words += [f"{text} at {at}" if at else text]
    words = list(dict.fromkeys(words)) or ["a _target_ node"]
    if value is not None and _adapter(annotation).validator.isinstance_python(None):
        words.append("null")
    return "must be " + " or ".join(words)


@cache
def _adapter(annotation: Any) -> Any:
    from pydantic import ConfigDict, TypeAdapter

    try:
        return TypeAdapter(annotation, config=ConfigDict(arbitrary_types_allowed=True))
    except Exception:  # a form pydantic cannot check (a protocol, a bare TypeVar): any value
        return None


def _built(value: Any) -> bool:
    """Whether ``value`` holds a node Hydra turns into an object (checked on its own)."""
    if isinstance(value, dict):
        return "_target_" in value or any(map(_built, value.values()))
    return isinstance(value, list) and any(map(_built, value))


def signature(target: str, path: str) -> tuple[inspect.Signature, dict[str, Any]] | None:
    """The imported ``target``'s signature and its annotations evaluated in its module (a name
    imported there only for type checkers: ``unseen``); None where it has none. A target that does
    not import is a ``ConfigError`` naming ``path``."""
    try:
        obj = get_object(target)
    except Exception as e:
        while e.__cause__ is not None:
            e = e.__cause__
        raise ConfigError(f"{path}._target_={target!r} cannot be imported: {one_line(e)}") from e
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):  # builtins and the like: nothing to check against
        return None
    namespace = getattr(inspect.unwrap(obj.__init__ if inspect.isclass(obj) else obj), "__globals__", {})
    lookup = lambda name: namespace[name] if name in namespace else unseen(name)  # noqa: E731
    hints = {
        n: evaluate(p.annotation, lookup) if isinstance(p.annotation, str) else p.annotation
        for n, p in sig.parameters.items()
        if p.annotation is not p.empty
    }
    return sig, hints


_MISSING = object()


def _get(node: DictConfig | ListConfig, key: Any) -> Any:
    """``node[key]``, or ``_MISSING`` for a ``???`` value (also through an interpolation)."""
    try:
        return _MISSING if OmegaConf.is_missing(node, key) else node[key]
    except MissingMandatoryValue:
        return _MISSING


def show(value: Any) -> str:
    return repr(OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value)


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
