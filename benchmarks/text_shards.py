"""A GPT on a corpus larger than memory: token shards on disk against the in-memory corpus.

Writes a corpus of ``--gb`` GB (Python's reference manual, its paragraphs recombined in a seeded
random order), tokenises it with ``attnlab-prepare``'s code (MB/s printed), then trains the
gpt_shakespeare_char model for ``--steps`` steps twice, each in a fresh process: from the shards
(``data=token_shards``) and from the in-memory pydoc corpus. Prints ms per step, tokens/s and the
peak resident memory of each training process, and the ratios (goals: shards >= 0.95x the
in-memory tokens/s; peak RSS < 1.5 GB on the shards).

    uv run python benchmarks/text_shards.py [--gb 4] [--steps 300] [--workdir /tmp/attnlab-shards]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path


def write_corpus(path: Path, gb: float, seed: int = 0) -> int:
    from attnlab.data.text.corpora import python_docs

    paragraphs = [p for p in python_docs().split("\n\n") if p.strip()]
    rng, target, size = random.Random(seed), int(gb * 1e9), 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        while size < target:
            block = "\n\n".join(rng.choices(paragraphs, k=2000)) + "\n\n"
            f.write(block)
            size += len(block.encode())
    return size


def child(mode: str, shards: str, steps: int, warmup: int) -> None:
    """One training run in this process (gpt_train's, fp32); prints a JSON line with its timing
    and peak RSS."""
    from gpt_train import attnlab_ms  # benchmarks/, beside this file
    from hydra import compose, initialize_config_dir

    from attnlab.cli.common import config_dir

    overrides = ["experiment=gpt_shakespeare_char", "paths.output_dir=/tmp/attnlab-shards-run"]
    overrides += (
        ["data=token_shards", f"data.source.path={shards}"] if mode == "shards" else ["data/source=pydoc"]
    )
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    ms = attnlab_ms(cfg, "32-true", steps, warmup)
    tokens = cfg.data.batch_size * cfg.data.max_len
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"mode": mode, "ms": ms, "tokens_per_s": tokens / ms * 1000, "rss_mb": rss_mb}))


def run_child(mode: str, shards: Path, steps: int, warmup: int) -> dict:
    argv = [sys.executable, __file__, "--child", mode, "--shards", str(shards)]
    argv += ["--steps", str(steps), "--warmup", str(warmup)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=4.0)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--workdir", default="/tmp/attnlab-shards")
    parser.add_argument("--keep", action="store_true", help="keep the corpus and shards")
    parser.add_argument("--child", choices=["shards", "memory"], help=argparse.SUPPRESS)
    parser.add_argument("--shards", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.shards, args.steps, args.warmup)

    from attnlab.core.hardware import cpu_model
    from attnlab.data.text.shards import prepare

    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    corpus, shards = work / "corpus.txt", work / "shards"
    t0 = time.perf_counter()
    size = write_corpus(corpus, args.gb)
    print(f"corpus: {size / 1e9:.2f} GB written in {time.perf_counter() - t0:.0f} s")
    t0 = time.perf_counter()
    manifest = prepare([str(corpus)], shards, workers=args.workers, progress=False)
    seconds = time.perf_counter() - t0
    train_tokens = sum(s["tokens"] for s in manifest["splits"]["train"])
    print(
        f"prepare: {train_tokens / 1e9:.2f} G training tokens in {seconds:.0f} s, "
        f"{size / 1e6 / seconds:.1f} MB/s of text ({args.workers} workers)"
    )
    memory = run_child("memory", shards, args.steps, args.warmup)
    on_disk = run_child("shards", shards, args.steps, args.warmup)
    ratio = on_disk["tokens_per_s"] / memory["tokens_per_s"]
    print(f"\nGPT (gpt_shakespeare_char model), fp32, {args.steps} steps, {cpu_model()}")
    print(f"{'data':<24}{'ms/step':>9}{'tokens/s':>10}{'peak RSS':>11}")
    for name, r in (("in memory (pydoc)", memory), (f"shards ({size / 1e9:.1f} GB)", on_disk)):
        print(f"{name:<24}{r['ms']:>9.1f}{r['tokens_per_s']:>10.0f}{r['rss_mb']:>8.0f} MB")
    print(f"shards / in memory: {ratio:.2f}x tokens/s (goal >= 0.95: {'ok' if ratio >= 0.95 else 'MISSED'})")
    rss_ok = on_disk["rss_mb"] < 1536
    print(f"peak RSS on shards: {on_disk['rss_mb']:.0f} MB (goal < 1536: {'ok' if rss_ok else 'MISSED'})")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
