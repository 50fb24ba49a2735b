"""Translation from a parallel corpus of millions of lines: pair shards on disk against the
in-memory path.

Writes a de-en corpus of ``--lines`` pairs (made-up words of a seeded 5,000-word dictionary, the
target the source's words reversed through it: a vocabulary BPE has to work at), prepares it with
``attnlab-prepare --mode translation``'s code (lines/s and MB/s printed), then trains the
nmt_transformer_multi30k model for ``--steps`` steps, each run a fresh ``attnlab-train`` process:
from the shards (``data=translation_shards``) and, with ``--memory``, from the same pairs read
whole (the in-memory path, as Multi30k files in ``data.source.data_dir``). Prints each run's wall time and
peak resident memory (the largest of the process and its loader workers).

    uv run python benchmarks/translation_shards.py [--lines 3000000] [--steps 50] [--memory]
"""

from __future__ import annotations

import argparse
import itertools
import random
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

HELD_OUT = 500  # validation and test pairs each


def dictionary(n: int, rng: random.Random) -> list[tuple[str, str]]:
    """``n`` made-up (source, target) word pairs, each word three or four syllables."""
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ber", "gen", "schu", "ell", "tor", "an"]
    candidates = ["".join(p) for k in (3, 4) for p in itertools.product(syllables, repeat=k)]
    words = rng.sample(candidates, 2 * n)
    return list(zip(words[:n], words[n:], strict=True))


def write_corpus(folder: Path, lines: int, seed: int = 0) -> int:
    """``corpus.tsv`` and the same pairs as Multi30k's file names (for the in-memory run)."""
    rng = random.Random(seed)
    words = dictionary(5000, rng)
    folder.mkdir(parents=True, exist_ok=True)
    files = {
        name: open(folder / name, "w", encoding="utf-8") for name in ("corpus.tsv", "train.de", "train.en")
    }  # noqa: SIM115
    held = {split: ([], []) for split in ("val", "test_2016_flickr")}
    for i in range(lines):
        pairs = rng.choices(words, k=rng.randint(3, 20))
        de, en = " ".join(w for w, _ in pairs) + ".", " ".join(t for _, t in reversed(pairs)) + "."
        files["corpus.tsv"].write(f"{de}\t{en}\n")
        split = "val" if i < HELD_OUT else "test_2016_flickr" if i < 2 * HELD_OUT else None
        if split:
            held[split][0].append(de)
            held[split][1].append(en)
        else:
            files["train.de"].write(de + "\n")
            files["train.en"].write(en + "\n")
    for f in files.values():
        f.close()
    for split, (de, en) in held.items():
        (folder / f"{split}.de").write_text("\n".join(de) + "\n", encoding="utf-8")
        (folder / f"{split}.en").write_text("\n".join(en) + "\n", encoding="utf-8")
    return (folder / "corpus.tsv").stat().st_size


def train(data: list[str], steps: int, out: Path) -> tuple[float, float]:
    """Wall seconds and peak RSS (MB) of one training run in a fresh process."""
    argv = [sys.executable, "-m", "attnlab.cli.train", "experiment=nmt_transformer_multi30k", *data]
    argv += [
        f"trainer.max_steps={steps}",
        f"trainer.val_check_interval={steps}",
        "trainer.limit_val_batches=2",
        "model.val_bleu=false",  # greedy decoding of an untrained model: minutes, and no data reading
        "callbacks.model_checkpoint.monitor=val/loss",
        "callbacks.model_checkpoint.mode=min",
        "trainer.num_sanity_val_steps=0",
        "test=false",
        "logger=csv",
        f"paths.output_dir={out}",
        "extras.print_config=false",
        "~callbacks.rich_progress_bar",
        "trainer.enable_progress_bar=false",
    ]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"training failed:\n{proc.stderr[-3000:]}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if peak <= before:
        print("  (peak RSS not above an earlier run's: the figure below is that run's)")
    return seconds, peak / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=3_000_000)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--memory", action="store_true", help="also train from the pairs read whole")
    parser.add_argument("--workdir", default="/tmp/attnlab-translation-shards")
    parser.add_argument("--keep", action="store_true", help="keep the corpus and shards")
    args = parser.parse_args()

    from attnlab.core.hardware import cpu_model
    from attnlab.data.text.shards import prepare_pairs

    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    t0 = time.perf_counter()
    size = write_corpus(work / "corpus", args.lines)
    print(f"corpus: {args.lines} pairs, {size / 1e6:.0f} MB written in {time.perf_counter() - t0:.0f} s")
    t0 = time.perf_counter()
    prepare_pairs(
        [str(work / "corpus" / "corpus.tsv")],
        work / "shards",
        "de",
        "en",
        val_pairs=HELD_OUT,
        test_pairs=HELD_OUT,
        workers=args.workers,
        progress=False,
    )
    seconds = time.perf_counter() - t0
    print(
        f"prepare: {args.lines / seconds:,.0f} lines/s, {size / 1e6 / seconds:.1f} MB/s "
        f"({args.workers} workers, BPE trained on the first 100 MB included), {cpu_model()}"
    )
    runs = [("shards", ["data=translation_shards", f"data.source.path={work / 'shards'}"])]
    if args.memory:
        in_memory = [f"data.source.data_dir={work / 'corpus'}", f"data.source.cache_dir={work / 'cache'}"]
        runs.append(("in memory", in_memory))
    print(f"\nnmt_transformer_multi30k, {args.steps} steps (a fresh process each)")
    print(f"{'data':<12}{'wall s':>8}{'peak RSS':>12}")
    for name, data in runs:
        wall, rss = train(data, args.steps, work / f"run_{name.replace(' ', '_')}")
        print(f"{name:<12}{wall:>8.0f}{rss:>9.0f} MB")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
