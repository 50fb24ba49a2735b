"""Issue 56's GPU check in one run (``scripts/gpu_bench.sh``): one markdown table, one row a bar.

On one H100/H200, bf16 autocast, compiled ((a) by the Task's ``model.optim.compile``, (b) and (c) each
Transformer block in place, regional compilation, for both sides alike):

(a) a GPT of GPT-2 small's shape (124 M parameters: 12 layers, 12 heads, dim 768, vocab 50304,
    T = 1,024) trained by attnlab's Trainer path (the ``attnlab-train`` config composed by Hydra,
    ``data=token_shards`` on random token shards written by attnlab-prepare's code into a temporary
    folder): tokens/s and MFU (bar: >= 40%);
(b) ViT-S/16 at 224 px (conf/model/net/vit_small.yaml) on random images beside timm's
    ``vit_small_patch16_224`` (random init), same batch, precision and compile: images/s and MFU
    (bar: >= 1.0x timm's);
(c) the GPT with ALiBi, T5 and a sliding window through ``model.net.attn_impl=flex`` against full
    causal attention on SDPA (its flash kernel) at T = 4,096: tokens/s ratio (bar: >= 0.8x);
(d) the trainer's overhead: ``benchmarks/gpt_train.py``'s attnlab step against its plain PyTorch
    loop (same model, data and optimizer), fp32 and bf16 (bar: <= 1.03x).

Step counts are fixed and the warm-up steps (compilation included) are left out of every timing;
they are sized for the whole run, compiles included, to end within 8 minutes on one H200, and no
part starts after ``--budget-s``. ``--smoke`` runs the same code reduced (tiny
shapes, a few steps, no compile, fp32 where the CPU has no native bf16) on a CPU in seconds, for CI.
The table is printed and, with ``--out`` (or ``$OUT`` set: ``$OUT/gpu_bench.md``), written after
each part, so a run stopped early keeps what it measured. A part that fails is one row
``failed: ...`` and the exit status is 1.

    bash scripts/gpu_bench.sh                       # alone on the GPU machine
    uv run python benchmarks/gpu_bench.py --smoke   # any machine, seconds
"""

from __future__ import annotations

import argparse
import datetime
import gc
import math
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import get_args

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpt_train, beside this file
from gpt_train import attnlab_ms, compose_experiment, plain_loop_ms  # noqa: E402

from attnlab.cli.common import compose_train, config_dir  # noqa: E402
from attnlab.core.hardware import compute_dtype, cpu_model, native_bf16_cpu, peak_flops  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    """Shapes and step counts of every part; ``SMOKE`` shrinks them for a CPU."""

    # (a) the GPT through the Trainer, and the shape of (c)'s GPT
    vocab: int = 50304
    depth: int = 12
    n_head: int = 12
    dim: int = 768
    seq: int = 1024
    batch: int = 32
    steps: int = 50
    warmup: int = 10
    train_tokens: int = 2_000_000  # in the random shards; windows are drawn at random from them
    # (b) ViT-S/16
    img: int = 224
    patch: int = 16
    vit_dim: int = 384
    vit_depth: int = 12
    vit_heads: int = 6
    classes: int = 1000
    vit_batch: int = 256
    vit_steps: int = 50
    vit_warmup: int = 5
    # (c) long context: the reference is full causal attention at the same length
    long_seq: int = 4096
    long_batch: int = 8
    window: int = 1024
    long_steps: int = 20
    long_warmup: int = 3
    # (d) gpt_train.py's model (gpt_shakespeare_char on the pydoc corpus), its own step counts
    overhead_steps: int = 300
    overhead_warmup: int = 30
    overhead_tiny: bool = False  # (d)'s model shrunk to (a)'s smoke shape


SMOKE = Sizes(
    vocab=256, depth=1, n_head=2, dim=32, seq=32, batch=4, steps=4, warmup=2, train_tokens=20_000,
    img=32, patch=8, vit_dim=32, vit_depth=1, vit_heads=2, classes=10, vit_batch=4, vit_steps=3,
    vit_warmup=1, long_seq=64, long_batch=1, window=16, long_steps=3, long_warmup=1,
    overhead_steps=3, overhead_warmup=1, overhead_tiny=True,
)  # fmt: skip


@dataclass(frozen=True)
class Setup:
    """What every part runs with."""

    sizes: Sizes
    device: str
    precision: str  # "bf16-mixed" or "32-true"
    compile: bool  # each Transformer block compiled (regional compilation)
    variant_impl: str  # (c)'s attn_impl for ALiBi, T5 and the sliding window
    peak: float  # FLOP/s, for MFU
    peak_source: str
    workdir: str
    extra: tuple[str, ...] = ()  # Hydra overrides added to (a)'s run (--override)


@dataclass
class Row:
    """One line of the table; ``ratio`` is what the bar judges."""

    key: str
    what: str
    ours: str
    reference: str
    ratio: float
    bar: str
    ok: bool

    def markdown(self) -> str:
        ratio = f"{self.ratio:.3g}" if math.isfinite(self.ratio) else "-"
        mark = "ok" if self.ok else "MISSED"
        return (
            f"| {self.key} | {self.what} | {self.ours} | {self.reference} | {ratio} | {self.bar} | {mark} |"
        )


# Every row a run prints, by part (the keys CI checks); (d) adds "d bf16-mixed" where bf16 runs.
PARTS = {"a": ["a"], "b": ["b"], "c": ["c alibi", "c t5", "c sliding"], "d": ["d 32-true"]}


# ---- measuring ----------------------------------------------------------------------------------


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def fresh() -> None:
    """Nothing of the last model left: its memory, and dynamo's compiled code (a block class
    compiled for many models and shapes would reach dynamo's recompile limit and fall back to
    eager, or be compiled for dynamic shapes)."""
    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def autocast(setup: Setup) -> AbstractContextManager:
    if setup.precision != "bf16-mixed":
        return nullcontext()
    return torch.autocast(setup.device.split(":")[0], dtype=torch.bfloat16)


def steps_per_s(net: nn.Module, x: Tensor, y: Tensor, setup: Setup, steps: int, warmup: int) -> float:
    """Training steps per second of ``net`` on the fixed batch ``(x, y)``: forward under the run's
    autocast, cross-entropy, backward, a fused AdamW step; ``warmup`` steps (compilation) first,
    then ``steps`` timed together (one synchronisation at each end, as a training loop runs)."""
    net.to(setup.device).train()
    if setup.compile:
        from attnlab.training.base import compile_net

        compile_net(net, "regional")  # each block once; identical blocks share the code
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)

    def step() -> None:
        with autocast(setup):
            out = net(x)
        F.cross_entropy(out.float().flatten(0, -2), y.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    sync(setup.device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync(setup.device)
    return steps / (time.perf_counter() - t0)


def step_flops(net: nn.Module, x: Tensor) -> float:
    """Model FLOPs of one training step of ``net`` on the batch ``x`` (only its shape is read):
    the net's analytic count (``attnlab.nn.flops``), what every run's MFU column divides."""
    return float(net.flops(x).total)


def failed(keys: list[str], error: BaseException) -> list[Row]:
    why = f"failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    why = why.replace("|", "/")[:200]
    return [Row(k, why, "-", "-", math.nan, "-", False) for k in keys]


# ---- (a) GPT-2 small through the Trainer ------------------------------------------------------


def write_random_shards(folder: Path, sizes: Sizes) -> Path:
    """Token shards of uniformly random ids over ``sizes.vocab`` tokens, written by
    attnlab-prepare's own code: random text over ``vocab`` characters (code points from U+0100,
    below the surrogates, no newline), tokenised by its char tokenizer, one id per character."""
    from attnlab.data.text.shards import prepare

    if sizes.vocab > 0xD800 - 0x100:
        raise ValueError(f"vocab {sizes.vocab}: at most {0xD800 - 0x100} characters below the surrogates")
    held_out = 4 * (sizes.seq + 2)  # the data module wants more than a window in each split
    n = sizes.train_tokens + 2 * held_out
    rng = np.random.default_rng(0)
    ids = rng.integers(0, sizes.vocab, n)
    ids[: sizes.vocab] = rng.permutation(sizes.vocab)  # every character once: the vocabulary is vocab
    text = (ids + 0x100).astype("<u4").tobytes().decode("utf-32-le")
    corpus = folder / "random.txt"
    corpus.write_text(text, encoding="utf-8")
    out = folder / "shards"
    manifest = prepare([str(corpus)], out, "char", val_tokens=held_out, test_tokens=held_out, progress=False)
    assert manifest["vocab_size"] == sizes.vocab, manifest["vocab_size"]
    corpus.unlink()
    return out


def gpt_overrides(s: Sizes, seq: int) -> list[str]:
    """GPT-2 small's shape on nanoGPT's GPT (no biases, no dropout) from the gpt_shakespeare_char
    recipe (AdamW, gradient clipping 1.0)."""
    return [
        "experiment=gpt_shakespeare_char",
        f"model.net.depth={s.depth}",
        f"model.net.n_head={s.n_head}",
        f"model.net.dim={s.dim}",
        f"model.net.max_len={seq}",
        "model.net.dropout=0.0",
        "model.net.bias=false",
    ]


def gpt_trainer(setup: Setup) -> list[Row]:
    from hydra.utils import instantiate

    s = setup.sizes
    shards = write_random_shards(Path(setup.workdir), s)
    overrides = gpt_overrides(s, s.seq) + [
        "data=token_shards",
        f"data.source.path={shards}",
        f"data.batch_size={s.batch}",
        f"model.optim.compile={'regional' if setup.compile else 'false'}",
        f"paths.output_dir={setup.workdir}/gpt",
        *setup.extra,
    ]
    if setup.device == "cpu":
        overrides.append("data.num_workers=0")  # a loader process costs a CPU smoke seconds
    cfg = compose_train(overrides)
    ms = attnlab_ms(cfg, setup.precision, s.steps, s.warmup)
    n, batch, seq = cfg.model.net, cfg.data.batch_size, cfg.data.max_len  # --override included
    with torch.device("meta"):
        net = instantiate(n, vocab_size=s.vocab)
        flops = step_flops(net, torch.zeros(batch, seq, dtype=torch.long))
    tokens_s = batch * seq / (ms / 1000)
    peak_tokens_s = setup.peak / (flops / (batch * seq))
    mfu = tokens_s / peak_tokens_s
    what = (
        f"GPT {sum(p.numel() for p in net.parameters()) / 1e6:.1f} M parameters ({n.depth} layers, "
        f"{n.n_head} heads, dim {n.dim}, vocab {s.vocab}), T {seq:,}, batch {batch}: attnlab Trainer "
        f"on token shards, {ms:.1f} ms/step; ratio = MFU"
    )
    ours = f"{tokens_s:,.0f} tokens/s ({100 * mfu:.1f}% MFU)"
    ref = f"{peak_tokens_s:,.0f} tokens/s at peak"
    return [Row("a", what, ours, ref, mfu, ">= 0.40", mfu >= 0.40)]


# ---- (b) ViT-S/16 against timm's --------------------------------------------------------------


def vit_pair(s: Sizes) -> tuple[Callable[[], nn.Module], Callable[[], nn.Module]]:
    """Our ViT-S (conf/model/net/vit_small.yaml) and timm's ``vit_small_patch16_224``, random
    init, the same shape: patches of ``s.patch``, no stochastic depth (timm's default)."""
    import timm
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    net = OmegaConf.load(Path(config_dir()) / "model" / "net" / "vit_small.yaml")
    shape = dict(num_classes=s.classes, img_size=s.img, patch_size=s.patch, depth=s.vit_depth, in_chans=3)

    def ours() -> nn.Module:
        return instantiate(net, dim=s.vit_dim, n_head=s.vit_heads, drop_path=0.0, stem="patch", **shape)

    def theirs() -> nn.Module:
        return timm.create_model(
            "vit_small_patch16_224", pretrained=False, embed_dim=s.vit_dim, num_heads=s.vit_heads, **shape
        )

    return ours, theirs


def vit_vs_timm(setup: Setup) -> list[Row]:
    s = setup.sizes
    torch.manual_seed(0)
    x = torch.randn(s.vit_batch, 3, s.img, s.img, device=setup.device)
    y = torch.randint(0, s.classes, (s.vit_batch,), device=setup.device)
    results, per_image = [], None
    for build in vit_pair(s):
        fresh()
        torch.manual_seed(0)
        net = build()
        n = sum(p.numel() for p in net.parameters())
        if per_image is None:  # ours first: timm's is the same architecture, the same model FLOPs
            per_image = step_flops(net, x) / s.vit_batch
        images_s = s.vit_batch * steps_per_s(net, x, y, setup, s.vit_steps, s.vit_warmup)
        results.append((images_s, images_s * per_image / setup.peak, n))
        del net
    (ours, ours_mfu, n), (ref, ref_mfu, n_ref) = results
    what = (
        f"ViT-S/{s.patch} at {s.img} px ({s.vit_depth} blocks, dim {s.vit_dim}; {n:,} parameters, "
        f"timm's {n_ref:,}), batch {s.vit_batch}, random images"
    )
    return [
        Row(
            "b",
            what,
            f"{ours:,.0f} images/s ({100 * ours_mfu:.1f}% MFU)",
            f"timm vit_small_patch16_224: {ref:,.0f} images/s ({100 * ref_mfu:.1f}% MFU)",
            ours / ref,
            ">= 1.0",
            ours / ref >= 1.0,
        )
    ]


# ---- (c) ALiBi, T5, sliding window through flex against flash SDPA ---------------------------


def variant_overrides(setup: Setup) -> dict[str, list[str]]:
    impl = f"model.net.attn_impl={setup.variant_impl}"
    return {
        "full": ["model.net.positions=learned", "model.net.attention=full", "model.net.attn_impl=sdpa"],
        "alibi": ["model.net.positions=alibi", "model.net.attention=full", impl],
        "t5": ["model.net.positions=t5", "model.net.attention=full", impl],
        "sliding": [
            "model.net.positions=rope",
            "model.net.attention=sliding",
            f"model.net.window={setup.sizes.window}",
            impl,
        ],
    }


def long_context(setup: Setup) -> list[Row]:
    from hydra.utils import instantiate

    s = setup.sizes
    torch.manual_seed(0)
    x = torch.randint(0, s.vocab, (s.long_batch, s.long_seq + 1), device=setup.device)
    x, y = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    tokens_s = {}
    for name, extra in variant_overrides(setup).items():
        fresh()
        cfg = compose_train(gpt_overrides(s, s.long_seq) + extra)
        torch.manual_seed(0)
        net = instantiate(cfg.model.net, vocab_size=s.vocab)
        rate = steps_per_s(net, x, y, setup, s.long_steps, s.long_warmup)
        tokens_s[name] = s.long_batch * s.long_seq * rate
        del net
    ref = tokens_s.pop("full")
    rows = []
    for name, rate in tokens_s.items():
        what = (
            f"GPT {name}{f' (window {s.window:,})' if name == 'sliding' else ''} through "
            f"attn_impl={setup.variant_impl} against full causal attention (learned positions, "
            f"attn_impl=sdpa), T {s.long_seq:,}, "
            f"batch {s.long_batch}"
        )
        ours = f"{rate:,.0f} tokens/s"
        rows.append(
            Row(f"c {name}", what, ours, f"{ref:,.0f} tokens/s", rate / ref, ">= 0.8", rate / ref >= 0.8)
        )
    return rows


# ---- (d) the trainer's overhead ---------------------------------------------------------------


def overhead_precisions(setup: Setup) -> list[str]:
    bf16 = torch.cuda.is_bf16_supported() if setup.device.startswith("cuda") else False
    return ["32-true", "bf16-mixed"] if bf16 else ["32-true"]  # a CPU smoke: fp32 alone, quick


def trainer_overhead(setup: Setup) -> list[Row]:
    from omegaconf import OmegaConf

    s = setup.sizes
    cfg = compose_experiment(None, f"{setup.workdir}/overhead")
    if s.overhead_tiny:
        for key, value in (("net.depth", s.depth), ("net.n_head", s.n_head), ("net.dim", s.dim)):
            OmegaConf.update(cfg.model, key, value)
    rows = []
    for precision in overhead_precisions(setup):
        fresh()
        ref = plain_loop_ms(cfg.copy(), precision, s.overhead_steps, s.overhead_warmup)
        fresh()
        ours = attnlab_ms(cfg.copy(), precision, s.overhead_steps, s.overhead_warmup)
        what = (
            f"trainer overhead, {precision}: benchmarks/gpt_train.py (gpt_shakespeare_char, pydoc), "
            f"mean of {s.overhead_steps} steps"
        )
        rows.append(
            Row(
                f"d {precision}",
                what,
                f"attnlab {ours:.2f} ms/step",
                f"plain loop {ref:.2f} ms/step",
                ours / ref,
                "<= 1.03",
                ours / ref <= 1.03,
            )
        )
    return rows


# ---- the run ----------------------------------------------------------------------------------


def machine(device: str) -> str:
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    return f"{cpu_model()}, {torch.get_num_threads()} threads, no GPU"


def table(setup: Setup, rows: list[Row]) -> str:
    s = setup.sizes
    head = (
        f"### gpu_bench on {machine(setup.device)}\n\n"
        f"{datetime.date.today()}, torch {torch.__version__}, {setup.precision}, "
        f"{'compiled' if setup.compile else 'not compiled'}; MFU against "
        f"{setup.peak_source}; FLOPs: attnlab.nn.flops. "
        f"Timed: (a) {s.steps} steps after {s.warmup}, (b) {s.vit_steps} after {s.vit_warmup}, "
        f"(c) {s.long_steps} after {s.long_warmup}, (d) {s.overhead_steps} after {s.overhead_warmup}.\n\n"
        "| | what | ours | reference | ratio | bar | |\n| --- | --- | --- | --- | --- | --- | --- |\n"
    )
    rows = sorted(rows, key=lambda r: "abcd".index(r.key[0]))  # stable: (c)'s and (d)'s rows keep their order
    return head + "\n".join(r.markdown() for r in rows) + "\n"


def choose_setup(args: argparse.Namespace, workdir: str) -> Setup:
    sizes = replace(SMOKE if args.smoke else Sizes(), **args.set)
    if args.smoke:  # tiny shapes gain nothing from more threads, and lose much beside other jobs
        torch.set_num_threads(1)
    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    bf16 = torch.cuda.is_bf16_supported() if cuda else native_bf16_cpu()
    precision = "bf16-mixed" if bf16 else "32-true"
    # flex on a CPU too: training there runs FlexAttention's eager operator (no compile), cheap at
    # the smoke's shapes, so CI runs (c)'s code path as the GPU does
    impl = args.variant_impl or "flex"
    try:
        from attnlab.nn.attention import AttentionImpl

        if impl not in get_args(AttentionImpl):
            print(f"attn_impl={impl} is not accepted yet: the variants run on auto", file=sys.stderr)
            impl = "auto"
    except ImportError:
        pass
    peak, source = peak_flops(torch.device(device), compute_dtype(precision))
    if peak is None:
        print(f"{source}: give the MFU columns a peak with --peak-tflops", file=sys.stderr)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else (peak or math.nan)
    source = f"{args.peak_tflops:g} TFLOP/s (--peak-tflops)" if args.peak_tflops else source
    compiled = cuda and not args.no_compile
    return Setup(sizes, device, precision, compiled, impl, peak, source, workdir, tuple(args.override))


def size_setting(text: str) -> tuple[str, int]:
    """``KEY=N`` of ``--set``: a field of ``Sizes`` and a whole number."""
    key, _, value = text.partition("=")
    names = [f.name for f in fields(Sizes) if f.type == "int"]
    if key not in names or not value.isdigit():
        raise argparse.ArgumentTypeError(f"expected KEY=N with KEY one of {', '.join(names)}, got {text!r}")
    return key, int(value)


PART_FUNCTIONS = {"a": gpt_trainer, "b": vit_vs_timm, "c": long_context, "d": trainer_overhead}
RUN_ORDER = "dabc"  # the cheapest first, (c)'s three FlexAttention compiles last: --budget-s cuts there


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, a few steps, on the CPU")
    parser.add_argument("--parts", default="abcd", help="which parts, e.g. ab (default: abcd)")
    parser.add_argument(
        "--set",
        type=size_setting,
        action="append",
        default=[],
        metavar="KEY=N",
        help="change a size or step count, e.g. --set batch=64 --set vit_steps=50 (see Sizes)",
    )
    parser.add_argument("--variant-impl", default=None, help="(c)'s attn_impl (default: flex)")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--peak-tflops", type=float, default=None, help="MFU's peak (default: attnlab's)")
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a Hydra override for (a)'s Trainer run, e.g. --override model.optim.compile=regional",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="start no part after this many seconds (default 420: the check must end within 8 minutes)",
    )
    parser.add_argument("--out", default=None, help="also write the table here (default: $OUT/gpu_bench.md)")
    args = parser.parse_args(argv)
    args.set = dict(args.set)
    if unknown := set(args.parts) - set(PART_FUNCTIONS):
        parser.error(f"--parts takes letters of abcd, got {''.join(sorted(unknown))!r}")
    out = args.out or (os.path.join(os.environ["OUT"], "gpu_bench.md") if os.environ.get("OUT") else None)
    start, rows, failures = time.perf_counter(), [], 0
    with tempfile.TemporaryDirectory(prefix="gpu_bench-") as workdir:
        setup = choose_setup(args, workdir)
        for part in sorted(set(args.parts), key=RUN_ORDER.index):
            t0 = time.perf_counter()
            try:
                if t0 - start > args.budget_s:
                    raise TimeoutError(
                        f"not started: {t0 - start:.0f} s gone of --budget-s {args.budget_s:.0f}"
                    )
                rows += PART_FUNCTIONS[part](setup)
            except Exception as e:  # one part's failure leaves the others' rows
                if not isinstance(e, TimeoutError):
                    traceback.print_exc()
                rows += failed(PARTS[part], e)
                failures += 1
            fresh()
            now = time.perf_counter()
            print(f"[gpu_bench] part {part}: {now - t0:.1f} s ({now - start:.1f} s in all)", file=sys.stderr)
            if out:
                Path(out).write_text(table(setup, rows))
    print(table(setup, rows))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
