"""Callbacks the entry points add to every run."""

from __future__ import annotations

import logging
import math
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch import callbacks as pl_callbacks
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_only
from torch.optim.swa_utils import get_ema_multi_avg_fn

from attnlab import __version__
from attnlab.core.cpu import release_freed_memory
from attnlab.core.errors import ConfigError
from attnlab.core.memory import peak_memory_mb, reset_peak_memory
from attnlab.core.specs import PositiveFloat, Probability
from attnlab.models.text.gpt import GPT
from attnlab.training.base import gather_objects

log = logging.getLogger(__name__)


def sync(pl_module: L.LightningModule) -> None:
    """Wait for the module's device (a clock read after it times the work queued before)."""
    if pl_module.device.type == "cuda":
        torch.cuda.synchronize(pl_module.device)


class RunMetadata(L.Callback):
    """Keep in each checkpoint (``checkpoint["attnlab"]``, plain containers: ``weights_only`` loads)
    what rebuilds and resumes the run: config, data artifacts, machine, W&B run id."""

    def __init__(self, config_yaml: str, artifacts: dict[str, Any], machine: dict[str, Any]) -> None:
        self.config_yaml, self.artifacts, self.machine = config_yaml, artifacts, machine

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        wandb_id = next((lg.experiment.id for lg in trainer.loggers if isinstance(lg, WandbLogger)), None)
        checkpoint["attnlab"] = {
            "version": __version__,
            "config": self.config_yaml,
            "artifacts": self.artifacts,
            "machine": self.machine,
            "wandb_run_id": wandb_id,
        }


def rng_states() -> dict[str, Any]:
    """The global generators' states (torch, CUDA, NumPy, Python) as plain tensors and containers."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
        "python": random.getstate(),
    }


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    kind, keys, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, state, gauss = states["python"]
    random.setstate((version, tuple(state), gauss))


class ResumableRandomness(L.Callback):
    """Reseed process r with ``seed + r`` as training starts (nanoGPT, DeiT) and keep every process's
    random streams in each checkpoint, restored on a resume with as many processes."""

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed
        self.pending: list[dict[str, Any]] | None = None

    def on_save_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # every process saves (Lightning writes rank 0's copy): each sends its states to it
        checkpoint["rng_states"] = gather_objects([rng_states()])

    def on_load_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        states = checkpoint.get("rng_states")
        self.pending = [states] if isinstance(states, dict) else states  # one process, before lists

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.pending is not None and len(self.pending) == trainer.world_size:
            set_rng_states(self.pending[trainer.global_rank])
        elif trainer.world_size > 1 and self.seed is not None:
            if self.pending is not None:
                log.warning(
                    "the checkpoint holds the random streams of %d processes, this run has %d: "
                    "each starts afresh from seed + rank",
                    len(self.pending),
                    trainer.world_size,
                )
            L.seed_everything(self.seed + trainer.global_rank, workers=True, verbose=False)
        self.pending = None


class ReleaseFreedMemory(L.Callback):
    """Return the heap's free pages to the kernel every ``every_n_steps`` steps and after each validation."""

    def __init__(self, every_n_steps: int = 50) -> None:
        self.every_n_steps = every_n_steps

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if trainer.global_step % self.every_n_steps == 0:
            release_freed_memory()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        release_freed_memory()


class FiniteLoss(L.Callback):
    """Stop, in one line, a run whose training loss turns NaN or infinite, before a checkpoint holds it;
    on an accelerator the check is kept on the device and read at the logging steps."""

    def __init__(self) -> None:
        self.first_bad: torch.Tensor | None = None  # on an accelerator: (step, loss), step -1 if none

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not isinstance(loss, torch.Tensor):  # a step the task skipped
            return
        if self.read_every_step(loss):  # one float read, not the device-side bookkeeping below
            if self.first_bad is None and not math.isfinite(value := float(loss.detach().reshape(-1)[0])):
                self.first_bad = torch.tensor([float(trainer.global_step), value])
            if self.first_bad is not None or trainer.world_size > 1:  # the ranks decide together
                self.check(trainer)
            return
        loss = loss.detach().float().reshape(-1)[:1]
        here = torch.cat([torch.where(torch.isfinite(loss), -1.0, float(trainer.global_step)), loss])
        if self.first_bad is None or self.first_bad.device != loss.device:
            self.first_bad = here
        else:
            self.first_bad = torch.where(self.first_bad[:1] < 0, here, self.first_bad)
        if trainer.global_step % (trainer.log_every_n_steps or 1) == 0:
            self.check(trainer)

    def read_every_step(self, loss: torch.Tensor) -> bool:
        return loss.device.type == "cpu"

    def check(self, trainer: L.Trainer, *args: Any) -> None:
        """Raise if the loss was not finite on any step of any process so far."""
        step, value = self.first_bad.tolist() if self.first_bad is not None else (-1.0, 0.0)
        if not trainer.strategy.reduce_boolean_decision(step >= 0, all=False):
            return
        what = f"{value} at step {int(step)}" if step >= 0 else f"not finite by step {trainer.global_step}"
        raise ConfigError(
            f"train/loss is {what}: the training diverged; lower model.optim.optimizer.lr (or set "
            "trainer.gradient_clip_val), or check the data; the checkpoints written before are kept"
        )

    on_validation_start = on_save_checkpoint = check  # before each validation and checkpoint too


class ModelCheckpoint(pl_callbacks.ModelCheckpoint):
    """Lightning's, with ``last.ckpt`` written after every validation and at the end of training
    (Lightning 2.6 writes it only with a new best)."""

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        self._save_last_if_behind(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        self._save_last_if_behind(trainer)

    def _save_last_if_behind(self, trainer: L.Trainer) -> None:
        if self.save_last and not self._should_skip_saving_checkpoint(trainer):  # skips a step saved
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


class StepProgressBar(pl_callbacks.RichProgressBar):
    """Lightning's rich bar counting optimizer steps (``step n/max_steps``) for step recipes, drawn
    ``refresh_rate`` times a second, its metrics read every ``metrics_every`` seconds."""

    def __init__(self, refresh_rate: int = 10, metrics_every: float = 0.5, **kwargs: Any) -> None:
        super().__init__(refresh_rate=refresh_rate, **kwargs)
        self.metrics_every = metrics_every
        self._metrics_due = 0.0

    def _by_steps(self) -> bool:
        return self.trainer.max_steps > 0

    @property
    def total_train_batches(self) -> int | float:
        return self.trainer.max_steps if self._by_steps() else super().total_train_batches

    def _get_train_description(self, current_epoch: int) -> str:
        return "step" if self._by_steps() else super()._get_train_description(current_epoch)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if not self.is_disabled and self.train_progress_bar_id is None:  # a resumed run, mid-epoch
            self._initialize_train_progress_bar_id()
        if (now := time.monotonic()) >= self._metrics_due:
            self._metrics_due = now + self.metrics_every
            self._update_metrics(trainer, pl_module)
        batch_idx = args[-1]  # the bar drawn at the next refresh (or now, in a notebook)
        self._update(self.train_progress_bar_id, trainer.global_step if self._by_steps() else batch_idx + 1)


class MetricsPrinter(L.Callback):
    """One plain log line per validation: step, losses, learning rate, ms per iteration."""

    def __init__(self) -> None:
        self._t0, self._step0 = time.perf_counter(), 0
        self._ms = 0.0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._t0, self._step0 = time.perf_counter(), trainer.global_step

    on_validation_epoch_end = on_train_start

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        steps = trainer.global_step - self._step0
        self._ms = 1000 * (time.perf_counter() - self._t0) / max(1, steps)

    @rank_zero_only
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        m = trainer.callback_metrics
        parts = [f"step {trainer.global_step:>6}"]
        shown = ("train/loss", "val/loss", "val/acc", "val/bleu", "val/zeroshot_acc")
        parts += [f"{k} {float(m[k]):.4f}" for k in shown if k in m]
        if trainer.optimizers:
            parts.append(f"lr {trainer.optimizers[0].param_groups[0]['lr']:.2e}")
        parts.append(f"{self._ms:.1f} ms/it")
        log.info(" | ".join(parts))


class TrainingCost(L.Callback):
    """Log once, at the end of training: the median step's ms (per step, per token), its peak memory
    and, for a GPT, ms per generated token (``cost/...``)."""

    def __init__(self, warmup: int = 1, new_tokens: int = 16) -> None:
        self.warmup, self.new_tokens = warmup, new_tokens
        self._steps: list[float] = []
        self._tokens = 0
        self._t0 = self._baseline = 0.0

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, *args: Any
    ) -> None:
        if len(self._steps) == self.warmup:  # the first timed step
            self._baseline = reset_peak_memory(pl_module.device)
        first = batch[0] if isinstance(batch, list | tuple) else batch
        self._tokens = first.numel() if isinstance(first, torch.Tensor) else 0
        sync(pl_module)
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        sync(pl_module)
        self._steps.append(time.perf_counter() - self._t0)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        timed = self._steps[self.warmup :]
        if not timed:
            log.warning("TrainingCost: no step after the %d warm-up steps, nothing measured", self.warmup)
            return
        ms = 1000 * float(np.median(timed))
        metrics = {
            "cost/train_ms_per_step": ms,
            "cost/train_peak_mb": peak_memory_mb(pl_module.device) - self._baseline,
        }
        if self._tokens:
            metrics["cost/train_ms_per_token"] = ms / self._tokens
        net = getattr(pl_module, "net", None)
        if isinstance(net, GPT) and net.max_len > self.new_tokens:
            metrics["cost/generate_ms_per_token"] = self._generation_ms(net, pl_module)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        log.info("training cost: %s", ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))

    @torch.no_grad()
    def _generation_ms(self, net: GPT, pl_module: L.LightningModule) -> float:
        was_training = net.training
        net.eval()
        idx = torch.randint(net.vocab_size, (1, net.max_len), device=pl_module.device)
        start = net.max_len - self.new_tokens
        _, state = net.step(idx[:, start - 1], net.start(idx[:, : start - 1]))  # the context, one pass
        times = []
        for j in range(start, net.max_len):
            sync(pl_module)
            t0 = time.perf_counter()
            _, state = net.step(idx[:, j], state)
            sync(pl_module)
            times.append(time.perf_counter() - t0)
        net.train(was_training)
        return 1000 * float(np.median(times))


def ema_with_warmup(
    decay: Probability,
) -> Callable[[list[torch.Tensor], list[torch.Tensor], torch.Tensor], None]:
    """An EMA update for ``WeightAveraging(multi_avg_fn=...)`` whose decay rises as
    min(decay, (1 + n) / (10 + n)) with n updates (timm's ModelEmaV3 warm-up)."""

    def update(averaged: list[torch.Tensor], current: list[torch.Tensor], n: torch.Tensor) -> None:
        get_ema_multi_avg_fn(min(decay, (1 + int(n)) / (10 + int(n))))(averaged, current, n)

    return update


class WeightAveraging(pl_callbacks.WeightAveraging):
    """Lightning's weight averaging (EMA, SWA), which outside fit keeps the checkpoint's average weights."""

    @staticmethod
    def refuse_sharding(trainer: L.Trainer) -> None:
        """Called before fit starts the other processes, so the refusal is said once."""
        averaging = any(isinstance(c, pl_callbacks.WeightAveraging) for c in trainer.callbacks)
        if averaging and isinstance(trainer.strategy, FSDPStrategy | ModelParallelStrategy):
            raise ConfigError(
                "callbacks.ema: weight averaging keeps a full copy of the model, which sharded training "
                "(trainer=fsdp, fsdp2) does not allow; drop it with ~callbacks.ema"
            )

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.refuse_sharding(trainer)
        super().setup(trainer, pl_module, stage)

    def on_load_checkpoint(
        self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            super().on_load_checkpoint(trainer, pl_module, checkpoint)


class SubmititRequeue(L.Callback):
    """On submitit's signal, every process together writes ``last.ckpt`` at the end of the next
    optimizer step and the job is requeued (and resumes from it)."""

    def __init__(self, last: Any) -> None:
        from submitit import JobEnvironment

        self.last = last
        self.signum = getattr(signal, f"SIG{JobEnvironment.USR_SIG}")
        self.submitit_handler = self.sigterm_handler = None
        self.received = self.saved = False
        self.step = -1

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.sigterm_handler = signal.getsignal(signal.SIGTERM)  # submitit's, before Lightning's

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # after Lightning registered its handlers; its teardown puts submitit's back
        self.submitit_handler = signal.getsignal(self.signum)
        signal.signal(self.signum, self.receive)
        # SIGTERM, which SLURM sends with a preemption, stays submitit's (ignored): Lightning's would
        # end the job at its next step, not requeued, before submitit's signal is acted on
        if callable(self.sigterm_handler):
            signal.signal(signal.SIGTERM, self.sigterm_handler)

    def receive(self, signum: int, frame: Any) -> None:
        self.received = True

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if self.saved:
            self.requeue()
        self.step = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:  # gradients still accumulating: no step taken
            return
        if trainer.strategy.reduce_boolean_decision(self.received, all=False):
            log.info("submitit's signal: last.ckpt at step %d, then the job is requeued", trainer.global_step)
            trainer.save_checkpoint(self.last)
            self.saved = True

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        signal.signal(self.signum, self.submitit_handler)  # from here on, submitit's own handler
        if trainer.strategy.reduce_boolean_decision(self.received, all=False):
            if not self.saved:  # the signal came after the last step: the weights as they end
                trainer.save_checkpoint(self.last)
            self.requeue()

    def requeue(self) -> None:
        signal.signal(self.signum, self.submitit_handler)
        if callable(self.submitit_handler):
            self.submitit_handler(self.signum, None)  # process 0: requeue the job and exit
        raise SystemExit(0)  # the other processes: the requeued job starts them again


class Throughput(L.Callback):
    """Log items/s, model TFLOP/s and MFU (over ``peak_tflops``, the table's or a measured peak) at
    every logging step, the first step and validation time left out (``throughput/...``)."""

    _sync = staticmethod(sync)  # (a test counts the waits)

    def __init__(self, peak_tflops: PositiveFloat | None = None) -> None:
        self.peak_tflops = peak_tflops
        self.peak: float | None = None
        self.counting = True
        self._t0: float | None = None  # the clock, None until the first step is done
        self._paused: float | None = None  # when a validation began
        self._step, self._items, self._flops = -1, 0, 0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        from attnlab.core.hardware import DTYPE_NAMES, compute_dtype, peak_flops

        dtype = compute_dtype(trainer.precision)
        if self.peak_tflops:
            self.peak = self.peak_tflops * 1e12
            source = f"peak_tflops={self.peak_tflops} (the config's)"
        else:
            self.peak, source = peak_flops(trainer.strategy.root_device, dtype)
        log.info("MFU: model FLOPs over the peak of %s", source)
        peak = round(self.peak / 1e12, 4) if self.peak else None
        self.record(trainer, {"tflops": peak, "dtype": DTYPE_NAMES.get(dtype, str(dtype)), "source": source})

    @staticmethod
    def record(trainer: L.Trainer, peak: dict[str, Any]) -> None:
        """The peak beside the machine it belongs to: in ``machine.yaml`` and the checkpoints' record."""
        for callback in trainer.callbacks:
            if isinstance(callback, RunMetadata):
                callback.machine["peak_flops"] = peak
        path = Path(trainer.default_root_dir) / "machine.yaml"
        if trainer.is_global_zero and path.is_file():
            from omegaconf import OmegaConf

            machine = OmegaConf.load(path)
            machine.peak_flops = peak
            path.write_text(OmegaConf.to_yaml(machine))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._t0, self._paused, self._step = None, None, trainer.global_step

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if self._paused is not None and self._t0 is not None:  # a validation since: not training time
            self._t0 += time.perf_counter() - self._paused
        self._paused = None

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self.counting:
            return
        stepped = trainer.global_step != self._step
        self._step = trainer.global_step
        if self._t0 is None:  # the first step: compiling, warming up; the clock starts after it
            if stepped:
                self._sync(pl_module)
                self._t0, self._items, self._flops = time.perf_counter(), 0, 0
            return
        try:
            items, flops = pl_module.step_work(batch)
        except AttributeError as e:  # a task or net of one's own that does not count them
            log.warning("Throughput: no throughput or MFU logged: %s", e)
            self.counting = False
            return
        self._items += items
        self._flops += flops.total
        every = trainer.log_every_n_steps
        if stepped and every and trainer.global_step % every == 0:
            self._log(trainer, pl_module)

    def _log(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._sync(pl_module)
        now = time.perf_counter()
        seconds, flops = now - self._t0, float(self._flops)
        unit = getattr(pl_module, "items", "samples")
        metrics = {
            f"throughput/{unit}_per_sec": float(self._items) / seconds * trainer.world_size,
            "throughput/tflops_per_sec": flops / seconds / 1e12,
        }
        if self.peak:
            metrics["throughput/mfu"] = flops / seconds / self.peak
        pl_module.log_dict(metrics, prog_bar=True, on_step=True, on_epoch=False)
        self._t0, self._items, self._flops = now, 0, 0

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._t0 is not None and not trainer.sanity_checking:
            self._sync(pl_module)
            self._paused = time.perf_counter()
