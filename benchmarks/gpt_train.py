"""ms per training iteration of experiment=gpt_shakespeare_char inside the Lightning Trainer.

Side by side in one run, fp32 and bf16-mixed: attnlab (Trainer, the experiment's config) against a
plain PyTorch loop (nanoGPT's: get_batch, forward, backward, clip, AdamW step) on the same model.
Run it alone: a busy second core slows torch's two threads.

    uv run python benchmarks/gpt_train.py [--steps 300] [--data-dir ../shared/data/tinyshakespeare]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from contextlib import nullcontext

import lightning as L
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from attnlab.cli.common import config_dir
from attnlab.utils.config import fill_missing
from attnlab.utils.hardware import cpu_model, native_bf16_cpu


class StepTimer(L.Callback):
    """Wall time between consecutive training-batch ends: one whole iteration of the loop."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_end(self, *args) -> None:
        self.times.append(step_done())


def step_done() -> float:
    """The time once the step's work has finished: on a GPU, once its queued kernels have run."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def compose_experiment(data_dir: str | None, out: str):
    overrides = ["experiment=gpt_shakespeare_char", f"paths.output_dir={out}"]
    overrides += [f"data.data_dir={data_dir}"] if data_dir else ["data.corpus=pydoc"]
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose("train", overrides=overrides)


def attnlab_ms(cfg, precision: str, steps: int, warmup: int) -> float:
    dm = instantiate(cfg.data)
    dm.setup("fit")
    fill_missing(cfg.model.net, dm.model_kwargs(), "model.net")
    torch.manual_seed(0)
    model = instantiate(cfg.model)
    timer = StepTimer()
    trainer = instantiate(
        cfg.trainer,
        precision=precision,
        max_steps=steps + warmup,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=L.pytorch.loggers.CSVLogger(cfg.paths.output_dir),
        callbacks=[timer],
    )
    trainer.fit(model, datamodule=dm)
    deltas = [b - a for a, b in zip(timer.times[warmup:-1], timer.times[warmup + 1 :], strict=True)]
    return 1000 * statistics.median(deltas)


def plain_loop_ms(cfg, precision: str, steps: int, warmup: int) -> float:
    """nanoGPT's training loop around the same model and optimizer settings."""
    dm = instantiate(cfg.data)
    dm.setup("fit")
    fill_missing(cfg.model.net, dm.model_kwargs(), "model.net")
    torch.manual_seed(0)
    net = instantiate(cfg.model.net)
    decay = [p for p in net.parameters() if p.dim() >= 2]
    other = [p for p in net.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=1e-3,
        betas=(0.9, 0.99),
        fused=True,
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the Trainer's accelerator: auto
    net.to(device)
    data, t, b = dm.train_tokens.to(device), dm.block_size, dm.batch_size
    ctx = torch.autocast(device, dtype=torch.bfloat16) if precision == "bf16-mixed" else nullcontext()
    times = []
    for _ in range(steps + warmup):
        ix = torch.randint(len(data) - t, (b,), device=device)
        x = torch.stack([data[i : i + t] for i in ix])
        y = torch.stack([data[i + 1 : i + 1 + t] for i in ix])
        with ctx:
            logits = net(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(step_done())
    deltas = [b - a for a, b in zip(times[warmup:-1], times[warmup + 1 :], strict=True)]
    return 1000 * statistics.median(deltas)


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
    args = parser.parse_args()
    precisions = ["32-true"]
    machine = torch.cuda.get_device_name() if torch.cuda.is_available() else cpu_model()
    if args.bf16 or native_bf16_cpu() or (torch.cuda.is_available() and torch.cuda.is_bf16_supported()):
        precisions.append("bf16-mixed")
    else:
        print(f"{machine} has no native bf16: fp32 only (--bf16 to measure it anyway)")
    goal = 1.10  # the Trainer's overhead: at most 10% over the plain loop, on any machine
    rows = []
    with tempfile.TemporaryDirectory() as out:
        cfg = compose_experiment(args.data_dir, out)
        for precision in precisions:
            ref = plain_loop_ms(cfg.copy(), precision, args.steps, args.warmup)
            ours = attnlab_ms(cfg.copy(), precision, args.steps, args.warmup)
            rows.append((precision, ours, ref))
    print(
        f"\nGPT (gpt_shakespeare_char config), median ms per training iteration, "
        f"{args.steps} steps, {machine}, {torch.get_num_threads()} threads"
    )
    print(f"{'precision':<12}{'attnlab':>10}{'plain loop':>12}{'ratio':>8}{'goal':>8}")
    for precision, ours, ref in rows:
        mark = "ok" if ours / ref <= goal else "MISSED"
        print(f"{precision:<12}{ours:>10.1f}{ref:>12.1f}{ours / ref:>8.2f}{goal:>7.2f}x {mark}")
    if len(rows) == 2:
        print(f"bf16-mixed speed-up over fp32 (attnlab): {rows[0][1] / rows[1][1]:.2f}x")


if __name__ == "__main__":
    main()
