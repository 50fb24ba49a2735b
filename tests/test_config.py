"""Every config composes and instantiates; schedules, W&B mode and the CPU settings behave."""

import math
import os
import platform
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import get_class, instantiate
from lightning.pytorch import Callback
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import OmegaConf
from torch import nn

from attnlab.cli.common import config_dir
from attnlab.core.config import check_types, fill_missing
from attnlab.core.cpu import keep_freed_memory, tune_cpu_for_training
from attnlab.core.errors import ConfigError
from attnlab.training.schedules import WarmupCosine, WarmupInverseSqrt
from attnlab.training.wandb_mode import ensure_wandb_mode
from attnlab.weights.checkpoint import metadata
from conftest import (
    FLAMINGO_RECIPE,
    bert_overrides,
    captioning_overrides,
    clip_overrides,
    flamingo_overrides,
    vision_overrides,
)

CONF = Path(config_dir())


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def composed(*overrides: str, tmp: Path):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=[f"paths.output_dir={tmp}", *overrides])


@pytest.mark.parametrize("experiment", options("experiment"))
def test_experiments_build_their_model_and_data(experiment, tmp_path):
    flamingo = experiment in FLAMINGO_RECIPE  # its convnet, its GPT, the captioner
    text = experiment.startswith(("nmt_", "gpt_", "gpt2_")) and not flamingo
    bert, clip = experiment.startswith("bert_"), experiment.startswith("clip_")
    captioning = experiment.startswith("sat_") or experiment == "flamingo_scenes"
    if flamingo:
        cfg = composed(f"experiment={experiment}", *flamingo_overrides(experiment, tmp_path), tmp=tmp_path)
    elif text:
        corpus = "synthetic" if experiment.startswith("nmt_") else "pydoc"  # no download either way
        scratch = ["model.init_from=null"] if experiment.startswith("gpt2_") else []  # not the hub's
        cfg = composed(f"experiment={experiment}", f"data/source={corpus}", *scratch, tmp=tmp_path)
    elif bert:
        cfg = composed(f"experiment={experiment}", *bert_overrides(experiment, tmp_path), tmp=tmp_path)
    elif clip:
        cfg = composed(f"experiment={experiment}", *clip_overrides(experiment, tmp_path), tmp=tmp_path)
    elif captioning:
        cfg = composed(f"experiment={experiment}", *captioning_overrides(experiment, tmp_path), tmp=tmp_path)
    else:
        cfg = composed(f"experiment={experiment}", *vision_overrides(experiment, tmp_path), tmp=tmp_path)
    dm = instantiate(cfg.data)
    dm.setup()
    fill_missing(cfg.model.net, dm.model_kwargs(), "model.net")
    task = instantiate(cfg.model)
    if text or experiment == "gpt_scene_captions":
        vocab = dm.model_kwargs()["vocab_size"]
        ids = torch.randint(4, vocab, (2, 5))
        logits = task.net(ids, ids) if experiment.startswith("nmt_") else task.net(ids)
        assert logits.shape == (2, 5, vocab)
    elif bert:
        batch = next(iter(dm.val_dataloader()))
        out = task.net(batch["ids"], batch["segments"])
        if "pretrain" in experiment:
            assert out[0].shape[:2] == batch["ids"].shape and out[1].shape == (len(batch["ids"]), 2)
        else:
            per_token = "ner" in experiment
            assert out.shape == (*batch["ids"].shape[: 1 + per_token], dm.num_classes)
    elif clip:
        images, tokens, _ = next(iter(dm.val_dataloader()))
        image_features, text_features, scale = task.net(dm.normalize(images), tokens)
        assert image_features.shape == text_features.shape == (len(images), cfg.model.net.embed_dim)
    elif captioning:
        batch = dm.on_after_batch_transfer(next(iter(dm.val_dataloader())), 0)
        logits, attn = task.net(batch["image"], batch["tokens"])
        b, t = batch["tokens"].shape
        assert logits.shape == (b, t, dm.tokenizer.vocab_size) and attn.shape[:2] == (b, t)
    elif experiment in ("convnet_scenes", "vit_scenes", "perceiver_scenes"):  # multi-label
        batch = dm.on_after_batch_transfer(next(iter(dm.val_dataloader())), 0)
        assert task.net(batch["image"]).shape == batch["target"].shape
    else:
        images, _ = next(iter(dm.val_dataloader()))
        assert task.net(dm.normalize(images)).shape == (len(images), len(dm.classes))
    assert cfg.task_name == experiment
    for name, node in cfg.callbacks.items():  # each one a Lightning callback of the class it names
        callback = instantiate(node)
        assert isinstance(callback, Callback) and type(callback) is get_class(node._target_), name
        if isinstance(callback, ModelCheckpoint):  # in the run's directory, the best by what it optimises
            assert callback.dirpath == os.path.realpath(tmp_path / "checkpoints"), name
            metric = cfg.optimized_metric.removesuffix("_best")
            mode = "min" if "loss" in metric else "max"
            assert (callback.monitor, callback.mode) == (metric, mode), experiment


@pytest.mark.parametrize(
    "group,name", [(g, n) for g in ("trainer", "logger", "callbacks", "debug", "data") for n in options(g)]
)
def test_every_group_option_composes(group, name, tmp_path):
    cfg = composed(f"{group}={name}", tmp=tmp_path)
    OmegaConf.resolve(cfg)  # every interpolation resolves
    if group in ("callbacks", "logger"):
        for node in (cfg[group] or {}).values():
            assert "_target_" in node


# Each size preset of model/net and model/bert, with what the data would fill in: timm's sizes at
# 224x224 RGB, the CPU-sized ones at the image size of their recipes
PRESET_INPUTS = {"vit_mini": 28, "deit_mini": 28, "swin_mini": 32, "convnet": 28, "timm": 32}


def built(node) -> nn.Module:
    """The net ``node`` describes, after the config check that ``attnlab-train`` runs first (not
    on the meta device: DeiT's heads start as copies of each other, which needs data)."""
    check_types(node, "model.net")
    return instantiate(node)


# gpt2: a text net; the captioners: tests/test_captioning.py, tests/test_flamingo.py
CAPTIONERS = ("show_attend_tell", "flamingo", "flamingo_vit")


@pytest.mark.parametrize("preset", [p for p in options("model/net") if p not in ("gpt2", *CAPTIONERS)])
def test_every_vision_preset_builds(preset, tmp_path):
    size = PRESET_INPUTS.get(preset, 224)
    cfg = composed(
        "experiment=vit_fashion_mnist",
        f"model/net={preset}",
        "model.net.num_classes=10",
        f"model.net.img_size={size}",
        f"model.net.in_chans={1 if size == 28 else 3}",
        tmp=tmp_path,
    )
    net = built(cfg.model.net)
    assert sum(p.numel() for p in net.parameters()) > 0
    if "dim" in cfg.model.net and "mlp_ratio" in cfg.model.net:  # the transformers: MLP = ratio x width
        fc1 = next(m for n, m in net.named_modules() if n.endswith("mlp.fc1"))
        assert fc1.out_features == int(cfg.model.net.mlp_ratio * cfg.model.net.dim)


# BERT-Tiny, -Mini, -Small (Turc et al.): width and MLP width, as the presets gave them before
# the MLP was a ratio (mlp_dim 512, 1024, 2048)
BERT_SHAPES = {"tiny": (128, 512), "mini": (256, 1024), "small": (512, 2048)}


@pytest.mark.parametrize("preset", options("model/bert"))
def test_every_bert_preset_builds_its_paper_shape(preset, tmp_path):
    cfg = composed(
        "experiment=bert_pretrain_sst2",
        f"model/bert@model.net.encoder={preset}",
        "model.net.encoder.vocab_size=100",
        "model.net.encoder.pad_id=0",
        tmp=tmp_path,
    )
    encoder = built(cfg.model.net.encoder)
    fc1 = encoder.blocks[0].mlp.fc1
    assert (fc1.in_features, fc1.out_features) == BERT_SHAPES[preset]


@pytest.mark.parametrize(
    "experiment,mlp_width",  # the MLP widths the configs gave before they were ratios (d_ff, 4 x n_embd)
    [("gpt_pydoc_char", 512), ("nmt_synthetic", 128), ("nmt_transformer_multi30k", 1024)],
)
def test_the_renamed_configs_build_the_same_shapes(experiment, mlp_width, tmp_path):
    pad = [] if experiment.startswith("gpt_") else ["model.net.pad_id=0"]
    cfg = composed(f"experiment={experiment}", "model.net.vocab_size=100", *pad, tmp=tmp_path)
    net = built(cfg.model.net)
    assert {m.out_features for n, m in net.named_modules() if n.endswith("mlp.fc1")} == {mlp_width}


def test_gpt_shakespeare_recipe_is_nanogpts(tmp_path):
    cfg = composed("experiment=gpt_shakespeare_char", tmp=tmp_path)
    net, opt = cfg.model.net, cfg.model.optim.optimizer
    assert (net.depth, net.n_head, net.dim, net.max_len, net.dropout) == (4, 4, 128, 64, 0.0)
    assert (cfg.data.batch_size, cfg.trainer.max_steps, cfg.trainer.val_check_interval) == (12, 2000, 250)
    assert (opt.lr, list(opt.betas), cfg.model.optim.weight_decay) == (1e-3, [0.9, 0.99], 0.1)
    assert cfg.trainer.gradient_clip_val == 1.0 and cfg.data.val_batches == 20


def nanogpt_lr(it, lr=1e-3, min_lr=1e-4, warmup=100, decay=2000):  # nanoGPT's train.get_lr
    if it < warmup:
        return lr * (it + 1) / (warmup + 1)
    if it > decay:
        return min_lr
    ratio = (it - warmup) / (decay - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (lr - min_lr)


def test_warmup_cosine_matches_nanogpt():
    f = WarmupCosine(100, 2000, 0.1)
    for it in (0, 50, 99, 100, 500, 1999, 2000, 2500):
        assert 1e-3 * f(it) == pytest.approx(nanogpt_lr(it))


def test_warmup_inverse_sqrt_is_the_papers_noam_schedule():
    d_model, warmup = 512, 4000
    f = WarmupInverseSqrt(warmup)
    base = (d_model * warmup) ** -0.5
    for step in (1, 100, 3999, 4000, 4001, 20000):  # the paper counts steps from 1
        noam = d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)
        assert base * f(step - 1) == pytest.approx(noam)


def unset(monkeypatch, *names):
    for name in names:  # setenv first so that monkeypatch restores the original state
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def test_wandb_goes_offline_without_a_key(monkeypatch, tmp_path):
    unset(monkeypatch, "WANDB_MODE", "WANDB_API_KEY")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert ensure_wandb_mode() == "offline"


def test_wandb_key_or_explicit_mode_is_respected(monkeypatch, tmp_path):
    unset(monkeypatch, "WANDB_MODE", "WANDB_API_KEY")
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai login user password abc123\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    assert ensure_wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert ensure_wandb_mode() == "disabled"


def test_training_flushes_denormals_and_keeps_freed_memory():
    torch.set_flush_denormal(False)  # other tests may have trained in this process
    tiny = torch.tensor([1e-39])  # a denormal float32
    try:
        tune_cpu_for_training()
        assert (tiny * 1.0).item() == 0.0
    finally:
        torch.set_flush_denormal(False)
    assert (tiny * 1.0).item() != 0.0
    if platform.libc_ver()[0] == "glibc":
        assert keep_freed_memory()  # glibc accepted every mallopt setting


def test_fill_missing_fills_nested_keys_and_refuses_too_small_values():
    node = OmegaConf.create({"text": {"vocab_size": "???", "width": 8}, "image": {"classes": "???"}})
    fill_missing(node, {"text": {"vocab_size": 100}, "image": {"classes": 10}, "absent": 1}, "model.net")
    assert node.text.vocab_size == 100 and node.image.classes == 10 and "absent" not in node
    node = OmegaConf.create({"text": {"vocab_size": 50}})
    with pytest.raises(ConfigError, match="model.net.text.vocab_size=50 is smaller than the data's"):
        fill_missing(node, {"text": {"vocab_size": 100}}, "model.net")


def test_checkpoints_from_before_artifacts_still_name_their_tokenizer(tmp_path):
    old = {"attnlab": {"config": "a: 1", "tokenizer": '{"kind": "char", "chars": "ab"}'}}
    assert metadata(old, tmp_path)["artifacts"] == {"tokenizer": '{"kind": "char", "chars": "ab"}'}
    assert metadata({"attnlab": {"config": "a: 1", "artifacts": {}}}, tmp_path)["artifacts"] == {}


def test_weight_decay_skips_biases_norms_and_what_the_model_declares():
    from attnlab.models import Transformer
    from attnlab.training.optim import param_groups

    net = nn.Module()
    net.net = Transformer(50, dim=16, n_head=2, enc_depth=1, dec_depth=1, mlp_ratio=2.0, positions="learned")
    decay, no_decay = param_groups(net, 0.1)
    names = {id(p): n for n, p in net.named_parameters()}
    skipped = {names[id(p)] for p in no_decay["params"]}
    assert {
        "net.src_embed.positions.emb.weight",
        "net.encoder.0.norm1.weight",
        "net.encoder.0.attn.in_proj.bias",
    } <= skipped
    decayed = {names[id(p)] for p in decay["params"]}
    assert "net.src_embed.tokens.weight" in decayed and not any("positions" in n for n in decayed)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
