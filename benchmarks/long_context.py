"""What long context costs each position and attention variant of GPT (docs/positions.md).

For each variant and sequence length (256 -> 8192 by default, doubling, as far as memory allows),
times a training step (forward + backward + AdamW, median of ``--iters``) and generation (the
median time of one new token with the variant's cache, after a prompt filling the context), and
the peak memory of the training steps above what was held before them (the model and batch): the
GPU's allocations, or on a CPU the process's resident memory (each variant runs in a fresh process,
so one variant's freed memory does not hide the next's; memory freed by a shorter length of the
same variant may be reused, so on a CPU the figure can be low by what a shorter length held).
Full attention with learned positions is the reference: each row gives the variant's time and
memory as a ratio of its (0.25 = a quarter of full attention's).

    uv run python benchmarks/long_context.py                                   # all variants
    uv run python benchmarks/long_context.py --lengths 256,512 --variants rope,sliding,linear
    uv run python benchmarks/long_context.py --device cuda --batch 8
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

# name -> (positions, attention[, linear attention's feature map]); the reference first
VARIANTS = {
    "full": ("learned", "full"),
    "sinusoidal": ("sinusoidal", "full"),
    "rope": ("rope", "full"),
    "alibi": ("alibi", "full"),
    "t5": ("t5", "full"),
    "none": ("none", "full"),
    "sliding": ("rope", "sliding"),
    "global_local": ("rope", "global_local"),
    "linear": ("rope", "linear"),
    "linear_taylor": ("rope", "linear", "taylor"),
}


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(name: str, length: int, args: argparse.Namespace) -> dict[str, float]:
    """One variant at one length: ms per training step, peak MB, ms per generated token."""
    import torch

    from attnlab.core.memory import peak_memory_mb, reset_peak_memory
    from attnlab.models import GPT

    torch.manual_seed(0)
    positions, attention, *feature_map = VARIANTS[name]
    net = GPT(
        args.vocab, max_len=length, depth=args.depth, n_head=args.n_head, dim=args.dim,
        positions=positions, attention=attention, window=args.window, n_global=args.n_global,
        feature_map=feature_map[0] if feature_map else "elu",
    ).to(args.device)  # fmt: skip
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    x = torch.randint(args.vocab, (args.batch, length), device=args.device)
    steps = []
    baseline = reset_peak_memory(args.device)
    for i in range(args.iters + 1):  # the first is a warm-up
        sync(args.device)
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(net(x).flatten(0, 1), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(args.device)
        if i:
            steps.append(time.perf_counter() - t0)
    mem = peak_memory_mb(args.device) - baseline
    net.eval()
    tokens = []
    with torch.no_grad():
        caches = net.new_caches()
        net(x[:1, : length - args.new_tokens], caches)  # the prompt fills the context
        for j in range(length - args.new_tokens, length):
            sync(args.device)
            t0 = time.perf_counter()
            net(x[:1, j : j + 1], caches)
            sync(args.device)
            tokens.append(time.perf_counter() - t0)
    return {
        "train_ms": 1000 * statistics.median(steps),
        "peak_mb": mem,
        "token_ms": 1000 * statistics.median(tokens),
    }


def run_variant(name: str, args: argparse.Namespace, out: mp.Queue) -> None:
    """Every length of one variant, in this (fresh) process, until one does not fit."""
    import torch

    from attnlab.core.cpu import tune_cpu_for_training

    tune_cpu_for_training()  # as attnlab-train runs: denormals flushed (ALiBi's far keys make them)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    for length in args.lengths:
        try:
            out.put((name, length, measure(name, length, args)))
        except torch.OutOfMemoryError:
            out.put((name, length, None))
            return


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="256,512,1024,2048,4096,8192")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=65)
    ap.add_argument("--window", type=int, default=64, help="sliding and global_local attention")
    ap.add_argument("--n-global", type=int, default=4)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=16, help="generated tokens timed per length")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    args = ap.parse_args()
    args.lengths = [int(n) for n in args.lengths.split(",")]
    names = ["full", *[n for n in args.variants.split(",") if n != "full"]]
    unknown = set(names) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")

    from attnlab.core.hardware import cpu_model

    print(f"{args.device}, CPU {cpu_model()}; GPT dim {args.dim}, depth {args.depth}, batch {args.batch}")
    results: dict[tuple[str, int], dict[str, float] | None] = {}
    ctx = mp.get_context("spawn")
    for name in names:
        queue = ctx.Queue()
        proc = ctx.Process(target=run_variant, args=(name, args, queue))
        proc.start()
        proc.join()
        while not queue.empty():
            variant, length, row = queue.get()
            results[(variant, length)] = row
        if proc.exitcode:  # killed, out of memory: the lengths it did not finish are missing
            print(f"{name}: its process ended with {proc.exitcode} (out of memory?)")
    unit = "MB" if args.device.startswith("cuda") else "MB RSS"
    print(
        "\n| variant | length | train ms/step | vs full | ms/token generated | vs full "
        f"| training peak {unit} | vs full |\n| --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    for length in args.lengths:
        ref = results.get(("full", length))
        for name in names:
            row = results.get((name, length))
            if row is None:
                print(f"| {name} | {length} | out of memory | | | | | |")
                continue
            cells = []
            for key in ("train_ms", "token_ms", "peak_mb"):
                ratio = f"{row[key] / ref[key]:.2f}" if ref else "-"
                cells += [f"{row[key]:.1f}", ratio]
            print(f"| {name} | {length} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
