"""Prepare data of any size for training that reads it as it goes: a text corpus tokenised into
shards (GPT's tokens, BERT's documents, translation pairs), an image folder or image-caption
pairs written into tar shards (webdataset's layout, as open_clip reads them).

examples:
  attnlab-prepare ../shared/data/tinyshakespeare/input.txt --out shards/shakespeare_char
  attnlab-prepare 'corpus/**/*.txt' --out shards/corpus_bpe --tokenizer bpe --vocab-size 8192 --workers 2
  attnlab-train experiment=gpt_shakespeare_char data=token_shards data.source.path=shards/shakespeare_char

  attnlab-prepare --mode bert 'wiki/*.txt' --out shards/wiki --vocab-size 8000 --val-docs 2000
  attnlab-train experiment=bert_pretrain_sst2 data=bert_shards data.source.path=shards/wiki

  attnlab-prepare --mode translation wmt.tsv --src-lang de --tgt-lang en --out shards/de_en
  attnlab-prepare --mode translation corpus/train --src-lang de --tgt-lang en --out shards/de_en
  attnlab-train experiment=nmt_transformer_multi30k data=translation_shards data.source.path=shards/de_en

  attnlab-prepare --mode images path/to/image_folder --out shards/pets     # train/<class>/<image>
  attnlab-prepare --mode pairs captions.csv --out shards/captions          # image,caption rows

--mode lm (GPT): the first --val-tokens tokens validate and the next --test-tokens are the test
split; the rest trains. --mode bert (one sentence per line, documents separated by blank lines,
WordPiece): the first --val-docs documents, then --test-docs. --mode translation (joint BPE): a
.tsv (source<TAB>target), a .jsonl ({"de": ..., "en": ...}) or a prefix of two aligned files
(corpus/train reads corpus/train.de and corpus/train.en); the first --val-pairs pairs, then
--test-pairs. Text shards hold uint16 ids while the vocabulary fits. --mode images|pairs:
key.jpg + key.cls (images) or key.jpg + key.txt (pairs) in tar files of --shard-records records;
--val-size training records are carved out (seeded) to validate; test/ (or --test-file) is the
test split. Every folder gets a manifest.json (the tokenizer, counts, sha256 of each file, the
sources). A prepare writes into <out>.partial, moved into place at the end: a failed one removes
it, a killed one leaves it for the next to remove; a second prepare into an --out being written is
refused. --vocab-size is at most 1048576; a vocabulary raised to hold the special tokens and the
alphabet is noted.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from attnlab.cli.common import arg_parser, exit_on_user_error

IMAGES = {"val_size": 1000, "shard_records": 10_000, "on_bad_record": "error", "seed": 1337}
# the options of some modes only, with their defaults there
MODE_OPTIONS = {
    "lm": {"tokenizer": "char", "val_tokens": 100_000, "test_tokens": 100_000},
    "bert": {"val_docs": 2000, "test_docs": 2000},
    "translation": {"src_lang": None, "tgt_lang": None, "val_pairs": 1000, "test_pairs": 1000},
    "images": IMAGES,
    "pairs": {**IMAGES, "test_file": None, "image_key": "image", "caption_key": "caption"},
}
TEXT_OPTIONS = {"vocab_size": None, "shard_tokens": 100_000_000, "workers": 1}
for mode in ("lm", "bert", "translation"):
    MODE_OPTIONS[mode] = {**MODE_OPTIONS[mode], **TEXT_OPTIONS}
VOCAB_SIZE = {"lm": 1024, "bert": 8000, "translation": 8000}
UNITS = {"lm": "tokens", "bert": "documents", "translation": "pairs"}
# attnlab.data.text.shards.MAX_VOCAB_SIZE, restated: this module imports no torch (a test checks both)
MAX_VOCAB_SIZE = 1 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = arg_parser("attnlab-prepare", __doc__)
    p.add_argument(
        "inputs", nargs="+", help="files or globs (quoted: 'corpus/**/*.txt'), UTF-8; images: one folder"
    )
    p.add_argument("--out", required=True, help="the folder to create (must not exist or be empty)")
    p.add_argument(
        "--mode", choices=list(MODE_OPTIONS), default="lm", help="for GPT, BERT, translation, images, CLIP"
    )
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
    p.add_argument("--shard-tokens", type=int, help="text: tokens per shard, about (100000000)")
    p.add_argument("--workers", type=int, help="text: tokenising processes (1)")
    p.add_argument(
        "--val-size", type=int, help="images, pairs: training records carved out to validate (1000)"
    )
    p.add_argument("--shard-records", type=int, help="images, pairs: records per tar file (10000)")
    p.add_argument(
        "--on-bad-record", choices=["error", "skip"], help="images, pairs: an image that does not decode"
    )
    p.add_argument("--seed", type=int, help="images, pairs: of the validation split (1337)")
    p.add_argument("--test-file", help="pairs: rows of the test split (default: none)")
    p.add_argument("--image-key", help="pairs: the image column (image)")
    p.add_argument("--caption-key", help="pairs: the caption column (caption)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p.parse_args(argv)


def mode_options(args: argparse.Namespace) -> dict:
    """The options of ``args.mode`` with their defaults; another mode's option is refused."""
    from attnlab.core.errors import ConfigError

    ours = MODE_OPTIONS[args.mode]
    for name in {n for options in MODE_OPTIONS.values() for n in options} - ours.keys():
        if getattr(args, name) is not None:
            modes = " or ".join(m for m, options in MODE_OPTIONS.items() if name in options)
            raise ConfigError(f"--{name.replace('_', '-')} is for --mode {modes}, not --mode {args.mode}")
    out = {k: d if getattr(args, k) is None else getattr(args, k) for k, d in ours.items()}
    check_text_options(args, out)
    for name in ("src_lang", "tgt_lang"):
        if name in out and out[name] is None:
            raise ConfigError(f"--mode translation needs --{name.replace('_', '-')} (e.g. de, en)")
    if args.mode in ("images", "pairs") and len(args.inputs) != 1:
        what = "folder (train/<class>/...)" if args.mode == "images" else "CSV or JSONL file"
        raise ConfigError(f"--mode {args.mode} takes one {what}, not {len(args.inputs)} inputs")
    return out


def check_text_options(args: argparse.Namespace, options: dict) -> None:
    """The text modes' counts, checked before anything is read (what argparse's ``int`` lets by)."""
    from attnlab.core.errors import ConfigError

    if "workers" in options and options["workers"] < 1:
        raise ConfigError(f"--workers must be a positive integer (tokenising processes), got {args.workers}")
    if args.vocab_size is None:
        return
    if options.get("tokenizer") == "char":
        raise ConfigError("--vocab-size is for --tokenizer bpe: a char vocabulary is the corpus's characters")
    if not 1 <= args.vocab_size <= MAX_VOCAB_SIZE:
        raise ConfigError(f"--vocab-size must be from 1 to {MAX_VOCAB_SIZE}, got {args.vocab_size}")


def vocabulary_note(asked: int, manifest: dict) -> str | None:
    """A line when the trainer made the vocabulary larger than ``--vocab-size``."""
    if manifest["vocab_size"] <= asked:
        return None
    return (
        f"note: the vocabulary holds {manifest['vocab_size']} entries, not --vocab-size {asked}: "
        "raised to hold the special tokens and the alphabet (every byte or character) before any merge"
    )


def prepare_text(args: argparse.Namespace, options: dict) -> str:
    options["vocab_size"] = options["vocab_size"] or VOCAB_SIZE[args.mode]
    options["progress"] = not args.no_progress
    t0 = time.perf_counter()  # the import of the tokenisers included, as a user waits for it
    from attnlab.data.text import shards

    write = {"lm": shards.prepare, "bert": shards.prepare_documents, "translation": shards.prepare_pairs}
    manifest = write[args.mode](args.inputs, args.out, **options)
    unit = UNITS[args.mode]  # a split: its shards, or (translation's val and test) one file
    counts = {
        s: v[unit] if isinstance(v, dict) else sum(x[unit] for x in v) for s, v in manifest["splits"].items()
    }
    seconds = time.perf_counter() - t0
    if options.get("tokenizer") != "char" and (note := vocabulary_note(options["vocab_size"], manifest)):
        print(note, file=sys.stderr)
    size = sum(s["bytes"] for s in manifest["sources"])
    return (
        f"{args.out}: {counts['train']} train / {counts['val']} val / {counts['test']} test "
        f"{UNITS[args.mode]} ({manifest['dtype']}, vocab {manifest['vocab_size']}) from "
        f"{size / 1e6:.1f} MB in {seconds:.1f} s ({size / 1e6 / max(seconds, 1e-9):.2f} MB/s)"
    )


def prepare_images(args: argparse.Namespace, options: dict) -> str:
    from attnlab.data.shards.writer import writing

    if args.mode == "images":
        from attnlab.data.vision.shards import prepare_images as write
    else:
        from attnlab.data.multimodal.image_text import prepare_image_text as write
    t0 = time.perf_counter()
    with writing(Path(args.out)):  # one prepare at a time into --out; a failed one leaves nothing
        manifest = write(args.inputs[0], args.out, **options)
    seconds = time.perf_counter() - t0
    counts = {s: sum(e["count"] for e in entries) for s, entries in manifest["splits"].items()}
    size = sum(e["bytes"] for entries in manifest["splits"].values() for e in entries)
    skipped = f", {len(manifest['skipped'])} unreadable images skipped" if manifest["skipped"] else ""
    return (
        f"{args.out}: {counts['train']} train / {counts['val']} val / {counts['test']} test records in "
        f"{sum(len(e) for e in manifest['splits'].values())} shards ({size / 1e6:.1f} MB) in "
        f"{seconds:.1f} s ({sum(counts.values()) / max(seconds, 1e-9):.0f} images/s){skipped}"
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    with exit_on_user_error(console=True):
        options = mode_options(args)
        print(
            prepare_images(args, options) if args.mode in ("images", "pairs") else prepare_text(args, options)
        )


if __name__ == "__main__":
    sys.exit(main())
