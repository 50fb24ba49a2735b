"""scripts/gpu_bench.sh (benchmarks/gpu_bench.py), issue 56's GPU check, kept working on a CPU:
``--smoke`` runs every part reduced and prints one row per bar with finite numbers."""

from __future__ import annotations

import math
import re
import subprocess
import sys

from conftest import ROOT, cli_env

# every row of a smoke run: (a), (b), the three variants of (c), (d) in fp32
ROWS = {"a", "b", "c alibi", "c t5", "c sliding", "d 32-true"}
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")


def numbers(cell: str) -> list[float]:
    return [float(n.replace(",", "")) for n in NUMBER.findall(cell)]


def test_smoke_prints_every_row_with_finite_numbers(tmp_path):
    env = cli_env() | {"OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", "scripts/gpu_bench.sh", "--smoke"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    written = (tmp_path / "gpu_bench.md").read_text()
    assert written.strip() in proc.stdout  # the table printed is the table written
    assert written.startswith("### gpu_bench on ")
    rows = {}
    for line in written.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and cells[0] not in ("", "---"):
            rows[cells[0]] = cells
    assert set(rows) == ROWS, written
    for variant in ("alibi", "t5", "sliding"):  # through FlexAttention, as on the GPU
        assert "attn_impl=flex" in rows[f"c {variant}"][1], rows[f"c {variant}"]
    for key, (_, what, ours, reference, ratio, bar, mark) in rows.items():
        assert "failed" not in what, what
        for cell in (ours, reference, ratio, bar):
            found = numbers(cell)
            assert found and all(math.isfinite(n) for n in found), (key, cell)
        assert mark in ("ok", "MISSED"), (key, mark)
        # the ratio is what the bar judges: ours over the reference, or (a) the MFU
        assert float(ratio) > 0, (key, ratio)
