"""``attnlab-average RUN_DIR --last N [key=value ...]``: average the weights of a run's last N
checkpoints (timm's avg_checkpoints.py, fairseq), write them to
``RUN_DIR/checkpoints/average_lastN.ckpt``, evaluate the average and the last checkpoint on the
validation and test splits (as attnlab-eval), print the two rows, and save them to
``RUN_DIR/average_lastN.json``.

A run keeps only its best and last checkpoints unless trained with
``callbacks.model_checkpoint.save_top_k=-1`` (one at every validation).

examples:
    attnlab-train experiment=vit_fashion_mnist callbacks.model_checkpoint.save_top_k=-1
    attnlab-average logs/vit_fashion_mnist/runs/<time> --last 5
    attnlab-average logs/vit_fashion_mnist/runs/<time> --last 5 trainer.accelerator=cpu
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf

from attnlab.cli.common import aligned, arg_parser, build_trainer, compose_config, exit_on_user_error
from attnlab.core.errors import ConfigError

if TYPE_CHECKING:
    from attnlab.inference.runs import TrainedRun


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = arg_parser("attnlab-average", __doc__)
    p.add_argument("run_dir", type=Path, help="a run's folder (holding checkpoints/)")
    p.add_argument("--last", type=int, required=True, help="how many of its last checkpoints to average")
    p.add_argument("overrides", nargs="*", help="attnlab-eval's key=value overrides (trainer.*, data.*)")
    return p.parse_intermixed_args(argv)


def evaluate(cfg: DictConfig, run: TrainedRun) -> dict[str, float]:
    """The run's validation and test metrics (without the ``*_best`` the run tracked while training)."""
    from hydra.utils import instantiate

    datamodule = instantiate(OmegaConf.merge(run.config.data, cfg.get("data") or {}))
    if run.artifacts:
        datamodule.load_artifacts(run.artifacts)
    datamodule.prepare_data()
    task = run.task()
    metrics = {}
    trainer = build_trainer(cfg, logger=False, callbacks=[], enable_progress_bar=False)
    for stage in (trainer.validate, trainer.test):
        stage(task, datamodule=datamodule, verbose=False)
        metrics |= {k: float(v) for k, v in trainer.callback_metrics.items() if not k.endswith("_best")}
    return metrics


def table(report: dict[str, dict]) -> str:
    """A row per checkpoint of the report, a column per metric."""
    names = sorted({k for r in report.values() for k in r["metrics"]})
    return aligned(
        [["checkpoint", *names]]
        + [
            [f"{r['checkpoint']} (steps {', '.join(map(str, r['steps']))})"]
            + [f"{r['metrics'][k]:.4f}" if k in r["metrics"] else "-" for k in names]
            for r in report.values()
        ]
    )


def average(args: argparse.Namespace) -> dict[str, dict]:
    """Average, evaluate both, print and save; the report saved (``last`` and ``average``)."""
    if args.last < 1:
        raise ConfigError(f"--last must be a positive number of checkpoints, got {args.last}")
    run_dir = args.run_dir.resolve()
    cfg = compose_config("eval", args.overrides)  # attnlab-eval's trainer and data overrides
    cfg.paths.output_dir = str(run_dir)  # the trainer's root (it writes nothing there: no logger)
    from attnlab.inference.runs import TrainedRun
    from attnlab.weights.averaging import average_last

    out, last, steps = average_last(run_dir, args.last)
    report = {
        name: {
            "checkpoint": path.name,
            "steps": kept,
            "metrics": evaluate(cfg, TrainedRun(str(path), run_dir)),
        }
        for name, path, kept in (("last", last, steps[-1:]), ("average", out, steps))
    }
    print(table(report))
    saved = run_dir / f"{out.stem}.json"
    saved.write_text(json.dumps(report, indent=2))
    print(f"average written to {out}; metrics saved to {saved}")
    return report


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with exit_on_user_error(console=True):
        average(args)


if __name__ == "__main__":
    main()
