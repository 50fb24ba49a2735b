"""Captioning metrics as pure functions of the decoded texts: BLEU-4, CIDEr-D, and for scenes exact
match of items and relations, and grounding of a word's attention."""

from __future__ import annotations

import re

import torch
from torch import Tensor

from attnlab.data.multimodal.captions import CLASS_PHRASES
from attnlab.data.vision.scenes import RELATIONS

# the relation each phrasing means, and each relation said the other way round
PHRASINGS = {tuple(p.split()): rel for rel, ps in RELATIONS.items() for p in ps}
INVERSE = {"to the right of": "to the left of", "below": "above"}
# a caption's words: letters, digits and inner hyphens or apostrophes ("t-shirt"), or one other
# non-space character (as attnlab.data.text.tokenizers.CAPTION_WORDS)
WORD = re.compile(r"[^\W_]+(?:['-][^\W_]+)*|[^\w\s]|_")


def words(text: str) -> list[str]:
    return WORD.findall(text.lower())


def _references(refs: list[list[str]] | list[str]) -> list[list[str]]:
    return [[r] if isinstance(r, str) else list(r) for r in refs]


def bleu4(hyps: list[str], refs: list[list[str]] | list[str]) -> float:
    """Corpus BLEU-4 of ``hyps`` against their references (a list each, or one string), over ``words``."""
    from torchmetrics.text import BLEUScore

    joined = [" ".join(words(h)) for h in hyps]
    references = [[" ".join(words(r)) for r in rs] for rs in _references(refs)]
    return float(BLEUScore(n_gram=4)(joined, references))


def cider(hyps: list[str], refs: list[list[str]] | list[str]) -> float:
    """CIDEr-D (x10, as COCO reports it) of ``hyps``, document frequencies from their references."""
    from pycocoevalcap.cider.cider import Cider

    if not hyps:
        return 0.0
    gts = {i: [" ".join(words(r)) for r in rs] for i, rs in enumerate(_references(refs))}
    res = {i: [" ".join(words(h))] for i, h in enumerate(hyps)}
    score, _ = Cider().compute_score(gts, res)
    return float(score)


def parse_scene(caption: str, names: list[str]) -> tuple[list[str], list[tuple[str, str, str]]]:
    """The items (in order, a repeat counted once) and relations (item, relation, item) a caption says."""
    ws = words(caption)
    found = []  # ("item", name) or ("rel", relation), in order
    phrases = {tuple(n.split()): ("item", n) for n in names} | {p: ("rel", r) for p, r in PHRASINGS.items()}
    longest = max(map(len, phrases))
    i = 0
    while i < len(ws):
        for n in range(min(longest, len(ws) - i), 0, -1):  # the longest phrase starting here
            if (hit := phrases.get(tuple(ws[i : i + n]))) is not None:
                found.append(hit)
                i += n
                break
        else:
            i += 1
    items = [
        what for k, (kind, what) in enumerate(found) if kind == "item" and found[k - 1 : k] != [(kind, what)]
    ]
    relations = [
        (_item(found, k - 1), what, _item(found, k + 1))
        for k, (kind, what) in enumerate(found)
        if kind == "rel"
    ]
    return items, relations


def _item(found: list[tuple[str, str]], k: int) -> str:
    """The item named at ``found[k]``, or "" where there is none."""
    return found[k][1] if 0 <= k < len(found) and found[k][0] == "item" else ""


def scene_exact_match(
    hyp: str, items: list[str], relations: list[tuple[str, str, str]], names: list[str] | None = None
) -> bool:
    """Whether ``hyp`` names exactly the scene's ``items`` and ``relations`` (inverse relations alike),
    ``names`` the item names looked for."""
    names = sorted({*(names or [n for ps in CLASS_PHRASES.values() for n in ps]), *items})
    said_items, said_relations = parse_scene(hyp, names)
    return sorted(said_items) == sorted(items) and _canonical(said_relations) == _canonical(relations)


def _canonical(relations: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    return sorted((b, INVERSE[r], a) if r in INVERSE else (a, r, b) for a, r, b in relations)


def grounding_hit(attn: Tensor, grid: tuple[int, int], box: Tensor, canvas: int) -> bool:
    """Whether at least half of ``attn``'s mass over a row-major ``grid`` tiling the ``canvas`` lies
    in ``box`` (x0, y0, x1, y1; cells counted by the part covered)."""
    h, w = grid
    x0, y0, x1, y1 = (float(v) for v in box)

    def cover(lo: float, hi: float, cells: int) -> Tensor:  # (cells,): the share of each cell in [lo, hi)
        edges = torch.arange(cells + 1, dtype=torch.float64) * canvas / cells
        return (edges[1:].clamp(max=hi) - edges[:-1].clamp(min=lo)).clamp(min=0) / (canvas / cells)

    mass = attn.detach().double().cpu().reshape(h, w)
    inside = (mass * cover(y0, y1, h)[:, None] * cover(x0, x1, w)[None, :]).sum()
    return bool(inside >= 0.5 * mass.sum())
