"""Cold start and steady-state training step of model.optim.compile=false, true and regional.

For the GPT of experiment=gpt_shakespeare_char (random tokens of its vocabulary) and the ViT of
experiment=vit_fashion_mnist (random 28x28 images), each setting in a fresh process with an empty
inductor cache, so every compile starts cold as a user's first run does: the cold start is the
time from ``trainer.fit`` to the end of the first training step (compiling included), the step
the mean over the steps after the warm-up. The trainer is Lightning's with the run's precision
(``trainer.precision=auto``: bf16-mixed where the machine multiplies bf16 natively), no logger
and no callbacks. Prints one markdown table. Run it alone: compiling takes both cores.

    uv run python benchmarks/compile.py                      # minutes on a 2-core CPU
    uv run python benchmarks/compile.py --smoke              # tiny nets, a few steps: it works
    uv run python benchmarks/compile.py --variants false true:reduce-overhead   # CUDA graphs
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = {  # the experiment, and what its data would fill into model.net
    "gpt": ("gpt_shakespeare_char", {"vocab_size": 65}),
    "vit": ("vit_fashion_mnist", {"num_classes": 10, "img_size": 28, "in_chans": 1}),
}
SMOKE = {  # tiny nets and batches: the script works, in seconds of steps
    "gpt": [
        "model.net.depth=2",
        "model.net.dim=32",
        "model.net.n_head=2",
        "model.net.max_len=16",
        "data.batch_size=4",
    ],
    "vit": ["model.net.depth=2", "model.net.dim=16", "model.net.n_head=2", "data.batch_size=4"],
}
DEFAULT_VARIANTS = ["false", "true", "regional"]
GPU_VARIANTS = ["true:reduce-overhead", "regional:reduce-overhead"]  # CUDA graphs, on a GPU only


def parse_variant(variant: str) -> tuple[bool | str, str]:
    """``true``, ``regional:reduce-overhead`` -> (model.optim.compile, model.optim.compile_mode)."""
    scope, _, mode = variant.partition(":")
    value = {"false": False, "true": True, "regional": "regional"}.get(scope)
    if value is None:
        raise SystemExit(f"error: --variants {variant}: expected false, true or regional[:<mode>]")
    return value, mode or "default"


def batches(model: str, cfg, n: int) -> list:
    """``n`` random batches shaped as the experiment's data gives them."""
    import torch

    g = torch.Generator().manual_seed(0)
    b = cfg.data.batch_size
    if model == "gpt":
        t, v = cfg.model.net.max_len, cfg.model.net.vocab_size
        tokens = [torch.randint(0, v, (b, t + 1), generator=g) for _ in range(n)]
        return [(x[:, :-1], x[:, 1:]) for x in tokens]
    net = cfg.model.net
    return [
        (
            torch.randn(b, net.in_chans, net.img_size, net.img_size, generator=g),
            torch.randint(0, 10, (b,), generator=g),
        )
        for _ in range(n)
    ]


def child(model: str, variant: str, steps: int, warmup: int, smoke: bool, precision: str) -> dict:
    """Build and train one setting in this process; its cold start, step time and precision."""
    import lightning as L
    import torch
    from hydra.utils import instantiate

    from attnlab.cli.common import compose_train
    from attnlab.core.config import fill_missing
    from attnlab.core.cpu import tune_cpu_for_training
    from attnlab.core.hardware import resolve_precision

    torch.set_float32_matmul_precision("high")  # as attnlab-train
    tune_cpu_for_training()
    experiment, filled = MODELS[model]
    with tempfile.TemporaryDirectory() as out:
        cfg = compose_train(
            [f"experiment={experiment}", f"paths.output_dir={out}", *(SMOKE[model] if smoke else [])]
        )
    fill_missing(cfg.model.net, filled, "model.net")
    scope, mode = parse_variant(variant)
    torch.manual_seed(0)
    task = instantiate(cfg.model, compile=scope, compile_mode=mode)
    precision = resolve_precision("auto", precision)
    cuda = torch.cuda.is_available()

    def now() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.first = self.start = self.end = 0.0
            self.n = 0

        def on_train_batch_end(self, *args) -> None:
            self.n += 1  # the device is waited for at these steps only
            if self.n == 1:
                self.first = now()
            if self.n == warmup:
                self.start = now()
            if self.n == warmup + steps:
                self.end = now()

    clock = Clock()
    trainer = L.Trainer(
        accelerator="auto",
        devices=1,
        precision=precision,
        max_steps=warmup + steps,
        gradient_clip_val=cfg.trainer.gradient_clip_val,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock],
    )
    data = torch.utils.data.DataLoader(batches(model, cfg, warmup + steps), batch_size=None)
    t0 = now()
    trainer.fit(task, data)
    from torch._dynamo.utils import counters

    return {
        "cold_s": clock.first - t0,
        "step_ms": 1000 * (clock.end - clock.start) / steps,
        "graphs": int(counters["stats"]["unique_graphs"]),
        "precision": str(precision),
    }


def run_child(model: str, variant: str, args: argparse.Namespace) -> dict:
    """One setting in a fresh process with an empty inductor cache: a cold start."""
    with tempfile.TemporaryDirectory() as cache:
        env = {
            **os.environ,
            "TORCHINDUCTOR_CACHE_DIR": cache,
            "TRITON_CACHE_DIR": str(Path(cache) / "triton"),
        }
        cmd = [sys.executable, __file__, "--child", model, variant, "--steps", str(args.steps)]
        cmd += ["--warmup", str(args.warmup), "--precision", args.precision] + (
            ["--smoke"] if args.smoke else []
        )
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.stderr.write(proc.stderr[-3000:])
        raise SystemExit(f"error: {model} with model.optim.compile={variant} failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument(
        "--variants",
        nargs="+",
        default=None,
        help="model.optim.compile[:model.optim.compile_mode] each; default: false true regional, and with "
        "reduce-overhead (CUDA graphs) on a GPU",
    )
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 50; 3 with --smoke)")
    parser.add_argument("--warmup", type=int, default=None, help="steps before timing (default 10; 2)")
    parser.add_argument("--smoke", action="store_true", help="tiny nets and a few steps: check it works")
    parser.add_argument(
        "--precision", default="auto", help="trainer.precision (auto: as attnlab-train picks it)"
    )
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.steps = args.steps or (3 if args.smoke else 50)
    args.warmup = max(2, args.warmup or (2 if args.smoke else 10))
    if args.child:
        print(json.dumps(child(*args.child, args.steps, args.warmup, args.smoke, args.precision)))
        return

    import torch

    from attnlab.core.hardware import cpu_model

    cuda = torch.cuda.is_available()
    variants = args.variants or DEFAULT_VARIANTS + (GPU_VARIANTS if cuda else [])
    for variant in variants:
        parse_variant(variant)
    rows = []
    for model in args.models:
        for variant in variants:
            result = run_child(model, variant, args)
            rows.append((model, variant, result))
            print(f"{model} {variant}: {result}", file=sys.stderr, flush=True)
    machine = torch.cuda.get_device_name() if cuda else f"{cpu_model()}, {torch.get_num_threads()} threads"
    print(
        f"\nmodel.optim.compile, {machine}, torch {torch.__version__}, {rows[0][2]['precision']}, "
        f"{args.steps} steps timed after {args.warmup}{' (smoke: tiny nets)' if args.smoke else ''}\n"
    )
    print("| model | model.optim.compile | cold start (s) | step (ms) | step vs eager | graphs compiled |")
    print("|---|---|---:|---:|---:|---:|")
    eager = {m: r["step_ms"] for m, v, r in rows if v == "false"}
    for model, variant, r in rows:
        ratio = f"{r['step_ms'] / eager[model]:.2f}x" if model in eager else "-"
        cells = [MODELS[model][0], variant, f"{r['cold_s']:.2f}", f"{r['step_ms']:.1f}", ratio, r["graphs"]]
        print("| " + " | ".join(map(str, cells)) + " |")


if __name__ == "__main__":
    main()
