"""Which attention path is fastest here, for each attention variant: SDPA, FlexAttention or the
explicit softmax (``attn_impl: sdpa | flex | math``), and what ``attn_impl: auto`` picks.

For every variant (full attention causal and padded, ALiBi, T5, sliding window, global + local)
times one attention layer of the shakespeare GPT's width (128, 4 heads) at ``--length`` tokens:
a training step (forward + backward) and inference (forward without gradients), in fp32 and
bf16 where the hardware has it. On a CPU FlexAttention is compiled for inference only: PyTorch has
no CPU kernel for its backward, so its training row is the operator's dense eager form; and for
ALiBi and T5 a last column gives SDPA with the bias as one float mask (the path before SDPA took
them in pieces, ``nn/flash_pieces.py``).

    uv run python benchmarks/attention_paths.py [--length 1024] [--device cuda] [--no-bf16]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from attnlab.core.cpu import tune_cpu_for_training
from attnlab.core.hardware import cpu_model, native_bf16_cpu
from attnlab.nn import MultiHeadAttention, SlidingWindowAttention, attention
from attnlab.nn.attention import choose_impl
from attnlab.nn.positions import relative_positions

# name -> (layer, positions, causal, padded)
VARIANTS = {
    "causal": ("full", "none", True, False),
    "padded": ("full", "none", False, True),
    "alibi": ("full", "alibi", True, False),
    "t5": ("full", "t5", True, False),
    "sliding": ("sliding", "none", True, False),
    "global_local": ("global_local", "none", True, False),
}
IMPLS = ("sdpa", "flex", "math")
FLOAT_MASK = "sdpa, float mask"  # ALiBi and T5 as one (H, T, T) mask, not in pieces: the path before


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def layer(kind: str, dim: int, n_head: int, window: int) -> MultiHeadAttention:
    if kind == "full":
        return MultiHeadAttention(dim, n_head, bias=False)
    n_global = 4 if kind == "global_local" else 0
    return SlidingWindowAttention(dim, n_head, window, bias=False, n_global=n_global)


def time_variant(name: str, impl: str, train: bool, dtype: torch.dtype, args: argparse.Namespace) -> float:
    """Median ms of a training step (forward + backward) or of a forward without gradients."""
    if impl == FLOAT_MASK:
        with _no_pieces():
            return time_variant(name, "sdpa", train, dtype, args)
    kind, positions, causal, padded = VARIANTS[name]
    torch.manual_seed(0)
    attn = layer(kind, args.dim, args.n_head, args.window).to(args.device)
    attn.impl = impl
    pos = relative_positions(positions, args.dim // args.n_head, args.n_head, causal=causal)
    pos = pos.to(args.device) if pos is not None else None
    x = torch.randn(args.batch, args.length, args.dim, device=args.device, requires_grad=train)
    padding = None
    if padded:  # a quarter of the keys are padding
        padding = torch.zeros(args.batch, args.length, dtype=torch.bool, device=args.device)
        padding[:, -args.length // 4 :] = True
    autocast = torch.autocast(args.device.split(":")[0], dtype=dtype) if dtype != torch.float32 else None
    times = []
    for i in range(args.iters + 2):  # two warm-ups (and FlexAttention's compile)
        sync(args.device)
        t0 = time.perf_counter()
        with autocast or contextlib.nullcontext(), torch.set_grad_enabled(train):
            y, _ = attn(x, causal=causal, key_padding_mask=padding, positions=pos)
        if train:
            y.float().sum().backward()
        sync(args.device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


@contextlib.contextmanager
def _no_pieces():
    pieces = attention.pieces_apply
    attention.pieces_apply = lambda *a: False
    try:
        yield
    finally:
        attention.pieces_apply = pieces


def auto_choice(name: str, dtype: torch.dtype, device: str) -> str:
    kind, positions, *_ = VARIANTS[name]
    fused_only = kind != "full" or positions in ("alibi", "t5")
    q = torch.empty(1, 1, 1, 1, device=device)
    with torch.autocast(device.split(":")[0], dtype=dtype, enabled=dtype != torch.float32):
        return choose_impl("auto", q, need_weights=False, fused_only=fused_only, dropout=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    ap.add_argument("--no-bf16", action="store_true", help="fp32 only")
    args = ap.parse_args()
    tune_cpu_for_training()  # as attnlab-train runs: denormals flushed (ALiBi's far keys make them)
    cuda = args.device.startswith("cuda")
    machine = torch.cuda.get_device_name() if cuda else f"CPU {cpu_model()}, native bf16: {native_bf16_cpu()}"
    print(
        f"{machine}, {torch.get_num_threads()} threads; T = {args.length}, batch {args.batch}, dim {args.dim}"
    )
    dtypes = [torch.float32]
    if not args.no_bf16 and (cuda or native_bf16_cpu()):
        dtypes.append(torch.bfloat16)
    impls = (*IMPLS, FLOAT_MASK)
    print(
        "\n| dtype | variant | step | " + " | ".join(f"{i} ms" for i in impls) + " | fastest | auto picks |"
    )
    print("| --- | --- | --- | " + " | ".join("---" for _ in impls) + " | --- | --- |")
    for dtype in dtypes:
        for name in args.variants.split(","):
            for train in (True, False):
                biased = VARIANTS[name][1] in ("alibi", "t5") and not args.device.startswith("cuda")
                ms = {
                    impl: time_variant(name, impl, train, dtype, args)
                    for impl in (*IMPLS, FLOAT_MASK)[: 3 + biased]
                }
                cells = " | ".join(f"{ms[i]:.2f}" if i in ms else "" for i in impls)
                fastest = min(ms, key=ms.get)
                step = "train" if train else "infer"
                dt = str(dtype).removeprefix("torch.")
                auto = auto_choice(name, dtype, args.device)
                print(f"| {dt} | {name} | {step} | {cells} | {fastest} | {auto} |")


if __name__ == "__main__":
    main()
