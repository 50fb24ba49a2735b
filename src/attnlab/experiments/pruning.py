"""Stopping a sweep's trial early from inside its training run."""

from __future__ import annotations

import lightning.pytorch as L
import optuna

from attnlab.experiments.study import STUDY, open_storage, trial_id


class TrialPruning(L.Callback):
    """The sweep's metric reported after every validation, by global step (optuna-integration's
    reports by epoch), from rank 0; the pruner's decision broadcast so every rank stops."""

    def __init__(
        self,
        storage: str,
        number: int,
        monitor: str,
        pruner: optuna.pruners.BasePruner,
        study_name: str | None = None,
    ) -> None:
        # the pruner is not stored with the study: each trial builds the sweep's own from its config
        study = optuna.load_study(
            study_name=study_name or STUDY, storage=open_storage(storage), pruner=pruner
        )
        self.trial = optuna.trial.Trial(study, trial_id(study, number))
        self.monitor = monitor

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        prune = False
        value = trainer.callback_metrics.get(self.monitor)
        if trainer.is_global_zero and value is not None:
            self.trial.report(float(value), step=trainer.global_step)
            prune = self.trial.should_prune()
            if prune:
                self.trial.set_user_attr("pruned_at_step", trainer.global_step)
        if trainer.strategy.broadcast(prune):
            raise optuna.TrialPruned(f"pruned at step {trainer.global_step} ({self.monitor} {value})")
