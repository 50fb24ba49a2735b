"""CLIP: the text tower against open_clip's with copied weights, the loss against open_clip's
ClipLoss, the logit scale, pooling at the end-of-text token, the DDP gather's gradients."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.multiprocessing as mp

from attnlab.data.sources import Builtin, Pairs
from attnlab.models import CLIP, TextTransformer, VisionTransformer
from attnlab.training.contrastive import clip_loss
from conftest import write_pairs

V, CTX, W = 20, 8, 16
EOT = V - 1  # open_clip pools at the argmax id: the end-of-text token is the largest


def captions(b: int = 3, seed: int = 0) -> torch.Tensor:
    """Right-padded captions (pad 0) of different lengths, each ending in EOT."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.zeros(b, CTX, dtype=torch.long)
    for i, n in enumerate(range(CTX - b + 1, CTX + 1)):
        tokens[i, : n - 1] = torch.randint(1, EOT, (n - 1,), generator=g)
        tokens[i, n - 1] = EOT
    return tokens


def copy_open_clip_text(ours: TextTransformer, ref: torch.nn.Module, proj: torch.nn.Linear) -> None:
    state = {
        "embed.tokens.weight": ref.token_embedding.weight,
        "embed.positions.emb.weight": ref.positional_embedding,
        "norm.weight": ref.ln_final.weight,
        "norm.bias": ref.ln_final.bias,
    }
    names = {
        "ln_1": "norm1",
        "ln_2": "norm2",
        "attn.in_proj_": "attn.in_proj.",
        "mlp.c_fc": "mlp.fc1",
        "mlp.c_proj": "mlp.fc2",
    }
    for key, value in ref.transformer.resblocks.state_dict().items():
        for theirs, mine in names.items():
            key = key.replace(theirs, mine)
        state[f"blocks.{key}"] = value
    ours.load_state_dict(state, strict=True)
    proj.weight.data.copy_(ref.text_projection.t())


def test_text_tower_equals_open_clip_with_copied_weights():
    pytest.importorskip("open_clip")
    from open_clip.transformer import TextTransformer as OpenClipText

    ref = OpenClipText(context_length=CTX, vocab_size=V, width=W, heads=2, layers=2, output_dim=12).eval()
    net = CLIP(
        VisionTransformer(10, 8, 1, patch_size=4, dim=16, depth=1, n_head=2),
        TextTransformer(V, CTX, dim=W, depth=2, n_head=2),
        embed_dim=12,
    ).eval()
    copy_open_clip_text(net.text, ref, net.text_proj)
    tokens = captions()
    torch.testing.assert_close(net.encode_text(tokens, normalize=False), ref(tokens), atol=1e-5, rtol=0)


def test_text_feature_is_read_at_the_end_of_text_under_a_causal_mask():
    text = TextTransformer(V, CTX, dim=W, depth=2, n_head=2).eval()
    tokens = captions()  # caption 0 has 6 tokens and 2 of padding
    base = text(tokens)
    torch.testing.assert_close(text(tokens[:1, :6]), base[:1])  # the padding is never seen
    changed = tokens.clone()
    changed[:, 0] = (changed[:, 0] % (EOT - 1)) + 1  # a different first word: every caption changes
    assert not torch.isclose(text(changed), base).all(dim=-1).any()


def test_clip_features_are_unit_length_and_the_scale_starts_at_1_over_007_and_stops_at_100():
    net = CLIP(
        VisionTransformer(10, 8, 1, patch_size=4, dim=16, depth=1, n_head=2),
        TextTransformer(V, CTX, dim=W, depth=1, n_head=2),
        embed_dim=12,
    )
    images, texts, scale = net(torch.randn(3, 1, 8, 8), captions())
    assert images.shape == texts.shape == (3, 12)
    torch.testing.assert_close(images.norm(dim=-1), torch.ones(3))
    torch.testing.assert_close(texts.norm(dim=-1), torch.ones(3))
    assert scale.item() == pytest.approx(1 / 0.07, rel=1e-5)
    with torch.no_grad():
        net.logit_scale.fill_(math.log(1000.0))
    assert net.scale().item() == pytest.approx(100.0, rel=1e-5)
    from attnlab.training.optim import param_groups

    decay, no_decay = (set(map(id, g["params"])) for g in param_groups(net, 0.1))
    for name in ("logit_scale", "image.pos_embed", "text.embed.positions.emb.weight", "text.norm.weight"):
        assert id(net.get_parameter(name)) in no_decay, name
    assert id(net.get_parameter("text_proj.weight")) in decay


def test_loss_equals_open_clips():
    open_clip = pytest.importorskip("open_clip")
    g = torch.Generator().manual_seed(0)
    images = torch.nn.functional.normalize(torch.randn(6, 12, generator=g), dim=-1)
    texts = torch.nn.functional.normalize(torch.randn(6, 12, generator=g), dim=-1)
    scale = torch.tensor(14.3)
    ref = open_clip.ClipLoss(local_loss=False, gather_with_grad=False)
    expected = ref(image_features=images, text_features=texts, logit_scale=scale)
    torch.testing.assert_close(clip_loss(images, texts, scale), expected)
    # matching pairs aligned: a low loss; shuffled: a high one
    assert clip_loss(images, images, torch.tensor(100.0)) < 0.01 < clip_loss(images, images.roll(1, 0), scale)


def _gather_worker(rank: int, world: int, port: int, out: dict) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(0)
    images = torch.nn.functional.normalize(torch.randn(4 * world, 8, generator=g), dim=-1)
    texts = torch.nn.functional.normalize(torch.randn(4 * world, 8, generator=g), dim=-1)
    mine = slice(4 * rank, 4 * (rank + 1))
    local_images = images[mine].clone().requires_grad_()
    local_texts = texts[mine].clone().requires_grad_()
    loss = clip_loss(local_images, local_texts, torch.tensor(10.0))
    loss.backward()
    out[rank] = (loss.item(), local_images.grad.clone(), local_texts.grad.clone())
    dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_gather_contrasts_the_global_batch_and_keeps_gradients():
    world, port = 2, 29500 + os.getpid() % 1000
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_gather_worker, args=(world, port, out), nprocs=world, join=True)
        out = dict(out)
    g = torch.Generator().manual_seed(0)
    images = torch.nn.functional.normalize(torch.randn(4 * world, 8, generator=g), dim=-1).requires_grad_()
    texts = torch.nn.functional.normalize(torch.randn(4 * world, 8, generator=g), dim=-1).requires_grad_()
    loss = clip_loss(images, texts, torch.tensor(10.0))  # one process, the global batch
    loss.backward()
    for rank in range(world):
        rank_loss, image_grad, text_grad = out[rank]
        assert rank_loss == pytest.approx(loss.item(), rel=1e-5)  # every rank sees the whole batch
        # each rank's part gets every rank's gradient of the (same) global loss: DDP's mean undoes
        # the factor `world`
        mine = slice(4 * rank, 4 * (rank + 1))
        torch.testing.assert_close(image_grad, world * images.grad[mine])
        torch.testing.assert_close(text_grad, world * texts.grad[mine])


# -- metrics and zero-shot ------------------------------------------------------------------------
def test_recall_counts_identical_captions_as_one_and_ranks_correctly():
    from attnlab.training.contrastive import recall_at_k

    # 3 images, 2 distinct captions: images 0 and 1 share caption 0, image 2 has caption 1
    sim = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.3, 0.7]])
    r = recall_at_k(sim, torch.tensor([0, 0, 1]), ks=(1, 2))
    assert r["i2t_r1"] == pytest.approx(2 / 3) and r["i2t_r2"] == 1.0  # image 1 ranks its caption 2nd
    # caption 0's best image is image 0 (a right one), caption 1's is image 1 (wrong), then image 2
    assert r["t2i_r1"] == pytest.approx(2 / 3) and r["t2i_r2"] == 1.0


def test_zeroshot_classifier_averages_templates_and_renormalises():
    from attnlab.inference.zeroshot import zeroshot_accuracy, zeroshot_classifier

    class Fixed(torch.nn.Module):
        def encode_text(self, tokens):
            return torch.nn.functional.normalize(tokens.float(), dim=-1)

    prompts = torch.tensor([[1, 0], [1, 1], [0, 1], [0, 3]])  # 2 classes x 2 templates
    classifier = zeroshot_classifier(Fixed(), prompts, num_classes=2)
    mean0 = (torch.tensor([1.0, 0]) + torch.tensor([1, 1]) / 2**0.5) / 2
    torch.testing.assert_close(classifier[0], mean0 / mean0.norm())
    torch.testing.assert_close(classifier[1], torch.tensor([0.0, 1.0]))
    acc = zeroshot_accuracy(torch.tensor([[1.0, 0], [0, 1], [1, 0]]), classifier, torch.tensor([0, 1, 1]))
    assert acc[1] == pytest.approx(2 / 3) and acc[5] == 1.0


def test_a_tiny_clip_learns_to_tell_two_caption_classes_apart():
    from attnlab.data.text.tokenizers import CaptionTokenizer
    from attnlab.inference.zeroshot import class_embeddings, zeroshot_probs

    torch.manual_seed(0)
    texts = {0: "a bright square in the middle", 1: "a thin bar along the top"}
    tok = CaptionTokenizer.fit(list(texts.values()) * 4, 300)

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        labels = torch.arange(n) % 2
        images = torch.rand(n, 1, 16, 16) * 0.2
        images[labels == 0, :, 5:11, 5:11] = 1.0
        images[labels == 1, :, 0:2, :] = 1.0
        return images, tok.encode_captions([texts[int(y)] for y in labels], 12)[0], labels

    net = CLIP(
        VisionTransformer(0, 16, 1, patch_size=4, dim=32, depth=1, n_head=2),
        TextTransformer(tok.vocab_size, 12, dim=32, depth=1, n_head=2),
        embed_dim=16,
    )
    opt = torch.optim.AdamW(net.parameters(), 3e-3)
    for _ in range(80):
        loss = clip_loss(*net(*batch(16)[:2]))
        loss.backward()
        opt.step()
        opt.zero_grad()
    net.eval()
    images, _, labels = batch(20)
    classifier = class_embeddings(net, tok, 12, ["bright square", "thin bar"], ["a {} in the picture"])
    assert (zeroshot_probs(net, images, classifier).argmax(-1) == labels).all()


# -- captions and data ------------------------------------------------------------------------------
def test_measured_attributes_follow_the_pixels():
    from attnlab.data.multimodal import captions as cap

    images = torch.zeros(3, 1, 28, 28, dtype=torch.uint8)
    images[0, :, 10:14, 2:26] = 250  # wide, bright
    images[1, :, 2:26, 12:16] = 90  # tall, dark
    images[2, :, 4:24, 4:24] = 160  # large, square
    brightness, area, width = cap.measure(images).t()
    assert brightness[0] > brightness[2] > brightness[1]
    assert area[2] > area[0] and width[0] == pytest.approx(6.0) and width[1] == pytest.approx(1 / 6)
    labels = torch.zeros(3, dtype=torch.long)
    levels = cap.attribute_levels(
        cap.measure(images), labels, cap.tertile_cuts(cap.measure(images), labels, 1)
    )
    assert levels.tolist() == [[2, 0, 2], [0, 0, 0], [1, 2, 1]]  # per attribute: above 1/3, 2/3 cuts
    assert cap.caption("coat", levels[0].tolist(), "a {size}, {brightness} {c} ({width})") == (
        "a small, bright coat (wide)"
    )
    corpus = cap.caption_corpus(["coat"])
    assert len(corpus) == 27 * len(cap.TRAIN_TEMPLATES)
    assert not {t.format("coat") for t in cap.ZEROSHOT_TEMPLATES} & set(corpus)  # held out


def test_generated_caption_data_gives_batches_with_held_out_templates(tmp_path):
    from attnlab.data import ImageTextDataModule
    from attnlab.data.multimodal import captions as cap
    from conftest import write_idx_dataset

    folder = write_idx_dataset(tmp_path / "fm", n_train=60, n_test=20)
    data = ImageTextDataModule(
        source=Builtin("fashion_mnist", str(folder), val_size=10),
        batch_size=8,
        max_len=16,
        vocab_size=300,
    )
    data.setup("fit")
    images, tokens, labels = next(iter(data.train_dataloader()))
    assert images.shape == (8, 1, 28, 28) and images.dtype == torch.uint8 and tokens.shape == (8, 16)
    assert (tokens[:, 0] == 1).all() and ((tokens == 2).sum(1) == 1).all()  # <sot> ... <eot>, once
    assert data.model_kwargs() == {
        "image": {"img_size": 28, "in_chans": 1},
        "text": {"vocab_size": data.tokenizer.vocab_size, "max_len": 16, "pad_id": 0},
    }
    assert data.classes[9] == "ankle boot" and len(data.templates) == 8
    val, train = data.splits["val"], data.splits["train"]
    # evaluation: one fixed caption per image, the fullest template with the image's own class and
    # attribute levels, whichever epoch asks for it
    label, levels = int(val.labels[0]), val.levels[0].tolist()
    fixed = cap.caption(data.classes[label], levels, val.eval_template)
    words = [
        cap.ATTRIBUTE_WORDS[name][level] for name, level in zip(cap.ATTRIBUTE_WORDS, levels, strict=True)
    ]
    assert data.classes[label] in fixed and all(w in fixed for w in words)  # every attribute named
    assert val.caption(0) == fixed and {val.caption((epoch, 0)) for epoch in range(8)} == {fixed}
    # training: the same image phrased anew each epoch (so a fixed caption is not a given), but
    # the same draw for the same (epoch, index): a resumed run sees the same captions
    drawn = [train.caption((epoch, 0)) for epoch in range(8)]
    assert len(set(drawn)) > 1 and drawn == [train.caption((epoch, 0)) for epoch in range(8)]
    again = ImageTextDataModule(Builtin("fashion_mnist", str(folder), val_size=10), max_len=16)
    again.load_artifacts(data.artifacts())  # inference rebuilds the same tokenizer and normalisation
    assert again.tokenizer.to_json() == data.tokenizer.to_json() and again.mean == data.mean


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_pairs_files_load_resize_and_count_cut_captions(tmp_path, suffix, caplog):
    from attnlab.data import ImageTextDataModule

    path = write_pairs(tmp_path / "p", suffix=suffix)
    data = ImageTextDataModule(
        source=Pairs(str(path), val_size=3),
        img_size=8,
        in_chans=3,
        batch_size=4,
        max_len=6,
        vocab_size=300,
    )
    with caplog.at_level("WARNING"):
        data.setup("fit")
    assert "9 of 9 training captions are longer than data.max_len=6 tokens: cut" in caplog.text
    images, tokens, labels = next(iter(data.train_dataloader()))
    assert images.shape == (4, 3, 8, 8) and tokens.shape == (4, 6) and (labels == -1).all()
    assert (tokens[:, -1] == 2).all()  # a cut caption still ends in <eot>


def test_missing_images_empty_captions_labels_and_templates_are_clear_errors(tmp_path, caplog):
    from attnlab.core.errors import ConfigError, DataError
    from attnlab.data import ImageTextDataModule
    from attnlab.inference.zeroshot import parse_labels, read_templates

    path = write_pairs(tmp_path / "m", missing=2)
    strict = ImageTextDataModule(Pairs(str(path), val_size=3), img_size=8)
    with pytest.raises(
        DataError,
        match=r"2 of 12 listed images are missing or unreadable \(first: .*img0.png\); "
        "set data.source.on_bad_record=skip",
    ):
        strict.setup("fit")
    lenient = ImageTextDataModule(Pairs(str(path), val_size=3, on_bad_record="skip"), img_size=8)
    with caplog.at_level("WARNING"):
        lenient.setup("fit")
    assert (
        "2 of 12 listed images are missing or unreadable" in caplog.text and len(lenient.splits["train"]) == 7
    )
    empty = tmp_path / "empty.csv"
    empty.write_text("image,caption\nimg.png,a cat\nimg2.png,   \n")
    with pytest.raises(DataError, match=r"empty.csv:3: empty caption"):
        ImageTextDataModule(Pairs(str(empty), val_size=1)).setup("fit")
    with pytest.raises(ConfigError, match="labels: an empty label list"):
        parse_labels(" , ")
    templates = tmp_path / "t.txt"
    templates.write_text("a photo of a {}.\na photo of a thing.\n")
    with pytest.raises(DataError, match=r"t.txt:2: a template needs \{\} where the class name goes"):
        read_templates(str(templates))


# -- the run and its CLI ------------------------------------------------------------------------------
def test_clip_run_then_zeroshot_cli_on_an_image_and_on_the_test_split(tmp_path):
    from PIL import Image

    from conftest import assert_user_error, clip_overrides, run_cli

    args = [
        "experiment=clip_fashion_mnist",
        *clip_overrides("clip_fashion_mnist", tmp_path),
        "logger=csv",
        "trainer.max_steps=12",
        "trainer.val_check_interval=6",
        "extras.print_config=false",
    ]
    proc = run_cli("train", args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "logs" / "clip_fashion_mnist" / "runs").iterdir()
    assert (run_dir / "similarity" / "similarity.png").read_bytes()[:4] == b"\x89PNG"
    metrics = (run_dir / "csv" / "metrics.csv").read_text()
    assert all(k in metrics for k in ("test/zeroshot_acc", "test/i2t_r1", "test/t2i_r10", "val/zeroshot_acc"))

    Image.new("RGB", (40, 40), (200, 200, 200)).save(tmp_path / "shoe.png")  # RGB: converted, noted
    ask = ["ckpt_path=last", "image=shoe.png", "labels=sneaker, bag ,coat", "top_k=2"]
    proc = run_cli("zeroshot", ask, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip()
    assert line.startswith("shoe.png: ") and len(line.split(", ")) == 2 and "converted" in proc.stderr
    (tmp_path / "shoes").mkdir()
    for i in range(3):
        Image.new("RGB", (40, 40), (60 * i, 200, 200)).save(tmp_path / "shoes" / f"{i}.png")
    proc = run_cli("zeroshot", ["ckpt_path=last", "image=shoes", "labels=sneaker,bag"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()  # a folder: one line per image on stdout, progress on stderr
    assert len(lines) == 3 and all(line.startswith("shoes/") for line in lines)
    assert "labelling" in proc.stderr and "3/3" in proc.stderr
    (tmp_path / "prompts.txt").write_text("a photo of a {}.\n\nthe {}, seen from above\n")
    split = ["ckpt_path=last", "split=test", "templates=prompts.txt"]
    proc = run_cli("zeroshot", split, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("zero-shot test: top-1 ") and "(20 images, 2 templates)" in proc.stdout
    (tmp_path / "bad.txt").write_text("a photo of a cat\n")
    assert_user_error(
        run_cli("zeroshot", ["ckpt_path=last", "split=test", "templates=bad.txt"], tmp_path),
        "bad.txt:1: a template needs {} where the class name goes",
    )
    assert_user_error(
        run_cli("zeroshot", ["ckpt_path=last", "image=shoe.png", "labels=,"], tmp_path),
        "labels: an empty label list",
    )
