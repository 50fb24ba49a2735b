"""Prepare data of any size for training that reads it as it goes: a text corpus into token
shards, an image folder or image-caption pairs into tar shards (webdataset's layout).

examples:
  attnlab-prepare ../shared/data/tinyshakespeare/input.txt --out shards/shakespeare_char
  attnlab-prepare 'corpus/**/*.txt' --out shards/corpus_bpe --tokenizer bpe --vocab-size 8192 --workers 2
  attnlab-train experiment=gpt_shakespeare_char data.shards_dir=shards/shakespeare_char
  attnlab-prepare images path/to/image_folder --out shards/pets          # train/<class>/<image>
  attnlab-prepare pairs captions.csv --out shards/captions               # image,caption rows

Text: the first --val-tokens tokens validate and the next --test-tokens are the test split; the
rest trains. The folder gets one file per shard (uint16 ids while the vocabulary fits) and a
manifest.json (the tokenizer, counts, sha256 of each shard, the sources).
Images: key.jpg + key.cls (images) or key.jpg + key.txt (pairs) in tar files of --shard-records
records; --val-size training images are carved out (seeded) to validate; test/ (or --test-file)
is the test split; manifest.json holds the counts, classes and sha256 of each shard.
An interrupted prepare leaves only <out>.partial, which the next one removes.
"""

from __future__ import annotations

import argparse
import sys
import time

from attnlab.cli.common import exit_on_user_error

IMAGE_COMMANDS = ("images", "pairs")


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


def parse_image_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=f"attnlab-prepare {argv[0]}",
        description="Write images (an ImageFolder tree) or image-caption pairs (CSV/JSONL) into tar shards.",
    )
    p.add_argument("source", help="images: the folder with train/<class>/; pairs: the CSV or JSONL file")
    p.add_argument("--out", required=True, help="the folder to create (must not exist or be empty)")
    p.add_argument("--val-size", type=int, default=1000, help="training records carved out to validate")
    p.add_argument("--shard-records", type=int, default=10_000, help="records per tar file")
    p.add_argument(
        "--on-bad-record", choices=["error", "skip"], default="error", help="an image that does not decode"
    )
    p.add_argument("--seed", type=int, default=1337, help="of the validation split")
    if argv[0] == "pairs":
        p.add_argument("--test-file", default=None, help="rows of the test split (default: none)")
        p.add_argument("--image-key", default="image")
        p.add_argument("--caption-key", default="caption")
    args = p.parse_args(argv[1:])
    args.command = argv[0]
    return args


def prepare_images(args: argparse.Namespace) -> None:
    from attnlab.data.vision import shards

    t0 = time.perf_counter()
    common = dict(
        val_size=args.val_size,
        shard_records=args.shard_records,
        on_bad_record=args.on_bad_record,
        seed=args.seed,
    )
    if args.command == "images":
        manifest = shards.prepare_images(args.source, args.out, **common)
    else:
        manifest = shards.prepare_pairs(
            args.source,
            args.out,
            test_file=args.test_file,
            image_key=args.image_key,
            caption_key=args.caption_key,
            **common,
        )
    seconds = time.perf_counter() - t0
    counts = {s: sum(e["count"] for e in entries) for s, entries in manifest["splits"].items()}
    n = sum(counts.values())
    size = sum(e["bytes"] for entries in manifest["splits"].values() for e in entries)
    skipped = f", {len(manifest['skipped'])} unreadable images skipped" if manifest["skipped"] else ""
    print(
        f"{args.out}: {counts['train']} train / {counts['val']} val / {counts['test']} test records in "
        f"{sum(len(e) for e in manifest['splits'].values())} shards ({size / 1e6:.1f} MB) in "
        f"{seconds:.1f} s ({n / max(seconds, 1e-9):.0f} images/s){skipped}"
    )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in IMAGE_COMMANDS:
        args = parse_image_args(argv)
        with exit_on_user_error(console=True):
            prepare_images(args)
        return
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
