"""Attention health in every family (issue 59): a tiny training run of each (2 steps, one
validation) logs ``attn/<metric>/<layer>`` in csv/metrics.csv, finite, with the mean attention
distance wherever queries have a place (not the Perceiver's latents, nor the words of Show, Attend
and Tell: docs/runs.md); recording leaves every net's output bit for bit as it was."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from attnlab.cli.common import config_dir
from attnlab.cli.train import train
from attnlab.models import (
    GPT,
    DistilledVisionTransformer,
    Flamingo,
    Perceiver,
    Seq2Seq,
    ShowAttendTell,
    SwinTransformer,
    TimmModel,
    Transformer,
    VisionTransformer,
)
from attnlab.models.vision.vit import grid_centres
from attnlab.nn import health
from conftest import (
    bert_overrides,
    captioning_overrides,
    clip_overrides,
    flamingo_overrides,
    read_metrics,
    tiny,
    vision_overrides,
    write_idx_dataset,
)
from test_translation import fake_multi30k

# two steps, one validation (the one attention health records), no test, no pictures
FAST = [
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.check_val_every_n_epoch=null",
    "trainer.num_sanity_val_steps=0",
    "trainer.limit_val_batches=1",
    "trainer.enable_progress_bar=false",
    "test=false",
    "logger=csv",
    "extras.print_config=false",
    "~callbacks.rich_progress_bar",
    "~callbacks.model_summary",
]
NMT = ["data.vocab_size=120", "data.max_tokens=256", "model.plot_sentences=0", "model.beam_size=1"]
SEQ2SEQ = ["model.net.dim=16", "model.net.enc_hidden=16", "model.net.dec_hidden=32", "model.net.attn_dim=16"]
TIMM_VIT = "{patch_size: 4, embed_dim: 16, depth: 1, num_heads: 2}"


def gpt(*overrides: str) -> Callable[[Path], list[str]]:
    return lambda tmp: tiny(*FAST, "data.val_batches=1", *overrides)


def experiment(name: str, make: Callable[[str, Path], list[str]], *extra: str) -> Callable[[Path], list[str]]:
    return lambda tmp: [f"experiment={name}", *make(name, tmp), *extra, *FAST]


def multi30k(name: str, tmp: Path) -> list[str]:
    return [f"data.source.data_dir={fake_multi30k(tmp / 'm30k')}", *NMT, *SEQ2SEQ]


def synthetic(name: str, tmp: Path) -> list[str]:
    size = ["model.net.dim=32", "model.net.n_head=2", "model.net.enc_depth=1", "model.net.dec_depth=1"]
    return ["data.source.train_size=200", "model.compile_loss=false", *NMT, *size]


def timm_vit(name: str, tmp: Path) -> list[str]:
    return [
        "model/net=timm",
        "model.net.name=vit_tiny_patch16_224",
        f"model.net.kwargs={TIMM_VIT}",
        f"data.source.data_dir={write_idx_dataset(tmp / 'idx')}",
        "data.batch_size=8",
        "data.source.val_size=10",
        "model.plot_images=0",
        "model.optim.compile=false",
    ]


GPT_LAYERS = {"blocks.0.attn"}
# family: (its overrides, the layers recorded, those of them with a distance)
FAMILIES: dict[str, tuple[Callable[[Path], list[str]], set[str], set[str]]] = {
    "gpt_learned": (gpt(), GPT_LAYERS, GPT_LAYERS),
    "gpt_rope": (gpt("model.net.positions=rope"), GPT_LAYERS, GPT_LAYERS),
    "gpt_alibi": (gpt("model.net.positions=alibi"), GPT_LAYERS, GPT_LAYERS),
    "gpt_sliding": (gpt("model.net.attention=sliding", "model.net.window=4"), GPT_LAYERS, GPT_LAYERS),
    "gpt_linear": (gpt("model.net.attention=linear"), GPT_LAYERS, GPT_LAYERS),
    "bert": (
        experiment("bert_finetune_sst2_scratch", bert_overrides),
        {"encoder.blocks.0.attn"},
        {"encoder.blocks.0.attn"},
    ),
    "transformer": (
        experiment("nmt_synthetic", synthetic),
        {"encoder.0.attn", "decoder.0.attn", "decoder.0.cross_attn"},
        {"encoder.0.attn", "decoder.0.attn", "decoder.0.cross_attn"},
    ),
    "bahdanau": (experiment("nmt_bahdanau_multi30k", multi30k), {"attn"}, {"attn"}),
    "luong": (experiment("nmt_luong_multi30k", multi30k), {"attn"}, {"attn"}),
    "vit": (experiment("vit_fashion_mnist", vision_overrides), {"blocks.0.attn"}, {"blocks.0.attn"}),
    "deit": (experiment("deit_fashion_mnist", vision_overrides), {"blocks.0.attn"}, {"blocks.0.attn"}),
    "swin": (
        experiment("swin_fashion_mnist", vision_overrides),
        {f"layers.{i}.blocks.0.attn" for i in range(3)},
        {f"layers.{i}.blocks.0.attn" for i in range(3)},
    ),
    "timm_vit": (experiment("vit_fashion_mnist", timm_vit), {"model.blocks.0.attn"}, {"model.blocks.0.attn"}),
    "clip": (
        experiment("clip_fashion_mnist", clip_overrides, "model.plot_pairs=0"),
        {"image.blocks.0.attn", "text.blocks.0.attn"},
        {"image.blocks.0.attn", "text.blocks.0.attn"},
    ),
    "perceiver": (
        experiment("perceiver_fashion_mnist", vision_overrides),
        {"cross_first.attn", "cross.attn", "blocks.0.attn"},
        set(),  # the latents have no place
    ),
    "show_attend_tell": (
        experiment("sat_scenes", captioning_overrides, "model.plot_images=0"),
        {"attn"},
        set(),
    ),
    "flamingo": (
        experiment("flamingo_scenes", flamingo_overrides, "model.plot_images=0"),
        {"resampler.layers.0.attn", "xattn.0.attn", "lm.blocks.0.attn", "lm.blocks.1.attn"},
        {"lm.blocks.0.attn", "lm.blocks.1.attn"},  # the resampler's and the gated blocks' latents have none
    ),
}


def attention_columns(overrides: list[str], tmp: Path) -> dict[str, float]:
    """The attn/ columns of a tiny run's csv/metrics.csv, as attnlab-train composes and trains it."""
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose(
            "train", overrides=[*overrides, f"paths.root_dir={tmp}", f"paths.output_dir={tmp / 'run'}"]
        )
    logging.getLogger("lightning").setLevel(logging.WARNING)
    train(cfg)
    return {k: v[-1][1] for k, v in read_metrics(tmp / "run").items() if k.startswith("attn/")}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_logs_attention_health(family, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make, layers, placed = FAMILIES[family]
    columns = attention_columns(make(tmp_path), tmp_path)
    assert all(math.isfinite(v) for v in columns.values()), columns
    logged = {k.split("/")[2] for k in columns if k.count("/") == 2}
    assert layers <= logged, (layers, logged)
    for layer in layers:
        for metric in ("entropy", "first_token", "max_weight"):
            assert f"attn/{metric}/{layer}" in columns and f"attn/{metric}/{layer}/h0" in columns
        assert 0 <= columns[f"attn/first_token/{layer}"] <= columns[f"attn/max_weight/{layer}"] <= 1
    assert all(f"attn/distance/{layer}" in columns for layer in placed)
    assert ("attn/distance" in columns) == bool(placed)
    assert {f"attn/distance/{layer}" for layer in layers - placed}.isdisjoint(columns)


def recorded(net: torch.nn.Module, *inputs: torch.Tensor) -> tuple[dict[str, float], bool]:
    """A net's health on ``inputs``, and whether recording left its outputs bit for bit as they were."""
    net.eval()
    with torch.no_grad():
        plain = net(*inputs)
        with health.recording(net, rows=2) as records:
            seen = net(*inputs)
    pairs = zip(plain, seen, strict=True) if isinstance(plain, tuple) else [(plain, seen)]
    return health.flat(health.per_head(records)), all(torch.equal(a, b) for a, b in pairs)


V, IMAGES = 40, torch.randn(3, 1, 16, 16)
SRC, TGT = torch.randint(3, V, (3, 7)), torch.randint(3, V, (3, 5))
NETS = {
    "vit": lambda: (VisionTransformer(10, 16, 1, dim=16, depth=1, n_head=2), IMAGES),
    "deit": lambda: (DistilledVisionTransformer(10, 16, 1, dim=16, depth=1, n_head=2), IMAGES),
    "swin": lambda: (
        SwinTransformer(10, 16, 1, 2, dim=8, depths=(2, 1), n_head=(1, 2), window_size=4),
        IMAGES,
    ),
    "perceiver": lambda: (Perceiver(10, 16, 1, n_latents=4, dim=16, depth=1, n_head=2, n_bands=2), IMAGES),
    "timm": lambda: (
        TimmModel(
            "vit_tiny_patch16_224", 10, 16, 1, {"patch_size": 4, "embed_dim": 16, "depth": 1, "num_heads": 2}
        ),
        IMAGES,
    ),
    "bahdanau": lambda: (Seq2Seq(V, dim=16, enc_hidden=16, dec_hidden=16, attn_dim=16), SRC, TGT),
    "luong": lambda: (Seq2Seq(V, attention="general", dim=16, enc_hidden=16, dec_hidden=16), SRC, TGT),
    "show_attend_tell": lambda: (
        ShowAttendTell(V, 16, 1, enc_dim=16, enc_depth=2, dim=16, hidden=16),
        IMAGES,
        TGT,
    ),
    "gpt_linear": lambda: (GPT(V, 16, depth=1, n_head=2, dim=16, attention="linear"), SRC),
    "gpt_sliding": lambda: (GPT(V, 16, depth=1, n_head=2, dim=16, attention="sliding", window=3), SRC),
    "transformer": lambda: (Transformer(V, dim=16, n_head=2, enc_depth=1, dec_depth=1), SRC, TGT),
    "flamingo": lambda: (
        Flamingo(
            partial(VisionTransformer, 0, dim=16, depth=1, n_head=2),
            partial(GPT, max_len=16, depth=1, n_head=2, dim=16),
            V,
            16,
            1,
            n_latents=4,
            n_head=2,
            resampler_depth=1,
        ),
        IMAGES,
        TGT,
    ),
}


@pytest.mark.parametrize("name", NETS)
def test_recording_leaves_outputs_as_they_were(name):
    torch.manual_seed(0)
    net, *inputs = NETS[name]()
    values, same = recorded(net, *inputs)
    assert same
    assert values and all(math.isfinite(v) for v in values.values())


def test_vit_distances_are_in_pixels():
    """Uniform attention (no scores): each patch's mean distance is its mean distance to every
    patch centre, in pixels; [CLS] is nowhere."""
    net = VisionTransformer(10, 16, 1, patch_size=4, dim=16, depth=1, n_head=2)
    torch.nn.init.zeros_(net.blocks[0].attn.in_proj.weight)
    torch.nn.init.zeros_(net.blocks[0].attn.in_proj.bias)
    values, _ = recorded(net, IMAGES)
    centres = grid_centres(4, 4, 4.0)
    assert grid_centres(1, 2, 4.0, prefix=1).tolist()[1:] == [[2.0, 2.0], [2.0, 6.0]]
    assert values["attn/distance"] == pytest.approx(torch.cdist(centres, centres).mean().item(), rel=1e-5)
