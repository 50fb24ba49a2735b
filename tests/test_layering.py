"""The package's layers: nn -> models (plain nn.Modules) -> tasks (LightningModules) -> cli, with
inference (turning a trained net into outputs) between models and tasks. A module imports only
from its own layer and those below it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import ROOT

SRC = ROOT / "src" / "attnlab"

# what each layer must never import (``attnlab.<name>`` and everything under it)
FORBIDDEN = {
    "nn": ("models", "tasks", "data", "inference", "cli"),
    "models": ("tasks", "data", "inference", "cli"),
    "inference": ("tasks", "cli"),
    "tasks": ("cli",),
}


def attnlab_imports(path: Path) -> set[str]:
    """The ``attnlab.*`` modules a file imports, at its top or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m == "attnlab" or m.startswith("attnlab.")}


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_a_layer_imports_nothing_above_it(layer: str):
    bad = [
        f"{path.relative_to(SRC)} imports {module}"
        for path in sorted((SRC / layer).rglob("*.py"))
        for module in sorted(attnlab_imports(path))
        if module.split(".")[1:2] and module.split(".")[1] in FORBIDDEN[layer]
    ]
    assert not bad, "\n".join(bad)


def test_decoding_and_zeroshot_live_in_inference_only():
    """Greedy/beam search and the zero-shot class embeddings moved to ``attnlab.inference``;
    no copy or re-export is left where they were."""
    assert not (SRC / "models" / "text" / "decoding.py").exists()
    contrastive = (SRC / "tasks" / "contrastive.py").read_text(encoding="utf-8")
    assert "def class_embeddings" not in contrastive and "def zeroshot_classifier" not in contrastive
