"""Shared helpers: run the entry points as a user would, on tiny configs, in a temporary directory."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"

# A GPT small enough to train 20 steps in about a second.
TINY = [
    "model.net.n_layer=1",
    "model.net.n_head=2",
    "model.net.n_embd=32",
    "model.net.block_size=16",
    "data.batch_size=4",
    "data.val_batches=2",
    "trainer.max_steps=20",
    "trainer.val_check_interval=10",
    "trainer.limit_test_batches=2",
    "sample.max_new_tokens=10",
    "extras.print_config=false",
    "~callbacks.rich_progress_bar",
    "~callbacks.model_summary",
]


def tiny(*overrides: str) -> list[str]:
    """TINY with ``overrides`` replacing entries for the same keys."""
    keys = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    return [a for a in TINY if a.split("=", 1)[0].lstrip("+~") not in keys] + list(overrides)


def cli_env() -> dict[str, str]:
    """The environment of a new user: no W&B key, no WANDB_MODE."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["NETRC"] = os.devnull
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("HYDRA_FULL_ERROR", None)
    return env


def run_cli(entry: str, args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``attnlab-<entry>`` (as ``python -m attnlab.<entry>``) with Hydra overrides."""
    return subprocess.run(
        [sys.executable, "-m", f"attnlab.cli.{entry}", *args],
        cwd=cwd, env=cli_env(), capture_output=True, text=True, timeout=timeout,
    )


def popen_cli(entry: str, args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", f"attnlab.cli.{entry}", *args],
        cwd=cwd, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def run_dirs(cwd: Path, task_name: str) -> list[Path]:
    return sorted((cwd / "logs" / task_name / "runs").glob("*"))


def read_metrics(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every metric of a run's CSV log as (step, value) pairs."""
    out: dict[str, list[tuple[int, float]]] = {}
    with open(run_dir / "csv" / "metrics.csv") as f:
        for row in csv.DictReader(f):
            for k, v in row.items():
                if k not in ("step", "epoch") and v not in ("", None):
                    out.setdefault(k, []).append((int(row["step"]), float(v)))
    return out


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished tiny run of the default experiment; returns its output directory."""
    cwd = tmp_path_factory.mktemp("trained")
    proc = run_cli("train", [*TINY, "task_name=tiny"], cwd)
    assert_ok(proc)
    (run_dir,) = run_dirs(cwd, "tiny")
    return run_dir


def needs_shared(name: str) -> Path:
    path = SHARED_DATA / name
    if not path.exists():
        pytest.skip(f"needs the shared dataset {path} (not present outside the team's machines)")
    return path
