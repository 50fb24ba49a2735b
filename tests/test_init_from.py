"""``model.init_from`` with one of our own runs: the whole net carried over, a head of another
size started fresh, anything else that does not fit refused by name."""

from __future__ import annotations

import logging

import pytest
import torch
from omegaconf import OmegaConf

from attnlab.core.errors import CheckpointError
from attnlab.models import VisionTransformer
from attnlab.weights.checkpoint import load_checkpoint, metadata
from attnlab.weights.init import load_init
from conftest import TINY, run_main

VIT = dict(img_size=28, in_chans=1, patch_size=7, dim=48, depth=2, n_head=3)


def gpt_run(tmp_path, task: str, *extra: str) -> tuple[dict, str]:
    status, out = run_main(
        "train",
        [
            "experiment=gpt_pydoc_char",
            f"task_name={task}",
            f"paths.root_dir={tmp_path}",
            "logger=csv",
            *TINY,
            *extra,
        ],
    )
    assert status == 0, out[-3000:]
    [ckpt] = (tmp_path / "logs" / task / "runs").glob("*/checkpoints/last.ckpt")
    return load_checkpoint(ckpt), str(ckpt)


def test_a_gpt_starts_from_a_run_named_by_its_task_with_its_tokenizer(tmp_path):
    before, path = gpt_run(tmp_path, "pre")
    after, _ = gpt_run(
        tmp_path,
        "tuned",
        "model.init_from=pre",
        "model.optim.optimizer.lr=0.0",
        "trainer.max_steps=1",
        "test=false",
    )
    net = {k: v for k, v in before["state_dict"].items() if k.startswith("net.")}
    assert net and all(torch.equal(after["state_dict"][k], v) for k, v in net.items())  # lr 0: unchanged
    tuned = metadata(after, path)
    assert tuned["artifacts"]["tokenizer"] == metadata(before, path)["artifacts"]["tokenizer"]
    assert OmegaConf.create(tuned["config"]).model.init_from == path  # the file, not the task name


def saved_vit(tmp_path, **kwargs) -> tuple[VisionTransformer, str]:
    torch.manual_seed(0)
    net = VisionTransformer(**{**VIT, **kwargs})
    path = tmp_path / "vit.ckpt"
    torch.save({"state_dict": {f"net.{k}": v for k, v in net.state_dict().items()}}, path)
    return net, str(path)


def test_a_head_of_another_size_starts_fresh_the_rest_is_copied(tmp_path, caplog):
    source, path = saved_vit(tmp_path, num_classes=10)
    torch.manual_seed(1)
    net = VisionTransformer(**VIT, num_classes=3)
    head = net.head.weight.clone()
    with caplog.at_level(logging.INFO):
        load_init(net, path)
    assert "head.weight, head.bias differ in size" in caplog.text
    assert torch.equal(net.head.weight, head)
    assert torch.equal(net.pos_embed, source.pos_embed) and torch.equal(
        net.blocks[1].mlp.fc2.weight, source.blocks[1].mlp.fc2.weight
    )


def test_a_body_tensor_that_does_not_fit_is_refused_by_name(tmp_path):
    _, path = saved_vit(tmp_path, num_classes=10, dim=24)
    with pytest.raises(
        CheckpointError,
        match=r"init_from\) does not match.*pos_embed: checkpoint \(1, 17, 24\) vs model \(1, 17, 48",
    ):
        load_init(VisionTransformer(**VIT, num_classes=10), path)


def test_a_clips_image_tower_fills_a_classifier_whose_head_starts_fresh(tmp_path, caplog):
    """A CLIP run's net holds the image tower under ``image.``: a ViT classifier of its shape takes
    that part (the text tower and projections left out) and starts its head fresh."""
    from attnlab.models import CLIP, TextTransformer

    torch.manual_seed(0)
    clip = CLIP(
        VisionTransformer(**VIT, num_classes=0),
        TextTransformer(vocab_size=20, max_len=8, dim=16, depth=1, n_head=2),
        16,
    )
    path = tmp_path / "clip.ckpt"
    torch.save({"state_dict": {f"net.{k}": v for k, v in clip.state_dict().items()}}, path)
    torch.manual_seed(1)
    net = VisionTransformer(**VIT, num_classes=3)
    head = net.head.weight.clone()
    with caplog.at_level(logging.INFO):
        load_init(net, str(path))
    assert f"the net is {path}'s image" in caplog.text and "has no head.weight, head.bias" in caplog.text
    assert torch.equal(net.head.weight, head)
    tower = clip.image.state_dict()
    assert all(torch.equal(net.state_dict()[k], v) for k, v in tower.items())
    # a tower of another width: refused, its tensors named
    with pytest.raises(
        CheckpointError, match=r"init_from\) does not match.*cls_token: checkpoint \(1, 1, 48\)"
    ):
        load_init(VisionTransformer(**{**VIT, "dim": 24, "n_head": 2}, num_classes=3), str(path))
