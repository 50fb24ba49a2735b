"""Transformer training throughput against ``torch.nn.Transformer``, and beam-search speed.

1. Training target tokens/s (forward, label-smoothed loss, backward, AdamW) of
   ``attnlab.models.Transformer`` and of ``torch.nn.Transformer`` with the same size (d 256,
   8 heads, 3+3 layers, ff 1024, dropout 0.1, tied 8k vocabulary), batch and length, side by
   side in fp32 and under bf16 autocast, printed as ratios. Both use the same loss function:
   compiled, as the Multi30k experiment trains (``--loss eager`` for plain ``F.cross_entropy``).
2. Beam-5 (and greedy) decoding sentences/s on Multi30k test_2016_flickr, with a trained
   checkpoint (``--ckpt``) or, without one, a model with random weights (slower: its outputs run
   to the length limit).

Run it alone: a busy second core slows torch's two threads.

    uv run python benchmarks/nmt_train.py [--data-dir ../shared/data/multi30k] [--ckpt last]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import Tensor, nn

from attnlab.core.hardware import cpu_model, native_bf16_cpu
from attnlab.models import Transformer
from attnlab.nn import SinusoidalPositions
from attnlab.training.translation import cross_entropy

SIZE = {"dim": 256, "n_head": 8, "depth": 3, "mlp_ratio": 4.0, "dropout": 0.1, "vocab": 8000}


class TorchTransformer(nn.Module):
    """``nn.Transformer`` with the same embeddings, positions and tied output layer as ours."""

    def __init__(self) -> None:
        super().__init__()
        d = SIZE["dim"]
        self.emb = nn.Embedding(SIZE["vocab"], d)
        self.pos = SinusoidalPositions(d, 256)
        self.drop = nn.Dropout(SIZE["dropout"])
        self.core = nn.Transformer(
            d,
            SIZE["n_head"],
            SIZE["depth"],
            SIZE["depth"],
            int(SIZE["mlp_ratio"] * d),
            SIZE["dropout"],
            batch_first=True,
        )
        self.out = nn.Linear(d, SIZE["vocab"], bias=False)
        self.out.weight = self.emb.weight

    def _embed(self, x: Tensor) -> Tensor:
        return self.drop(self.emb(x) * math.sqrt(self.emb.embedding_dim) + self.pos(x.size(1)))

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tgt_in.size(1))
        return self.out(self.core(self._embed(src), self._embed(tgt_in), tgt_mask=mask, tgt_is_causal=True))


def ours() -> nn.Module:
    return Transformer(
        SIZE["vocab"],
        0,
        dim=SIZE["dim"],
        n_head=SIZE["n_head"],
        enc_depth=SIZE["depth"],
        dec_depth=SIZE["depth"],
        mlp_ratio=SIZE["mlp_ratio"],
        dropout=SIZE["dropout"],
    )


def train_tokens_per_s(
    net: nn.Module, loss_fn: Callable, bf16: bool, batch: int, length: int, steps: int
) -> float:
    torch.manual_seed(0)
    net.train()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
    src = torch.randint(4, SIZE["vocab"], (batch, length))
    tgt = torch.randint(4, SIZE["vocab"], (batch, length + 1))
    times = []
    for i in range(steps + 3):
        t0 = time.perf_counter()
        with torch.autocast("cpu", torch.bfloat16) if bf16 else nullcontext():
            logits = net(src, tgt[:, :-1])
        loss = loss_fn(logits.flatten(0, 1), tgt[:, 1:].flatten(), 0.1)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return batch * length / statistics.median(times)


def decoding(args: argparse.Namespace, with_bf16: bool) -> None:
    from attnlab.data.sources import Builtin
    from attnlab.data.text.translation import TranslationDataModule, read_parallel
    from attnlab.inference.runs import TrainedRun
    from attnlab.inference.translation import translate_sentences

    data = Path(args.data_dir)
    src, _ = read_parallel(data / "test_2016_flickr.de", data / "test_2016_flickr.en")
    if args.ckpt:
        run = TrainedRun(args.ckpt, Path("logs"))
        net, tok, what = run.net(), run.tokenizer, f"checkpoint {run.path}"
    else:
        dm = TranslationDataModule(Builtin("multi30k", data_dir=str(data), cache_dir="data"))
        dm.setup()
        torch.manual_seed(0)
        net, tok, what = ours().eval(), dm.tokenizer, "random weights (outputs run to the length limit)"
    src = src[: args.sentences]
    print(f"\ndecoding {len(src)} test_2016_flickr sentences, {what}")
    for beam in (1, 5):
        for bf16 in (False, True)[: 1 + with_bf16]:
            t0 = time.perf_counter()
            with torch.autocast("cpu", torch.bfloat16) if bf16 else nullcontext():
                translate_sentences(net, tok, src, beam_size=beam)
            dt = time.perf_counter() - t0
            name = "greedy" if beam == 1 else f"beam {beam}"
            print(f"{name:<8} {'bf16' if bf16 else 'fp32':<5} {len(src) / dt:8.1f} sentences/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--length", type=int, default=32)
    p.add_argument("--data-dir", default=None, help="Multi30k files, for the decoding benchmark")
    p.add_argument("--ckpt", default=None, help="a trained translation checkpoint (decoding)")
    p.add_argument("--sentences", type=int, default=1000)
    p.add_argument(
        "--loss",
        choices=["compiled", "eager"],
        default="compiled",
        help="the label-smoothed cross-entropy, for both models",
    )
    p.add_argument(
        "--bf16", action="store_true", help="measure bf16 also on a CPU without native bf16 (it crawls there)"
    )
    args = p.parse_args()
    runs = [(False, 1.0)]
    if args.bf16 or native_bf16_cpu():
        runs.append((True, 2.0))
    else:
        print(f"{cpu_model()} has no native bf16: fp32 only (--bf16 to measure it anyway)")
    torch.set_float32_matmul_precision("high")

    loss_fn = torch.compile(cross_entropy, dynamic=True) if args.loss == "compiled" else cross_entropy
    threads = torch.get_num_threads()
    print(
        f"training, batch {args.batch} x length {args.length}, {args.steps} steps, {threads} threads, "
        f"{args.loss} loss"
    )
    print(f"{'precision':<10} {'attnlab tok/s':>14} {'nn.Transformer':>15} {'ratio':>7} {'goal':>6}")
    results = {}
    for bf16, goal in runs:
        a = train_tokens_per_s(ours(), loss_fn, bf16, args.batch, args.length, args.steps)
        r = train_tokens_per_s(TorchTransformer(), loss_fn, bf16, args.batch, args.length, args.steps)
        results[bf16] = (a, r)
        verdict = "ok" if a / r >= goal else "MISSED"
        name = "bf16-mixed" if bf16 else "32-true"
        print(f"{name:<10} {a:14.0f} {r:15.0f} {a / r:7.2f} {goal:5.1f}x {verdict}")
    if True in results:
        print(
            f"bf16 speed-up over fp32: attnlab {results[True][0] / results[False][0]:.2f}x, "
            f"nn.Transformer {results[True][1] / results[False][1]:.2f}x"
        )
    if args.data_dir:
        decoding(args, with_bf16=len(runs) == 2)


if __name__ == "__main__":
    main()
