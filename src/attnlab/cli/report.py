"""``attnlab-report <run or sweep dirs, study URLs>... --out report.html``: one self-contained HTML
page (opens offline, can be sent): every group's curves with their seed bands, the table of
``attnlab-compare --format json`` (confidence intervals, p-values against ``--baseline``), the
attention-health heat maps and attention maps of each group side by side, cost per token against
length where measured, and each run's config diff, machine, git commit and command line.

examples:
    attnlab-report logs/gpt_pydoc_char/multiruns/<time> --out report.html
    attnlab-report logs/gpt_positions --baseline model.net.positions=learned --metrics test/loss --out r.html
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from attnlab.cli.common import arg_parser, exit_on_user_error
from attnlab.core.errors import ConfigError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = arg_parser("attnlab-report", __doc__)
    p.add_argument("paths", nargs="+", help="run directories, folders holding runs (sweeps), study URLs")
    p.add_argument("--out", type=Path, required=True, help="the HTML file to write")
    p.add_argument(
        "--baseline", metavar="ROW", help="the row the others are tested against (as attnlab-compare)"
    )
    p.add_argument("--metrics", help="comma-separated metric names (default: the test metrics)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with exit_on_user_error(console=True):
        if not args.out.parent.is_dir():
            raise ConfigError(f"{args.out}: no such folder {args.out.parent}")
        from attnlab.experiments.report import build_report

        page = build_report(args.paths, args.metrics.split(",") if args.metrics else None, args.baseline)
        args.out.write_text(page, encoding="utf-8")
        print(f"report written to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
