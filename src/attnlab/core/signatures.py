"""A ``_target_``'s signature and annotations read from its source without importing it (light
modules' names evaluated, others ``Unseen``); it gives up where the source is not plain."""

from __future__ import annotations
import __future__

import ast
import builtins
import copy
import importlib
import importlib.util
import inspect
import sys
import typing
from collections.abc import Callable, Mapping
from functools import cache
from importlib.machinery import PathFinder
from pathlib import Path
from typing import Any

from hydra.utils import get_object

from attnlab.core.errors import ConfigError, one_line
from attnlab.core.targets import is_allowed

# stands for a default value that is not None: only "is the default None" matters to the check
NOT_NONE = object()
MAX_HOPS = 12  # re-exports and aliases followed (``lightning.pytorch.Trainer`` is two)
ANNOTATIONS = __future__.annotations.compiler_flag  # annotations kept as text
LIGHT = ("annotated_types", "typing_extensions", "attnlab.core.specs")  # imported to evaluate names


class Unseen:
    """A name not evaluated, and any use of it (``Run[int]``, ``np.ndarray``, ``Run | None``): any
    value, while the rest of an annotation is checked (``list[Run]``: a list)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # not a type: copy, pickle and typing probe these
            raise AttributeError(name)
        return self

    def __or__(self, other: Any) -> Any:
        return self

    __ror__ = __getitem__ = __call__ = __or__  # (callable: typing takes it as a type argument)

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        from pydantic_core import core_schema

        return core_schema.any_schema()


@cache
def _parse(module: str) -> tuple[Path, ast.Module] | None:
    """The ``.py`` file of ``module`` and its syntax, found without importing it or its packages."""
    top, *rest = module.split(".")
    try:
        spec = importlib.util.find_spec(top)  # a top-level name: located, not run
        for i in range(len(rest)):
            spec = spec and PathFinder.find_spec(
                ".".join([top, *rest[: i + 1]]), spec.submodule_search_locations
            )
        if not (spec and spec.origin and spec.origin.endswith(".py")):
            return None
        source = Path(spec.origin)
        return source, ast.parse(source.read_text(encoding="utf-8"))
    except (ImportError, OSError, SyntaxError, ValueError):  # (UnicodeDecodeError: a ValueError)
        return None


def _bindings(body: list[ast.stmt], name: str) -> list[ast.stmt]:
    """The module-level statements that bind ``name`` (inside ``if`` and ``try`` blocks too)."""
    found: list[ast.stmt] = []
    for stmt in body:
        if isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
            found.append(stmt)
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)) and _alias(stmt, name):
            found.append(stmt)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            if any(name in {n.id for n in ast.walk(t) if isinstance(n, ast.Name)} for t in targets):
                found.append(stmt)
        elif isinstance(stmt, ast.Try) or (
            isinstance(stmt, ast.If) and "TYPE_CHECKING" not in ast.unparse(stmt.test)
        ):
            # (a name only type checkers import has no value at run time: the full check's ``Unseen``)
            blocks = [stmt.body, stmt.orelse, *(h.body for h in getattr(stmt, "handlers", []))]
            found += [s for block in blocks for s in _bindings(block, name)]
    return found


def _alias(stmt: ast.stmt, name: str) -> ast.alias | None:
    """The ``ast.alias`` by which an import statement binds ``name`` (``import a.b`` binds ``a``)."""
    return next((a for a in getattr(stmt, "names", []) if (a.asname or a.name.split(".")[0]) == name), None)


def _absolute(module: str, source: Path, stmt: ast.ImportFrom) -> str | None:
    """The module a ``from ... import`` names, relative imports made absolute."""
    if not stmt.level:
        return stmt.module
    parts = (module if source.name == "__init__.py" else module.rpartition(".")[0]).split(".")
    if stmt.level - 1 >= len(parts):
        return None
    base = ".".join(parts[: len(parts) - (stmt.level - 1)])
    return f"{base}.{stmt.module}" if stmt.module else base


def _light(module: str) -> bool:
    return module.split(".")[0] in sys.stdlib_module_names or module.startswith(LIGHT)


def _binding(module: str, name: str, hops: int) -> tuple[str, str, ast.stmt] | None:
    """The module, the name and the one statement that bind ``name`` there, re-exports followed."""
    parsed = _parse(module)
    if parsed is None or hops == 0:
        return None
    source, tree = parsed
    bound = _bindings(tree.body, name)
    if len(bound) != 1:
        return None
    stmt = bound[0]
    if isinstance(stmt, ast.ImportFrom) and not _light(origin := _absolute(module, source, stmt) or ""):
        return _binding(origin, _alias(stmt, name).name, hops - 1) if origin else None
    return module, name, stmt


def unseen(name: str) -> Unseen:
    """A name an evaluation does not know: ``Unseen``, or a builtin (``KeyError``: Python's turn)."""
    if hasattr(builtins, name):
        raise KeyError(name)
    return Unseen()


class _Names(dict):  # an evaluation's names, each looked up as it is read
    def __init__(self, lookup: Callable[[str], Any]) -> None:
        super().__init__()
        self.lookup = lookup

    def __missing__(self, name: str) -> Any:
        return self.lookup(name)


def evaluate(expression: str, lookup: Callable[[str], Any]) -> Any:
    """A source expression (an annotation) evaluated, each name it reads from ``lookup``."""
    return eval(expression, {"__builtins__": builtins}, _Names(lookup))


@cache
def _value(module: str, name: str, hops: int = MAX_HOPS) -> Any:
    """The value ``name`` has in ``module`` where the source says it plainly, else ``Unseen``."""
    if (found := _binding(module, name, hops)) is None:
        return unseen(name)
    module, name, stmt = found
    alias = _alias(stmt, name)
    try:
        if isinstance(stmt, ast.ImportFrom):  # from a light module
            return getattr(importlib.import_module(_absolute(module, _parse(module)[0], stmt)), alias.name)
        if isinstance(stmt, ast.Import) and _light(alias.name):
            top = importlib.import_module(alias.name)
            return top if alias.asname else sys.modules[alias.name.split(".")[0]]
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None and hops > 1:
            return evaluate(ast.unparse(stmt.value), lambda n: _value(module, n, hops - 1))
    except Exception:  # an expression the reading cannot evaluate: any value
        pass
    return Unseen()


def static_signature(target: str) -> tuple[inspect.Signature, dict[str, Any]] | None:
    """``target``'s signature and its annotations evaluated; None where the source does not say
    them plainly (``Class.method`` is not followed)."""
    module, _, name = target.rpartition(".")
    if (found := _binding(module, name, MAX_HOPS)) is None:
        return None
    module, name, stmt = found
    if isinstance(stmt, ast.ClassDef):
        if stmt.decorator_list or stmt.keywords:  # a dataclass, a metaclass: another signature
            return None
        members = {s.name: s for s in stmt.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))}
        if "__init__" not in members or "__new__" in members or "__signature__" in members:
            return None
        signature = _from_def(members["__init__"], drop_self=True)
    elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
        signature = _from_def(stmt, drop_self=False)
    else:
        return None
    return signature, {
        p.name: _hint(p.annotation, module)
        for p in signature.parameters.values()
        if p.annotation is not p.empty
    }


def _hint(annotation: str, module: str) -> Any:
    try:
        return evaluate(annotation, lambda n: _value(module, n))
    except Exception:  # e.g. a forward reference in quotes: left to the full check
        return Any


def _from_def(fn: ast.FunctionDef | ast.AsyncFunctionDef, drop_self: bool) -> inspect.Signature:
    """The signature of a ``def`` (decorators are taken to keep it: ``functools.wraps``), made by
    running it without its body, annotations as text, each default not None as ``NOT_NONE``."""
    args = copy.deepcopy(fn.args)
    none = lambda d: d is None or (isinstance(d, ast.Constant) and d.value is None)  # noqa: E731
    args.defaults = [ast.Constant(None) if none(d) else ast.Name("_", ast.Load()) for d in args.defaults]
    args.kw_defaults = [d if none(d) else ast.Name("_", ast.Load()) for d in args.kw_defaults]
    stub = ast.FunctionDef("f", args, [ast.Pass()], [], None, type_params=[])
    namespace = {"_": NOT_NONE}
    exec(
        compile(ast.fix_missing_locations(ast.Module([stub], [])), "<signature>", "exec", ANNOTATIONS),
        namespace,
    )
    sig = inspect.signature(namespace["f"])
    return sig.replace(parameters=list(sig.parameters.values())[1:]) if drop_self else sig


def unpacked(sig: inspect.Signature, hints: dict[str, Any]) -> tuple[inspect.Signature, dict[str, Any]]:
    """A ``**attn: Unpack[Spec]`` parameter (a TypedDict of settings several constructors share:
    ``attnlab.nn.AttentionSpec``) read as Spec's keyword parameters, each with its type."""
    for name, p in sig.parameters.items():
        if p.kind is p.VAR_KEYWORD and typing.get_origin(hint := hints.get(name)) is typing.Unpack:
            if not isinstance(spec := typing.get_args(hint)[0], type):  # unseen by the quick check
                break
            fields = typing.get_type_hints(spec, include_extras=True)
            kept = [q for q in sig.parameters.values() if q is not p]
            keys = [inspect.Parameter(f, p.KEYWORD_ONLY) for f in fields if f not in sig.parameters]
            return sig.replace(parameters=kept + keys), {k: v for k, v in hints.items() if k != name} | fields
    return sig, hints


def signature(target: str, path: str) -> tuple[inspect.Signature, dict[str, Any]] | None:
    """The imported ``target``'s signature and its annotations evaluated in its module; None where it
    has none; a target that does not import is a ``ConfigError`` naming ``path``."""
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


def parameters(
    target: Any, static: bool = True, trusted: bool = False
) -> Mapping[str, inspect.Parameter] | None:
    """``target``'s parameters: read from its source (``static``), else imported if it is ``trusted``
    or allowed in a run folder's config (which is input, not code); None where neither tells."""
    if not isinstance(target, str):
        return None
    try:
        found = static_signature(target) if static else None
        if found is None and (trusted or is_allowed(target)):
            found = signature(target, "")
        return unpacked(*found)[0].parameters if found else None
    except Exception:  # not importable or no signature: left to whoever builds it
        return None
