"""Tokenise a corpus of any size into token shards on disk, for training that reads them as it goes.

examples:
  attnlab-prepare ../shared/data/tinyshakespeare/input.txt --out shards/shakespeare_char
  attnlab-prepare 'corpus/**/*.txt' --out shards/corpus_bpe --tokenizer bpe --vocab-size 8192 --workers 2
  attnlab-train experiment=gpt_shakespeare_char data.shards_dir=shards/shakespeare_char

The first --val-tokens tokens validate and the next --test-tokens are the test split; the rest
trains. The folder gets one file per shard (uint16 ids while the vocabulary fits) and a
manifest.json (the tokenizer, counts, sha256 of each shard, the sources). An interrupted
prepare leaves only <out>.partial, which the next one removes.
"""

from __future__ import annotations

import argparse
import sys
import time

from attnlab.cli.common import exit_on_user_error


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="attnlab-prepare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("inputs", nargs="+", help="text files or globs (quoted: 'corpus/**/*.txt'), UTF-8")
    p.add_argument("--out", required=True, help="the folder to create (must not exist or be empty)")
    p.add_argument("--tokenizer", choices=["char", "bpe"], default="char")
    p.add_argument("--vocab-size", type=int, default=1024, help="BPE vocabulary size")
    p.add_argument("--val-tokens", type=int, default=100_000)
    p.add_argument("--test-tokens", type=int, default=100_000)
    p.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard file")
    p.add_argument("--workers", type=int, default=1, help="tokenising processes")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with exit_on_user_error(console=True):
        from attnlab.data.text.shards import prepare

        t0 = time.perf_counter()
        manifest = prepare(
            args.inputs,
            args.out,
            tokenizer=args.tokenizer,
            vocab_size=args.vocab_size,
            val_tokens=args.val_tokens,
            test_tokens=args.test_tokens,
            shard_tokens=args.shard_tokens,
            workers=args.workers,
            progress=not args.no_progress,
        )
        seconds = time.perf_counter() - t0
        size = sum(s["bytes"] for s in manifest["sources"])
        counts = {split: sum(s["tokens"] for s in shards) for split, shards in manifest["splits"].items()}
        print(
            f"{args.out}: {counts['train']} train / {counts['val']} val / {counts['test']} test tokens "
            f"({manifest['dtype']}, vocab {manifest['vocab_size']}) from {size / 1e6:.1f} MB in "
            f"{seconds:.1f} s ({size / 1e6 / max(seconds, 1e-9):.2f} MB/s)"
        )


if __name__ == "__main__":
    sys.exit(main())
