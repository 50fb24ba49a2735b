"""The signature of a ``_target_`` read from its source file, without importing it.

``attnlab-train`` checks a config's values against the constructors they go to before anything
is built (``attnlab.core.config.check_config``). Importing those constructors loads torch and
Lightning, which takes longer than the rest of a failing command; reading their ``def`` from the
source finds most wrong values (``trainer.max_steps=abc``) before that. The reading is cautious:
wherever the source does not say plainly what the signature is (a name bound twice, a class
without its own ``__init__``, a decorated class, an extension module), it gives up and the check
that imports the target, which runs next anyway, decides.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import sys
from functools import cache
from pathlib import Path
from typing import Any

# stands for a default value that is not None: only "is the default None" matters to the check
NOT_NONE = object()
MAX_HOPS = 12  # re-exports followed (``lightning.pytorch.Trainer`` is two)


def static_signature(target: str) -> tuple[inspect.Signature, dict[str, Any], str] | None:
    """``target``'s signature (its annotations as source text), the names its module imports from
    the standard library (to evaluate them), and where it is defined (``module.Name``); None where
    the source does not say it plainly."""
    parts = target.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:i])
        source = module_source(module)
        if source is not None:
            if i != len(parts) - 1:  # an attribute of an attribute (Class.method): not followed
                return None
            return _signature_in(module, source, parts[-1], MAX_HOPS)
    return None


def module_source(module: str) -> Path | None:
    """The ``.py`` file of ``module``, found without importing it or its packages."""
    top, *rest = module.split(".")
    try:
        spec = importlib.util.find_spec(top)  # a top-level name: located, not run
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if not rest:
        return Path(spec.origin) if spec.origin and spec.origin.endswith(".py") else None
    folders = [Path(p) for p in spec.submodule_search_locations or []]
    path = None
    for part in rest:
        path, inner = None, []
        for folder in folders:
            if (folder / part / "__init__.py").is_file():
                path, inner = folder / part / "__init__.py", [folder / part]
                break
            if (folder / f"{part}.py").is_file():
                path, inner = folder / f"{part}.py", []
                break
            if (folder / part).is_dir():  # a namespace package
                inner = [folder / part]
                break
        folders = inner
        if path is None and not folders:
            return None
    return path


@cache
def _parse(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None


def _bindings(body: list[ast.stmt], name: str) -> list[ast.stmt]:
    """The module-level statements that bind ``name`` (inside ``if`` and ``try`` blocks too)."""
    found: list[ast.stmt] = []
    for stmt in body:
        if isinstance(stmt, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
            found.append(stmt)
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name.split(".")[0]) == name for a in stmt.names):
                found.append(stmt)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            if any(name in {n.id for n in ast.walk(t) if isinstance(n, ast.Name)} for t in targets):
                found.append(stmt)
        elif isinstance(stmt, ast.If):
            found += _bindings(stmt.body, name) + _bindings(stmt.orelse, name)
        elif isinstance(stmt, ast.Try):
            found += _bindings(stmt.body, name) + _bindings(stmt.orelse, name)
            for handler in stmt.handlers:
                found += _bindings(handler.body, name)
    return found


def _absolute(module: str, source: Path, stmt: ast.ImportFrom) -> str | None:
    """The module a ``from ... import`` names, relative imports made absolute."""
    if not stmt.level:
        return stmt.module
    package = module if source.name == "__init__.py" else module.rpartition(".")[0]
    parts = package.split(".")
    if stmt.level - 1 >= len(parts):
        return None
    base = ".".join(parts[: len(parts) - (stmt.level - 1)])
    return f"{base}.{stmt.module}" if stmt.module else base


def _signature_in(
    module: str, source: Path, name: str, hops: int
) -> tuple[inspect.Signature, dict[str, Any], str] | None:
    tree = _parse(source)
    if tree is None or hops == 0:
        return None
    bound = _bindings(tree.body, name)
    if len(bound) != 1:
        return None
    stmt = bound[0]
    if isinstance(stmt, ast.ImportFrom):
        alias = next(a for a in stmt.names if (a.asname or a.name) == name)
        origin = _absolute(module, source, stmt)
        origin_source = module_source(origin) if origin else None
        if origin is None or origin_source is None:
            return None
        return _signature_in(origin, origin_source, alias.name, hops - 1)
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
    return signature, _stdlib_names(tree), f"{module}.{name}"


def _from_def(fn: ast.FunctionDef | ast.AsyncFunctionDef, drop_self: bool) -> inspect.Signature:
    """The signature of a ``def``; decorators are taken to keep it (``functools.wraps``)."""
    P = inspect.Parameter
    a = fn.args

    def param(arg: ast.arg, kind: Any, default: ast.expr | None = None) -> inspect.Parameter:
        annotation = ast.unparse(arg.annotation) if arg.annotation is not None else P.empty
        value = P.empty
        if default is not None:
            value = None if isinstance(default, ast.Constant) and default.value is None else NOT_NONE
        return P(arg.arg, kind, default=value, annotation=annotation)

    positional = [*a.posonlyargs, *a.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    params = [
        param(arg, P.POSITIONAL_ONLY if i < len(a.posonlyargs) else P.POSITIONAL_OR_KEYWORD, d)
        for i, (arg, d) in enumerate(zip(positional, defaults, strict=True))
    ]
    if drop_self and params:
        params = params[1:]
    if a.vararg is not None:
        params.append(param(a.vararg, P.VAR_POSITIONAL))
    params += [param(arg, P.KEYWORD_ONLY, d) for arg, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)]
    if a.kwarg is not None:
        params.append(param(a.kwarg, P.VAR_KEYWORD))
    return inspect.Signature(params)


def _stdlib_names(tree: ast.Module) -> dict[str, Any]:
    """The names a module imports from the standard library at its top level (``Optional``,
    ``Literal``, ``Path``, ...), imported here: enough to evaluate most annotations. Names from
    anywhere else are left out (they would load the packages this module avoids)."""
    names: dict[str, Any] = {}
    for stmt in tree.body:
        try:
            if isinstance(stmt, ast.Import):
                for a in stmt.names:
                    if a.name.split(".")[0] in sys.stdlib_module_names:
                        top = __import__(a.name)
                        names[a.asname or a.name.split(".")[0]] = sys.modules[a.name] if a.asname else top
            elif isinstance(stmt, ast.ImportFrom) and not stmt.level and stmt.module:
                if stmt.module.split(".")[0] in sys.stdlib_module_names and stmt.module != "__future__":
                    mod = importlib.import_module(stmt.module)
                    for a in stmt.names:
                        if hasattr(mod, a.name):
                            names[a.asname or a.name] = getattr(mod, a.name)
        except ImportError:
            continue
    return names
