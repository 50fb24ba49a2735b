"""One of two processes started by ``torch.distributed.run`` from ``test_scaleout.py``.

Both processes go through the jobs of a JSON file, in one process group (one interpreter start
for all of them):
- ``runs``: ``attnlab.cli.train.train`` on a composed config (an experiment's fast configuration
  under ``trainer=ddp_cpu`` or ``trainer=fsdp2``); its final metrics are kept;
- ``fixed``: a task trained on the fixed global batches that one process trained on in the test
  (``reference_losses``), each process on its half of every batch; the global loss of every step
  is kept.
Rank 0 writes the results next to the JSON file.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torch import Tensor

from attnlab.cli.common import compose_train
from attnlab.cli.train import train


class LossCurve(L.Callback):
    """The training loss of every step, averaged over the processes (CLIP's is already global)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"].detach().clone()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        self.losses.append(float(loss))


class RandomDraws(L.Callback):
    """A draw of the global generator at every training step, per process: rank 0 writes every
    process's draws to ``draws.json`` in the run directory."""

    def __init__(self) -> None:
        self.draws: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.draws.append(float(torch.rand(())))

    def on_train_end(self, trainer, pl_module) -> None:
        everyone = [None] * trainer.world_size
        dist.all_gather_object(everyone, self.draws)
        if trainer.is_global_zero:
            (Path(trainer.default_root_dir) / "draws.json").write_text(json.dumps(everyone))


def shard(batch: Any, rank: int, world: int) -> Any:
    """This process's part of a global batch: rows ``rank::world`` of every batch-sized tensor."""
    if isinstance(batch, Tensor):
        return batch[rank::world]
    if isinstance(batch, dict):
        return {k: shard(v, rank, world) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        return type(batch)(shard(v, rank, world) for v in batch)
    return batch


def fit_fixed(saved: dict[str, Any], trainer_overrides: list[str], rank: int, world: int) -> list[float]:
    """Train the saved task from its saved weights on (this process's part of) the saved batches."""
    task: L.LightningModule = instantiate(OmegaConf.create(saved["model"]))
    task.load_state_dict(saved["state"])
    trainer_cfg = compose_train(trainer_overrides).trainer
    curve = LossCurve()
    trainer = instantiate(
        trainer_cfg,
        precision="32-true",
        max_steps=len(saved["batches"]),
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[curve],
        default_root_dir=saved["dir"],
    )
    batches = [shard(b, rank, world) for b in saved["batches"]]
    trainer.fit(task, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    return curve.losses


def evaluate_fixed(saved: dict[str, Any], trainer_overrides: list[str]) -> dict[str, float]:
    """Validate and test the saved task's weights on its experiment's data; the metrics logged."""
    task: L.LightningModule = instantiate(OmegaConf.create(saved["model"]))
    task.load_state_dict(saved["state"])
    data = instantiate(OmegaConf.create(saved["data"]))
    trainer = instantiate(
        compose_train(trainer_overrides).trainer,
        precision="32-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=saved["dir"],
    )
    metrics = {}
    for run in (trainer.validate, trainer.test):
        for part in run(task, datamodule=data, verbose=False):
            metrics.update({k: float(v) for k, v in part.items()})
    return metrics


def main() -> None:
    spec_file = Path(sys.argv[1])
    spec = json.loads(spec_file.read_text())
    logging.getLogger("lightning").setLevel(logging.WARNING)
    results: dict[str, Any] = {}
    for name, overrides in spec.get("runs", {}).items():
        results[name] = train(compose_train(overrides))
    for name, job in spec.get("fixed", {}).items():
        saved = torch.load(job["file"], weights_only=False)
        results[name] = fit_fixed(saved, job["trainer"], dist.get_rank(), dist.get_world_size())
    for name, job in spec.get("evals", {}).items():
        results[f"{name}-eval"] = evaluate_fixed(torch.load(job["file"], weights_only=False), job["trainer"])
    if dist.get_rank() == 0:
        spec_file.with_suffix(".out.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
