"""Precision and gradient clipping on hardware CI does not have: fp16 with a gradient scaler (what
``precision: auto`` picks on a GPU without bf16) and FSDP's sharded gradients."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from hydra.utils import instantiate
from lightning.pytorch.plugins import MixedPrecision
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel

from attnlab.cli.common import compose_train
from attnlab.core.config import fill_missing
from attnlab.core.hardware import choose_precision
from attnlab.training.optim import clip_gradients
from conftest import TINY


def test_auto_precision_is_fp16_with_scaling_on_a_gpu_without_bf16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert choose_precision("auto")[0] == "16-mixed"


def test_fp16_with_a_gradient_scaler_trains_the_recipe_and_clips(tmp_path: Path):
    """Every recipe asks for a fused AdamW and clipping; Lightning refuses to clip for a fused
    optimizer under a gradient scaler (it unscales inside its step). The optimizer is then built
    unfused, and the run trains. fp16 autocast runs on the CPU too, so CI checks it."""
    cfg = compose_train([*TINY, f"paths.output_dir={tmp_path}", f"paths.root_dir={tmp_path}"])
    assert cfg.model.optim.optimizer.fused and cfg.trainer.gradient_clip_val
    data = instantiate(cfg.data)
    data.prepare_data()
    data.setup("fit")
    fill_missing(cfg.model.net, data.model_kwargs(), "model.net")
    task = instantiate(cfg.model)
    before = [p.detach().clone() for p in task.parameters()]
    trainer = L.Trainer(
        accelerator="cpu",
        plugins=[MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))],
        gradient_clip_val=cfg.trainer.gradient_clip_val,
        max_steps=3,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(task, datamodule=data)
    assert trainer.global_step == 3
    assert trainer.optimizers[0].defaults["fused"] is False
    assert any(not torch.equal(a, b) for a, b in zip(before, task.parameters(), strict=True))


class RecordingFSDP(FullyShardedDataParallel):
    """Stands for FSDP's root module (which needs a process group): records its clipping."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.clipped: list[float] = []

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        self.clipped.append(max_norm)
        return torch.tensor(0.0)


def test_fsdp_clips_by_the_norm_of_the_whole_sharded_gradient():
    """Under ``trainer=fsdp`` each process holds a shard of every gradient: clipping goes through
    FSDP's ``clip_grad_norm_``, which reduces the norm over the shards, not through a per-shard
    ``torch.nn.utils.clip_grad_norm_``."""
    module = L.LightningModule()
    module.layer = nn.Linear(4, 4)
    module.layer.weight.grad = torch.full((4, 4), 10.0)
    strategy = FSDPStrategy()
    strategy.model = RecordingFSDP()
    module._trainer = SimpleNamespace(strategy=strategy, precision_plugin=Precision())
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    clip_gradients(module, optimizer, 0.5, "norm")
    assert strategy.model.clipped == [0.5]
    assert torch.equal(module.layer.weight.grad, torch.full((4, 4), 10.0))  # not clipped per shard
    with pytest.raises(Exception, match="gradient_clip_algorithm"):
        clip_gradients(module, optimizer, 0.5, "value")
