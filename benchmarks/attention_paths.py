"""Which attention path is faster here: ``F.scaled_dot_product_attention`` or explicit softmax?

Times forward + backward of both paths of ``attnlab.nn.scaled_dot_product_attention`` in fp32 and
under bf16 autocast, for a GPT-like and a translation-like shape, and prints the ratio beside what
``impl="auto"`` picks on this machine.

    uv run python benchmarks/attention_paths.py
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

from attnlab.nn.attention import _use_math, scaled_dot_product_attention
from attnlab.utils.hardware import cpu_model, native_bf16_cpu

SHAPES = {"gpt (8, 4, 256, 64)": (8, 4, 256, 64), "nmt (64, 8, 32, 32)": (64, 8, 32, 32)}


def time_path(shape: tuple[int, ...], impl: str, causal: bool, bf16: bool, iters: int) -> float:
    q, k, v = (torch.randn(*shape, requires_grad=True) for _ in range(3))
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    times = []
    for i in range(iters + 2):
        t0 = time.perf_counter()
        with ctx:
            y, _ = scaled_dot_product_attention(q, k, v, causal=causal, impl=impl)
        y.float().sum().backward()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return 1000 * sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--no-bf16", action="store_true", help="skip bf16 (it crawls without native bf16)")
    args = ap.parse_args()
    print(f"CPU {cpu_model()}, native bf16: {native_bf16_cpu()}, {torch.get_num_threads()} threads")
    for bf16 in (False, True):
        if bf16 and args.no_bf16:
            continue
        for name, shape in SHAPES.items():
            for causal in (False, True):
                sdpa = time_path(shape, "sdpa", causal, bf16, args.iters)
                math = time_path(shape, "math", causal, bf16, args.iters)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    auto = "math" if _use_math(torch.empty(0), "auto", False) else "sdpa"
                print(
                    f"{'bf16' if bf16 else 'fp32'} {name} causal={causal!s:5}: sdpa {sdpa:7.2f} ms, "
                    f"math {math:7.2f} ms, sdpa/math {sdpa / math:4.2f}; auto picks {auto}"
                )


if __name__ == "__main__":
    main()
