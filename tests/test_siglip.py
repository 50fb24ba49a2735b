"""SigLIP (``model.loss=siglip``): the loss against open_clip's SigLipLoss on one process and
gathered on two, its start (scale 10, bias -10), its split loss, and a bad loss name refused."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from torch.nn.functional import normalize

from attnlab.training.contrastive import siglip_loss, split_siglip_loss

open_clip = pytest.importorskip("open_clip")
B, E, WORLD = 4, 8, 2


def features(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return normalize(torch.randn(n, E, generator=g), dim=-1), normalize(
        torch.randn(n, E, generator=g), dim=-1
    )


def test_loss_equals_open_clips_siglip_and_its_split_form():
    images, texts = features(6)
    scale, bias = torch.tensor(10.0), torch.tensor([-10.0])
    expected = open_clip.loss.SigLipLoss()(images, texts, scale, bias)
    torch.testing.assert_close(siglip_loss(images, texts, scale, bias), expected, rtol=0, atol=1e-5)
    # the whole split a few rows at a time gives the same loss
    torch.testing.assert_close(
        split_siglip_loss(images, texts, scale, bias, chunk=4), expected, rtol=0, atol=1e-5
    )
    # orthogonal pairs aligned: a low loss; shuffled: a high one
    pairs = torch.eye(6, E)
    low, high = (siglip_loss(pairs, t, torch.tensor(100.0), bias) for t in (pairs, pairs.roll(1, 0)))
    assert low < 0.01 < 1 < high


def _worker(rank: int, port: int, folder: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool: it hangs
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    images, texts = features(B * WORLD)
    mine = slice(B * rank, B * (rank + 1))
    results = []
    for loss in ("ours", "open_clip"):
        local_images = images[mine].clone().requires_grad_()
        local_texts = texts[mine].clone().requires_grad_()
        scale, bias = torch.tensor(10.0), torch.tensor([-10.0])
        if loss == "ours":
            value = siglip_loss(local_images, local_texts, scale, bias)
        else:  # neighbour exchange: this rank's images against every rank's captions
            value = open_clip.loss.SigLipLoss(rank=rank, world_size=WORLD)(
                local_images, local_texts, scale, bias
            )
        value.backward()
        results.append((value.item(), local_images.grad.clone(), local_texts.grad.clone()))
    torch.save(results, f"{folder}/{rank}.pt")
    dist.destroy_process_group()


def test_gathered_on_two_processes_equals_open_clips_neighbour_exchange(tmp_path):
    port = 29500 + os.getpid() % 1000 + 7
    method = "spawn" if torch.cuda.is_initialized() else "fork"  # fork: no second start of torch
    mp.start_processes(_worker, args=(port, str(tmp_path)), nprocs=WORLD, start_method=method)
    out = {rank: torch.load(tmp_path / f"{rank}.pt") for rank in range(WORLD)}
    images, texts = features(B * WORLD)
    whole = siglip_loss(images, texts, torch.tensor(10.0), torch.tensor([-10.0]))  # one process
    ours, theirs = zip(*(out[r] for r in range(WORLD)), strict=True)
    for rank in range(WORLD):  # every rank scores the whole global batch
        assert ours[rank][0] == pytest.approx(whole.item(), abs=1e-5)
    # open_clip's rank losses each score their own images' rows: their mean is the global loss
    assert sum(t[0] for t in theirs) / WORLD == pytest.approx(whole.item(), abs=1e-5)
    # and each rank's features get the same gradients (after DDP's mean: the same update)
    for rank in range(WORLD):
        torch.testing.assert_close(ours[rank][1], theirs[rank][1], rtol=0, atol=1e-5)
        torch.testing.assert_close(ours[rank][2], theirs[rank][2], rtol=0, atol=1e-5)


def test_siglip_task_starts_at_scale_10_and_bias_minus_10_and_clip_keeps_its_own():
    from attnlab.models import CLIP, TextTransformer, VisionTransformer
    from attnlab.training import ContrastiveTask
    from attnlab.training.optim import Optimization

    def task(loss: str) -> ContrastiveTask:
        image = VisionTransformer(
            img_size=8, in_chans=1, patch_size=4, dim=8, depth=1, n_head=2, num_classes=0
        )
        net = CLIP(image, TextTransformer(vocab_size=10, max_len=4, dim=8, depth=1, n_head=2), embed_dim=8)
        return ContrastiveTask(net, Optimization(optimizer=torch.optim.AdamW), loss=loss)

    siglip, clip = task("siglip"), task("clip")
    assert siglip.net.scale().item() == pytest.approx(10.0)
    assert siglip.logit_bias.item() == -10.0 and "logit_bias" in siglip.state_dict()
    assert clip.net.scale().item() == pytest.approx(1 / 0.07) and "logit_bias" not in clip.state_dict()
    decay, no_decay = (
        set(map(id, g["params"])) for g in siglip.configure_optimizers()["optimizer"].param_groups
    )
    assert id(siglip.logit_bias) in no_decay  # learned, not decayed


def test_a_bad_loss_name_is_one_line(tmp_path):
    from conftest import assert_user_error, clip_overrides, run_cli

    args = [
        "experiment=clip_fashion_mnist",
        *clip_overrides("clip_fashion_mnist", tmp_path),
        "model.loss=hinge",
    ]
    proc = run_cli("train", args, tmp_path)
    assert_user_error(proc, "model.loss", "siglip")
    assert len([line for line in (proc.stdout + proc.stderr).splitlines() if "error" in line]) == 1
