"""Start-up time of every console script: ``--help``, and a config type error (the quickest way a
user's command ends), each a fresh process, beside the reference measured in the same run:
``python -c "import torch"`` (what any script of a torch project pays before doing anything).
Goal: ``--help`` and a config error in <= 3 s on a 2-core laptop CPU.

    uv run python benchmarks/startup.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from attnlab.core.hardware import cpu_model

ROOT = Path(__file__).resolve().parents[1]
# a value of the wrong type for each script: refused by the config check before any work
BAD_VALUE = {
    "train": ["trainer.max_steps=abc"],
    "eval": ["ckpt_path=last", "trainer.max_steps=abc"],
    "sweep": ["hparams_search=gpt_optuna", "sweep.n_trials=abc"],
    "compare": ["--sort"],
}


def seconds(argv: list[str], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(argv, capture_output=True, cwd=ROOT)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    bin_dir = Path(sys.executable).parent
    reference = seconds([sys.executable, "-c", "import torch"], args.repeat)
    print(f"machine: {cpu_model()}; median of {args.repeat} fresh processes")
    print(f"reference: python -c 'import torch': {reference:.2f} s")
    print(f"{'script':<20}{'--help':>10}{'ratio':>8}{'config error':>15}{'ratio':>8}")
    for name in sorted(scripts):
        script = str(bin_dir / name)
        helped = seconds([script, "--help"], args.repeat)
        bad = BAD_VALUE.get(name.removeprefix("attnlab-"), ["ckpt_path=last", "seed=abc"])
        failed = seconds([script, *bad], args.repeat)
        ratios = f"{helped:>9.2f}s{helped / reference:>7.1f}x{failed:>14.2f}s{failed / reference:>7.1f}x"
        print(f"{name:<20}{ratios}")


if __name__ == "__main__":
    main()
