"""``attnlab-rerun RUN_DIR [key=value ...]``: train a run again from its folder, in a new folder,
with the overrides it was given (and any added here), after one warning line for each thing its
``run.yaml`` records that differs now (git commit, uncommitted diff, uv.lock, data); then print its
final test and validation metrics beside the original's.

examples:
    attnlab-rerun logs/gpt_pydoc_char/runs/<time>
    attnlab-rerun logs/gpt_pydoc_char/runs/<time> trainer.accelerator=cpu
    attnlab-rerun logs/gpt_pydoc_char/runs/<time> --check      # the warnings only, nothing trained
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import yaml

from attnlab.cli.common import aligned, arg_parser, compose_train, exit_on_user_error
from attnlab.core.errors import ConfigError
from attnlab.core.run_record import code_state, data_hashes, differences


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = arg_parser("attnlab-rerun", __doc__)
    p.add_argument("run_dir", type=Path, help="a folder attnlab-train wrote (logs/<task>/runs/<time>)")
    p.add_argument("overrides", nargs="*", help="attnlab-train overrides added to the run's own")
    p.add_argument("--check", action="store_true", help="print the warnings only; train nothing")
    return p.parse_intermixed_args(argv)


def read_run(run_dir: Path) -> tuple[list[str], dict | None, Path]:
    """The run's overrides, its record (None before runs recorded one) and the folder it ran from."""
    hydra = run_dir / ".hydra"
    if not all(
        p.is_file() for p in (run_dir / "config.yaml", hydra / "overrides.yaml", hydra / "hydra.yaml")
    ):
        raise ConfigError(f"{run_dir}: not a run folder (attnlab-train's holds config.yaml and .hydra/)")
    overrides = yaml.safe_load((hydra / "overrides.yaml").read_text()) or []
    cwd = Path(yaml.safe_load((hydra / "hydra.yaml").read_text())["hydra"]["runtime"]["cwd"])
    record = run_dir / "run.yaml"
    return overrides, yaml.safe_load(record.read_text()) if record.is_file() else None, cwd


def final_metrics(run_dir: Path) -> dict[str, float]:
    """The last value of every validation and test metric in the run's CSV log."""
    from attnlab.experiments.compare import read_curves

    csv = run_dir / "csv" / "metrics.csv"
    curves = read_curves(csv) if csv.is_file() else {}
    return {k: points[-1][1] for k, points in curves.items() if k.startswith(("val/", "test/"))}


def table(before: dict[str, float], after: dict[str, float]) -> str:
    """The two runs' metrics side by side, with the rerun's difference."""
    lines = [("metric", "run", "rerun", "difference")]
    for k in sorted(before | after):
        a, b = before.get(k), after.get(k)
        diff = f"{b - a:+.4f}" if a is not None and b is not None else "-"
        lines.append((k, *(f"{v:.4f}" if v is not None else "-" for v in (a, b)), diff))
    return aligned(lines)


def rerun(args: argparse.Namespace) -> int:
    run_dir = args.run_dir.resolve()
    overrides, record, cwd = read_run(run_dir)
    if record and record.get("ckpt_path"):  # the file it resumed from, not today's newest checkpoint
        overrides = [o for o in overrides if not o.startswith("ckpt_path=")]
        overrides.append(f"ckpt_path={record['ckpt_path']}")
    if cwd.is_dir():  # its relative paths (data, logs) mean what they meant
        os.chdir(cwd)
    cfg = compose_train([*overrides, *args.overrides])
    if record is None:
        print(f"warning: {run_dir}: no run.yaml (a run from before runs recorded one): nothing to compare")
    else:
        now = {**code_state(), "data": data_hashes(cfg.data)}
        for line in differences(record, now):
            print(f"warning: {line}")
    sys.stdout.flush()  # before the training's own output
    if args.check:
        return 0
    stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S-%f")  # Hydra's run folder, named here to find it
    new = Path(cfg.paths.log_dir).resolve() / cfg.task_name / "runs" / stamp
    command = [*overrides, *args.overrides, f"hydra.run.dir={new}"]
    # in a process of its own: DDP's launcher starts the other ranks by running its command line again
    status = subprocess.run([sys.executable, "-m", "attnlab.cli.train", *command]).returncode
    if status == 0:
        print(f"rerun of {run_dir} in {new}:\n{table(final_metrics(run_dir), final_metrics(new))}")
    return status


def main() -> None:
    args = parse_args()
    with exit_on_user_error(console=True):
        status = rerun(args)
    sys.exit(status)


if __name__ == "__main__":
    main()
