"""Resident memory over a training run of varying-shape batches: does it stay flat?

Runs an experiment's recipe (default ``bert_pretrain_sst2``: token-budget batches, so every step
has another (batch, length) shape) for ``--steps`` steps through ``attnlab-train``'s own code,
samples the process's RSS every ``--every`` steps, and fits a line to the samples after the
warm-up (the first quarter). Prints the slope in MB per 100 steps beside the same figure for the
reference run, the same recipe on one batch over and over (Lightning's ``overfit_batches=1``:
one shape), and fails (exit 1) when the varying-shape slope exceeds
``--max-slope`` MB per 100 steps: at 0.9 MB a step, a 100k-step run would not fit in memory.

    uv run python benchmarks/memory_growth.py --data-dir ../shared/data/sst2_glue
    uv run python benchmarks/memory_growth.py --precision bf16-mixed    # where bf16 is native
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import lightning as L

from attnlab.cli.common import compose_train
from attnlab.cli.train import train
from attnlab.core.hardware import cpu_model, native_bf16_cpu


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class RssSampler(L.Callback):
    """The process's RSS (MB) every ``every`` training steps, kept in ``RssSampler.samples``."""

    samples: list[tuple[int, float]] = []

    def __init__(self, every: int = 10) -> None:
        self.every = every

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step % self.every == 0:
            RssSampler.samples.append((trainer.global_step, rss_mb()))


def slope_per_100(samples: list[tuple[int, float]]) -> float:
    tail = samples[len(samples) // 4 :]
    steps, mb = [s for s, _ in tail], [m for _, m in tail]
    return 100 * statistics.linear_regression(steps, mb).slope


def run(args: argparse.Namespace, fixed: bool, out: Path) -> list[tuple[int, float]]:
    RssSampler.samples = []
    overrides = [
        f"experiment={args.experiment}",
        f"trainer.max_steps={args.steps}",
        f"trainer.val_check_interval={args.steps}",
        f"trainer.precision={args.precision}",
        "trainer.num_sanity_val_steps=0",
        "test=false",
        "logger=csv",
        "extras.print_config=false",
        "~callbacks.rich_progress_bar",
        "trainer.enable_progress_bar=false",
        f"+callbacks.rss._target_={__name__}.RssSampler",
        f"+callbacks.rss.every={args.every}",
        f"paths.root_dir={out}",
        f"paths.output_dir={out / ('fixed' if fixed else 'varying')}",
        *([f"data.source.data_dir={args.data_dir}"] if args.data_dir else []),
        *(["trainer.overfit_batches=1"] if fixed else []),
        *args.overrides,
    ]
    train(compose_train(overrides))
    return RssSampler.samples


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--experiment", default="bert_pretrain_sst2")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--max-slope", type=float, default=10.0, help="MB per 100 steps")
    parser.add_argument("overrides", nargs="*", help="more Hydra overrides")
    args = parser.parse_args()
    print(f"machine: {cpu_model()}, native bf16 {native_bf16_cpu()}; {args.experiment}, {args.steps} steps")
    with tempfile.TemporaryDirectory() as tmp:
        varying = run(args, False, Path(tmp))
        fixed = run(args, True, Path(tmp))
    for name, samples in (("varying shapes", varying), ("one batch repeated (reference)", fixed)):
        first, last = samples[0][1], samples[-1][1]
        print(f"{name}: RSS {first:.0f} -> {last:.0f} MB, {slope_per_100(samples):+.1f} MB/100 steps")
    slope = slope_per_100(varying)
    ok = slope <= args.max_slope
    print(f"{'ok' if ok else 'GROWS'}: {slope:+.1f} MB/100 steps (limit {args.max_slope})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
