"""``attnlab-eval ckpt_path=<file|last>``: test a checkpoint on the data it was trained with."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from attnlab.cli.common import build_trainer, config_dir, exit_on_user_error, resolve_checkpoint
from attnlab.utils.config import check_config

log = logging.getLogger("attnlab.eval")


def evaluate(cfg: DictConfig) -> dict[str, float]:
    check_config(cfg, imports=False)  # before torch loads: a wrong trainer value is one quick line
    resolve_checkpoint(cfg)  # and so is a checkpoint that is not there
    from lightning.pytorch.loggers import CSVLogger

    from attnlab.inference.runs import TrainedRun

    run = TrainedRun(str(cfg.ckpt_path), Path(cfg.paths.log_dir))
    log.info("evaluating %s", run.path)
    data_cfg = OmegaConf.merge(run.config.data, cfg.get("data") or {})
    datamodule = instantiate(data_cfg)
    if run.artifacts:
        datamodule.load_artifacts(run.artifacts)
    datamodule.prepare_data()
    datamodule.setup("test")
    task = run.task()
    out = Path(cfg.paths.output_dir)
    trainer = build_trainer(cfg, logger=CSVLogger(save_dir=out, name="csv", version=""), callbacks=[])
    trainer.test(task, datamodule=datamodule)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    (out / "metrics.json").write_text(json.dumps({"ckpt_path": str(run.path), **metrics}, indent=2))
    log.info("metrics: %s (saved to %s)", metrics, out / "metrics.json")
    return metrics


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="eval")
def main(cfg: DictConfig) -> None:
    with exit_on_user_error(discard=Path(cfg.paths.output_dir)):
        evaluate(cfg)


if __name__ == "__main__":
    main()
