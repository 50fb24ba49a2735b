"""attnlab-compare's statistics: intervals, tests against a baseline, seeds needed and sacreBLEU's
paired bootstrap equal to scipy's and sacreBLEU's own on fixed values; ``--metrics`` globs. The
real multirun's comparison is in tests/test_compare.py (beside the other test of that multirun)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from scipy import stats

from attnlab.cli.compare import compare, main, parse_args
from attnlab.experiments.compare import Stats, confidence_interval, seeds_needed, versus

A = [2.31, 2.27, 2.35, 2.29]
B = [2.41, 2.38, 2.45]


def test_intervals_equal_scipys():
    sem = stats.sem(A)
    assert confidence_interval(A) == pytest.approx(stats.t.interval(0.95, len(A) - 1, np.mean(A), sem))
    assert confidence_interval(A, 0.9) == pytest.approx(stats.t.interval(0.9, len(A) - 1, np.mean(A), sem))
    boot = stats.bootstrap((A,), np.mean, confidence_level=0.95, rng=0).confidence_interval
    assert confidence_interval(A, method="bootstrap") == pytest.approx([boot.low, boot.high])
    assert confidence_interval([1.0]) is None  # one seed: no interval


def test_welch_and_mann_whitney_against_the_baseline_equal_scipys():
    got = versus(B, A, Stats())
    welch = stats.ttest_ind(B, A, equal_var=False)
    assert got["p"] == pytest.approx(welch.pvalue) and got["diff"] == pytest.approx(np.mean(B) - np.mean(A))
    # Welch-Satterthwaite: the difference ± t(df) * its standard error, df from the two variances
    va, vb = np.var(A, ddof=1) / len(A), np.var(B, ddof=1) / len(B)
    df = (va + vb) ** 2 / (va**2 / (len(A) - 1) + vb**2 / (len(B) - 1))
    half = stats.t.ppf(0.975, df) * np.sqrt(va + vb)
    assert got["diff_ci"] == pytest.approx([got["diff"] - half, got["diff"] + half])
    assert versus(B, A, Stats(test="mwu"))["p"] == pytest.approx(stats.mannwhitneyu(B, A).pvalue)
    pooled = np.sqrt(((len(A) - 1) * np.var(A, ddof=1) + (len(B) - 1) * np.var(B, ddof=1)) / 5)
    assert got["seeds_needed"] == seeds_needed(got["diff"] / pooled)


def test_seeds_needed_are_the_textbook_values():
    # Cohen (1988), two-sided two-sample t-test at alpha 0.05 and power 0.8
    assert [seeds_needed(d) for d in (0.2, 0.5, 0.8, 1.0, -0.5)] == [394, 64, 26, 17, 64]
    assert seeds_needed(0.5, alpha=0.01) == 96 and seeds_needed(0.0) is None
    # a large effect (attention-health rows: d of 10-50), where scipy's noncentral t gives NaN
    assert seeds_needed(3.0) == 4 and seeds_needed(50.0) == 2 and seeds_needed(12.0) == 2


def write_run(root: Path, name: str, seed: int, kind: str, values: dict[str, float]) -> Path:
    run = root / name
    (run / "csv").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"seed": seed, "model": {"net": {"kind": kind}}}))
    header = ",".join(["step", *values])
    (run / "csv" / "metrics.csv").write_text(f"{header}\n10,{','.join(map(str, values.values()))}\n")
    return run


REFS = ["the cat sat on the mat", "a dog runs in the park", "it is raining today", "we like green tea"]
HYPS = {
    "base": ["the cat sat on a mat", "a dog ran in the park", "it rains today", "we like tea"],
    "new": ["the cat sat on the mat", "a dog runs in park", "it is raining today", "we like green tea"],
}


def test_bleu_rows_get_sacrebleus_paired_bootstrap(tmp_path, capsys):
    for i, kind in enumerate(HYPS):
        run = write_run(tmp_path, str(i), 1, kind, {"test/bleu": 30.0 + i, "test/loss": 2.0 - i})
        (run / "test_translations.txt").write_text("".join(h + "\n" for h in HYPS[kind]))
        (run / "test_references.txt").write_text("".join(r + "\n" for r in REFS))
    main([str(tmp_path), "--baseline", "model.net.kind=base", "--format", "json"])
    table = json.loads(capsys.readouterr().out)
    (files := tmp_path / "files").mkdir()
    for name, lines in (("ref", REFS), *HYPS.items()):
        (files / name).write_text("".join(line + "\n" for line in lines))
    ref, base, new = (str(files / name) for name in ("ref", "base", "new"))
    cli = [sys.executable, "-m", "sacrebleu", ref, "-i", base, new, "--paired-bs", "-f", "json"]
    own = json.loads(subprocess.run(cli, capture_output=True, text=True).stdout)
    row = table["rows"][1]["metrics"]
    assert row["test/bleu"]["bleu_p"] == pytest.approx(own[1]["BLEU"]["p_value"])
    assert row["test/bleu"]["mark"] == "better"  # one seed each: the paired bootstrap decides
    assert row["test/loss"]["bleu_p"] is None and row["test/loss"]["p"] is None


def test_metrics_take_globs_and_prefixes_and_a_bad_baseline_is_one_line(tmp_path, capsys):
    names = {"attn/entropy": 1.0, "attn/entropy/0": 1.1, "attn/entropy/0/h0": 1.2, "attn/distance/0": 3.0}
    write_run(tmp_path, "0", 1, "a", names)
    write_run(tmp_path, "1", 1, "b", names)

    def header(metrics: str) -> list[str]:
        out = compare(parse_args([str(tmp_path), "--metrics", metrics, "--format", "csv"]))
        return out.splitlines()[0].split(",")[2:]

    assert header("attn/entropy") == ["attn/entropy"]  # exact
    assert header("attn/entropy/*") == ["attn/entropy/0", "attn/entropy/0/h0"]
    assert header("attn/distance") == ["attn/distance/0"]  # a prefix: the names under it
    for argv, needle in (
        (["--baseline", "model.net.kind=c"], "error: --baseline: 'model.net.kind=c' names 0 rows"),
        (["--metrics", "attn/sinks/*"], "error: --metrics attn/sinks/*: no run logged it"),
    ):
        with pytest.raises(SystemExit) as e:
            main([str(tmp_path), *argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith(needle) and err.count("\n") == 1, err
