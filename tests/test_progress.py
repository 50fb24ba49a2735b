"""The training bar counts a step recipe's optimizer steps, across gradient accumulation and resumes."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn

from attnlab.training.callbacks import StepProgressBar
from conftest import assert_ok, read_metrics, run_cli, tiny


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class BarAtEnd(L.Callback):
    """The train bar's (completed, total, description) as training ends."""

    def __init__(self, bar: StepProgressBar) -> None:
        self.bar, self.seen = bar, None

    def on_train_end(self, trainer, pl_module) -> None:
        task = next(t for t in self.bar.progress.tasks if t.id == self.bar.train_progress_bar_id)
        self.seen = (task.completed, task.total, task.description)


def fit(tmp_path, max_steps: int, ckpt_path=None, **trainer_kwargs) -> tuple:
    bar = StepProgressBar()
    probe = BarAtEnd(bar)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(10, 4), torch.randn(10, 1)))
    trainer = L.Trainer(
        max_steps=max_steps,
        callbacks=[bar, probe],
        logger=False,
        default_root_dir=tmp_path,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.fit(Regression(), data, ckpt_path=ckpt_path)
    return probe.seen


def test_the_bar_counts_optimizer_steps_of_the_recipe(tmp_path):
    # 2 batches a step over epochs of 10 batches: Lightning's bar showed 10/10 per epoch, 40/20 overall
    completed, total, description = fit(tmp_path, 20, accumulate_grad_batches=2)
    assert (completed, total) == (20, 20) and "step" in description


def test_a_resumed_run_s_bar_goes_on_from_its_step(tmp_path):
    fit(tmp_path, 6, enable_checkpointing=True)
    (ckpt,) = tmp_path.rglob("*.ckpt")
    completed, total, _ = fit(tmp_path / "resumed", 13, ckpt_path=ckpt)
    assert (completed, total) == (13, 13)


def test_validation_keeps_the_recipes_step_schedule_under_gradient_accumulation(tmp_path):
    """``val_check_interval`` counts optimizer steps as ``max_steps`` does: Lightning counts
    batches, so 2 batches a step validated after steps 2, 4, 6, 8 instead of 4 and 8."""
    out = tmp_path / "run"
    overrides = tiny(
        "trainer.max_steps=8",
        "trainer.val_check_interval=4",
        "trainer.accumulate_grad_batches=2",
        "test=false",
        "sample=null",
        f"paths.output_dir={out}",
    )
    assert_ok(run_cli("train", ["experiment=gpt_pydoc_char", *overrides, "logger=csv"], tmp_path))
    metrics = read_metrics(out)
    # logged at the step index (global step - 1), as without accumulation; it was [1, 3, 5, 7]
    assert [step for step, _ in metrics["val/loss"]] == [3, 7]


def test_the_bar_reads_the_logged_metrics_every_metrics_every_seconds_not_every_step(tmp_path):
    """Reading them every batch cost a small GPT ~1% of its step on a CPU (and waits for a GPU)."""
    calls = {}
    for every in (0.0, 3600.0):
        bar = StepProgressBar(metrics_every=every)
        bar._update_metrics = lambda *args, every=every: calls.update({every: calls.get(every, 0) + 1})
        data = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(torch.randn(10, 4), torch.randn(10, 1))
        )
        trainer = L.Trainer(
            max_steps=20, callbacks=[bar], logger=False, default_root_dir=tmp_path, enable_model_summary=False
        )
        trainer.fit(Regression(), data)
    assert calls[0.0] >= 20 and calls[3600.0] <= 4  # the first batch's, and once an epoch
