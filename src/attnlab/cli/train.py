"""``attnlab-train``: compose a run from ``conf/``, train it, test it, keep everything on disk."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

from attnlab.cli.common import config_dir, exit_on_user_error, own_run_folder, refuse_unknown_keys, user_error
from attnlab.core.config import (
    check_config,
    constructor_errors,
    container,
    fill_missing,
    instantiate_trainer,
    print_config_tree,
    refuse_renamed_overrides,
    resolve,
    save_config,
)
from attnlab.core.distributed import (
    check_job_tasks,
    check_launcher_overrides,
    check_submitit_launcher,
    export_local_ranks,
    own_last_checkpoint,
    submitit_executor,
)
from attnlab.core.errors import ConfigError, DataError
from attnlab.core.run_paths import resolve_ckpt_path
from attnlab.experiments.compare import flatten, is_hyperparameter

# torch, Lightning and the models load in train(), after the config is checked: --help and a
# wrong value end without them (tests/test_cli.py checks that this module does not import torch)
if TYPE_CHECKING:
    import lightning as L
    from lightning.pytorch.loggers import Logger, TensorBoardLogger

log = logging.getLogger("attnlab.train")

# conf/hydra/launcher/submitit_*.yaml share the plugin's config names, so Hydra checks them against
# its schema, and says so at every composition (deprecated since Hydra 1.1, still so in 1.3)
warnings.filterwarnings(
    "ignore", r"\s*'hydra/launcher/submitit_(slurm|local)' is validated against ConfigStore", UserWarning
)


def trainer_rank_zero() -> bool:
    """Rank 0 of a multi-process run (Lightning's variables, or srun's SLURM_PROCID)."""
    return all(int(os.environ.get(k, 0)) == 0 for k in ("LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"))


def instantiate_group(cfg: DictConfig, name: str) -> list[Any]:
    """Every entry of a group such as ``callbacks``, a refusal naming ``<name>.<entry>``."""
    objects = []
    for key, node in (cfg.get(name) or {}).items():
        if node and "_target_" in node:
            with constructor_errors(f"{name}.{key}"):
                objects.append(instantiate(node))
    return objects


def refuse_a_sweep(cfg: DictConfig) -> None:
    """``hparams_search=<name>`` is attnlab-sweep's: refused with the command that runs it."""
    if not (cfg.get("sweep") or {}).get("params") or cfg.get("sweep_trial"):
        return
    overrides = " ".join(o for o in given_overrides() if not o.startswith("hydra."))
    raise ConfigError(
        f"hparams_search describes an Optuna sweep, which attnlab-sweep runs (attnlab-train, with "
        f"or without -m, would train one job): attnlab-sweep {overrides}"
    )


def given_overrides() -> list[str]:
    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def name_wandb_run(cfg: DictConfig) -> None:
    """A null W&B name as the task and its overrides; a multirun's jobs in a group of their own."""
    wandb = cfg.logger.wandb
    hidden = ("hydra.", "paths.", "experiment=", "logger", "~", "ckpt_path=")
    shown = [o for o in given_overrides() if not o.startswith(hidden)]
    multirun = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    with open_dict(cfg):
        if wandb.get("name") is None:
            wandb.name = " ".join([cfg.task_name, *shown])
        if multirun and wandb.group == cfg.task_name:
            wandb.group = f"{cfg.task_name} multirun {Path(HydraConfig.get().sweep.dir).name}"


def setup_loggers(cfg: DictConfig, out: Path) -> list[Logger]:
    from lightning.pytorch.loggers import CSVLogger

    from attnlab.training.loggers import CSVLogger as ContinuingCSVLogger

    loggers = instantiate_group(cfg, "logger")
    if not any(isinstance(lg, CSVLogger) for lg in loggers):  # a CSV log is always written
        loggers.append(ContinuingCSVLogger(save_dir=out, name="csv", version=""))
    return loggers


def train(cfg: DictConfig) -> dict[str, float]:
    """Train (and test) the model the config describes; return the final metrics."""
    resolve(cfg)
    check_config(cfg, imports=False)  # before torch loads: a wrong value is one quick line
    refuse_a_sweep(cfg)
    check_job_tasks(cfg.trainer)

    import lightning as L
    import torch

    from attnlab.core.cpu import tune_cpu_for_training
    from attnlab.core.distributed import cluster_plugins, relaunch_this_multirun_job
    from attnlab.training.callbacks import WeightAveraging
    from attnlab.training.wandb_mode import ensure_wandb_mode
    from attnlab.weights.checkpoint import AtomicCheckpointIO, check_fits

    torch.set_float32_matmul_precision("high")
    ensure_wandb_mode()
    tune_cpu_for_training()
    check_config(cfg)  # what the quick check could not see without importing the targets
    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True)
    out = Path(cfg.paths.output_dir)
    if submitit_executor() and (own := own_last_checkpoint(cfg)).is_file():
        # a requeued job (its time limit, a preemption) resumes from its own last.ckpt, never the
        # newest checkpoint of its task (Lightning #13773)
        log.info("requeued: resuming from this job's own %s", own)
        with open_dict(cfg):
            cfg.ckpt_path = str(own)

    ckpt_path, ckpt, meta = checkpoint_to_resume(cfg, out)
    datamodule = build_datamodule(cfg, meta)
    record_run_config(cfg, meta, out)
    log.info("Instantiating model <%s>", cfg.model.net._target_)
    model: L.LightningModule = instantiate(cfg.model)
    if ckpt is not None:
        check_fits(model, ckpt["state_dict"], ckpt_path)
        del ckpt

    machine = record_machine(out)
    callbacks = build_callbacks(cfg, datamodule, machine)
    loggers = setup_loggers(cfg, out)
    relaunch_this_multirun_job()
    trainer: L.Trainer = instantiate_trainer(
        cfg.trainer, callbacks=callbacks, logger=loggers, plugins=[AtomicCheckpointIO(), *cluster_plugins()]
    )
    WeightAveraging.refuse_sharding(trainer)
    record_run(cfg, out, trainer.world_size, machine, ckpt_path)
    for lg in loggers:
        lg.log_hyperparams({**container(cfg), "machine": machine})

    metrics = fit_and_test(cfg, trainer, model, datamodule, ckpt_path)
    sample = closing_sample(cfg, trainer, model, datamodule)
    if trainer.is_global_zero:
        finish(cfg, model, loggers, metrics, out, sample)
    return metrics


def record_machine(out: Path) -> dict[str, Any]:
    """The machine the run trains on, written to ``machine.yaml`` beside its checkpoints."""
    from attnlab.core.hardware import machine_info

    machine = machine_info()
    if trainer_rank_zero():
        (out / "machine.yaml").write_text(OmegaConf.to_yaml(machine))
    what = (machine["cpu"], machine["torch_threads"], machine["cpu_native_bf16"], machine["gpus"] or "none")
    log.info("machine: %s, %s threads, native bf16 %s, GPUs %s", *what)
    return machine


def record_run(cfg: DictConfig, out: Path, world_size: int, machine: dict, ckpt_path: str | None) -> None:
    """``run.yaml``: what attnlab-rerun needs to re-run the run and say what changed since."""
    import yaml

    from attnlab.core.run_record import run_record

    if trainer_rank_zero():
        record = run_record(cfg, given_overrides(), world_size, machine, ckpt_path)
        (out / "run.yaml").write_text(yaml.safe_dump(record, sort_keys=False))


def checkpoint_to_resume(cfg: DictConfig, out: Path) -> tuple[str | None, dict | None, dict]:
    """``ckpt_path``'s file (``last``: this task's newest), checkpoint, metadata; its CSV rows carried."""
    from attnlab.training.loggers import continue_history
    from attnlab.weights.checkpoint import load_checkpoint, metadata, require_same_model

    ckpt_path = resolve_ckpt_path(
        cfg.get("ckpt_path"), Path(cfg.paths.log_dir), f"{cfg.task_name}/runs/*/checkpoints/last.ckpt"
    )
    ckpt = load_checkpoint(ckpt_path) if ckpt_path else None
    meta = metadata(ckpt, ckpt_path) if ckpt else {}
    if meta:
        require_same_model(meta, ckpt_path, cfg.model)
        step = ckpt["global_step"]
        source = ckpt_path.parent.parent / "csv" / "metrics.csv"  # <run>/checkpoints/last.ckpt
        if trainer_rank_zero() and (n := continue_history(source, step, out / "csv" / "metrics.csv")):
            log.info("csv: the %d rows %s's run logged before step %d kept", n, ckpt_path, step)
    return ckpt_path, ckpt, meta


def build_datamodule(cfg: DictConfig, meta: dict) -> Any:
    """The data set up for fitting (a resumed or pre-trained run's tokenizer); what it decides about
    the net (vocabulary, classes) filled into ``model.net``."""
    from attnlab.weights.init import init_artifacts, resolve_init_from

    log.info("Instantiating datamodule <%s>", cfg.data._target_)
    datamodule = instantiate(cfg.data)
    if meta.get("artifacts"):
        datamodule.load_artifacts(meta["artifacts"])
    if cfg.model.get("init_from"):  # fine-tuning: the weights' tokenizer comes with them
        with open_dict(cfg):  # the file, not a task name, goes into the saved config
            resolved = resolve_init_from(cfg.model.init_from, Path(cfg.paths.log_dir))
            cfg.model.init_from = resolved if isinstance(resolved, dict) else str(resolved)
        if not meta.get("artifacts") and (
            artifacts := init_artifacts(cfg.model.init_from, cfg.model._target_)
        ):
            datamodule.load_artifacts(artifacts)
    datamodule.prepare_data()
    datamodule.setup("fit")
    fill_missing(cfg.model.net, datamodule.model_kwargs(), "model.net")
    return datamodule


def record_run_config(cfg: DictConfig, meta: dict, out: Path) -> None:
    """Precision resolved and the W&B run named (a resumed run's id), then the config saved."""
    from attnlab.core.hardware import resolve_precision

    with open_dict(cfg):
        cfg.trainer.precision = resolve_precision(cfg.trainer.accelerator, cfg.trainer.precision)
    if cfg.get("logger") and "wandb" in cfg.logger:
        name_wandb_run(cfg)
        if meta.get("wandb_run_id"):
            with open_dict(cfg):  # continue the interrupted run's W&B run
                cfg.logger.wandb.id = meta["wandb_run_id"]
                cfg.logger.wandb.resume = "allow"
    save_config(cfg, out / "config.yaml")
    if cfg.extras.get("print_config"):
        print_config_tree(cfg)


def build_callbacks(cfg: DictConfig, datamodule: Any, machine: dict) -> list[Any]:
    """The config's callbacks, those every run has, and a sweep trial's pruning report."""
    from attnlab.experiments.pruning import TrialPruning
    from attnlab.training.callbacks import FiniteLoss, ReleaseFreedMemory, ResumableRandomness, RunMetadata

    callbacks = instantiate_group(cfg, "callbacks")
    callbacks += [FiniteLoss(), RunMetadata(OmegaConf.to_yaml(cfg), datamodule.artifacts(), machine)]
    callbacks += [ResumableRandomness(cfg.get("seed")), ReleaseFreedMemory()]
    if submitit_executor():  # a job of Hydra's submitit launcher: requeued at submitit's signal
        from attnlab.training.callbacks import SubmititRequeue

        callbacks.append(SubmititRequeue(own_last_checkpoint(cfg)))
    if trial := cfg.get("sweep_trial"):  # a trial of attnlab-sweep: report to its study, for pruning
        import optuna

        pruner = (cfg.get("sweep") or {}).get("pruner")
        pruner = instantiate(pruner) if pruner else optuna.pruners.NopPruner()
        callbacks.append(
            TrialPruning(trial.storage, trial.number, cfg.optimized_metric, pruner, trial.get("study"))
        )
    return callbacks


def fit_and_test(cfg: DictConfig, trainer: Any, model: Any, datamodule: Any, ckpt_path: str | None) -> dict:
    """Fit (``train``), then test the best checkpoint (``test``); the metrics of both."""
    metrics: dict[str, float] = {}
    if cfg.get("train"):
        trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
        if trainer.num_training_batches == 0:  # Lightning only notes it, then tests an untrained model
            size = cfg.data.get("batch_size")
            dropped = f" (data.batch_size={size}, incomplete batches are dropped)"
            how = f"{dropped}; add data or lower data.batch_size" if size else "; add data"
            raise DataError(f"the training data gives no batch: fewer examples than one batch{how}")
        metrics.update({k: float(v) for k, v in trainer.callback_metrics.items()})
    if cfg.get("test"):
        best = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
        if not best:
            log.warning("no best checkpoint: testing the current weights")
        trainer.test(model, datamodule=datamodule, ckpt_path=best or None, weights_only=True)
        metrics.update({k: float(v) for k, v in trainer.callback_metrics.items()})
    return metrics


def closing_sample(cfg: DictConfig, trainer: Any, model: Any, datamodule: Any) -> str | None:
    """A language model's closing sample, drawn by every process (a sharded net needs them all)."""
    from attnlab.models.text.gpt import GPT

    if not (cfg.get("sample") and isinstance(model.net, GPT)):
        return None
    from attnlab.core.distributed import unsharded
    from attnlab.inference.generation import generate_text

    # in the training precision: FSDP's mixed precision keeps each unit's weights in bf16/fp16
    # and casts only the inputs of the root's forward, which generation does not go through
    with unsharded(model.net), trainer.precision_plugin.forward_context():
        return generate_text(model.net, datamodule.tokenizer, **cfg.sample, seed=cfg.get("seed"))[0]


def finish(
    cfg: DictConfig,
    model: L.LightningModule,
    loggers: list[Logger],
    metrics: dict[str, float],
    out: Path,
    sample: str | None,
) -> None:
    """Print the sample and the final metrics; close the W&B run with them in its summary."""
    from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

    if sample is not None:
        log.info("sample:\n%s\n%s\n%s", "-" * 60, sample, "-" * 60)
    # attention health per layer and head stays in the CSV and W&B: the line keeps its means
    shown = {k: v for k, v in metrics.items() if not (k.startswith("attn/") and k.count("/") > 1)}
    summary = " | ".join(f"{k} {v:.4f}" for k, v in sorted(shown.items()))
    n_params = sum(p.numel() for p in model.parameters())
    log.info("final: %s | params %s | outputs in %s", summary, f"{n_params:,}", out)
    for lg in loggers:
        if isinstance(lg, TensorBoardLogger):
            hparams_for_tensorboard(lg, cfg, metrics)
        if isinstance(lg, WandbLogger):
            lg.experiment.summary.update({**metrics, "params": n_params})
            if sample is not None:
                lg.experiment.summary["sample"] = sample
            lg.experiment.finish()


def hparams_for_tensorboard(logger: TensorBoardLogger, cfg: DictConfig, metrics: dict[str, float]) -> None:
    """Hyperparameters (as attnlab-compare picks them) and final metrics for TensorBoard's HParams
    tab, written here: Lightning's way would log the metrics again at step 0."""
    from torch.utils.tensorboard.summary import hparams

    params = {
        k: v if isinstance(v, int | float | str | bool) else str(v)
        for k, v in sorted(flatten(container(cfg)).items())
        if is_hyperparameter(k)
    }
    writer = logger.experiment._get_file_writer()
    for summary in hparams(params, metrics):
        writer.add_summary(summary)
    writer.flush()


def pruned(e: BaseException) -> bool:
    """Whether ``e`` is Optuna's ``TrialPruned`` (only a sweep trial, which loaded Optuna, raises it)."""
    optuna = sys.modules.get("optuna")
    return optuna is not None and isinstance(e, optuna.TrialPruned)


def main() -> float | None:
    """``attnlab-train``: an old hyper-parameter name refused before Hydra composes, then train."""
    with exit_on_user_error(console=True):
        refuse_renamed_overrides(sys.argv[1:])
        refuse_unknown_keys("train", sys.argv[1:])
        check_launcher_overrides(sys.argv[1:])
    return hydra_main()


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="train")
def hydra_main(cfg: DictConfig) -> float | None:
    export_local_ranks()  # a submitit_local job's processes: their ranks, before anything asks
    try:
        # rank 0 decides about the run folder it shares with the other ranks
        with exit_on_user_error(discard=own_run_folder(cfg) if trainer_rank_zero() else None):
            try:
                metrics = train(cfg)
            except Exception as e:
                if not pruned(e):
                    raise
                log.info("%s", e)  # a sweep trial stopped early: the sweep records it
                return None
    except SystemExit as e:
        # a submitit job's refused config: the job's error, which Hydra's launcher reports in the
        # multirun in one line after the job's overrides (not submitit's "the job produced no output")
        if submitit_executor() and e.code == 2 and (err := user_error(e.__context__)):
            raise JobRefused(f"error: {err}") from None
        raise
    name = cfg.get("optimized_metric")
    return metrics.get(name) if name else None


class JobRefused(CompactHydraException):
    """A submitit job's refused config, as the multirun's process reports it: its line only."""


class SubmititChecks(Callback):
    """The submitit launcher's options checked before Hydra sends a job: a refusal is one line, exit
    status 2, its empty sweep folder removed."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        folder = Path(str(config.hydra.sweep.dir))
        with exit_on_user_error(console=True):
            try:
                check_submitit_launcher(config)
            except ConfigError:
                if folder.is_dir() and not any(folder.iterdir()):
                    folder.rmdir()
                raise


if __name__ == "__main__":
    main()
