"""Wall time of one Optuna sweep run one trial at a time and two at once: ``attnlab-sweep`` with
``sweep.n_jobs=1`` against ``sweep.n_jobs=2`` (each trial on half the cores, one torch thread per
core; on GPUs, one GPU each with ``--accelerator gpu``), the same 4 trials drawn by a seeded random
sampler in both. Prints a table naming the machine: wall time of each sweep, their ratio, the
trials' mean time, and how many trials overlapped in time (read from the study).

    uv run python benchmarks/sweep_parallel.py [--steps 300] [--trials 4]
    uv run python benchmarks/sweep_parallel.py --smoke      # a tiny model, a few steps: it runs

Run it alone: the point is how two trials share the machine, not what a neighbour takes.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna

from attnlab.core.hardware import cpu_model, gpu_names
from attnlab.experiments.sweep import device_slots, usable_cores

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "model.net.depth=1",
    "model.net.n_head=2",
    "model.net.dim=32",
    "model.net.max_len=16",
    "data.batch_size=4",
]


def sweep_args(args: argparse.Namespace, n_jobs: int, sweep_dir: Path) -> list[str]:
    return [
        "hparams_search=gpt_optuna",
        "experiment=gpt_pydoc_char",
        "logger=csv",
        "test=false",
        "extras.print_config=false",
        "trainer.enable_progress_bar=false",
        "~callbacks.rich_progress_bar",
        f"trainer.accelerator={args.accelerator}",
        f"trainer.max_steps={args.steps}",
        f"trainer.val_check_interval={max(1, args.steps // 2)}",
        "data.val_batches=5",
        "sample.max_new_tokens=10",
        *(TINY if args.smoke else []),
        f"sweep.n_trials={args.trials}",
        f"sweep.n_jobs={n_jobs}",
        "~sweep.params",
        "+sweep.params.model.optim.optimizer.lr=tag(log, interval(3e-4, 3e-3))",
        "sweep.sampler._target_=optuna.samplers.RandomSampler",
        "~sweep.sampler.n_startup_trials",
        "sweep.sampler.seed=0",
        "sweep.pruner._target_=optuna.pruners.NopPruner",  # every trial runs all its steps
        "~sweep.pruner.n_startup_trials",
        "~sweep.pruner.n_warmup_steps",
        f"sweep.dir={sweep_dir}",
    ]


def run_sweep(args: argparse.Namespace, n_jobs: int, work: Path) -> dict:
    sweep_dir = work / f"n_jobs_{n_jobs}"
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "attnlab.cli.sweep", *sweep_args(args, n_jobs, sweep_dir)],
        cwd=work,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        tail = f"{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
        sys.exit(f"n_jobs={n_jobs}: attnlab-sweep failed ({proc.returncode}):\n{tail}")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name="sweep", storage=f"sqlite:///{sweep_dir / 'optuna.db'}")
    trials = [t for t in study.get_trials() if t.datetime_complete is not None]
    spans = [(t.datetime_start.timestamp(), t.datetime_complete.timestamp()) for t in trials]
    overlapping = sum(a[0] < b[1] and b[0] < a[1] for a, b in itertools.combinations(spans, 2))
    return {
        "wall": wall,
        "trial": statistics.fmean(e - s for s, e in spans),
        "overlapping": overlapping,
        "states": {t.state.name.lower() for t in trials},
        "params": sorted(round(t.params["model.optim.optimizer.lr"], 12) for t in trials),
        "slots": "; ".join(s.label or "all it has" for s in device_slots(n_jobs, None, args.accelerator, 1)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="training steps of each trial")
    ap.add_argument("--trials", type=int, default=4)
    ap.add_argument("--accelerator", default="cpu", help="cpu (default) or gpu: one GPU per trial")
    ap.add_argument(
        "--smoke", action="store_true", help="2 trials of a tiny model, 4 steps: checks the script"
    )
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.trials = 4, 2
    gpus = gpu_names() if args.accelerator != "cpu" else []
    print(
        f"machine: {cpu_model()}, {len(usable_cores())} cores usable"
        + (f", GPUs: {', '.join(gpus)}" if gpus else "")
        + f"; {args.trials} trials of experiment=gpt_pydoc_char{' (tiny model)' if args.smoke else ''}, "
        f"{args.steps} steps each, random sampler (seed 0), no pruning"
    )
    with tempfile.TemporaryDirectory() as tmp:
        results = {n: run_sweep(args, n, Path(tmp)) for n in (1, 2)}
    print(f"{'n_jobs':>6} {'wall (s)':>9} {'trial mean (s)':>15} {'overlapping pairs':>18}  trials on")
    for n, r in results.items():
        print(f"{n:>6} {r['wall']:>9.1f} {r['trial']:>15.1f} {r['overlapping']:>18}  {r['slots']}")
    same = results[1]["params"] == results[2]["params"]
    print(
        f"n_jobs=1 / n_jobs=2 wall time: {results[1]['wall'] / results[2]['wall']:.2f}x; "
        f"the same trials in both: {'yes' if same else 'NO'}; "
        f"states: {', '.join(sorted(results[1]['states'] | results[2]['states']))}"
    )


if __name__ == "__main__":
    main()
