"""Printing, saving and checking the composed Hydra config (torch and Lightning imported only inside
the functions that need them: ``check_config(cfg, imports=False)`` needs neither)."""

from __future__ import annotations

import difflib
import json
import logging
import re
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from attnlab.core.errors import AttnlabError, ConfigError, one_line
from attnlab.core.legacy import renamed
from attnlab.core.signatures import parameters, signature, static_signature, unpacked
from attnlab.core.specs import is_int
from attnlab.core.targets import target_nodes

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
    """Set the ``???`` fields of ``node`` from ``values`` (the data's vocab_size, ...), nested too."""
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
    """Build the ``trainer`` node under ``constructor_errors``, ``val_check_interval`` scaled by gradient
    accumulation (it counts optimizer steps, as ``max_steps``; Lightning counts batches)."""
    every = node.get("val_check_interval")
    accumulate = node.get("accumulate_grad_batches", 1)
    if is_int(every) and is_int(accumulate) and accumulate > 1:
        kwargs.setdefault("val_check_interval", every * accumulate)
    with constructor_errors("trainer"):
        return instantiate(node, **kwargs)


@contextmanager
def constructor_errors(key: str) -> Iterator[None]:
    """A constructor's refusal of a value as one ``ConfigError`` line naming ``key`` (``refusal``)."""
    try:
        yield
    except Exception as e:
        if (err := refusal(e, key)) is None:
            raise
        raise err from e


def refusal(e: BaseException, key: str = "") -> ConfigError | None:
    """The one-line ``ConfigError`` for the refusal behind ``e``, named by the key of the node that raised
    it (``model.net.image.dim: ...`` for ``dim: ...``); None where ``e`` is no refusal (a bug)."""
    exceptions = sys.modules.get("lightning.fabric.utilities.exceptions")  # loaded where Lightning is
    refusals = (ValueError, *([exceptions.MisconfigurationException] if exceptions else []))
    where = key
    target = None
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
                and re.split(r"[.[]", name)[0] in (parameters(target, static=False, trusted=True) or {})
            ):
                return ConfigError(f"{where}.{name}: {rest}")
            return ConfigError(f"{where}: {message}" if where else message)
        e = e.__cause__
    return None


def refuse_renamed_overrides(overrides: list[str]) -> None:
    """Refuse an override of an old key (``model.net.n_embd=64``) naming the new one."""
    for override in overrides:
        if not override.startswith("-") and "=" in override:
            if message := renamed(override.split("=", 1)[0].lstrip("+~")):
                raise ConfigError(message)


# ---- checking values against the constructors they are passed to ---------------------------------

HYDRA_KEYS = ("_target_", "_partial_", "_recursive_", "_convert_", "_args_")
# values of ours that a constructor does not know: resolved before it is called
EXTRA_CHOICES = {"trainer.precision": ("auto",)}  # attnlab.core.hardware.resolve_precision


def check_config(cfg: DictConfig, imports: bool = True) -> None:
    """Check every ``_target_`` node against its constructor's signature (trainer and model first:
    others interpolate them), then the lengths; ``imports=False``: signatures read from source."""
    first = [k for k in ("trainer", "model") if k in cfg]
    for key in [*first, *(str(k) for k in cfg.keys() if k not in first)]:
        if key not in HYDRA_KEYS and key != "hydra":
            for path, node in target_nodes(cfg._get_node(key), key):
                check_types(node, path, imports)
    check_lengths(cfg)
    check_heads(cfg)


# (the data's longest sequence, the model's position table that must cover it): the data modules
# cut or drop sequences at the first key, the nets raise at the first batch longer than the second
POSITION_TABLES = (
    ("data.max_len", "model.net.max_len"),  # GPT, the translation Transformer (Seq2Seq has no table)
    ("data.max_len", "model.net.encoder.max_len"),  # BERT: pre-training, classifier, tagger
    ("data.max_len", "model.net.text.max_len"),  # CLIP (filled from the data unless set)
)


def check_lengths(cfg: DictConfig) -> None:
    """Refuse a data sequence length the model has no positions for, before anything is loaded."""
    for data_key, model_key in POSITION_TABLES:
        longest, table = (
            OmegaConf.select(cfg, k, default=None, throw_on_missing=False) for k in (data_key, model_key)
        )
        if is_int(longest) and is_int(table) and longest > table:
            raise ConfigError(
                f"{data_key}={longest} is longer than {model_key}={table} (the model's position "
                f"table): lower {data_key} or raise {model_key}"
            )


def check_heads(cfg: DictConfig) -> None:
    """Refuse key/value heads that do not divide the query heads, in any net of the model."""
    for path, node in target_nodes(cfg.get("model"), "model"):
        try:
            heads, kv = (OmegaConf.select(node, k, default=None) for k in ("n_head", "n_kv_head"))
        except OmegaConfBaseException:  # an interpolation that cannot resolve yet: the model's check
            continue
        if is_int(heads) and is_int(kv) and kv > 0 and heads % kv:
            raise ConfigError(f"{path}.n_kv_head: must divide n_head ({heads}), got {kv}")


def check_types(node: DictConfig, path: str, imports: bool = True) -> None:
    """Check one ``_target_`` node against its signature: a key it does not take (an old one: the new name),
    a value its annotation refuses; ``imports=False``: the signature read from source, or nothing checked."""
    target = node._target_
    if not isinstance(target, str):
        return
    if (found := signature(target, path) if imports else static_signature(target)) is None:
        return
    sig, hints = unpacked(*found)
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    params = {n: p for n, p in sig.parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    for key in (str(k) for k in node.keys() if k not in HYDRA_KEYS):
        value = _get(node, key)
        shown = "" if value is _MISSING else f"={show(value)}"
        if key not in params:
            if message := renamed(f"{path}.{key}", params):
                raise ConfigError(message)
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


_MISSING = object()


def _get(node: DictConfig | ListConfig, key: Any) -> Any:
    """``node[key]``, or ``_MISSING`` for a ``???`` value (also through an interpolation)."""
    try:
        return _MISSING if OmegaConf.is_missing(node, key) else node[key]
    except MissingMandatoryValue:
        return _MISSING


def show(value: Any) -> str:
    return repr(OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value)
