"""The Perceiver: any image size through one set of weights, weights shared across repeats, the
paper's Fourier features, invariance to the order of the inputs, and learning through the CLI."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from attnlab.models import Perceiver
from attnlab.nn import fourier_features
from conftest import QUIET, VISION_NETS, needs_shared, read_metrics, run_dirs, run_main
from test_classification import write_quadrant_idx

TINY = dict(num_classes=10, img_size=28, in_chans=1, n_latents=8, dim=32, depth=1, n_head=2, n_bands=4)


def n_params(net: torch.nn.Module) -> int:
    return sum(p.numel() for p in net.parameters())


@pytest.mark.parametrize("size", [28, 56, 112])
def test_any_image_size_runs_through_the_same_latents(size):
    torch.manual_seed(0)
    net = Perceiver(**TINY).eval()
    images = torch.randn(2, 1, size, size)
    assert net.byte_array(images).shape == (2, size * size, 1 + 2 + 4 * 4)
    assert net.forward_features(images).shape == (2, 8, 32)  # N x D whatever the size
    assert net(images).shape == (2, 10)
    maps = net.patch_attention(images)
    assert {m.shape for m in maps.values()} == {(2, size, size)}
    for m in maps.values():  # each latent's weights over the pixels sum to 1, per head
        assert torch.allclose(m.sum((1, 2)), torch.full((2,), 8.0), atol=1e-4)


def test_repeats_share_their_weights():
    """Every repeat after the first runs the same cross-attention and the same latent tower: the
    parameters do not grow with the repeats, and the shared modules run once per repeat."""
    sizes = {r: n_params(Perceiver(**TINY, repeats=r)) for r in (1, 2, 3, 6)}
    assert sizes[2] == sizes[3] == sizes[6] > sizes[1]  # repeats=1: no shared cross-attention
    net = Perceiver(**TINY, repeats=4)
    calls = {"cross_first": 0, "cross": 0, "blocks.0": 0}
    for name in calls:
        net.get_submodule(name).register_forward_hook(
            lambda m, i, o, name=name: calls.__setitem__(name, calls[name] + 1)
        )
    net(torch.randn(2, 1, 28, 28)).sum().backward()
    assert calls == {"cross_first": 1, "cross": 3, "blocks.0": 4}
    assert all(p.grad is not None for p in net.parameters())  # every weight is used


def test_fourier_features_hand_computed_and_as_the_papers_code():
    """The paper's features: [x_row, x_col, sin(pi f_k x_d), cos(pi f_k x_d)], coordinates over
    [-1, 1] and bands spaced from 1 to the Nyquist frequency; equal to transformers' Perceiver."""
    from transformers.models.perceiver.modeling_perceiver import (
        build_linear_positions,
        generate_fourier_features,
    )

    f = fourier_features(3, 5, n_bands=2, max_freq=(1.5, 2.5))  # (15, 2 + 8)
    # pixel (row 2, column 1) of the 3 x 5 grid: x_row = 1.0, x_col = -0.5; bands (1, 1.5), (1, 2.5)
    row, col = 1.0, -0.5
    angles = [math.pi * row, math.pi * 1.5 * row, math.pi * col, math.pi * 2.5 * col]
    expected = [row, col, *map(math.sin, angles), *map(math.cos, angles)]
    assert torch.allclose(f[2 * 5 + 1], torch.tensor(expected), atol=1e-6)

    pos = build_linear_positions((28, 28)).reshape(1, 28 * 28, 2)
    reference = generate_fourier_features(pos, num_bands=8, max_resolution=(28, 28))[0]
    assert torch.allclose(fourier_features(28, 28, 8, (14.0, 14.0)), reference, atol=1e-5)


def test_each_element_holds_the_neighbourhood_of_its_pixel():
    """neighbourhood=3: the element of pixel (i, j) holds the 3 x 3 pixels around it, channel by
    channel, row by row, zeros past the border, then the same position features; even sides refused."""
    torch.manual_seed(0)
    images = torch.randn(2, 2, 6, 5)
    net = Perceiver(**{**TINY, "in_chans": 2, "img_size": 6}, neighbourhood=3)
    inputs = net.byte_array(images)
    assert inputs.shape == (2, 6 * 5, 2 * 9 + 2 + 4 * 4)
    padded = F.pad(images, (1, 1, 1, 1))
    for i, j in [(0, 0), (2, 3), (5, 4)]:
        around = padded[:, :, i : i + 3, j : j + 3].flatten(1)  # (B, C * 9)
        assert torch.equal(inputs[:, i * 5 + j, :18], around)
    alone = Perceiver(**{**TINY, "in_chans": 2, "img_size": 6}).byte_array(images)
    assert torch.equal(inputs[..., 18:], alone[..., 2:])  # the same position features
    assert torch.equal(inputs[..., [4, 13]], alone[..., :2])  # each channel's centre: the pixel
    assert net(images).shape == (2, 10)
    with pytest.raises(ValueError, match="^neighbourhood: must be odd"):
        Perceiver(**TINY, neighbourhood=2)
    with pytest.raises(ValueError, match=r"^cross_heads: must divide dim \(32\), got 3$"):
        Perceiver(**TINY, cross_heads=3)


def test_the_output_does_not_depend_on_the_order_of_the_pixels():
    """Shuffling the pixels together with their position features changes nothing: the Perceiver
    sees a set, whose positions travel in the features."""
    torch.manual_seed(0)
    net = Perceiver(**TINY).eval()
    inputs = net.byte_array(torch.randn(2, 1, 28, 28))
    order = torch.randperm(inputs.size(1))
    latents, _ = net.encode(inputs)
    shuffled, _ = net.encode(inputs[:, order])
    assert torch.allclose(latents, shuffled, atol=1e-5)
    # while shuffling the pixels alone (their positions left in place) is another image
    pixels_moved = torch.cat([inputs[:, order, :1], inputs[:, :, 1:]], dim=-1)
    assert not torch.allclose(latents, net.encode(pixels_moved)[0], atol=1e-3)


def test_the_inputs_are_projected_once_for_the_repeats_that_share_a_cross_attention():
    torch.manual_seed(0)
    net = Perceiver(**TINY)
    inputs = net.byte_array(torch.randn(2, 1, 28, 28))
    calls = []
    net.cross.attn.kv_proj.register_forward_hook(lambda *_: calls.append(1))
    net.encode(inputs)
    assert len(calls) == 1 and net.repeats > 2
    # keys and values straight from the byte array's channels: one linear map of C' inputs
    assert net.cross_first.attn.kv_proj.in_features == inputs.size(-1)


def test_loss_falls_on_a_real_batch():
    from attnlab.data.vision.datasets import load_idx_dataset

    splits = load_idx_dataset("fashion_mnist", str(needs_shared("fashion_mnist")), "data")
    x = (splits.train_images[:32].float() / 255 - 0.286) / 0.353
    y = splits.train_labels[:32]
    torch.manual_seed(0)
    net = Perceiver(**TINY)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    losses = []
    for _ in range(40):
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses[::8]  # 2.31 -> 1.25 here


def test_a_tiny_perceiver_run_learns_where_the_light_is(tmp_path):
    """attnlab-train's Perceiver recipe (EMA validated and tested), cut to a tiny net and 100 steps,
    learns which quadrant of noise is bright: only the pixels' positions tell the classes apart."""
    data = write_quadrant_idx(tmp_path / "quadrants")
    status, out = run_main(
        "train",
        [
            "experiment=perceiver_fashion_mnist",
            "task_name=quadrants",
            f"paths.root_dir={tmp_path}",
            *QUIET,
            f"data.source.data_dir={data}",
            "data.source.val_size=40",
            "data.batch_size=32",
            "data.crop_padding=0",  # no augmentation: a flip moves the bright quadrant, the class
            "data.hflip=0.0",
            *VISION_NETS["perceiver"],
            "model.net.cross_heads=2",  # finds the bright quadrant sooner than one head
            "model.plot_images=0",
            "model.optim.optimizer.lr=1e-2",
            "model.optim.scheduler.warmup_steps=5",
            "trainer.max_steps=100",
            "trainer.val_check_interval=25",
            "trainer.log_every_n_steps=5",
        ],
    )
    assert status == 0, out[-3000:]
    (run_dir,) = run_dirs(tmp_path, "quadrants")
    metrics = read_metrics(run_dir)
    losses = [v for _, v in metrics["train/loss"]]
    assert losses[-1] < 0.5 * losses[0], losses
    assert metrics["test/acc"][-1][1] >= 0.9, metrics["test/acc"]


def quadrant_scenes(n: int, seed: int, side: int = 8) -> list[dict[str, torch.Tensor]]:
    """A multi-label set: side x side noise where each quadrant is bright or not, its own class
    (any number of the 4 at once); the scenes' batch layout (``image``, multi-hot ``target``)."""
    g = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, 2, (n, 4), generator=g).float()
    images = torch.rand(n, 1, side, side, generator=g) * 0.3
    half = side // 2
    for image, target in zip(images, targets, strict=True):
        for q in target.nonzero().flatten().tolist():
            row, col = divmod(q, 2)
            image[:, half * row : half * (row + 1), half * col : half * (col + 1)] += 1.0
    return [{"image": x, "target": y} for x, y in zip(images, targets, strict=True)]


def test_multilabel_classification_learns_which_quadrants_are_bright():
    """``model.multilabel``: binary cross-entropy per class on dict batches (the scenes' layout);
    over 80 steps the validation loss falls and accuracy, F1 and exact match rise."""
    import lightning as L
    from torch.utils.data import DataLoader

    from attnlab.training import ImageClassificationTask
    from attnlab.training.optim import Optimization

    torch.manual_seed(0)
    net = Perceiver(**{**TINY, "num_classes": 4, "img_size": 8, "n_latents": 4})
    task = ImageClassificationTask(
        net,
        Optimization(lambda p: torch.optim.AdamW(p, lr=5e-3)),
        plot_images=0,
        multilabel=True,
    )
    train = DataLoader(quadrant_scenes(320, 0), batch_size=32, shuffle=True)
    val = DataLoader(quadrant_scenes(64, 1), batch_size=32)
    trainer = L.Trainer(
        max_steps=80,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    (before,) = trainer.validate(task, val, verbose=False)
    trainer.fit(task, train)
    (after,) = trainer.validate(task, val, verbose=False)
    assert {"val/loss", "val/acc", "val/f1", "val/exact_match"} <= set(after), after
    assert after["val/loss"] < 0.85 * before["val/loss"], (before, after)
    for metric in ("val/acc", "val/f1", "val/exact_match"):
        assert after[metric] > before[metric] + 0.05, (metric, before, after)


def test_multilabel_loss_is_binary_cross_entropy_with_smoothed_targets():
    from attnlab.training import ImageClassificationTask
    from attnlab.training.optim import Optimization

    task = ImageClassificationTask(Perceiver(**TINY), Optimization(torch.optim.AdamW), multilabel=True)
    logits, targets = torch.randn(3, 10), torch.randint(0, 2, (3, 10)).float()
    expected = F.binary_cross_entropy_with_logits(logits, targets * 0.9 + 0.05)
    assert torch.allclose(task.loss(logits, targets, label_smoothing=0.1), expected)
