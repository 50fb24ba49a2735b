"""``attnlab-compare <run or sweep dirs, study URLs>...``: a table of the runs' metrics beside the
hyperparameters that differ between them; runs differing only by seed grouped as mean ± std, with
confidence intervals, and p-values and the seeds needed against a ``--baseline`` row; the trials of
a sweep with the machine each ran on.

examples:
    attnlab-compare logs/gpt_pydoc_char/multiruns/2026-11-25_10-00-00-000000
    attnlab-compare logs/vit_fashion_mnist logs/deit_fashion_mnist --metrics test/acc --sort test/acc
    attnlab-compare logs/... --where model.optim.optimizer.lr=0.001 --best --format md
    attnlab-compare logs/... --plot val/loss --out val_loss.png
    attnlab-compare logs/gpt_long_context --plot cost/train_ms_per_token --x model.net.max_len
    attnlab-compare logs/gpt_positions --plot 'eval/test/ppl_x*'     # against each name's number
    attnlab-compare postgresql://me@db/optuna --study gpt_pydoc_char     # every machine's trials
    attnlab-compare journal:/shared/sweeps/gpt.log logs/gpt_pydoc_char/sweeps/<time>
    attnlab-compare logs/gpt_positions/multiruns/<time> --baseline model.net.positions=learned
    attnlab-compare logs/... --metrics 'attn/entropy/*' --ci bootstrap --format json
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import shutil
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from attnlab.cli.common import arg_parser, exit_on_user_error
from attnlab.core.errors import ConfigError
from attnlab.experiments.compare import (
    Stats,
    choose_metrics,
    comparison,
    find_sources,
    logged_metrics,
    lower_is_better,
    plot,
    rows,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = arg_parser("attnlab-compare", __doc__)
    p.add_argument(
        "paths",
        nargs="+",
        help="run directories, folders holding runs (sweeps), or an attnlab-sweep study's storage: "
        "postgresql://USER@HOST/DB, journal:FILE, sqlite:///FILE (every trial, with the machine it ran on)",
    )
    p.add_argument("--study", help="with a study URL: this study only (default: every study there)")
    p.add_argument(
        "--metrics",
        help="comma-separated metric names or globs ('attn/entropy/*'); a prefix stands for the "
        "names under it (default: the test metrics)",
    )
    p.add_argument("--best", action="store_true", help="each metric's best value, not its last")
    p.add_argument("--sort", help="sort by this metric (best first)")
    p.add_argument(
        "--where",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keep runs whose config has KEY=VALUE (repeatable)",
    )
    p.add_argument("--no-group", action="store_true", help="one row per run, even across seeds")
    p.add_argument("--format", choices=("table", "md", "csv", "json"), default="table")
    p.add_argument("--ci", choices=("t", "bootstrap"), help="show each mean's confidence interval")
    p.add_argument("--level", type=float, help="the intervals' confidence level (default: 0.95)")
    p.add_argument(
        "--baseline",
        metavar="ROW",
        help="test every row against this one: its label (model.net.positions=learned) or 1-based "
        "index; prints the p-value, the difference with its interval and the seeds needed",
    )
    p.add_argument(
        "--test", choices=("welch", "mwu"), default="welch", help="Welch's t-test or Mann-Whitney U"
    )
    p.add_argument("--alpha", type=float, default=0.05, help="the level that marks a row better or worse")
    p.add_argument(
        "--plot", metavar="METRIC", help="write a PNG of METRIC against the step, one line per run"
    )
    p.add_argument(
        "--x",
        metavar="KEY",
        help="plot each run's last METRIC against this config key (e.g. model.net.max_len) instead "
        "of the step; with a * in METRIC (eval/test/ppl_x*), against the number it stands for",
    )
    p.add_argument("--out", type=Path, help="where the plot goes (default: <metric>.png)")
    return p.parse_args(argv)


def matches(config: dict, where: list[str]) -> bool:
    for cond in where:
        if "=" not in cond:
            raise ConfigError(f"--where {cond!r}: expected KEY=VALUE, e.g. model.optim.optimizer.lr=0.001")
        key, value = cond.split("=", 1)
        if str(config.get(key)) != value:
            return False
    return True


def render(header: list[str], body: list[list[str]], fmt: str, left: int) -> str:
    """The table as CSV, Markdown or for the terminal (the first ``left`` columns left-aligned)."""
    if fmt == "csv":
        out = io.StringIO()
        csv.writer(out).writerows([header, *body])
        return out.getvalue()
    if fmt == "md":
        lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body]) + "\n"
    table = Table(show_lines=False)
    for i, name in enumerate(header):
        table.add_column(name, justify="left" if i < left else "right")
    for row in body:
        table.add_row(*row)
    out = io.StringIO()
    # the terminal's width (COLUMNS where set); 200 when the table goes to a file or a pipe
    Console(file=out, width=shutil.get_terminal_size((200, 24)).columns).print(table)
    return out.getvalue()


def interval(ci: list[float | None] | None) -> str:
    return "" if ci is None or None in ci else f" [{ci[0]:.3g}, {ci[1]:.3g}]"


def stats_cells(c: dict, baseline: bool) -> list[str]:
    """A metric's cells: mean ± std [interval]; against a baseline, the difference [its
    interval], the p-value (sacreBLEU's paired bootstrap's beside) with the mark, the seeds needed."""
    if not c["n"]:
        return ["-"] * (4 if baseline else 1)
    mean = "nan" if c["mean"] is None else f"{c['mean']:.4g}"
    mean += (f" ± {c['std']:.2g}" if c["std"] is not None else "") + interval(c["ci"])
    if not baseline:
        return [mean]
    diff = "" if c["diff"] is None else f"{c['diff']:+.3g}" + interval(c["diff_ci"])
    p = [f"{c['p']:.3g}"] if c["p"] is not None else []
    p += [f"(paired bootstrap {c['bleu_p']:.3g})"] if c["bleu_p"] is not None else []
    p += [c["mark"]] if c["mark"] else []
    return [mean, diff or "-", " ".join(p) or "-", str(c["seeds_needed"] or "-")]


def stats_table(table: dict, fmt: str) -> str:
    baseline = table["baseline"] is not None
    header = [*table["keys"], "runs"]
    for m in table["metrics"]:
        shown = f"{m} ({table['level']:.0%} CI)" if table["ci"] else m
        header += [shown] + [f"Δ {m}", f"p {m}", f"seeds {m}"] * baseline
    body = [
        [str(row["config"][k]) for k in table["keys"]]
        + [str(len(row["runs"]))]
        + [cell for m in table["metrics"] for cell in stats_cells(row["metrics"][m], baseline)]
        for row in table["rows"]
    ]
    return render(header, body, fmt, len(table["keys"]))


def compare(args: argparse.Namespace) -> str:
    found, study_metrics = find_sources(args.paths, args.study)
    runs = [r for r in found if matches(r.config, args.where)]
    if not runs:
        raise ConfigError(f"--where {' '.join(args.where)}: no run matches")
    if args.plot:
        out = args.out or Path(args.plot.replace("/", "_").replace("*", "") + ".png")
        x = args.x or ("*" if "*" in args.plot else None)
        out = plot(runs, args.plot, out, x, not args.no_group)
        print(f"plot written to {out}", file=sys.stderr)
    if args.sort and args.sort not in (logged := logged_metrics(runs)):
        raise ConfigError(f"--sort {args.sort}: no run logged it (logged: {', '.join(logged)})")
    metrics = choose_metrics(runs, args.metrics.split(",") if args.metrics else None, study_metrics)
    table_rows = rows(runs, metrics, group_seeds=not args.no_group, best=args.best)
    if args.sort:
        sign = 1 if lower_is_better(args.sort) else -1
        table_rows.sort(key=lambda r: (math.isnan(r.mean(args.sort)), sign * r.mean(args.sort)))
    for option, value in (("--level", args.level), ("--alpha", args.alpha)):
        if value is not None and not 0 < value < 1:
            raise ConfigError(f"{option}: expected a number between 0 and 1, got {value}")
    plain = args.format != "json" and not (args.ci or args.level or args.baseline)  # mean ± std only
    stats = Stats(args.baseline, None if plain else args.ci or "t", args.level or 0.95, args.test, args.alpha)
    table = comparison(table_rows, metrics, stats)
    return json.dumps(table, indent=1) + "\n" if args.format == "json" else stats_table(table, args.format)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with exit_on_user_error(console=True):
        print(compare(args), end="")


if __name__ == "__main__":
    main()
