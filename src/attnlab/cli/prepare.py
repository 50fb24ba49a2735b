"""Tokenise a corpus of any size into shards on disk, for training that reads them as it goes.

examples:
  attnlab-prepare ../shared/data/tinyshakespeare/input.txt --out shards/shakespeare_char
  attnlab-prepare 'corpus/**/*.txt' --out shards/corpus_bpe --tokenizer bpe --vocab-size 8192 --workers 2
  attnlab-train experiment=gpt_shakespeare_char data.shards_dir=shards/shakespeare_char

  attnlab-prepare --mode bert 'wiki/*.txt' --out shards/wiki --vocab-size 8000 --val-docs 2000
  attnlab-train experiment=bert_pretrain_sst2 data=bert_shards data.shards_dir=shards/wiki

  attnlab-prepare --mode translation wmt.tsv --src-lang de --tgt-lang en --out shards/de_en
  attnlab-prepare --mode translation corpus/train --src-lang de --tgt-lang en --out shards/de_en
  attnlab-train experiment=nmt_transformer_multi30k data=translation_shards data.shards_dir=shards/de_en

--mode lm (GPT): the first --val-tokens tokens validate and the next --test-tokens are the test
split; the rest trains. --mode bert (one sentence per line, documents separated by blank lines,
WordPiece): the first --val-docs documents, then --test-docs. --mode translation (joint BPE): a
.tsv (source<TAB>target), a .jsonl ({"de": ..., "en": ...}) or a prefix of two aligned files
(corpus/train reads corpus/train.de and corpus/train.en); the first --val-pairs pairs, then
--test-pairs. The folder gets the shards (uint16 ids while the vocabulary fits) and a
manifest.json (the tokenizer, counts, sha256 of each file, the sources). An interrupted prepare
leaves only <out>.partial, which the next one removes.
"""

from __future__ import annotations

import argparse
import sys
import time

from attnlab.cli.common import exit_on_user_error

# the options of one mode only, with their defaults there
MODE_OPTIONS = {
    "lm": {"tokenizer": "char", "val_tokens": 100_000, "test_tokens": 100_000},
    "bert": {"val_docs": 2000, "test_docs": 2000},
    "translation": {"src_lang": None, "tgt_lang": None, "val_pairs": 1000, "test_pairs": 1000},
}
VOCAB_SIZE = {"lm": 1024, "bert": 8000, "translation": 8000}
UNITS = {"lm": "tokens", "bert": "documents", "translation": "pairs"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="attnlab-prepare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("inputs", nargs="+", help="files or globs (quoted: 'corpus/**/*.txt'), UTF-8")
    p.add_argument("--out", required=True, help="the folder to create (must not exist or be empty)")
    p.add_argument("--mode", choices=sorted(MODE_OPTIONS), default="lm", help="for GPT, BERT or translation")
    p.add_argument("--tokenizer", choices=["char", "bpe"], help="lm: char (default) or byte-level BPE")
    p.add_argument("--vocab-size", type=int, help="BPE / WordPiece vocabulary size (lm 1024, else 8000)")
    p.add_argument("--val-tokens", type=int, help="lm (100000)")
    p.add_argument("--test-tokens", type=int, help="lm (100000)")
    p.add_argument("--val-docs", type=int, help="bert (2000)")
    p.add_argument("--test-docs", type=int, help="bert (2000)")
    p.add_argument("--src-lang", help="translation: the source language, e.g. de")
    p.add_argument("--tgt-lang", help="translation: the target language, e.g. en")
    p.add_argument("--val-pairs", type=int, help="translation (1000)")
    p.add_argument("--test-pairs", type=int, help="translation (1000)")
    p.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard (about)")
    p.add_argument("--workers", type=int, default=1, help="tokenising processes")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p.parse_args(argv)


def mode_options(args: argparse.Namespace) -> dict:
    """The options of ``args.mode`` with their defaults; another mode's option is refused."""
    from attnlab.errors import ConfigError

    for mode, options in MODE_OPTIONS.items():
        for name in options:
            if mode != args.mode and getattr(args, name) is not None:
                raise ConfigError(f"--{name.replace('_', '-')} is for --mode {mode}, not --mode {args.mode}")
    out = {k: d if getattr(args, k) is None else getattr(args, k) for k, d in MODE_OPTIONS[args.mode].items()}
    for name in ("src_lang", "tgt_lang"):
        if name in out and out[name] is None:
            raise ConfigError(f"--mode translation needs --{name.replace('_', '-')} (e.g. de, en)")
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with exit_on_user_error(console=True):
        options = mode_options(args)
        common = {
            "vocab_size": args.vocab_size or VOCAB_SIZE[args.mode],
            "shard_tokens": args.shard_tokens,
            "workers": args.workers,
            "progress": not args.no_progress,
        }
        t0 = time.perf_counter()
        if args.mode == "lm":
            from attnlab.data.text.shards import prepare

            manifest = prepare(args.inputs, args.out, **options, **common)
            counts = {s: sum(x["tokens"] for x in shards) for s, shards in manifest["splits"].items()}
        elif args.mode == "bert":
            from attnlab.data.text.document_shards import prepare_documents

            manifest = prepare_documents(args.inputs, args.out, **options, **common)
            counts = {s: sum(x["documents"] for x in shards) for s, shards in manifest["splits"].items()}
        else:
            from attnlab.data.text.pair_shards import prepare_pairs

            manifest = prepare_pairs(args.inputs, args.out, **options, **common)
            splits = manifest["splits"]
            counts = {"train": sum(x["pairs"] for x in splits["train"]), "val": splits["val"]["pairs"]}
            counts["test"] = splits["test"]["pairs"]
        seconds = time.perf_counter() - t0
        size = sum(s["bytes"] for s in manifest["sources"])
        print(
            f"{args.out}: {counts['train']} train / {counts['val']} val / {counts['test']} test "
            f"{UNITS[args.mode]} ({manifest['dtype']}, vocab {manifest['vocab_size']}) from "
            f"{size / 1e6:.1f} MB in {seconds:.1f} s ({size / 1e6 / max(seconds, 1e-9):.2f} MB/s)"
        )


if __name__ == "__main__":
    sys.exit(main())
