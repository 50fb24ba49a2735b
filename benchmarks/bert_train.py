"""Training tokens/s of our BERT encoder against ``torch.nn.TransformerEncoder`` of the same size,
side by side in one run, in fp32 and (where the CPU multiplies bf16 natively, or with --bf16)
under bf16 autocast.

Both are the BERT-Mini shape of the SST-2 experiments (model/bert/mini: width 256, 4 post-LN
layers, 4 heads, MLP 1024, GELU, vocabulary 8,000) with the same embeddings (token + position +
segment, LayerNorm) and a sentence-classification head: forward, cross-entropy, backward and a
fused AdamW step on random batches of padded sentences (lengths 8-64, padding masked). Tokens
counted are the real ones. Goal: ours at least as fast as the reference (ratio >= 1.0).

Run it alone: a busy second core slows torch's two threads.

    uv run python benchmarks/bert_train.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.core.hardware import cpu_model, native_bf16_cpu
from attnlab.models import Bert, BertSequenceClassifier

SHAPE = dict(dim=256, depth=4, n_head=4, mlp_ratio=4.0, max_len=128)
VOCAB = 8000


class TorchEncoderClassifier(nn.Module):
    """The reference: BERT's embeddings and head around ``nn.TransformerEncoder`` (post-LN, GELU)."""

    def __init__(self, vocab: int, dim: int, depth: int, n_head: int, mlp_ratio: float, max_len: int) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.segments, self.norm = nn.Embedding(2, dim), nn.LayerNorm(dim, eps=1e-12)
        layer = nn.TransformerEncoderLayer(
            dim,
            n_head,
            int(mlp_ratio * dim),
            dropout=0.1,
            activation="gelu",
            layer_norm_eps=1e-12,
            batch_first=True,
        )
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.pooler, self.head, self.drop = nn.Linear(dim, dim), nn.Linear(dim, 2), nn.Dropout(0.1)

    def forward(self, ids: Tensor, segments: Tensor) -> Tensor:
        pos = self.positions(torch.arange(ids.size(1)))
        x = self.drop(self.norm(self.tokens(ids) + pos + self.segments(segments)))
        x = self.encoder(x, src_key_padding_mask=ids == 0)
        return self.head(self.drop(self.pooler(x[:, 0]).tanh()))


def batch_of_sentences(batch: int, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, int]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 65, (batch,), generator=g)
    ids = torch.randint(5, VOCAB, (batch, int(lengths.max())), generator=g)
    ids[torch.arange(ids.size(1)) >= lengths[:, None]] = 0
    return ids, torch.zeros_like(ids), torch.randint(0, 2, (batch,), generator=g), int(lengths.sum())


def tokens_per_s(net: nn.Module, bf16: bool, batch: int, steps: int) -> float:
    torch.manual_seed(0)
    net.train()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
    ids, segments, labels, n_tokens = batch_of_sentences(batch)
    times = []
    for i in range(steps + 3):
        t0 = time.perf_counter()
        with torch.autocast("cpu", torch.bfloat16) if bf16 else nullcontext():
            logits = net(ids, segments)
        F.cross_entropy(logits.float(), labels).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return n_tokens / statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument(
        "--bf16", action="store_true", help="measure bf16 also on a CPU without native bf16 (it crawls)"
    )
    args = p.parse_args()
    precisions = [False]
    if args.bf16 or native_bf16_cpu():
        precisions.append(True)
    else:
        print(f"{cpu_model()} has no native bf16: fp32 only (--bf16 to measure it anyway)")
    torch.set_float32_matmul_precision("high")
    print(
        f"training tokens/s, BERT-Mini shape, batch {args.batch} sentences of 8-64 tokens, "
        f"{args.steps} steps, {torch.get_num_threads()} threads, {cpu_model()}"
    )
    print(f"{'precision':<10} {'attnlab':>9} {'torch':>9} {'ratio':>7} {'goal':>6}")
    for bf16 in precisions:
        ours = tokens_per_s(BertSequenceClassifier(Bert(VOCAB, 0, **SHAPE), 2), bf16, args.batch, args.steps)
        ref = tokens_per_s(TorchEncoderClassifier(VOCAB, **SHAPE), bf16, args.batch, args.steps)
        verdict = "ok" if ours / ref >= 1.0 else "MISSED"
        print(
            f"{'bf16-mixed' if bf16 else '32-true':<10} {ours:9.0f} {ref:9.0f} {ours / ref:7.2f} "
            f"{1.0:5.1f}x {verdict}"
        )


if __name__ == "__main__":
    main()
