"""``attnlab-prepare`` when things go wrong: a bad count, an empty corpus, a full disk, an
unwritable --out, a second prepare into the same --out, parallel files of different lengths. Each is
one ``error:`` line with exit status 2 (or a ``note:`` where the input is usable), and nothing is
left behind that blocks the same command. In-process through ``attnlab.cli.prepare.main``."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from attnlab.cli import prepare as cli
from attnlab.core.errors import ConfigError, DataError
from attnlab.data.shards import writer as shard_writer
from attnlab.data.text import shards
from attnlab.data.text.translation import synthetic_pairs

WORDS = "the a film cast plot dog ran quickly over slow red house tree was good bad and".split()


def text_file(path: Path, lines: int = 400) -> str:
    """Sentences in documents of four (BERT reads blank lines as document ends)."""
    rows = [" ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(6)) + " ." for i in range(lines)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(r + ("\n\n" if i % 4 == 3 else "\n") for i, r in enumerate(rows)))
    return str(path)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """``attnlab-prepare argv``: exit status, stdout, stderr."""
    try:
        cli.main([*argv, "--no-progress"])
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def refused(capsys, message: str, *argv: str) -> None:
    code, _, err = run(capsys, *argv)
    assert code == 2 and err.strip().splitlines() == [f"error: {message}"], err


def left_behind(out: Path) -> list[str]:
    """What a prepare into ``out`` left next to it."""
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(out.name))


def test_counts_out_of_range_are_refused_before_anything_is_read(tmp_path, capsys):
    corpus, out = text_file(tmp_path / "c.txt"), str(tmp_path / "out")
    big = "--vocab-size must be from 1 to 1048576, got 1000000000"  # a Rust allocation abort before
    refused(capsys, big, corpus, "--out", out, "--tokenizer", "bpe", "--vocab-size", "1000000000")
    refused(capsys, big, corpus, "--out", out, "--mode", "bert", "--vocab-size", "1000000000")
    zero = "--vocab-size must be from 1 to 1048576, got 0"
    refused(capsys, zero, corpus, "--out", out, *"--mode bert --vocab-size 0".split())
    for n in ("0", "-1"):
        message = f"--workers must be a positive integer (tokenising processes), got {n}"
        refused(capsys, message, corpus, "--out", out, "--workers", n)
    message = "--vocab-size is for --tokenizer bpe: a char vocabulary is the corpus's characters"
    refused(capsys, message, corpus, "--out", out, "--vocab-size", "500")
    assert left_behind(tmp_path / "out") == []
    # the library refuses them too, before a trainer allocates for them
    assert cli.MAX_VOCAB_SIZE == shards.MAX_VOCAB_SIZE
    with pytest.raises(ConfigError, match="vocab_size must be an integer from 1 to 1048576, got 10"):
        shards.prepare([corpus], tmp_path / "a", tokenizer="bpe", vocab_size=10**9, progress=False)
    with pytest.raises(ConfigError, match="vocab_size must be an integer from 1 to 1048576"):
        shards.prepare_documents([corpus], tmp_path / "b", vocab_size=10**9, progress=False)
    (tmp_path / "p.tsv").write_text("ein hund .\ta dog .\n" * 10)
    with pytest.raises(ConfigError, match="vocab_size must be an integer from 1 to 1048576"):
        shards.prepare_pairs([str(tmp_path / "p.tsv")], tmp_path / "c", "de", "en", vocab_size=10**9)
    with pytest.raises(ConfigError, match="workers must be a positive integer, got 0"):
        shards.prepare([corpus], tmp_path / "d", workers=0, val_tokens=10, test_tokens=10, progress=False)
    assert left_behind(tmp_path / "a") == left_behind(tmp_path / "d") == []


def test_an_empty_corpus_or_one_the_held_out_splits_take_whole_is_refused(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    out = tmp_path / "out"
    refused(capsys, f"{empty}: no text (0 tokens); nothing to prepare", str(empty), "--out", str(out))
    small = tmp_path / "small.txt"
    small.write_text("a few words\n")
    message = (
        f"{small}: 12 tokens, none left for training after 12 validation and 0 test tokens; "
        "lower --val-tokens / --test-tokens"
    )
    refused(capsys, message, str(small), "--out", str(out))
    assert left_behind(out) == []


def test_a_vocabulary_raised_past_vocab_size_is_noted(tmp_path, capsys):
    corpus = text_file(tmp_path / "c.txt")
    bert = "--mode bert --vocab-size 5 --val-docs 5 --test-docs 5".split()
    code, out, err = run(capsys, corpus, "--out", str(tmp_path / "bert"), *bert)
    assert code == 0 and "vocab 5)" not in out, out
    note = err.strip().splitlines()
    assert (
        len(note) == 1
        and note[0].startswith("note: the vocabulary holds ")
        and "not --vocab-size 5" in note[0]
    )
    assert "raised to hold the special tokens and the alphabet" in note[0]
    bpe = "--tokenizer bpe --vocab-size 300 --val-tokens 100 --test-tokens 100".split()
    code, out, err = run(capsys, corpus, "--out", str(tmp_path / "bpe"), *bpe)
    assert code == 0 and err == "", err  # 300 > BPE's 256 bytes: as asked, no note


def test_a_full_disk_is_one_line_and_leaves_no_partial(tmp_path, capsys, monkeypatch):
    corpus = text_file(tmp_path / "c.txt")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    cases = [
        (shards.SplitWriter, ["--val-tokens", "100", "--test-tokens", "100"]),
        (shards.DocumentWriter, ["--mode", "bert", "--val-docs", "2", "--test-docs", "2"]),
    ]
    for writer, options in cases:
        out = tmp_path / writer.__name__
        with monkeypatch.context() as m:
            m.setattr(writer, "write", full)
            code, _, err = run(capsys, corpus, "--out", str(out), *options)
        assert code == 2 and err.strip().splitlines() == [
            f"error: {out}: could not write (No space left on device); is the disk full? Nothing was kept: "
            "free some space or choose another --out"
        ], err
        assert left_behind(out) == []

    # a real full device: numpy's tofile loses a short write without an error; the size check sees it
    if not Path("/dev/full").exists():
        return
    start = shard_writer.start_partial

    def onto_dev_full(out: Path) -> Path:
        partial = start(out)
        (partial / "val_00000.bin").symlink_to("/dev/full")
        return partial

    monkeypatch.setattr(shard_writer, "start_partial", onto_dev_full)
    out = tmp_path / "dev_full"
    code, _, err = run(capsys, corpus, "--out", str(out), "--val-tokens", "100", "--test-tokens", "100")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "val_00000.bin (0 of 200 bytes written); is the disk full? Nothing was kept" in err
    assert left_behind(out) == []


def test_an_unwritable_out_is_one_line(tmp_path, capsys, monkeypatch):
    corpus = text_file(tmp_path / "c.txt")
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "a_file" / "out"
    message = f"{out}: cannot write there ({out.parent} is not a folder); choose another --out"
    refused(capsys, message, corpus, "--out", str(out))
    locked = tmp_path / "locked"
    locked.mkdir()
    if os.geteuid() != 0:  # root writes anywhere: there, stand in for the refusal
        locked.chmod(0o555)
    else:
        real_open = os.open

        def no_write(path, flags, *args):
            if str(path).startswith(str(locked)):
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return real_open(path, flags, *args)

        monkeypatch.setattr(os, "open", no_write)
    out = locked / "out"
    message = f"{out}: cannot write there (Permission denied); choose another --out"
    refused(capsys, message, corpus, "--out", str(out))


def test_a_second_prepare_into_the_same_out_is_refused_and_stale_partials_go(tmp_path, capsys):
    corpus, out = text_file(tmp_path / "c.txt"), tmp_path / "out"
    args = (corpus, "--out", str(out), "--val-tokens", "100", "--test-tokens", "100")
    with shard_writer._lock(out):  # another prepare holds it: flock is per open file, so this process too
        message = f"{out}: another attnlab-prepare is writing it; wait for its end or choose another --out"
        refused(capsys, message, *args)
        assert (tmp_path / "out.lock").exists()
    (tmp_path / "out.partial").mkdir()  # what a killed prepare left: its lock file, no lock held
    (tmp_path / "out.partial" / "train_00000.bin").write_bytes(bytes(10))
    (tmp_path / "out.lock").write_text("")
    code, stdout, err = run(capsys, *args)
    assert code == 0 and "train /" in stdout, err
    assert left_behind(out) == ["out"]


def test_images_mode_is_held_and_cleaned_up_the_same_way(tmp_path, capsys, monkeypatch):
    from attnlab.data.vision import shards as image_shards

    def fails(folder, out_dir, **options):
        partial = Path(f"{out_dir}.partial")
        partial.mkdir()
        (partial / "train-000000.tar").write_bytes(bytes(10))
        raise OSError(errno.ENOSPC, "No space left on device", str(partial / "train-000000.tar"))

    monkeypatch.setattr(image_shards, "prepare_images", fails)
    (tmp_path / "pets").mkdir()
    out = tmp_path / "shards"
    code, _, err = run(capsys, "--mode", "images", str(tmp_path / "pets"), "--out", str(out))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "is the disk full? Nothing was kept" in err, (
        err
    )
    assert left_behind(out) == []


@pytest.mark.parametrize("longer", ["de", "en"])
def test_parallel_files_of_different_lengths_are_refused_either_way(tmp_path, longer):
    de, en = synthetic_pairs(600, 0)
    (tmp_path / "c.de").write_text("\n".join(de[: 600 if longer == "de" else 599]) + "\n")
    (tmp_path / "c.en").write_text("\n".join(en[: 600 if longer == "en" else 599]) + "\n")
    counts = {"de": 600 if longer == "de" else 599, "en": 600 if longer == "en" else 599}
    message = (
        f"parallel files differ in length: {tmp_path / 'c.de'} has {counts['de']} lines, "
        f"{tmp_path / 'c.en'} has {counts['en']}; line i of one must translate line i of the other"
    )
    with pytest.raises(DataError) as e:
        shards.prepare_pairs(
            [str(tmp_path / "c")],
            tmp_path / "out",
            "de",
            "en",
            vocab_size=120,
            val_pairs=10,
            test_pairs=10,
            progress=False,
        )
    assert str(e.value) == message
    assert left_behind(tmp_path / "out") == []
