"""``attnlab-report`` on a real multirun, opened in a real headless browser (Debian's chromium driven
by playwright): no console error, no request leaving the file, every figure drawn, and the table's
numbers those of ``attnlab-compare --format json``."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import run_main

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
BASELINE = "model.net.positions=learned"


def install_chromium() -> None:
    """CI's machines start without chromium: Debian's package, where we may install it."""
    if CHROMIUM.exists() or os.geteuid() != 0 or not shutil.which("apt-get"):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    with contextlib.suppress(subprocess.TimeoutExpired):
        for command in (["apt-get", "update"], ["apt-get", "install", "-y", "chromium"]):
            subprocess.run(command, env=env, capture_output=True, timeout=600)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright (the dev group)")
    install_chromium()
    if not CHROMIUM.exists():
        pytest.skip(f"needs Debian's chromium at {CHROMIUM} (apt-get install chromium)")
    pw = sync_api.sync_playwright().start()
    try:
        context = pw.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")),
            executable_path=str(CHROMIUM),
            headless=True,
            args=FLAGS,
        )
    except sync_api.Error as e:
        pw.stop()
        pytest.skip(f"{CHROMIUM} does not start headless here: {e.message.splitlines()[0]}")
    yield context
    context.close()
    pw.stop()


def open_page(browser, file: Path) -> tuple[dict, list[str]]:
    """What the page shows (figures, the table's numbers) and what went wrong loading it (console
    errors, uncaught exceptions, requests for anything but the file and its inline data)."""
    page = browser.new_page()
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"exception: {e}"))
    page.on(
        "request",
        lambda r: (
            None if r.url.startswith(("data:", file.as_uri())) else problems.append(f"request: {r.url}")
        ),
    )
    page.goto(file.as_uri(), wait_until="load")
    shown = page.evaluate(
        """() => ({
        images: [...document.images].map(i => i.complete ? i.naturalWidth : 0),
        svgs: [...document.querySelectorAll('svg')].map(s => s.getBBox().width),
        sections: Object.fromEntries([...document.querySelectorAll('section')].map(s => [
            s.querySelector('h2').textContent.split(' (')[0], s.querySelectorAll('img').length])),
        numbers: [...document.querySelectorAll('[data-value]')].map(e => [e.closest('tr').dataset.label,
            e.dataset.metric, e.dataset.field, e.dataset.value, e.textContent]),
        marked: document.querySelectorAll('td.better, td.worse, td.differs').length,
    })"""
    )
    page.close()
    return shown, problems


def test_the_report_of_a_multirun_opens_offline_with_every_figure_and_compares_numbers(
    positions_multirun, browser, tmp_path
):
    from attnlab.cli.compare import compare, parse_args

    multirun = positions_multirun  # conftest's: attnlab-train -m seed=1,2,3 model.net.positions=learned,alibi
    out = tmp_path / "report.html"
    status, log = run_main("report", [str(multirun), "--out", str(out), "--baseline", BASELINE])
    assert status == 0, log[-3000:]
    shown, problems = open_page(browser, out)
    assert problems == []
    with open(next(multirun.glob("*/csv/metrics.csv"))) as f:
        names = next(csv.reader(f))
    assert any(c.startswith("attn/entropy/") for c in names), names  # attention health, per head
    figures = {"Curves": 2, "Comparison": 0, "Attention health": 2, "Runs": 0}  # val/loss, val/ppl; 2 groups
    if any(c.startswith("cost/") for c in names):  # cost per token, where the runs measured it
        figures["Cost per token"] = sum(c.endswith("_ms_per_token") for c in names)
    assert shown["sections"] == figures
    assert all(w > 0 for w in shown["images"])
    assert all(w > 0 for w in shown["svgs"])

    table = json.loads(compare(parse_args([str(multirun), "--format", "json", "--baseline", BASELINE])))
    expected = {}
    for row in table["rows"]:
        for metric, cell in row["metrics"].items():
            for field in ("mean", "ci", "diff", "diff_ci", "p", "bleu_p", "seeds_needed"):
                values = enumerate(cell[field] or []) if field.endswith("ci") else [(None, cell[field])]
                for i, v in values:
                    if v is not None:
                        expected[row["label"], metric, field if i is None else f"{field}.{i}"] = v
    got = {(label, metric, field): float(value) for label, metric, field, value, _ in shown["numbers"]}
    assert got == expected and any(k[2] == "p" for k in got)  # every number, the p-values included
    assert all(text == f"{float(value):.4g}" for *_, value, text in shown["numbers"])
    marks = [c["mark"] for row in table["rows"] for c in row["metrics"].values() if c["mark"]]
    assert marks and shown["marked"] == len(marks)  # ALiBi's lower loss is drawn as better


def test_bad_input_is_one_line(tmp_path):
    missing = tmp_path / "no" / "report.html"
    status, out = run_main("report", [str(tmp_path), "--out", str(missing)])
    assert (status, out.strip()) == (2, f"error: {missing}: no such folder {missing.parent}")
    status, out = run_main("report", [str(tmp_path), "--out", str(tmp_path / "r.html")])
    assert status == 2 and out.strip().splitlines() == [f"error: no runs (csv/metrics.csv) under {tmp_path}"]


def test_a_vision_run_s_attention_maps_are_on_the_page(browser, tmp_path, monkeypatch):
    """A ViT saves its attention over the validation images at every validation (model.plot_dir):
    the report shows the last ones."""
    from conftest import QUIET, vision_overrides

    monkeypatch.chdir(tmp_path)
    tiny = [
        a for a in vision_overrides("vit_fashion_mnist", tmp_path) if not a.startswith("model.plot_images")
    ]
    steps = ["trainer.max_steps=2", "trainer.val_check_interval=2", "test=false", "model.plot_images=2"]
    argv = ["experiment=vit_fashion_mnist", *tiny, *QUIET, *steps, f"paths.root_dir={tmp_path}"]
    status, out = run_main("train", argv)
    assert status == 0, out[-3000:]
    (run,) = (tmp_path / "logs").glob("*/runs/*")
    assert run_main("report", [str(run), "--out", str(tmp_path / "r.html")])[0] == 0
    shown, problems = open_page(browser, tmp_path / "r.html")
    assert problems == [] and shown["sections"]["Attention maps"] == len(list(run.glob("attention/*.png")))
    assert all(w > 0 for w in shown["images"])
