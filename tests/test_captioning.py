"""Show, Attend and Tell, the captioning task and beam search, ``attnlab-caption``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attnlab.inference.captioning import caption_batch
from attnlab.inference.decoding import beam_search
from attnlab.models import ShowAttendTell
from conftest import QUIET, assert_ok, assert_user_error, read_metrics, run_cli, run_dirs
from test_debug_matrix import tiny_overrides

BOS, EOS, V = 1, 2, 12


def tiny_net(encoder: str = "cnn", **kw) -> ShowAttendTell:
    torch.manual_seed(0)
    size = dict(enc_dim=16, enc_depth=2, dim=8, hidden=16, attn_dim=8, patch_size=8, n_head=2)
    return ShowAttendTell(V, 32, 1, encoder=encoder, **(size | kw)).eval()


@pytest.mark.parametrize("encoder, grid", [("cnn", (8, 8)), ("vit", (4, 4))])
def test_shapes_and_attention_sums_to_one(encoder, grid):
    net = tiny_net(encoder)
    images, tokens = torch.randn(3, 1, 32, 32), torch.randint(3, V, (3, 5))
    logits, attn = net(images, tokens)
    assert net.grid == grid
    assert logits.shape == (3, 5, V) and attn.shape == (3, 5, grid[0] * grid[1])
    assert torch.allclose(attn.sum(-1), torch.ones(3, 5), atol=1e-6) and (attn >= 0).all()


def test_a_vit_encoder_of_a_width_its_heads_do_not_divide_names_enc_dim():
    with pytest.raises(ValueError, match=r"^enc_dim: must be divisible by n_head \(3\), got 16$"):
        tiny_net("vit", n_head=3)
    assert tiny_net("cnn", n_head=3).grid == (8, 8)  # the CNN has no heads


@pytest.mark.parametrize("encoder", ["cnn", "vit"])
def test_step_by_step_decoding_equals_teacher_forcing(encoder):
    net = tiny_net(encoder)
    images, tokens = torch.randn(2, 1, 32, 32), torch.randint(3, V, (2, 6))
    tokens[:, 0] = BOS
    logits, attn = net(images, tokens)
    state = net.start(images)
    for t in range(tokens.size(1)):
        step_logits, state = net.step(tokens[:, t], state)
        torch.testing.assert_close(step_logits, logits[:, t], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state["attn"], attn[:, t], atol=1e-6, rtol=1e-5)


def test_reorder_keeps_the_rows_asked_for():
    net = tiny_net()
    state = net.start(torch.randn(3, 1, 32, 32))
    kept = net.reorder(state, torch.tensor([2, 2, 0]))
    for key, value in state.items():
        assert torch.equal(kept[key], value[[2, 2, 0]]), key


def test_beam_size_one_is_greedy():
    """The batched beam search with one beam (its own code path) picks greedy decoding's words;
    every word's attention is a distribution over the 8 x 8 positions."""
    net = tiny_net()
    images = torch.randn(4, 1, 32, 32)
    greedy = caption_batch(net, images, BOS, EOS, max_len=7, beam_size=1)
    beam1 = beam_search(net, images, BOS, EOS, 7, beam_size=1, alpha=0.0)
    assert [ids for ids, _ in greedy] == beam1
    for ids, attn in greedy:
        assert attn.shape == (len(ids), 64)
        assert torch.allclose(attn.sum(-1), torch.ones(len(ids)), atol=1e-5)
    wide = caption_batch(net, images, BOS, EOS, max_len=7, beam_size=3)
    assert len(wide) == 4 and all(len(ids) <= 7 and EOS not in ids for ids, _ in wide)


def test_word_attention_is_the_attention_of_step_by_step_decoding():
    net = tiny_net()
    images = torch.randn(2, 1, 32, 32)
    (ids, attn), _ = caption_batch(net, images, BOS, EOS, max_len=5)
    state, token = net.start(images[:1]), torch.tensor([BOS])
    for t, word in enumerate(ids):
        _, state = net.step(token, state)
        torch.testing.assert_close(state["attn"][0], attn[t], atol=1e-6, rtol=1e-5)
        token = torch.tensor([word])


def test_doubly_stochastic_penalty_on_a_constructed_map():
    """sum_s (1 - sum_t attn_ts)^2 over the caption's steps, averaged over captions."""
    from attnlab.training.captioning import doubly_stochastic_penalty

    attn = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]], [[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]]])
    every = torch.ones(2, 2, dtype=torch.bool)
    # caption 0: totals (1, 1, 0) -> 1; caption 1: totals (1, 1, 0) -> 1
    assert doubly_stochastic_penalty(attn, every).item() == pytest.approx(1.0)
    first = torch.tensor([[True, False], [True, False]])  # the second step is padding
    # caption 0: totals (1, 0, 0) -> 2; caption 1: (0.5, 0.5, 0) -> 0.25 + 0.25 + 1 = 1.5
    assert doubly_stochastic_penalty(attn, first).item() == pytest.approx(1.75)


# ---- through the CLIs ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def captioner(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny sat_scenes run overfitting one batch of fake scenes: its folder and working folder."""
    cwd = tmp_path_factory.mktemp("sat")
    args = [
        "experiment=sat_scenes",
        *QUIET,
        *tiny_overrides("sat_scenes", cwd),
        "trainer.overfit_batches=1",
        "trainer.max_steps=40",
        "trainer.val_check_interval=20",
        "trainer.log_every_n_steps=5",
        "model.optim.scheduler=null",
        "model.optim.optimizer.lr=1e-2",
        "model.attention_reg=0.01",  # off in the recipe; its path is trained and logged here
    ]
    proc = run_cli("train", args, cwd)
    assert_ok(proc)
    (run_dir,) = run_dirs(cwd, "sat_scenes")
    return run_dir, cwd


def test_the_loss_falls_on_a_batch_and_the_run_scores_draws_and_writes_captions(captioner):
    run_dir, _ = captioner
    m = read_metrics(run_dir)
    losses = [v for _, v in m["train/loss"]]
    assert losses[-1] < 0.5 * losses[0], losses
    assert m["train/attention_reg"]
    for key in (
        "val/bleu4",
        "val/cider",
        "val/exact_match",
        "val/grounding",
        "test/cider",
        "test/exact_match",
    ):
        assert key in m, key
    assert len(list((run_dir / "caption_attention").glob("*.png"))) == 2  # one image, 2 validations
    assert len((run_dir / "test_captions.txt").read_text().splitlines()) == 12  # every test scene


def test_attnlab_caption_prints_the_caption_and_draws_each_words_attention(captioner):
    from PIL import Image, ImageDraw

    run_dir, cwd = captioner
    image = Image.new("L", (80, 72))  # not the run's 64x64: resized
    ImageDraw.Draw(image).rectangle((4, 4, 30, 30), fill=255)
    image.save(cwd / "scene.png")
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    proc = run_cli("caption", [f"ckpt_path={ckpt}", "image=scene.png", "beam_size=2"], cwd)
    assert_ok(proc)
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith("scene.png: ") and len(line) > len("scene.png: "), proc.stdout
    assert (cwd / "scene_attention.png").stat().st_size > 0
    assert "resized" in proc.stderr


@pytest.mark.parametrize(
    "name, content, needle",
    [("absent.png", None, "no such file or folder"), ("broken.png", b"not a png", "not a readable image")],
)
def test_attnlab_caption_refuses_a_bad_image_in_one_line(captioner, name, content, needle):
    run_dir, cwd = captioner
    if content is not None:
        (cwd / name).write_bytes(content)
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    proc = run_cli("caption", [f"ckpt_path={ckpt}", f"image={name}"], cwd)
    assert_user_error(proc, needle)
    assert len((proc.stdout + proc.stderr).strip().splitlines()) == 1


def test_attnlab_caption_refuses_a_run_of_another_task(trained, tmp_path):
    """A language model's checkpoint: one line saying what the command needs."""
    image = tmp_path / "one.png"
    from conftest import blank_image

    blank_image(image)
    proc = run_cli(
        "caption", [f"ckpt_path={trained / 'checkpoints' / 'last.ckpt'}", f"image={image}"], tmp_path
    )
    assert_user_error(proc, "attnlab-caption needs a captioning model")
