"""One HTML page comparing runs (``attnlab-report``): the curves with their seed bands, the table of
``attnlab-compare --format json``, attention health and attention maps per group, cost per token
against length, and each run's config diff, machine, commit and command line. Self-contained: the
figures are inline PNGs and the style sheet is in the page, so it opens offline and can be sent."""

from __future__ import annotations

import base64
import html
import io
import re
import shlex
import statistics
import tempfile
from pathlib import Path
from typing import Any

import yaml

from attnlab.core.errors import DataError
from attnlab.experiments.compare import (
    Row,
    Run,
    Stats,
    baseline_row,
    choose_metrics,
    comparison,
    find_sources,
    is_hyperparameter,
    logged_metrics,
    plot,
    row_label,
    rows,
)

HEALTH = re.compile(r"attn/(\w+)/(.+)/h(\d+)$")  # attn/<metric>/<layer>/h<head> (attention health)
# where runs save their attention maps (conf/model/*.yaml: plot_dir: ${paths.output_dir}/<name>)
MAP_DIRS = ("attention", "alignments", "caption_attention")
LENGTH = "model.net.max_len"  # what cost per token is drawn against
STYLE = """body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}
td.num{text-align:right;font-variant-numeric:tabular-nums}.better{background:#dfd}.worse{background:#fdd}.differs{background:#ffd}
.row{display:flex;flex-wrap:wrap;gap:1em;align-items:flex-start}figure{margin:0}img{max-width:46vw}
pre{margin:0;font-size:12px;white-space:pre-wrap;overflow-wrap:anywhere}figcaption{font-size:12px;color:#555}"""


def build_report(sources: list[str], metrics: list[str] | None = None, baseline: str | None = None) -> str:
    """The page for the runs under ``sources`` (run or sweep folders, study URLs)."""
    runs, study_metrics = find_sources(sources)
    metrics = choose_metrics(runs, metrics, study_metrics)
    table_rows = rows(runs, metrics)
    table = comparison(table_rows, metrics, Stats(baseline))
    base = baseline_row(table_rows, baseline) if baseline else table_rows[0]
    body = [
        section("Curves", curves(runs, metrics)),
        section("Comparison", table_html(table)),
        section("Attention health (last validation, mean over seeds)", health(table_rows)),
        section("Attention maps (last saved, first run of each group)", attention_maps(table_rows)),
        section("Cost per token", cost(runs)),
        section(
            f"Runs (config against {html.escape(row_label(base) or 'the first run')})",
            runs_html(table_rows, base),
        ),
    ]
    return (
        '<!doctype html><html><head><meta charset="utf-8"><title>attnlab report</title>'
        f'<link rel="icon" href="data:,"><style>{STYLE}</style></head><body><h1>attnlab report</h1>'
        f"<p>{'<br>'.join(map(html.escape, sources))}</p>{''.join(body)}</body></html>\n"
    )


def section(title: str, content: str) -> str:
    return f"<section><h2>{title}</h2>{content}</section>" if content else ""


def img(png: bytes, caption: str = "") -> str:
    data = base64.b64encode(png).decode()
    cap = f"<figcaption>{html.escape(caption)}</figcaption>" if caption else ""
    return f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,{data}">{cap}</figure>'


def figure_png(fig: Any) -> bytes:
    """A matplotlib figure as PNG bytes, the figure closed."""
    from attnlab.training.plots import plt

    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    plt.close(fig)
    return png.getvalue()


def drawn(runs: list[Run], metric: str, x: str | None = None) -> bytes:
    """The PNG that compare's ``plot`` writes, read back."""
    with tempfile.TemporaryDirectory() as tmp:
        return plot(runs, metric, Path(tmp) / "f.png", x).read_bytes()


def curves(runs: list[Run], metrics: list[str]) -> str:
    """A figure per table metric logged as a curve (a test metric's validation twin stands in)."""
    names = list(dict.fromkeys(n for m in metrics for n in (m, m.replace("test/", "val/", 1))))
    names = [n for n in names if any(len(r.curves.get(n, [])) > 1 for r in runs)]
    return f'<div class="row">{"".join(img(drawn(runs, n)) for n in names)}</div>'


def table_html(table: dict[str, Any]) -> str:
    """``attnlab-compare --format json``'s table; each number's exact value in ``data-value``."""
    level = f"{table['level']:.0%}"
    head = "".join(
        f"<th>{html.escape(m)}: mean [{level} CI]</th><th>diff [{level} CI]</th><th>p ({table['test']})</th>"
        "<th>seeds needed</th>"
        for m in table["metrics"]
    )
    body = []
    for row in table["rows"]:
        cells = [f"<td>{html.escape(row['label'] or '-')}</td><td class=num>{len(row['runs'])}</td>"]
        for m, c in row["metrics"].items():
            marked = f"num {c['mark']}" if c["mark"] else "num"  # one class attribute: a second is ignored
            cells.append(
                f"<td class='{marked}'>{num(m, 'mean', c['mean'])} {interval(m, 'ci', c['ci'])}</td>"
                f"<td class=num>{num(m, 'diff', c['diff'])} {interval(m, 'diff_ci', c['diff_ci'])}</td>"
                f"<td class=num>{num(m, 'p', c['p'])}{paired_bleu(m, c['bleu_p'])}</td>"
                f"<td class=num>{num(m, 'seeds_needed', c['seeds_needed'])}</td>"
            )
        body.append(f'<tr data-label="{html.escape(row["label"])}">{"".join(cells)}</tr>')
    base = table["baseline"]
    note = f"<p>baseline: {html.escape(base)}; p &lt; {table['alpha']} marked</p>" if base else ""
    return f"{note}<table><tr><th>row</th><th>runs</th>{head}</tr>{''.join(body)}</table>"


def num(metric: str, field: str, value: float | None) -> str:
    if value is None:
        return "-"
    where = f'data-metric="{html.escape(metric)}" data-field="{field}" data-value="{value!r}"'
    return f"<span {where}>{value:.4g}</span>"


def paired_bleu(metric: str, p: float | None) -> str:
    return f"<br>paired bootstrap: {num(metric, 'bleu_p', p)}" if p is not None else ""


def interval(metric: str, field: str, ci: list[float] | None) -> str:
    return f"[{num(metric, field + '.0', ci[0])}, {num(metric, field + '.1', ci[1])}]" if ci else ""


def health(table_rows: list[Row]) -> str:
    """Each group's attention-health heat maps (a panel per metric, layers x heads; the mean over
    its seeds of the last logged values) side by side, a metric on one colour scale in every group."""
    from attnlab.training.attention_health import heat_maps

    names = {m[1] for r in table_rows for run in r.runs for c in run.curves if (m := HEALTH.match(c))}
    groups = {row_label(r): {m: grid for m in sorted(names) if (grid := heads(r, m))} for r in table_rows}
    figures = []
    for label, values in ((k, v) for k, v in groups.items() if v):
        fig = heat_maps(values)
        for ax, metric in zip(fig.axes, values, strict=False):  # the panels, then their colour bars
            scale = [float(v) for g in groups.values() for layer in g.get(metric, {}).values() for v in layer]
            ax.images[0].set_clim(min(scale), max(scale))  # its colour bar follows
        figures.append(img(figure_png(fig), label))
    return f'<div class="row">{"".join(figures)}</div>' if names else ""


def heads(row: Row, metric: str) -> dict[str, Any]:
    """Layer -> per-head values (a tensor) of ``metric``, averaged over the row's runs."""
    import torch

    cells: dict[str, dict[int, list[float]]] = {}
    for run in row.runs:
        for name, points in run.curves.items():
            if (m := HEALTH.match(name)) and m[1] == metric:
                cells.setdefault(m[2], {}).setdefault(int(m[3]), []).append(points[-1][1])
    return {
        layer: torch.tensor([statistics.fmean(by_head[h]) for h in sorted(by_head)])
        for layer, by_head in sorted(cells.items(), key=lambda kv: natural(kv[0]))
    }


def natural(name: str) -> list[Any]:
    """``blocks.2`` before ``blocks.10``."""
    return [(0, int(t)) if t.isdigit() else (1, t) for t in re.split(r"(\d+)", name)]


def attention_maps(table_rows: list[Row]) -> str:
    """The attention maps each group's first run saved last, the groups side by side."""
    groups = []
    for row in table_rows:
        run = row.runs[0]
        files = sorted(f for d in MAP_DIRS for f in (run.path / d).glob("*.png"))
        last = files[-1].name.split("_")[0] if files else None  # step000120[_sentence0_...].png
        shown = "".join(img(f.read_bytes(), f.name) for f in files if f.name.split("_")[0] == last)
        if shown:
            groups.append(f"<div><h3>{html.escape(row_label(row) or run.path.name)}</h3>{shown}</div>")
    return f'<div class="row">{"".join(groups)}</div>' if groups else ""


def cost(runs: list[Run]) -> str:
    """Cost per token (``TrainingCost``'s ``cost/*_ms_per_token``) against the length, where logged."""
    names = [m for m in logged_metrics(runs) if m.startswith("cost/") and m.endswith("_ms_per_token")]
    figures = []
    for name in names:
        try:
            figures.append(img(drawn(runs, name, LENGTH), name))
        except DataError:  # no run with a length: nothing to draw against
            continue
    return f'<div class="row">{"".join(figures)}</div>' if figures else ""


def runs_html(table_rows: list[Row], base: Row) -> str:
    """A row per run: what its config changes from the baseline's first run, its machine, git
    commit and command line (its run record, ``run.yaml``; else machine.yaml and Hydra's overrides)."""
    head = "".join(f"<th>{h}</th>" for h in ("run", "config diff", "machine", "git commit", "command"))
    body = "".join(run_row(run, base.runs[0].config) for row in table_rows for run in row.runs)
    return f"<table><tr>{head}</tr>{body}</table>"


def run_row(run: Run, ref: dict[str, Any]) -> str:
    keys = sorted(k for k in ref.keys() | run.config.keys() if is_hyperparameter(k))
    diff = [
        f"{k}: {ref.get(k)} → {run.config.get(k)}"
        for k in keys
        if repr(ref.get(k)) != repr(run.config.get(k))
    ]
    record = read_yaml(run.path / "run.yaml")
    command = record.get("command") or ["attnlab-train", *read_yaml(run.path / ".hydra" / "overrides.yaml")]
    git = record.get("git") or {}
    dirty = " + uncommitted changes" if git.get("diff_sha256") else ""
    commit = f"{git.get('commit') or 'not recorded'}{dirty}"
    machine = yaml.safe_dump(record.get("machine") or read_yaml(run.path / "machine.yaml"), sort_keys=False)
    cells = [
        pre(str(run.path)),
        pre("\n".join(diff) or "(the baseline)"),
        f"<details><summary>{html.escape(machine.splitlines()[0])}</summary>{pre(machine)}</details>",
        pre(commit),
        pre(shlex.join(map(str, command))),
    ]
    return "<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>"


def pre(text: str) -> str:
    return f"<pre>{html.escape(text)}</pre>"


def read_yaml(path: Path) -> Any:
    """A run's YAML record, empty where the run has none (older runs)."""
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}
