"""Readers of the text formats the BERT tasks train on, each refusing bad input with one line
naming the file (and line): plain-text corpora, GLUE-style TSV and CoNLL tagging files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from attnlab.core.errors import DataError


def read_lines(path: Path, key: str | None = None) -> list[str]:
    """The lines of a UTF-8 text file; errors name it as the config ``key`` that gave it
    (``input=<path>``), or as a data file."""
    if not path.is_file():
        raise DataError(f"{key}={path}: no such file" if key else f"data file {path} does not exist")
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise DataError(f"{f'{key}=' if key else 'data file '}{path} is not UTF-8 text ({e})") from e


def read_corpus(path: Path) -> list[list[str]]:
    """Documents of sentences: a sentence per line, documents between blank lines; or a GLUE
    ``.tsv`` file's ``sentence`` column, a one-sentence document per row (labels not read)."""
    if path.suffix == ".tsv":
        return [[row.text] for row in read_tsv(path, need_labels=False)]
    docs: list[list[str]] = [[]]
    for line in read_lines(path):
        if line.strip():
            docs[-1].append(line.strip())
        elif docs[-1]:
            docs.append([])
    return [d for d in docs if d]


@dataclass(frozen=True)
class Example:
    """One labelled TSV row: a sentence, or a pair (``text_pair``), and an integer label."""

    text: str
    text_pair: str | None = None
    label: int = -1
    line: int = 0  # in its file, for errors


def read_tsv(path: Path, need_labels: bool = True) -> list[Example]:
    """GLUE-format TSV: a header row naming the columns, ``sentence`` (or ``sentence1`` and
    ``sentence2`` for pairs) and, when ``need_labels``, an integer ``label``."""
    lines = read_lines(path)
    if not lines:
        raise DataError(f"{path} is empty; expected a header row and tab-separated examples")
    header = lines[0].split("\t")
    if "sentence" in header:
        text_cols = [header.index("sentence")]
    elif "sentence1" in header and "sentence2" in header:
        text_cols = [header.index("sentence1"), header.index("sentence2")]
    else:
        raise DataError(
            f"{path}:1: no 'sentence' (or 'sentence1' and 'sentence2') column in the header {header}"
        )
    if need_labels and "label" not in header:
        raise DataError(f"{path}:1: no 'label' column in the header {header}")
    label_col = header.index("label") if "label" in header else None
    examples = []
    for n, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        cells = line.split("\t")
        if len(cells) < len(header):
            raise DataError(f"{path}:{n}: {len(cells)} tab-separated columns, the header has {len(header)}")
        label = -1
        if need_labels:
            try:
                label = int(cells[label_col])
            except ValueError:
                raise DataError(f"{path}:{n}: label {cells[label_col]!r} is not an integer") from None
        examples.append(Example(*(cells[i].strip() for i in text_cols), label=label, line=n))
    if not examples:
        raise DataError(f"{path} has a header but no examples")
    return examples


def read_conll(path: Path) -> list[tuple[list[str], list[str]]]:
    """CoNLL tagging file: one ``word ... tag`` per line (the first and last whitespace-separated
    fields are read), sentences separated by blank lines, ``-DOCSTART-`` lines skipped."""
    sentences: list[tuple[list[str], list[str]]] = [([], [])]
    for n, line in enumerate(read_lines(path), start=1):
        fields = line.split()
        if not fields:
            if sentences[-1][0]:
                sentences.append(([], []))
            continue
        if fields[0] == "-DOCSTART-":
            continue
        if len(fields) < 2:
            raise DataError(f"{path}:{n}: expected 'word ... tag', got {line!r}")
        sentences[-1][0].append(fields[0])
        sentences[-1][1].append(fields[-1])
    sentences = [s for s in sentences if s[0]]
    if not sentences:
        raise DataError(f"{path} holds no tagged sentences")
    return sentences
