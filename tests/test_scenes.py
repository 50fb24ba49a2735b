"""Scenes (attnlab.data.vision.scenes) and the captioning metrics (attnlab.training.caption_metrics):
items placed apart with their true boxes, captions that say exactly the scene, disjoint sources per
split, the batches; BLEU-4, CIDEr, exact match and grounding against hand-computed values."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from attnlab.cli.common import config_dir
from attnlab.core.errors import ConfigError
from attnlab.data import ScenesDataModule
from attnlab.data.multimodal.captions import CLASS_PHRASES
from attnlab.data.sources import Builtin
from attnlab.data.text.tokenizers import WordTokenizer, tokenizer_from_json
from attnlab.data.vision.scenes import GAP, RELATIONS, Scenes, make_scenes
from attnlab.training.caption_metrics import bleu4, cider, grounding_hit, parse_scene, scene_exact_match
from conftest import needs_shared, write_idx_dataset

PHRASES = CLASS_PHRASES["fashion_mnist"]


def items_of(n: int = 200, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """28x28 uint8 items: a bright rectangle of random size and place on black, class i % 10."""
    rng = np.random.default_rng(seed)
    images = np.zeros((n, 28, 28), np.uint8)
    for i in range(n):
        h, w = rng.integers(6, 29, 2)
        y, x = rng.integers(0, 29 - h), rng.integers(0, 29 - w)
        images[i, y : y + h, x : x + w] = rng.integers(1, 256, (h, w))
    return torch.from_numpy(images), torch.arange(n) % 10


@pytest.fixture(scope="module")
def scenes() -> Scenes:
    return make_scenes(*items_of(), PHRASES, n=60, seed=0)


def test_items_never_overlap_and_their_boxes_hold_exactly_their_pixels(scenes):
    images, labels = items_of()
    assert scenes.images.shape == (60, 1, 64, 64) and scenes.images.dtype == torch.uint8
    counts = {len(b) for b in scenes.boxes}
    assert counts == {2, 3, 4}
    for s in range(len(scenes)):
        canvas, boxes = scenes.images[s, 0], scenes.boxes[s]
        assert len(set(scenes.labels[s].tolist())) == len(boxes)  # one item per class
        covered = torch.zeros_like(canvas, dtype=torch.bool)
        for j, (x0, y0, x1, y1) in enumerate(boxes.tolist()):
            for x0b, y0b, x1b, y1b in boxes[j + 1 :].tolist():  # at least GAP pixels apart
                assert x1 + GAP <= x0b or x1b + GAP <= x0 or y1 + GAP <= y0b or y1b + GAP <= y0
            patch = canvas[y0:y1, x0:x1]
            assert patch.any(1)[[0, -1]].all() and patch.any(0)[[0, -1]].all()  # tight
            covered[y0:y1, x0:x1] = True
            source = images[scenes.sources[s][j]]  # the item is its source image, cropped
            rows, cols = source.any(1).nonzero(), source.any(0).nonzero()
            assert torch.equal(patch, source[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1])
            assert labels[scenes.sources[s][j]] == scenes.labels[s][j]
        assert not canvas[~covered].any()  # nothing outside the boxes


def test_captions_say_the_relations_the_boxes_have(scenes):
    for s in range(len(scenes)):
        names = [PHRASES[c] for c in scenes.labels[s].tolist()]
        assert [(a, b) for a, _, b in scenes.relations[s]] == list(zip(names, names[1:], strict=False))
        centres = [((x0 + x1) / 2, (y0 + y1) / 2) for x0, y0, x1, y1 in scenes.boxes[s].tolist()]
        for (ax, ay), (bx, by), (_, rel, _) in zip(centres, centres[1:], scenes.relations[s], strict=False):
            dx, dy = bx - ax, by - ay
            expected = ("to the left of" if dx > 0 else "to the right of") if abs(dx) >= abs(dy) else None
            expected = expected or ("above" if dy > 0 else "below")
            assert rel == expected
        words = scenes.captions[s].split()
        assert [words[w] for w in scenes.words[s]] == [n.split()[-1] for n in names]
    said = {p for c in scenes.captions for rel in RELATIONS.values() for p in rel if f" {p} " in c}
    assert len(said) >= 6  # several phrasings


def test_exact_match_parses_the_true_caption_and_refuses_a_swapped_item_or_relation(scenes):
    for s in range(len(scenes)):
        caption, relations = scenes.captions[s], scenes.relations[s]
        items = [PHRASES[c] for c in scenes.labels[s].tolist()]
        assert scene_exact_match(caption, items, relations), caption
        other = next(p for p in PHRASES if p not in items)
        swapped = [
            (other if a == items[-1] else a, r, other if b == items[-1] else b) for a, r, b in relations
        ]
        assert not scene_exact_match(caption, [*items[:-1], other], swapped)  # the caption names items[-1]
        a, r, b = relations[0]
        wrong = next(x for x in RELATIONS if x != r)
        assert not scene_exact_match(caption, items, [(a, wrong, b), *relations[1:]]), caption
        assert not scene_exact_match(caption, items[:-1], relations[:-1])  # one item more than the truth


def test_exact_match_reads_relations_said_either_way_round():
    items, relations = ["bag", "ankle boot"], [("bag", "to the left of", "ankle boot")]
    assert scene_exact_match("an ankle boot is to the right of a bag", items, relations)
    assert scene_exact_match("A bag, left of an ankle boot.", items, relations)
    assert not scene_exact_match("an ankle boot is to the left of a bag", items, relations)
    assert not scene_exact_match("a bag to the left of a boot", items, relations)  # "boot" is no item
    assert parse_scene("a coat over a bag and the bag is under a dress", PHRASES) == (
        ["coat", "bag", "dress"],
        [("coat", "above", "bag"), ("bag", "below", "dress")],
    )


def test_the_same_seed_gives_the_same_scenes():
    images, labels = items_of()
    a, b = (make_scenes(images, labels, PHRASES, n=10, seed=3) for _ in range(2))
    c = make_scenes(images, labels, PHRASES, n=10, seed=4)
    assert torch.equal(a.images, b.images) and a.captions == b.captions and a.relations == b.relations
    assert not torch.equal(a.images, c.images)


def test_a_canvas_too_small_is_one_line():
    with pytest.raises(ConfigError, match="data.canvas=30"):
        make_scenes(*items_of(), PHRASES, n=5, seed=0, canvas=30, items=(4, 4))


# --- the DataModule, through the shipped config ---------------------------------------------


def data_module(tmp: Path, *overrides: str):
    idx = write_idx_dataset(tmp / "idx", n_train=80, n_test=30)
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[f"paths.output_dir={tmp}", "data=scenes", *(f"data.{o}" for o in overrides)],
        )
    cfg.data.source.data_dir = str(idx)
    cfg.data.update(train_size=16, val_size=8, test_size=8, batch_size=4)
    dm = instantiate(cfg.data)
    dm.setup("fit")
    return dm


def test_splits_draw_from_disjoint_source_images(tmp_path):
    dm = data_module(tmp_path)
    pools = {split: set(s.pool.tolist()) for split, s in dm.splits.items()}
    assert not pools["train"] & pools["val"]  # halves of the training split; test: the test split
    for split in dm.splits.values():  # every item is a crop of a source image in its own pool
        used = {int(i) for s in split.sources for i in s}
        assert used <= set(range(len(split.pool))) and len(used) > 4


def test_caption_batches(tmp_path):
    dm = data_module(tmp_path)
    batch = dm.on_after_batch_transfer(next(iter(dm.train_dataloader())), 0)
    image, tokens = batch["image"], batch["tokens"]
    assert image.shape == (4, 1, 64, 64) and image.dtype == torch.float32
    assert tokens.dtype == torch.long and (tokens[:, 0] == 1).all() and tokens.size(1) <= dm.max_len
    tok = dm.tokenizer
    for row, caption, words, items in zip(
        tokens, batch["captions"], batch["words"], batch["items"], strict=True
    ):
        ids = row[row != 0].tolist()
        assert ids[-1] == 2 and 3 not in ids and tok.decode(ids) == caption
        assert [tok.decode([ids[w]]) for w in words] == [n.split()[-1] for n in items]
    assert [len(b) for b in batch["boxes"]] == [len(i) for i in batch["items"]]
    assert len(batch["relations"]) == 4 and batch["idx"].shape == (4,)
    val = next(iter(dm.val_dataloader()))
    assert val["idx"].tolist() == [0, 1, 2, 3]
    assert dm.model_kwargs() == {
        "vocab_size": tok.vocab_size,
        "max_len": dm.max_len,
        "pad_id": 0,
        "img_size": 64,
        "in_chans": 1,
    }


def test_the_tokenizer_travels_with_the_run(tmp_path):
    dm = data_module(tmp_path)
    saved = dm.artifacts()
    assert isinstance(tokenizer_from_json(saved["tokenizer"]), WordTokenizer)
    other = data_module(tmp_path / "other", "seed=5")
    other.load_artifacts(saved)
    other.splits = {}
    other.setup("fit")  # setup keeps the checkpoint's tokenizer and normalisation
    assert other.tokenizer.tokenizer.get_vocab() == dm.tokenizer.tokenizer.get_vocab()
    assert (other.mean, other.std) == (dm.mean, dm.std)


def test_label_batches(tmp_path):
    dm = data_module(tmp_path, "target=labels")
    batch = next(iter(dm.test_dataloader()))
    assert set(batch) == {"image", "target"} and batch["target"].shape == (4, 10)
    counts = batch["target"].sum(1).tolist()
    assert counts == [len(dm.splits["test"].labels[i]) for i in range(4)]
    assert dm.model_kwargs() == {"num_classes": 10, "img_size": 64, "in_chans": 1}


def test_grid_labels_say_which_class_is_in_which_quadrant(tmp_path):
    dm = data_module(tmp_path, "target=labels", "label_grid=2")
    batch = next(iter(dm.test_dataloader()))
    assert batch["target"].shape == (4, 40) and len(dm.classes) == 40
    assert dm.model_kwargs()["num_classes"] == 40
    scenes = dm.splits["test"]
    for row, i in enumerate(range(4)):
        expected = set()
        for (x0, y0, x1, y1), c in zip(scenes.boxes[i].tolist(), scenes.labels[i].tolist(), strict=True):
            quadrant = 2 * int((y0 + y1) / 2 >= 32) + int((x0 + x1) / 2 >= 32)
            expected.add(quadrant * 10 + c)
        assert set(batch["target"][row].nonzero().flatten().tolist()) == expected
    assert dm.classes[0] == f"{PHRASES[0]} (top left)" and dm.classes[39] == f"{PHRASES[9]} (bottom right)"


# --- metrics against hand-computed values -------------------------------------------------


def test_bleu4_is_one_for_a_perfect_caption_and_zero_without_a_shared_4gram():
    refs = [["a bag to the left of a coat"], ["there is a shirt above a dress"]]
    assert bleu4(["A bag to the left of a coat", "there is a shirt above a dress"], refs) == pytest.approx(
        1.0
    )
    assert bleu4(["a coat is above a bag"], refs[:1]) == 0.0  # no 4-gram in common
    # one word wrong of 8: 7/8 unigrams, 5/7 bigrams, 4/6 trigrams, 3/5 4-grams match; same length
    hyp, ref = "a bag to the left of the coat", "a bag to the left of a coat"
    p = [7 / 8, 5 / 7, 4 / 6, 3 / 5]
    assert bleu4([hyp], [ref]) == pytest.approx(float(np.exp(np.mean(np.log(p)))), abs=1e-6)


def test_cider_matches_the_hand_computed_cider_d():
    # image 0: "a c" against "a b": unigram cosine 1/2 (idf equal), no shared bigram -> 10 * 0.5 / 4
    # image 1: perfect, uni- and bigrams 1, no 3- or 4-grams -> 10 * 2 / 4
    assert cider(["a c", "d e"], [["a b"], ["d e"]]) == pytest.approx((1.25 + 5.0) / 2)
    assert cider(["A bag.", "a coat ."], ["a bag .", "a coat ."]) == pytest.approx(10 * 3 / 4)


def test_grounding_hit_on_a_constructed_map():
    attn = torch.zeros(4, 4)  # a 4x4 grid over a 64-pixel canvas: 16-pixel cells
    attn[1, 2] = 0.6  # the cell x 32..48, y 16..32
    attn[3, 0] = 0.4
    box = torch.tensor([32, 16, 48, 32])
    assert grounding_hit(attn.flatten(), (4, 4), box, 64)
    assert not grounding_hit(attn.flatten(), (4, 4), torch.tensor([0, 48, 16, 64]), 64)  # 0.4 only
    # a box covering half of the 0.6 cell and nothing else: 0.3 < 0.5
    assert not grounding_hit(attn.flatten(), (4, 4), torch.tensor([40, 16, 48, 32]), 64)
    # the row of one of two 0.5 cells: exactly half
    attn[1, 2], attn[3, 0] = 0.5, 0.5
    assert grounding_hit(attn.flatten(), (4, 4), torch.tensor([0, 16, 64, 32]), 64)


def test_scenes_of_the_real_fashion_mnist(tmp_path):
    dm = ScenesDataModule(
        Builtin("fashion_mnist", str(needs_shared("fashion_mnist"))),
        train_size=100,
        val_size=20,
        test_size=20,
    )
    dm.setup("fit")
    assert len(dm.splits["train"].pool) == len(dm.splits["val"].pool) == 30_000
    assert not set(dm.splits["train"].pool.tolist()) & set(dm.splits["val"].pool.tolist())
    train = dm.splits["train"]
    for s in range(len(train)):
        items = [PHRASES[c] for c in train.labels[s].tolist()]
        assert scene_exact_match(train.captions[s], items, train.relations[s]), train.captions[s]
    assert {r for rels in train.relations for _, r, _ in rels} == set(RELATIONS)
    assert dm.tokenizer.vocab_size < 60  # the words of the templates and class names
