"""A run saved by an older attnlab (tests/fixtures/run_before_redesign: a tiny GPT trained 4 steps
by the code before issue 58 moved and renamed things) still evaluates and resumes, with at most
one notice line."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import ROOT, assert_ok, read_metrics, run_cli, run_dirs

RUN = ROOT / "tests" / "fixtures" / "run_before_redesign"
CKPT = RUN / "checkpoints" / "last.ckpt"
# the command line that trained it (its .hydra/overrides.yaml), minus where it logged
OVERRIDES = [
    "model.net.depth=1",
    "model.net.n_head=2",
    "model.net.dim=16",
    "model.net.max_len=16",
    "data.batch_size=4",
    "data.val_batches=2",
    "trainer.val_check_interval=2",
    "trainer.limit_test_batches=2",
    "sample.max_new_tokens=4",
    "extras.print_config=false",
    "~callbacks.rich_progress_bar",
    "~callbacks.model_summary",
    "trainer.enable_progress_bar=false",
    "logger=csv",
]


def notices(proc) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if "older attnlab" in line]


def test_an_old_run_evaluates_with_one_notice(tmp_path: Path):
    proc = run_cli("eval", [f"ckpt_path={CKPT}", "trainer.enable_progress_bar=false"], tmp_path)
    assert_ok(proc)
    assert len(notices(proc)) == 1, notices(proc)
    (metrics,) = tmp_path.glob("logs/eval/runs/*/metrics.json")
    # the loss the code before the redesign computed for this checkpoint on the whole test split
    assert abs(json.loads(metrics.read_text())["test/loss"] - 4.604827) < 1e-4


def test_an_old_run_resumes(tmp_path: Path):
    proc = run_cli("train", [*OVERRIDES, "trainer.max_steps=6", f"ckpt_path={CKPT}"], tmp_path)
    assert_ok(proc)
    assert len(notices(proc)) <= 1, notices(proc)
    (run_dir,) = run_dirs(tmp_path, "gpt_pydoc_char")
    # it went on from step 4 (validating at step 6 only; a new run validates at steps 2, 4 and 6)
    assert len(read_metrics(run_dir)["val/loss"]) == 1
