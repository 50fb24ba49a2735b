"""ms per training step of experiment=gpt_shakespeare_char: attnlab against a plain PyTorch loop.

Side by side in one run, fp32 and bf16-mixed (where the machine multiplies bf16 natively):

- attnlab: the Trainer as ``attnlab-train`` builds it, with the run's callbacks (progress bar,
  checkpointing, learning-rate monitor, metrics line, throughput, the finite-loss check, random
  streams, memory trimming) and its CSV log (``logger=wandb`` adds W&B, offline without a key);
- trainer alone: the same Trainer and task with the CSV log alone (Lightning's loop);
- plain loop: nanoGPT's (get_batch, forward, backward, clip, AdamW step, the same LR schedule)
  around the same model and attention path.

All in one process set up as ``attnlab-train`` sets it (``tune_cpu_for_training``, fp32 matmul
precision "high"). A step's time is the wall time of the steps after the warm-up over their
number, the device waited for at both ends only, as in a run. ``--compile`` compiles the net alike
in all three (``attnlab.training.base.compile_net``); ``--compile-mode reduce-overhead`` adds CUDA
graphs, which on a GPU cut a small model's launch cost. The goal: attnlab within 1.10x of the
plain loop on a CPU, 1.03x on a GPU. Run it alone: a busy second core slows torch's two threads.

    uv run python benchmarks/gpt_train.py [--steps 300] [--data-dir ../shared/data/tinyshakespeare]
    uv run python benchmarks/gpt_train.py --compile true --compile-mode reduce-overhead   # a GPU
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import DictConfig

from attnlab.cli.common import compose_train
from attnlab.core.config import fill_missing, instantiate_trainer
from attnlab.core.cpu import tune_cpu_for_training
from attnlab.core.hardware import cpu_model, native_bf16_cpu
from attnlab.training.base import compile_net
from attnlab.training.optim import param_groups
from attnlab.training.wandb_mode import ensure_wandb_mode

CUDA = torch.cuda.is_available()


def now() -> float:
    """The time once the work queued so far has finished: on a GPU, once its kernels have run."""
    if CUDA:
        torch.cuda.synchronize()
    return time.perf_counter()


class Window(L.Callback):
    """The wall time from the end of step ``warmup`` to the end of the last step."""

    def __init__(self, warmup: int, last: int) -> None:
        self.warmup, self.last, self.n = warmup, last, 0
        self.start = self.end = 0.0

    def on_train_batch_end(self, *args) -> None:
        self.n += 1
        if self.n == self.warmup:
            self.start = now()
        elif self.n == self.last:
            self.end = now()


def compose_experiment(
    data_dir: str | None,
    out: str,
    overrides: Sequence[str] = (),
    compile_: str = "false",
    mode: str = "default",
) -> DictConfig:
    """The experiment's config; its loggers the CSV log alone (W&B's offline writer is a process of
    its own: ``logger=wandb`` among ``overrides`` measures it too)."""
    args = [
        "experiment=gpt_shakespeare_char",
        "logger=csv",
        f"paths.output_dir={out}",
        "extras.print_config=false",
    ]
    args += [f"data.source.data_dir={data_dir}"] if data_dir else ["data/source=pydoc"]
    args += [f"model.optim.compile={compile_}", f"model.optim.compile_mode={mode}", *overrides]
    return compose_train(args)


def datamodule(cfg: DictConfig):
    dm = instantiate(cfg.data)
    dm.setup("fit")
    fill_missing(cfg.model.net, dm.model_kwargs(), "model.net")
    return dm


def attnlab_ms(cfg: DictConfig, precision: str, steps: int, warmup: int, callbacks: bool = False) -> float:
    """attnlab's step: the Trainer and the task with a CSV log; with ``callbacks``, the callbacks
    and loggers as ``attnlab-train`` builds them from ``cfg``."""
    from attnlab.cli.train import build_callbacks, setup_loggers
    from attnlab.core.hardware import machine_info

    dm = datamodule(cfg)
    torch.manual_seed(0)
    model = instantiate(cfg.model)
    window = Window(warmup, warmup + steps)
    if callbacks:
        run_callbacks = [*build_callbacks(cfg, dm, machine_info()), window]
        loggers, quiet = setup_loggers(cfg, Path(cfg.paths.output_dir)), {}
    else:
        run_callbacks, loggers = [window], L.pytorch.loggers.CSVLogger(cfg.paths.output_dir)
        quiet = {"enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}
    trainer = instantiate_trainer(
        cfg.trainer,
        precision=precision,
        max_steps=warmup + steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=run_callbacks,
        logger=loggers,
        **quiet,
    )
    trainer.fit(model, datamodule=dm)
    return 1000 * (window.end - window.start) / steps


def plain_loop_ms(cfg: DictConfig, precision: str, steps: int, warmup: int) -> float:
    """nanoGPT's training loop around the same model, optimizer settings and LR schedule."""
    dm = datamodule(cfg)
    torch.manual_seed(0)
    device = "cuda" if CUDA else "cpu"  # the Trainer's accelerator: auto
    net = instantiate(cfg.model.net).to(device)
    opt = instantiate(cfg.model.optim.optimizer)(param_groups(net, cfg.model.optim.weight_decay))
    schedule = instantiate(cfg.model.optim.scheduler)(opt) if cfg.model.optim.get("scheduler") else None
    compile_net(net, cfg.model.optim.compile, cfg.model.optim.compile_mode)
    data, t, b = dm.train_tokens, dm.max_len, dm.batch_size
    ctx = torch.autocast(device, dtype=torch.bfloat16) if precision == "bf16-mixed" else nullcontext()
    clip = cfg.trainer.gradient_clip_val
    start = 0.0
    for i in range(warmup + steps):
        ix = torch.randint(len(data) - t, (b,))
        x = torch.stack([data[j : j + t] for j in ix])
        y = torch.stack([data[j + 1 : j + 1 + t] for j in ix])
        if CUDA:  # as nanoGPT: pinned, copied without waiting
            x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        with ctx:
            logits = net(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if schedule is not None:
            schedule.step()
        if i + 1 == warmup:
            start = now()
    return 1000 * (now() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--data-dir", default=None, help="tinyshakespeare dir; default: pydoc corpus")
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="measure bf16-mixed also on a CPU without native bf16 (it crawls there)",
    )
    parser.add_argument("--compile", default="false", choices=["false", "true", "regional"])
    parser.add_argument(
        "--compile-mode", default="default", help="torch.compile's mode, e.g. reduce-overhead"
    )
    parser.add_argument(
        "overrides", nargs="*", help="config overrides: model.* and data.* for both loops; logger=wandb"
    )
    args = parser.parse_args()
    torch.set_float32_matmul_precision("high")  # the process as attnlab-train sets it up
    tune_cpu_for_training()
    ensure_wandb_mode()  # W&B offline without a key, as attnlab-train
    precisions = ["32-true"]
    machine = torch.cuda.get_device_name() if CUDA else cpu_model()
    if args.bf16 or native_bf16_cpu() or (CUDA and torch.cuda.is_bf16_supported()):
        precisions.append("bf16-mixed")
    else:
        print(f"{machine} has no native bf16: fp32 only (--bf16 to measure it anyway)")
    goal = 1.03 if CUDA else 1.10  # the Trainer's overhead over the plain loop
    rows = []
    with tempfile.TemporaryDirectory() as out:
        cfg = compose_experiment(args.data_dir, out, args.overrides, args.compile, args.compile_mode)
        for precision in precisions:
            ref = plain_loop_ms(cfg.copy(), precision, args.steps, args.warmup)
            bare = attnlab_ms(cfg.copy(), precision, args.steps, args.warmup)
            ours = attnlab_ms(cfg.copy(), precision, args.steps, args.warmup, callbacks=True)
            rows.append((precision, ours, bare, ref))
    compiled = (
        "" if args.compile == "false" else f", model.optim.compile={args.compile} ({args.compile_mode})"
    )
    print(
        f"\nGPT (gpt_shakespeare_char config{compiled}), ms per training step over {args.steps} steps, "
        f"{machine}, {torch.get_num_threads()} threads, attn_impl={cfg.model.net.get('attn_impl')} in all"
    )
    print(f"{'precision':<12}{'attnlab':>10}{'trainer alone':>15}{'plain loop':>12}{'ratio':>8}{'goal':>8}")
    for precision, ours, bare, ref in rows:
        mark = "ok" if ours / ref <= goal else "MISSED"
        print(f"{precision:<12}{ours:>10.2f}{bare:>15.2f}{ref:>12.2f}{ours / ref:>8.2f}{goal:>7.2f}x {mark}")
    if len(rows) == 2:
        print(f"bf16-mixed speed-up over fp32 (attnlab): {rows[0][1] / rows[1][1]:.2f}x")


if __name__ == "__main__":
    main()
