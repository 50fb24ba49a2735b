"""Printing, saving and checking the composed Hydra config.

Imported before the command line's config is checked, so torch and Lightning are imported only
inside the functions that need them (``check_config(cfg, imports=False)`` needs neither).
"""

from __future__ import annotations

import difflib
import inspect
import logging
import math
import os
import sys
import types
from collections import abc
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import MissingMandatoryValue

from attnlab.core.checks import is_int, is_number
from attnlab.core.errors import AttnlabError, ConfigError
from attnlab.core.signatures import static_signature

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
    one ``ConfigError`` line prefixed with the config ``key``, also through Hydra's wrapping."""
    try:
        yield
    except Exception as e:
        # Lightning's exception only where Lightning is loaded (else nothing raised it)
        exceptions = sys.modules.get("lightning.fabric.utilities.exceptions")
        refusals = (ValueError, *([exceptions.MisconfigurationException] if exceptions else []))
        cause: BaseException | None = e
        while cause is not None:
            if isinstance(cause, AttnlabError):
                raise
            if isinstance(cause, refusals):
                raise ConfigError(f"{key}: {one_line(cause)}") from e
            cause = cause.__cause__
        raise


# ---- the model hyper-parameters' old names -------------------------------------------------------

# One vocabulary across the model families (issue 28): the name each constructor took before, the
# name it takes now and what changed beyond the name. An old name in a user's config is an error
# naming the new one (a silent alias would keep two spellings alive in configs, sweeps and
# ``attnlab-compare`` tables); a saved run's config is translated (``translate_renamed``).
RATIO = " (now a ratio: the MLP is int(mlp_ratio * dim) wide)"
RENAMED: dict[str, tuple[str, str]] = {
    "n_embd": ("dim", ""),  # GPT
    "d_model": ("dim", ""),  # Transformer, nn.MultiHeadAttention
    "emb_dim": ("dim", ""),  # Seq2Seq
    "n_layer": ("depth", ""),  # GPT
    "n_enc_layers": ("enc_depth", ""),  # Transformer, Seq2Seq
    "n_dec_layers": ("dec_depth", ""),  # Transformer
    "n_heads": ("n_head", ""),  # SwinTransformer (a list, one per stage)
    "block_size": ("max_len", ""),  # GPT's position table (data.block_size is still the window)
    "context_length": ("max_len", ""),  # CLIP's TextTransformer
    "d_ff": ("mlp_ratio", RATIO),  # Transformer
    "mlp_dim": ("mlp_ratio", RATIO),  # Bert
    "pretrained_ckpt": ("init_from", ""),  # TextClassificationTask
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
        parent, _, name = key.rpartition(".")
        if parent.split(".")[0] == "model" and name in RENAMED:
            new, note = RENAMED[name]
            raise ConfigError(f"{key} was renamed {parent}.{new}{note}")


def translate_renamed(cfg: DictConfig, where: str) -> list[str]:
    """Rename the old hyper-parameter names in every ``_target_`` node under ``cfg`` (a saved
    run's config, written before the rename) to the new ones, in place, and return what was
    renamed (``model.net.n_embd -> model.net.dim``). Only keys the target no longer takes and
    whose new name it does take are touched (a data module's own ``block_size`` stays); an MLP
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
NoneType = type(None)
LIST_TYPES = (list, tuple, abc.Sequence, abc.MutableSequence)
DICT_TYPES = (dict, abc.Mapping, abc.MutableMapping)
NAMES = {bool: "a bool", int: "an int", float: "a float", str: "a string"}
PLURALS = {bool: "bools", int: "ints", float: "floats", str: "strings"}


def check_config(cfg: DictConfig, imports: bool = True) -> None:
    """Check every value's type against the constructor it is passed to (see ``check_types``).

    Walks every node with a ``_target_`` (nested ones and list items too) before anything is
    built, so ``model.optimizer.lr=abc`` is one line naming the key instead of a traceback from
    inside torch. Missing (``???``) values are left for later (filled from the data). The
    trainer and the model come first: other nodes take values from them by interpolation
    (``total_steps: ${trainer.max_steps}``, ``block_size: ${model.net.max_len}``), and the
    error should name the key the user set. Then the data's sequence length is checked against
    the model's position table (see ``check_lengths``).

    ``imports=False``: the quick check of an entry point before torch loads; each constructor's
    signature is read from its source (``attnlab.core.signatures``), nodes whose source does not
    say it plainly are passed over, and names its annotations take from outside the standard
    library accept anything. It refuses only what the full check refuses; run that one after.
    """
    first = [k for k in ("trainer", "model") if k in cfg]
    for key in [*first, *(k for k in cfg.keys() if k not in first)]:
        if key in HYDRA_KEYS or key == "hydra":
            continue
        child = _get(cfg, key)
        if isinstance(child, (DictConfig, ListConfig)):
            _walk(child, str(key), imports)
    check_lengths(cfg)


# (the data's longest sequence, the model's position table that must cover it): the data modules
# cut or drop sequences at the first key, the nets raise at the first batch longer than the second
POSITION_TABLES = (
    ("data.max_len", "model.net.max_len"),  # the translation Transformer (Seq2Seq has no table)
    ("data.max_len", "model.net.encoder.max_len"),  # BERT: pre-training, classifier, tagger
    ("data.block_size", "model.net.max_len"),  # GPT (the data interpolates it unless set)
    ("data.context_length", "model.net.text.max_len"),  # CLIP (filled from the data unless set)
)


def check_lengths(cfg: DictConfig) -> None:
    """Refuse a data sequence length the model has no positions for, before anything is loaded
    (else the run fails at the first long batch, after the data and the model are built)."""
    for data_key, model_key in POSITION_TABLES:
        longest, table = _int_at(cfg, data_key), _int_at(cfg, model_key)
        if longest is not None and table is not None and longest > table:
            raise ConfigError(
                f"{data_key}={longest} is longer than {model_key}={table} (the model's position "
                f"table): lower {data_key} or raise {model_key}"
            )


def _int_at(cfg: DictConfig, key: str) -> int | None:
    """The int at the dotted ``key``; None where it is absent, ``???`` or not an int (the type
    check names those)."""
    value = OmegaConf.select(cfg, key, default=None, throw_on_missing=False)
    return value if is_int(value) else None


def _walk(node: Any, path: str, imports: bool = True) -> None:
    if isinstance(node, DictConfig):
        if node._is_none() or node._is_missing():
            return
        if "_target_" in node:
            if imports:
                check_types(node, path)
            else:
                check_types(node, path, imports=False)
        for key in node.keys():
            if key in HYDRA_KEYS:
                continue
            child = _get(node, key)
            if isinstance(child, (DictConfig, ListConfig)):
                _walk(child, f"{path}.{key}", imports)
    elif isinstance(node, ListConfig):
        if node._is_none() or node._is_missing():
            return
        for i in range(len(node)):
            child = _get(node, i)
            if isinstance(child, (DictConfig, ListConfig)):
                _walk(child, f"{path}[{i}]", imports)


_MISSING = object()


def _get(node: DictConfig | ListConfig, key: Any) -> Any:
    """``node[key]``, or ``_MISSING`` for a ``???`` value (also through an interpolation)."""
    if OmegaConf.is_missing(node, key):
        return _MISSING
    try:
        return node[key]
    except MissingMandatoryValue:
        return _MISSING


def check_types(node: DictConfig, path: str, imports: bool = True) -> None:
    """Check the keys and values of one ``_target_`` node against the target's signature
    (read from its source without importing it where ``imports`` is False: see ``check_config``)."""
    target = node._target_
    if not isinstance(target, str):
        return
    found = _imported_signature(target, path) if imports else _source_signature(target)
    if found is None:
        return
    sig, hints, trainer = found
    params = {
        name: p
        for name, p in sig.parameters.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    for key in node.keys():
        key = str(key)
        if key in HYDRA_KEYS:
            continue
        value = _get(node, key)
        if key not in params and RENAMED.get(key, (None,))[0] in params:
            new, note = RENAMED[key]
            raise ConfigError(f"{path}.{key} was renamed {path}.{new}{note}")
        if key not in params:
            if takes_kwargs:
                continue
            close = difflib.get_close_matches(key, list(params), n=1)
            hint = (
                f" (did you mean {close[0]}?)"
                if close
                else f" (its parameters: {', '.join(params)})"
                if len(params) <= 15
                else ""
            )
            shown = "" if value is _MISSING else f"={show(value)}"
            raise ConfigError(f"{path}.{key}{shown}: {target} has no parameter {key!r}{hint}")
        if value is _MISSING or key not in hints:
            continue
        if value is None and params[key].default is None:
            continue
        tp = hints[key]
        extra = EXTRA_CHOICES.get(key, ()) if trainer else ()
        if isinstance(value, str) and value in extra:
            continue
        if _checkable(tp) and not _accepts(value, tp):
            raise ConfigError(f"{path}.{key}={show(value)}: expected {describe(tp, extra)} ({target} {key})")


def _imported_signature(target: str, path: str) -> tuple[inspect.Signature, dict[str, Any], bool] | None:
    """The signature of the imported ``target``, its evaluated annotations, and whether it is
    Lightning's Trainer; None where it has none to check against. A target that does not import
    is a ``ConfigError`` naming ``path``."""
    try:
        obj = get_object(target)
    except Exception as e:
        cause = e
        while cause.__cause__ is not None:
            cause = cause.__cause__
        raise ConfigError(f"{path}._target_={target!r} cannot be imported: {one_line(cause)}") from e
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):  # builtins and the like: nothing to check against
        return None
    return sig, _type_hints(obj.__init__ if inspect.isclass(obj) else obj, sig), _is_trainer(obj)


TRAINER = "lightning.pytorch.trainer.trainer.Trainer"


def _source_signature(target: str) -> tuple[inspect.Signature, dict[str, Any], bool] | None:
    """As ``_imported_signature``, read from the source (``attnlab.core.signatures``); None
    where the source does not say it plainly. An annotation that does not evaluate from the
    standard library's names accepts anything: the full check sees it."""
    found = static_signature(target)
    if found is None:
        return None
    sig, namespace, where = found
    hints = {}
    for name, p in sig.parameters.items():
        if p.annotation is not inspect.Parameter.empty:
            try:
                hint = _evaluate(p.annotation, dict(namespace))
            except Exception:  # e.g. Union[int, <a name left out>]: not checked here
                hint = Any
            hints[name] = Any if isinstance(hint, _Unseen) else hint
    return sig, hints, where == TRAINER


def _type_hints(fn: Any, sig: inspect.Signature) -> dict[str, Any]:
    """The parameters' annotations, evaluated; one by one where some name a type imported only
    for type checkers (``if TYPE_CHECKING:``), which then stands for ``Any`` (see ``_evaluate``).
    Any other failure is a bug and raises: no parameter is left out of the check unseen."""
    try:
        return get_type_hints(fn)
    except NameError:
        pass
    namespace = getattr(inspect.unwrap(fn), "__globals__", {})
    return {
        name: _evaluate(p.annotation, namespace)
        for name, p in sig.parameters.items()
        if p.annotation is not inspect.Parameter.empty
    }


class _Unseen:
    """A name only type checkers import: any use of it (``Callable[[int], int]``, ``np.ndarray``,
    ``Run | None``) is ``Any``, so the rest of its annotation is still checked (``list[Run]``:
    a list)."""

    def __getitem__(self, item: Any) -> Any:
        return Any

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # not a type: copy, pickle and typing probe these
            raise AttributeError(name)
        return Any

    def __or__(self, other: Any) -> Any:
        return Any

    __ror__ = __or__


def _evaluate(annotation: Any, namespace: dict[str, Any]) -> Any:
    """A string annotation evaluated in ``namespace``, each name it lacks as ``_Unseen``."""
    if not isinstance(annotation, str):
        return annotation
    unseen: dict[str, Any] = {}
    while True:
        try:
            return eval(annotation, namespace, unseen)
        except NameError as e:
            if e.name is None or e.name in unseen:  # not a lookup of ours: a bug, not a missing import
                raise
            unseen[e.name] = _Unseen()


# values of ours that a constructor does not know: resolved before it is called
EXTRA_CHOICES = {"precision": ("auto",)}  # attnlab.core.hardware.resolve_precision


def _is_trainer(obj: Any) -> bool:
    import lightning as L  # obj is imported: so is Lightning, where obj is its Trainer

    return inspect.isclass(obj) and issubclass(obj, L.Trainer)


def show(value: Any) -> str:
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value, resolve=True)
    return repr(value)


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _is_target(value: Any) -> bool:
    """A node Hydra turns into an object (checked on its own by the walk)."""
    return isinstance(value, DictConfig) and not value._is_none() and "_target_" in value


def _is_union(origin: Any) -> bool:
    return origin is Union or origin is types.UnionType


def _checkable(tp: Any) -> bool:
    """Whether ``tp`` says something a config value can be checked against (else accept anything)."""
    origin = get_origin(tp)
    if _is_union(origin):
        return any(_checkable(a) for a in get_args(tp) if a is not NoneType)
    return origin is Literal or tp in NAMES or (origin or tp) in LIST_TYPES or (origin or tp) in DICT_TYPES


def _accepts(value: Any, tp: Any) -> bool:
    """Whether the config value ``value`` fits the annotation ``tp``."""
    if tp is Any or isinstance(tp, (TypeVar, _Unseen)):
        return True
    origin, args = get_origin(tp), get_args(tp)
    if _is_union(origin):
        return any(_accepts(value, a) for a in args)
    if origin is Literal:
        return any(type(value) is type(c) and value == c for c in args)
    if tp is NoneType or tp is None:
        return value is None
    if _is_target(value):
        return True
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return is_int(value)
    if tp is float:
        return is_number(value)
    if tp is str:
        return isinstance(value, str)
    kind = origin or tp
    if kind in LIST_TYPES:
        if not isinstance(value, ListConfig) or value._is_none():
            return False
        items = [_get(value, i) for i in range(len(value))]
        if kind is tuple and args and args[-1] is not Ellipsis:
            return len(items) == len(args) and all(
                v is _MISSING or _accepts(v, a) for v, a in zip(items, args, strict=True)
            )
        return not args or all(v is _MISSING or _accepts(v, args[0]) for v in items)
    if kind in DICT_TYPES:
        if not isinstance(value, DictConfig) or value._is_none():
            return False
        return len(args) < 2 or all(
            v is _MISSING or _accepts(v, args[1]) for v in (_get(value, k) for k in value.keys())
        )
    if not inspect.isclass(kind):  # a typing form we do not know: do not guess
        return True
    if issubclass(kind, (os.PathLike, PurePath)) and isinstance(value, str):
        return True
    try:
        return isinstance(value, kind)
    except TypeError:  # e.g. a protocol that is not runtime-checkable
        return True


def describe(tp: Any, extra: tuple[Any, ...] = ()) -> str:
    """What ``tp`` expects, in words: "an int or null", "one of 'auto', 'sdpa', 'math'"."""
    phrases: list[str] = []
    choices: list[Any] = []
    nullable = _phrases(tp, phrases, choices)
    choices += [c for c in extra if c not in choices]
    parts = (
        [f"one of {', '.join(map(repr, choices))}" if len(choices) > 1 else repr(choices[0])]
        if choices
        else []
    )
    parts += [p for i, p in enumerate(phrases) if p not in phrases[:i]]
    if not parts:
        parts = [f"a {getattr(get_origin(tp) or tp, '__name__', str(tp))}"]
    if nullable:
        parts.append("null")
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} or {parts[-1]}"


def _phrases(tp: Any, phrases: list[str], choices: list[Any]) -> bool:
    """Collect the words for each checkable member of ``tp``; return whether None is allowed."""
    origin, args = get_origin(tp), get_args(tp)
    if _is_union(origin):
        return any([_phrases(a, phrases, choices) for a in args])
    if origin is Literal:
        choices.extend(c for c in args if c not in choices)
    elif tp is NoneType or tp is None:
        return True
    elif tp in NAMES:
        phrases.append(NAMES[tp])
    elif (origin or tp) in LIST_TYPES:
        if (origin or tp) is tuple and args and args[-1] is not Ellipsis:
            items = {_plural(a) for a in args}
            phrases.append(f"a list of {len(args)} {items.pop() if len(items) == 1 else 'items'}")
        else:
            phrases.append(f"a list of {_plural(args[0])}" if args else "a list")
    elif (origin or tp) in DICT_TYPES:
        phrases.append("a mapping")
    return False


def _plural(tp: Any) -> str:
    words: list[str] = []
    _phrases(tp, words, [])
    named = [t for t in PLURALS if NAMES[t] in words]
    return PLURALS[named[0]] if len(named) == 1 and len(words) == 1 else "items"
