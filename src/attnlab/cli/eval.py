"""``attnlab-eval ckpt_path=<file|last>``: test a checkpoint on the data it was trained with, the
results added to the run's own logs."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from attnlab.cli.common import build_trainer, inference_main, resolve_checkpoint
from attnlab.core.config import check_config
from attnlab.core.errors import ConfigError
from attnlab.core.specs import is_int

if TYPE_CHECKING:
    from attnlab.inference.runs import TrainedRun

log = logging.getLogger("attnlab.eval")


def evaluate(cfg: DictConfig) -> dict[str, float]:
    check_config(cfg, imports=False)  # before torch loads: a wrong trainer value is one quick line
    lengths = length_multiples(cfg.get("lengths"))
    resolve_checkpoint(cfg)  # and so is a checkpoint that is not there
    from lightning.pytorch.utilities import rank_zero_only

    from attnlab.inference.runs import TrainedRun

    run = TrainedRun(str(cfg.ckpt_path), Path(cfg.paths.log_dir))
    log.info("evaluating %s", run.path)
    data_cfg = OmegaConf.merge(run.config.data, cfg.get("data") or {})
    out = Path(cfg.paths.output_dir)
    metrics = test_at_lengths(cfg, run, data_cfg, out, lengths) if lengths else test(cfg, run, data_cfg, out)
    (out / "metrics.json").write_text(json.dumps({"ckpt_path": str(run.path), **metrics}, indent=2))
    log.info("metrics: %s (saved to %s)", metrics, out / "metrics.json")
    if cfg.get("log_to_run", True) and rank_zero_only.rank == 0:
        log_to_run(run, metrics)
    return metrics


def test(
    cfg: DictConfig, run: TrainedRun, data_cfg: DictConfig, out: Path, version: str = ""
) -> dict[str, float]:
    """The run's test metrics on the data ``data_cfg`` describes, logged in ``<out>/csv/<version>``."""
    from lightning.pytorch.loggers import CSVLogger

    trainer = build_trainer(cfg, logger=CSVLogger(save_dir=out, name="csv", version=version), callbacks=[])
    datamodule = instantiate(data_cfg)
    if run.artifacts:
        datamodule.load_artifacts(run.artifacts)
    datamodule.prepare_data()
    datamodule.setup("test")
    from attnlab.nn.embedding import PastTheTable

    try:
        trainer.test(run.task(), datamodule=datamodule)
    except PastTheTable as e:  # the data's windows, longer than the net's learned positions
        raise ConfigError(f"data.max_len={data_cfg.get('max_len')}: {e}") from e
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


def length_multiples(value: object) -> list[int]:
    """``lengths=`` as a list of positive integers (``lengths=3``: ``[3]``; unset: ``[]``)."""
    from omegaconf import ListConfig

    if value is None:
        return []
    given = list(value) if isinstance(value, ListConfig | list | tuple) else [value]
    if not given or not all(is_int(m) and m > 0 for m in given):
        raise ConfigError(
            "lengths must be a list of positive integers (multiples of a language model's "
            f"data.max_len), e.g. lengths=[1,2,4], got {value}"
        )
    return given


def test_at_lengths(
    cfg: DictConfig, run: TrainedRun, data_cfg: DictConfig, out: Path, lengths: list[int]
) -> dict[str, float]:
    """A language model tested at each multiple in ``lengths`` of its ``data.max_len`` (``test/loss_x2``);
    a length it cannot take is skipped, saying why (all: the error)."""
    from hydra.utils import get_class

    from attnlab.data.text.language_modeling import TextDataModule

    try:  # only a language model's data cuts windows of max_len (a translation pair's is a limit)
        windows = issubclass(get_class(str(data_cfg.get("_target_"))), TextDataModule)
    except Exception:
        windows = False
    base = data_cfg.get("max_len") if windows else None
    if base is None:
        raise ConfigError(
            f"lengths needs a language model: {run.path}'s data ({data_cfg.get('_target_')}) has no "
            "data.max_len window to multiply; leave lengths out"
        )
    metrics, skipped = {}, []
    for m in lengths:
        data = OmegaConf.merge(data_cfg, {"max_len": base * m})
        try:
            found = test(cfg, run, data, out, f"x{m}")
        except ConfigError as e:
            log.warning("length x%d (%d tokens) skipped: %s", m, base * m, e)
            skipped.append(e)
            continue
        metrics |= {f"{k}_x{m}": v for k, v in found.items() if k in ("test/loss", "test/ppl")}
    if not metrics:
        raise skipped[0]
    return metrics


def log_to_run(run: TrainedRun, metrics: dict[str, float]) -> None:
    """``metrics`` as ``eval/...`` added at the checkpoint's step to its run's CSV log and W&B run."""
    if run.path.parent.name != "checkpoints":  # a checkpoint copied out of its run: no run to log to
        log.info("%s is not in a run's checkpoints/ folder: the metrics stay in this run's folder", run.path)
        return
    run_dir = run.path.parent.parent
    step = int(run.ckpt.get("global_step") or 0)
    keyed = {f"eval/{k}": v for k, v in metrics.items()}
    csv_file = run_dir / "csv" / "metrics.csv"
    if csv_file.is_file():
        from attnlab.training.loggers import CSVLogger as RunCSVLogger

        csv_log = RunCSVLogger(save_dir=run_dir, name="csv", version="")
        csv_log.log_metrics(keyed, step)
        csv_log.save()
        log.info("added to the run's CSV log %s (step %d)", csv_file, step)
    if run_id := run.meta.get("wandb_run_id"):
        from lightning.pytorch.loggers import WandbLogger

        from attnlab.training.wandb_mode import ensure_wandb_mode

        ensure_wandb_mode()
        settings = (run.config.get("logger") or {}).get("wandb") or {}
        wandb = WandbLogger(
            id=run_id,
            resume="allow",
            save_dir=str(run_dir),
            project=settings.get("project", "attnlab"),
            entity=settings.get("entity"),
        )
        wandb.log_metrics(keyed, step)
        wandb.experiment.finish()
        log.info("added to the run's W&B run %s (step %d)", run_id, step)


main = inference_main("eval", (), evaluate, discard=True)


if __name__ == "__main__":
    main()
