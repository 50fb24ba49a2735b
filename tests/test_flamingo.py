"""The Flamingo-style model: gates at 0 leave the frozen LM's logits exactly as they were, only
the new layers learn, each token sees only the image before it, decoding step by step equals
teacher forcing, few-shot prompts."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from attnlab.core.config import constructor_errors
from attnlab.core.errors import ConfigError, DataError
from attnlab.models import GPT, ConvNet, VisionTransformer
from attnlab.models.multimodal.flamingo import Flamingo, few_shot_prompt
from conftest import (
    FLAMINGO_RECIPE,
    QUIET,
    assert_ok,
    flamingo_overrides,
    read_metrics,
    run_cli,
    run_dirs,
    spec_refusal,
    write_idx_dataset,
)

BOS, EOS, VOCAB = 1, 2, 24


def tiny_parts(positions: str = "learned") -> tuple[partial, partial]:
    vision = partial(VisionTransformer, num_classes=0, patch_size=4, dim=32, depth=2, n_head=2)
    return vision, partial(GPT, max_len=48, depth=4, n_head=2, dim=32, positions=positions)


def tiny_flamingo(
    cross_every: int = 1, seed: int = 0, positions: str = "learned", **kwargs: object
) -> Flamingo:
    torch.manual_seed(seed)
    return Flamingo(
        *tiny_parts(positions),
        VOCAB,
        16,
        1,
        n_latents=4,
        resampler_depth=2,
        n_head=2,
        cross_every=cross_every,
        **kwargs,
    )


def open_gates(net: Flamingo) -> Flamingo:
    """Gates and new weights away from their initial values, as after training."""
    with torch.no_grad():
        for block in net.xattn:
            block.attn_gate.fill_(0.7)
            block.mlp_gate.fill_(-0.4)
    return net


def captions(b: int, t: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, VOCAB, (b, t), generator=g)
    tokens[:, 0] = BOS
    return tokens


@pytest.mark.parametrize(("cross_every", "positions"), [(1, "learned"), (2, "learned"), (1, "none")])
def test_closed_gates_give_the_frozen_lms_logits_exactly(cross_every: int, positions: str):
    """With a NoPE LM too, whose start token opens the sequence and sees no image."""
    net = tiny_flamingo(cross_every, positions=positions)
    with torch.no_grad():  # every new weight but the gates moved: the gates alone close the path
        for p in [*net.resampler.parameters(), *net.xattn.parameters()]:
            if p.numel() > 1:
                p.add_(torch.randn_like(p))
    assert all(not b.attn_gate.any() and not b.mlp_gate.any() for b in net.xattn)
    tokens = captions(3, 9)
    tokens[:, 5] = BOS  # a second image in each row
    images = torch.randn(3, 2, 1, 16, 16)
    logits, attn = net(images, tokens)
    assert torch.equal(logits, net.lm(tokens))
    assert attn.shape == (3, 9, 16) and torch.allclose(attn.sum(-1), torch.ones(3, 9))


def test_only_the_new_layers_learn_and_the_frozen_parts_stay_in_eval_mode():
    net = tiny_flamingo(cross_every=2)
    open_gates(net).train()
    assert not net.vision.training and not net.lm.training and net.resampler.training
    logits, _ = net(torch.randn(2, 1, 16, 16), captions(2, 6))
    logits.logsumexp(-1).mean().backward()
    frozen = [*net.vision.named_parameters(), *net.lm.named_parameters()]
    new = [*net.resampler.named_parameters(), *net.xattn.named_parameters()]
    assert all(not p.requires_grad and p.grad is None for _, p in frozen)
    assert all(p.grad is not None for _, p in new), [n for n, p in new if p.grad is None]
    trained = sum(p.numel() for _, p in new)
    total = sum(p.numel() for p in net.parameters())
    assert trained == sum(p.numel() for p in net.parameters() if p.requires_grad)
    print(f"tiny Flamingo: {trained} of {total} parameters trained ({trained / total:.1%})")


def test_a_part_refused_is_named_by_its_key():
    """A bad width of the language model (built inside from ``model.net.lm``) names ``lm.dim``,
    which the entry points show as ``model.net.lm.dim``; the vision encoder's as ``vision``."""
    vision, lm = tiny_parts()
    with pytest.raises(ValueError, match=r"^lm\.dim: must be divisible by n_head \(2\), got 33"):
        Flamingo(vision, partial(lm, dim=33), VOCAB, 16, 1)
    with pytest.raises(ValueError, match=r"^vision\.img_size: must be divisible by patch_size \(4\), got 18"):
        Flamingo(vision, lm, VOCAB, 18, 1)
    with pytest.raises(ValueError, match=r"^n_head: must divide the language model's width \(32\), got 3$"):
        Flamingo(vision, lm, VOCAB, 16, 1, n_head=3)
    part = {"_partial_": True, "depth": 1, "n_head": 2}
    node = OmegaConf.create(
        {
            "_target_": "attnlab.models.Flamingo",
            "vision": {
                "_target_": "attnlab.models.VisionTransformer",
                **part,
                "num_classes": 0,
                "patch_size": 4,
            },
            "lm": {"_target_": "attnlab.models.GPT", **part, "max_len": 48, "dim": 33},
            "vocab_size": VOCAB,
            "img_size": 16,
            "in_chans": 1,
        }
    )
    with pytest.raises(
        ConfigError, match=r"^model\.net\.lm\.dim: must be divisible by n_head \(2\), got 33$"
    ):
        with constructor_errors("model.net"):
            instantiate(node)


def test_the_resampler_knows_where_each_patch_is():
    """Without the places' features the resampler would pool a bag of patches, the same in any
    order, and no caption could say which item is left of which."""
    resampler = tiny_flamingo().resampler.eval()
    features = torch.randn(2, 16, 32)  # 4 x 4 patches
    swapped = features[:, torch.randperm(16, generator=torch.Generator().manual_seed(0))]
    with torch.no_grad():
        latents, _ = resampler(features)
        assert not torch.allclose(resampler(swapped)[0], latents, atol=1e-3)
        resampler.places.zero_()  # the places gone: the order no longer matters
        assert torch.allclose(resampler(swapped)[0], resampler(features)[0], atol=1e-5)
    with pytest.raises(DataError, match="built for 16 patches per image, got 9"):
        resampler(features[:, :9])
    assert spec_refusal("attnlab.models.Flamingo", place_bands=0).startswith("model.net.place_bands=0: ")


def test_region_latents_start_from_the_mean_of_their_region():
    """4 latents over a 4 x 4 grid: latent 1 (top right) starts at its learned vector plus the mean
    of the 2 x 2 patches at rows 0-1, columns 2-3, so it holds what is there and where."""
    resampler = tiny_flamingo(region_latents=True).resampler.eval()
    features = torch.randn(2, 16, 32)
    start = {}
    resampler.layers[0].register_forward_pre_hook(lambda _, args: start.update(x=args[0]))
    with torch.no_grad():
        resampler(features)
        media = resampler.proj(torch.cat([features, resampler.places.expand(2, -1, -1)], -1))
    top_right = media.unflatten(1, (4, 4))[:, :2, 2:].mean((1, 2))  # (B, dim)
    assert torch.allclose(start["x"][:, 1], resampler.latents[1] + top_right, atol=1e-6)
    with torch.no_grad():  # the plain resampler starts every image from the same latents
        plain = tiny_flamingo().resampler.eval()
        plain.layers[0].register_forward_pre_hook(lambda _, args: start.update(x=args[0]))
        plain(features)
    assert torch.equal(start["x"][0], start["x"][1])
    with pytest.raises(ValueError, match="^n_latents: region_latents needs a square"):
        Flamingo(*tiny_parts(), VOCAB, 16, 1, n_latents=5, region_latents=True)


def test_the_feature_cache_encodes_each_image_once_and_changes_nothing():
    """With ``feature_cache`` an image's frozen features are computed on its first pass and read
    back after: the same logits as encoding it every time, the encoder shown only new images, at
    most ``feature_cache`` images kept, none after new weights are loaded."""
    cached, plain = open_gates(tiny_flamingo(feature_cache=6)).eval(), open_gates(tiny_flamingo()).eval()
    encoded = []
    features = cached.features
    cached.features = lambda images: encoded.append(len(images)) or features(images)
    images, tokens = torch.randn(4, 1, 16, 16), captions(4, 6)
    with torch.no_grad():
        first = cached(images, tokens)[0]
        again = cached(images[[2, 0]], tokens[[2, 0]])[0]  # both seen: no encoding
        mixed = cached(torch.cat([images[1:2], images[1:2] + 1, images[:1] - 1]), tokens[:3])[0]
        expected = plain(torch.cat([images[1:2], images[1:2] + 1, images[:1] - 1]), tokens[:3])[0]
        with torch.autocast("cpu", dtype=torch.bfloat16):  # features of another dtype: their own entries
            half = cached(images[:1], tokens[:1])[0]
    assert encoded == [4, 2, 1]
    assert torch.equal(first, plain(images, tokens)[0].detach())
    assert torch.equal(again, first[[2, 0]]) and torch.equal(mixed, expected)
    assert len(cached.feature_cache.store) == 6 and half.dtype == torch.bfloat16
    cached.load_state_dict(cached.state_dict())
    assert not cached.feature_cache.store
    with torch.inference_mode():  # cached by a validation, then trained on
        cached(images, tokens)
    cached.train()(images, tokens)[0].sum().backward()
    assert cached.resampler.proj.weight.grad is not None
    assert not any("cache" in name for name in cached.state_dict())
    assert spec_refusal("attnlab.models.Flamingo", feature_cache=-1).startswith(
        "model.net.feature_cache=-1: "
    )


def test_a_token_sees_only_the_last_image_before_it():
    net = open_gates(tiny_flamingo()).eval()
    tokens = captions(1, 10)
    tokens[0, 0] = 5  # text before any image
    tokens[0, 2] = tokens[0, 6] = BOS  # image 0 at position 2, image 1 at position 6
    images = torch.randn(1, 2, 1, 16, 16)
    logits, attn = net(images, tokens)
    other = images.clone()
    other[:, 0] = torch.randn(1, 16, 16)  # change the first image only
    changed, _ = net(other, tokens)
    same = (logits - changed).abs().amax(-1)[0]
    assert torch.all(same[:2] == 0)  # before any image: no image at all
    assert torch.all(same[2:6] > 0)  # the first image's chunk, its marker included
    # after the second marker: only through the text of the first chunk, never its latents
    blind = Flamingo.image_of_tokens(net, tokens, 2)
    assert blind.tolist() == [[-1, -1, 0, 0, 0, 0, 1, 1, 1, 1]]
    assert torch.all(attn[0, :2] == 0) and torch.allclose(attn[0, 2:].sum(-1), torch.ones(8))
    with pytest.raises(DataError, match="more images"):
        net(images[:, :1], tokens)


@pytest.mark.parametrize("positions", ["learned", "none"])
def test_decoding_step_by_step_equals_teacher_forcing(positions: str):
    net = open_gates(tiny_flamingo(cross_every=2, positions=positions)).eval()
    images, tokens = torch.randn(3, 1, 16, 16), captions(3, 8)
    tokens[:, 6:] = BOS  # one image per row: every token sees it, a later BOS too (padding)
    with torch.no_grad():
        logits, attn = net(images, tokens)
        state = net.start(images)
        for t in range(tokens.size(1)):
            step_logits, state = net.step(tokens[:, t], state)
            torch.testing.assert_close(step_logits, logits[:, t], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(state.attn, attn[:, t], atol=1e-5, rtol=1e-5)
    assert net.grid == (4, 4)


def test_reorder_follows_the_beams():
    net = open_gates(tiny_flamingo()).eval()
    images, tokens = torch.randn(2, 1, 16, 16), captions(2, 5)
    with torch.no_grad():
        logits, _ = net(images, tokens)
        state = net.start(images)
        for t in range(3):
            _, state = net.step(tokens[:, t], state)
        state = net.reorder(state, torch.tensor([1, 1, 0]))
        step_logits, _ = net.step(tokens[[1, 1, 0], 3], state)
    torch.testing.assert_close(step_logits, logits[[1, 1, 0], 3], atol=1e-5, rtol=1e-5)


def test_few_shot_prompt_then_decoding_equals_the_interleaved_sequence():
    net = open_gates(tiny_flamingo()).eval()
    pad = 0
    shots = [
        (torch.randn(1, 16, 16), torch.tensor([BOS, 7, 8, 9, EOS, pad, pad])),
        (torch.randn(1, 16, 16), torch.tensor([BOS, 10, 11, EOS, pad, pad, pad])),
    ]
    query = torch.randn(1, 16, 16)
    images, prompt = few_shot_prompt(shots, query, pad_id=pad)
    assert images.shape == (3, 1, 16, 16) and torch.equal(images[2], query)
    assert prompt.tolist() == [BOS, 7, 8, 9, EOS, BOS, 10, 11, EOS]
    answer = torch.tensor([BOS, 12, 13])
    with torch.no_grad():
        full, attn = net(images[None], torch.cat([prompt, answer])[None])
        state = net.start(images[None], prompt=prompt[None])
        for i, token in enumerate(answer):
            step_logits, state = net.step(token[None], state)
            torch.testing.assert_close(step_logits, full[:, len(prompt) + i], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(state.attn, attn[:, len(prompt) + i], atol=1e-5, rtol=1e-5)
    assert state.image.tolist() == [2]  # the query image
    with pytest.raises(DataError, match="at least one"):
        few_shot_prompt([], query)


def test_init_from_fills_each_part_from_its_own_run(tmp_path):
    """``model.init_from={vision: ..., lm: ...}``: the ViT from a classifier's run (its head left
    out: the Flamingo's ViT has none) and the GPT from a language model's run."""
    from attnlab.weights.init import load_init

    torch.manual_seed(3)
    classifier = VisionTransformer(
        num_classes=10, img_size=16, in_chans=1, patch_size=4, dim=32, depth=2, n_head=2
    )
    lm = GPT(vocab_size=VOCAB, max_len=48, depth=4, n_head=2, dim=32)
    for name, net in (("vit", classifier), ("gpt", lm)):
        torch.save(
            {"state_dict": {f"net.{k}": v for k, v in net.state_dict().items()}}, tmp_path / f"{name}.ckpt"
        )
    net = tiny_flamingo(seed=4)
    load_init(net, {"vision": str(tmp_path / "vit.ckpt"), "lm": str(tmp_path / "gpt.ckpt")})
    vision = {k: v for k, v in classifier.state_dict().items() if not k.startswith("head")}
    assert all(torch.equal(net.vision.state_dict()[k], v) for k, v in vision.items())
    assert all(torch.equal(net.lm.state_dict()[k], v) for k, v in lm.state_dict().items())
    tokens = captions(2, 6)
    assert torch.equal(net(torch.randn(2, 1, 16, 16), tokens)[0], lm(tokens))
    with pytest.raises(
        ConfigError, match=r"model.init_from.text: the net has no such part \(its parts: vision, lm"
    ):
        load_init(net, {"text": str(tmp_path / "gpt.ckpt")})


@pytest.mark.parametrize("preset", ["flamingo", "flamingo_vit"])
def test_the_recipes_flamingo_trains_at_most_30_percent_of_its_parameters(preset: str):
    """The net of conf/model/net/flamingo.yaml (the recipe's) and flamingo_vit.yaml at the scenes'
    sizes (64-pixel canvases, a caption vocabulary of a few dozen words): the issue's bar is <= 30%
    trained."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from conftest import ROOT

    cfg = OmegaConf.load(ROOT / f"conf/model/net/{preset}.yaml")
    cfg.update({"vocab_size": 40, "img_size": 64, "in_chans": 1})  # what the data fills in
    net = instantiate(cfg)
    trained = sum(p.numel() for p in net.parameters() if p.requires_grad)
    total = sum(p.numel() for p in net.parameters())
    print(
        f"conf/model/net/{preset}.yaml: {trained:,} of {total:,} parameters trained ({trained / total:.1%})"
    )
    assert trained / total <= 0.30
    assert net.grid == (8, 8)


def test_a_convnet_encoder_is_read_cell_by_cell(tmp_path):
    """The paper's vision encoder is a convnet (NFNet): the resampler reads the cells of its last
    map, row-major, each at its place; its weights come from a classifier's run, head left out;
    with the gates at 0 the logits are still the frozen LM's."""
    from attnlab.weights.init import load_init

    torch.manual_seed(6)
    convnet = partial(ConvNet, widths=(4, 8, 8), dropout=0.0)
    lm = partial(GPT, max_len=48, depth=2, n_head=2, dim=32)
    classifier = convnet(num_classes=10, img_size=16, in_chans=1)
    torch.save(
        {"state_dict": {f"net.{k}": v for k, v in classifier.state_dict().items()}}, tmp_path / "c.ckpt"
    )
    net = Flamingo(
        partial(convnet, num_classes=0), lm, VOCAB, 16, 1, n_latents=4, resampler_depth=1, n_head=2
    )
    assert net.grid == (4, 4) and net.resampler.places.shape[0] == 16  # 16 pixels halved twice
    load_init(net, {"vision": str(tmp_path / "c.ckpt")})
    vision = {k: v for k, v in classifier.state_dict().items() if not k.startswith("head")}
    assert net.vision.state_dict().keys() == vision.keys()
    assert all(torch.equal(net.vision.state_dict()[k], v) for k, v in vision.items())
    images = torch.randn(2, 1, 16, 16)
    cells = classifier.eval().forward_features(images)  # (B, C, 4, 4)
    assert torch.equal(net.features(images), cells.flatten(2).transpose(1, 2))
    assert torch.equal(net.features(images)[:, 4 * 1 + 2], cells[:, :, 1, 2])  # row 1, column 2
    tokens = captions(2, 6)
    logits, attn = net(images, tokens)
    assert torch.equal(logits, net.lm(tokens)) and attn.shape == (2, 6, 16)


@pytest.mark.parametrize("beam_size", [1, 3])
def test_caption_batch_decodes_the_flamingo(beam_size: int):
    """The captioning contract as ``attnlab.inference.captioning`` uses it: greedy and beam search
    through start/step/reorder, each word's attention over the 4 x 4 patches."""
    from attnlab.inference.captioning import caption_batch

    net = open_gates(tiny_flamingo()).eval()
    out = caption_batch(net, torch.randn(2, 1, 16, 16), BOS, EOS, max_len=6, beam_size=beam_size)
    assert len(out) == 2
    for ids, attn in out:
        assert 0 < len(ids) <= 6 and EOS not in ids and attn.shape == (len(ids), 16)
        torch.testing.assert_close(attn.sum(-1), torch.ones(len(ids)))


def test_the_caption_text_is_every_caption_in_order_in_the_scenes_vocabulary(tmp_path):
    """data=scene_text: the GPT's stream is each caption's ``<bos> words <eos>`` as the captioner's
    batches hold them, one after another; its artifacts are the scenes' (the tokenizer)."""
    from attnlab.data.multimodal.caption_text import CaptionTextDataModule
    from attnlab.data.sources import Builtin
    from attnlab.data.vision.scenes import ScenesDataModule

    scenes = ScenesDataModule(
        Builtin("fashion_mnist", str(write_idx_dataset(tmp_path / "idx"))),
        train_size=12,
        val_size=6,
        test_size=6,
    )
    data = CaptionTextDataModule(scenes, max_len=8, batch_size=2, val_batches=1)
    data.setup("fit")
    tok = scenes.tokenizer
    for split, stream in (("train", data.train_tokens), ("test", data.test_tokens)):
        expected = [i for c in scenes.caption_texts(split) for i in [tok.bos_id, *tok.encode(c), tok.eos_id]]
        assert stream.tolist() == expected
    x, y = next(iter(data.train_dataloader()))
    assert x.shape == y.shape == (2, 8) and torch.equal(x[:, 1:], y[:, :-1])
    assert data.artifacts() == scenes.artifacts() and data.model_kwargs() == {"vocab_size": tok.vocab_size}


@pytest.mark.slow
def test_the_recipe_trains_the_parts_then_the_captioner_from_them(tmp_path):
    """convnet_scenes, gpt_scene_captions, then flamingo_scenes through attnlab-train: the
    captioner's frozen convnet and GPT are those runs' weights (and stay so), its tokenizer the GPT
    run's, and it is scored as a captioner."""
    from attnlab.inference.runs import TrainedRun

    fast = [*QUIET, "trainer.max_steps=6", "trainer.val_check_interval=3", "trainer.limit_test_batches=1"]
    for experiment in FLAMINGO_RECIPE:
        overrides = flamingo_overrides(experiment, tmp_path, init_from=True)
        assert_ok(run_cli("train", [f"experiment={experiment}", *fast, *overrides], tmp_path))
    convnet, gpt, flamingo = (
        TrainedRun(str(run_dirs(tmp_path, name)[0] / "checkpoints" / "last.ckpt"), tmp_path / "logs")
        for name in FLAMINGO_RECIPE
    )
    net = flamingo.net()
    for part, run in (("vision", convnet), ("lm", gpt)):
        theirs = {k: v for k, v in run.net().state_dict().items() if not k.startswith("head")}
        ours = getattr(net, part).state_dict()
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], v) for k, v in theirs.items()), part
    assert flamingo.artifacts["tokenizer"] == gpt.artifacts["tokenizer"]
    metrics = read_metrics(run_dirs(tmp_path, "flamingo_scenes")[0])
    assert {"val/cider", "val/exact_match", "val/grounding", "test/bleu4"} <= metrics.keys()


@pytest.mark.parametrize("source", ["clip", "show_attend_tell"])
def test_the_vision_part_comes_from_a_clip_or_a_vit_captioners_run(source, tmp_path):
    """``model.init_from={vision: <run>}`` where the ViT is a part of that run's net: a CLIP's
    image tower (``image.``) or a Show, Attend and Tell's ViT encoder (``encoder.vit.``)."""
    from attnlab.models import CLIP, ShowAttendTell, TextTransformer
    from attnlab.weights.init import load_init

    vit = dict(num_classes=0, img_size=16, in_chans=1, patch_size=4, dim=32, depth=2, n_head=2, stem="conv")
    torch.manual_seed(5)
    if source == "clip":
        saved = CLIP(
            VisionTransformer(**vit), TextTransformer(vocab_size=VOCAB, max_len=8, dim=16, depth=1, n_head=2)
        )
        tower = saved.image
    else:
        saved = ShowAttendTell(VOCAB, 16, 1, encoder="vit", enc_dim=32, enc_depth=2, patch_size=4, n_head=2)
        tower = saved.encoder.vit
    torch.save({"state_dict": {f"net.{k}": v for k, v in saved.state_dict().items()}}, tmp_path / "run.ckpt")
    vision = partial(VisionTransformer, **{k: v for k, v in vit.items() if k not in ("img_size", "in_chans")})
    lm = partial(GPT, max_len=48, depth=2, n_head=2, dim=32)
    net = Flamingo(vision, lm, VOCAB, 16, 1, n_latents=4, resampler_depth=1, n_head=2)
    load_init(net, {"vision": str(tmp_path / "run.ckpt")})
    theirs = tower.state_dict()
    assert net.vision.state_dict().keys() == theirs.keys()
    assert all(torch.equal(net.vision.state_dict()[k], v) for k, v in theirs.items())
