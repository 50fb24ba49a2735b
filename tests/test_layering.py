"""The package's layers, in order: each top-level package imports only those before it (at its top
or inside a function), no module imports itself back through others, and no function or
constructor outgrows what a reader holds in mind."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import ROOT

SRC = ROOT / "src" / "attnlab"

# every top-level name under attnlab, lowest first
LAYERS = ("core", "nn", "models", "data", "weights", "inference", "training", "experiments", "cli")
ROOT_MODULES = {"__init__"}  # attnlab/__init__.py: the version, importable from anywhere


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in SRC.rglob("*.py")}


def owner(name: str) -> str:
    """The module ``name`` is defined in (``attnlab.nn.MultiHeadAttention`` -> ``attnlab.nn``)."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def imports(path: Path) -> set[str]:
    """The attnlab modules a file imports, at its top or inside functions (relative ones too)."""
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found.update(owner(f"{base}.{a.name}") for a in node.names if base.startswith("attnlab"))
        elif isinstance(node, ast.Import):
            found.update(owner(a.name) for a in node.names if a.name.startswith("attnlab"))
    return found - {module_name(path)}


GRAPH = {name: imports(path) for name, path in MODULES.items()}


def layer(module: str) -> str:
    return module.split(".")[1] if "." in module else "__init__"


def test_every_top_level_name_has_a_layer():
    names = {p.stem if p.is_file() else p.name for p in SRC.iterdir() if p.name != "__pycache__"}
    assert names == set(LAYERS) | ROOT_MODULES


@pytest.mark.parametrize("name", LAYERS)
def test_a_layer_imports_only_those_before_it(name: str):
    allowed = set(LAYERS[: LAYERS.index(name) + 1]) | ROOT_MODULES
    bad = [
        f"{module} imports {target}"
        for module, targets in sorted(GRAPH.items())
        if layer(module) == name
        for target in sorted(targets)
        if layer(target) not in allowed
    ]
    assert not bad, "\n".join(bad)


def test_no_import_circles():
    """Tarjan's strongly connected components of the module graph: each must be one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not circles, "\n".join(" <-> ".join(c) for c in circles)


def functions() -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    return [
        (f"{path.relative_to(SRC)}:{node.lineno} {node.name}", node)
        for path in sorted(SRC.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    ]


def test_no_function_over_60_lines():
    long = [
        f"{where}: {n.end_lineno - n.lineno + 1} lines"
        for where, n in functions()
        if n.end_lineno - n.lineno >= 60
    ]
    assert not long, "\n".join(long)


def test_no_constructor_over_15_arguments():
    def count(a: ast.arguments) -> int:
        return len(a.posonlyargs) + len(a.args) - 1 + len(a.kwonlyargs)

    big = [
        f"{where}: {count(n.args)}" for where, n in functions() if n.name == "__init__" and count(n.args) > 15
    ]
    assert not big, "\n".join(big)


def test_decoding_and_zeroshot_live_in_inference_only():
    """Greedy/beam search and the zero-shot class embeddings live in ``attnlab.inference``; no
    copy or re-export is left where they were."""
    assert not (SRC / "models" / "text" / "decoding.py").exists()
    contrastive = (SRC / "training" / "contrastive.py").read_text(encoding="utf-8")
    assert "def class_embeddings" not in contrastive and "def zeroshot_classifier" not in contrastive
