"""Dropout masks on the CPU: ``attnlab.nn.Dropout`` (random bytes against a threshold) against
``nn.Dropout`` (a Bernoulli draw per element through torch's float sampler), in one run.

Times a training-mode forward of each on activations of a small Transformer's shapes and prints
ms per million elements and the ratio (goal: ours at least 2x faster; on a GPU both are
``F.dropout``, so nothing to measure there).

    uv run python benchmarks/dropout.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from attnlab.core.hardware import cpu_model
from attnlab.nn.dropout import Dropout

SHAPES = {"tokens (64, 32, 256)": (64, 32, 256), "MLP (64, 32, 1024)": (64, 32, 1024)}


def ms_per_million(layer: nn.Module, x: torch.Tensor, iters: int) -> float:
    times = []
    for _ in range(iters + 3):  # the first calls warm the allocator
        t0 = time.perf_counter()
        layer(x)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times[3:]) / (x.numel() / 1e6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--p", type=float, default=0.1)
    args = parser.parse_args()
    goal = 2.0
    print(f"dropout p={args.p}, training mode, {cpu_model()}, {torch.get_num_threads()} threads")
    print(f"{'shape':<24}{'attnlab':>10}{'nn.Dropout':>12}{'speed-up':>10}{'goal':>7}")
    for name, shape in SHAPES.items():
        x = torch.randn(*shape)
        ours = ms_per_million(Dropout(args.p).train(), x, args.iters)
        ref = ms_per_million(nn.Dropout(args.p).train(), x, args.iters)
        mark = "ok" if ref / ours >= goal else "MISSED"
        print(f"{name:<24}{ours:>9.2f}ms{ref:>10.2f}ms{ref / ours:>9.2f}x{goal:>6.1f}x {mark}")
    print("(ms per million elements)")


if __name__ == "__main__":
    main()
