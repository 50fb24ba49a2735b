"""timm ViT / DeiT / Swin and open_clip CLIP weights in (``model.init_from``) and out (``export``):
random reference models saved by their own library, our logits equal to theirs (fp32, 1e-5), and
back again; heads, image sizes and channels fitted with notices; bad inputs one line, exit 2."""

from __future__ import annotations

import json
import logging
import pickle
import re
from pathlib import Path

import open_clip
import pytest
import timm
import torch
from safetensors.torch import save_file
from timm.models import save_for_hf

from attnlab.core.errors import CheckpointError
from attnlab.data.text.tokenizers import CaptionTokenizer
from attnlab.models import (
    CLIP,
    DistilledVisionTransformer,
    SwinTransformer,
    TextTransformer,
    VisionTransformer,
)
from attnlab.weights.clip import CAPTION_EOT_ID
from attnlab.weights.pretrained import export_pretrained, load_pretrained
from conftest import QUIET, assert_user_error, read_metrics, run_cli, run_dirs, write_cifar

VIT_TIMM = dict(img_size=32, in_chans=3, patch_size=8, embed_dim=48, depth=2, num_heads=3)
VIT_OURS = dict(img_size=32, in_chans=3, patch_size=8, dim=48, depth=2, n_head=3)
SWIN_TIMM = dict(
    img_size=32, in_chans=3, patch_size=2, embed_dim=24, depths=(2, 2), num_heads=(2, 4), window_size=8
)
SWIN_OURS = dict(img_size=32, in_chans=3, patch_size=2, dim=24, depths=(2, 2), n_head=(2, 4), window_size=8)
FAMILIES = {
    "vit": (VisionTransformer, "vit_tiny_patch16_224", VIT_TIMM, VIT_OURS),
    "deit": (DistilledVisionTransformer, "deit_tiny_distilled_patch16_224", VIT_TIMM, VIT_OURS),
    "swin": (SwinTransformer, "swin_tiny_patch4_window7_224", SWIN_TIMM, SWIN_OURS),
}
# ViT's head on the mean patch token (timm's global_pool="avg" without its fc_norm)
POOLED = {
    "vit_avg": (
        VisionTransformer,
        "vit_tiny_patch16_224",
        VIT_TIMM | {"global_pool": "avg", "fc_norm": False},
        VIT_OURS | {"global_pool": "avg"},
    )
}
# the net of each fine-tuning recipe, cut to the reference's size (model.net overrides)
RECIPE_NET = {
    "vit": ["model.net.patch_size=8", "model.net.dim=48", "model.net.depth=2", "model.net.n_head=3"],
    "swin": [
        "model.net.patch_size=2",
        "model.net.dim=24",
        "model.net.depths=[2,2]",
        "model.net.n_head=[2,4]",
        "model.net.window_size=8",
    ],
}
RECIPE_NET["deit"] = RECIPE_NET["vit"]


def timm_reference(family: str, num_classes: int = 10, **overrides) -> torch.nn.Module:
    _, arch, args, _ = (FAMILIES | POOLED)[family]
    return timm.create_model(arch, pretrained=False, num_classes=num_classes, **(args | overrides)).eval()


def ours(family: str, num_classes: int = 10, **overrides) -> torch.nn.Module:
    cls, _, _, args = (FAMILIES | POOLED)[family]
    return cls(num_classes=num_classes, **(args | overrides)).eval()


def saved(model: torch.nn.Module, folder: Path) -> Path:
    save_for_hf(model, folder, safe_serialization=True)
    return folder


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", [*FAMILIES, *POOLED])
def test_timm_weights_in_and_back_out_give_the_same_logits(family, tmp_path):
    torch.manual_seed(0)
    reference = timm_reference(family)
    net = ours(family)
    load_pretrained(net, saved(reference, tmp_path / "timm"))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert_same(net(x), reference(x))
    export_pretrained(
        net, tmp_path / "out", {"classes": list("abcdefghij"), "mean": [0.4] * 3, "std": [0.2] * 3}
    )
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]
    back = timm.create_model(f"local-dir:{tmp_path / 'out'}", pretrained=True).eval()
    with torch.no_grad():
        assert_same(back(x), reference(x))
    assert list(back.pretrained_cfg["mean"]) == [0.4] * 3 and back.pretrained_cfg["label_names"][0] == "a"


def test_bare_state_dicts_load_safetensors_and_weights_only_pth(tmp_path):
    torch.manual_seed(0)
    reference = timm_reference("vit")
    save_file(reference.state_dict(), str(tmp_path / "vit.safetensors"))
    torch.save({"state_dict": reference.state_dict()}, tmp_path / "vit.pth")  # timm's train checkpoints
    x = torch.randn(2, 3, 32, 32)
    for file in ("vit.safetensors", "vit.pth"):
        net = load_pretrained(ours("vit"), tmp_path / file).eval()
        with torch.no_grad():
            assert_same(net(x), reference(x))


def test_a_head_of_another_size_starts_fresh_with_a_notice(tmp_path, caplog):
    torch.manual_seed(0)
    folder = saved(timm_reference("deit", num_classes=1000), tmp_path / "in1k")
    net = ours("deit")
    fresh = {k: v.clone() for k, v in net.state_dict().items() if k.startswith("head")}
    with caplog.at_level(logging.WARNING):
        load_pretrained(net, folder)
    assert "classification head does not fit" in caplog.text and "head_dist.weight" in caplog.text
    for k, v in fresh.items():
        assert torch.equal(net.state_dict()[k], v), k
    # a backbone (num_classes=0) drops the head with the same notice
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        load_pretrained(ours("vit", num_classes=0), saved(timm_reference("vit", 1000), tmp_path / "vit"))
    assert "classification head does not fit" in caplog.text


@pytest.mark.parametrize(("family", "size"), [("vit", 48), ("deit", 16), ("swin", 16)])
def test_another_image_size_is_resampled_as_timm_does(family, size, tmp_path, caplog):
    """Position embeddings (ViT, DeiT) and Swin's relative-position tables (a 16-pixel image shrinks
    the last stage's window from 8 to 4) resampled equal timm's own loading at the new size."""
    torch.manual_seed(0)
    folder = saved(timm_reference(family), tmp_path / "timm")
    net = ours(family, img_size=size)
    with caplog.at_level(logging.WARNING):
        load_pretrained(net, folder)
    assert ("resampled" if family != "swin" else "resized to windows of [4]") in caplog.text
    resized = timm.create_model(
        FAMILIES[family][1],
        pretrained=True,
        pretrained_cfg_overlay={"file": str(folder / "model.safetensors"), "num_classes": 10},
        num_classes=10,
        **(FAMILIES[family][2] | {"img_size": size}),
    ).eval()
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        assert_same(net.eval()(x), resized(x))


def test_rgb_weights_adapt_to_grayscale_with_a_notice(tmp_path, caplog):
    torch.manual_seed(0)
    reference = timm_reference("vit")
    with caplog.at_level(logging.WARNING):
        net = load_pretrained(ours("vit", in_chans=1), saved(reference, tmp_path / "timm")).eval()
    assert "3 input channels adapted to 1" in caplog.text
    gray = torch.randn(2, 1, 32, 32)
    with torch.no_grad():  # timm's adapt_input_conv sums the RGB filters: the same as a gray image in RGB
        assert_same(net(gray), reference(gray.expand(-1, 3, -1, -1)))


# ---------------------------------------------------------------------------------------------
# open_clip

OPEN_CLIP_CFG = {
    "embed_dim": 32,
    "quick_gelu": True,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "patch_size": 8, "head_width": 32},
    "text_cfg": {"context_length": 16, "vocab_size": 100, "width": 32, "heads": 2, "layers": 2},
}
CLIP_NET = [  # conf/model/clip.yaml's net as open_clip's OPEN_CLIP_CFG
    "model.net.embed_dim=32",
    "model.net.image.stem=patch",
    "model.net.image.patch_size=8",
    "model.net.image.dim=64",
    "model.net.image.depth=2",
    "model.net.image.n_head=2",
    "model.net.image.mlp_ratio=4",
    "+model.net.image.pre_norm=true",
    "+model.net.image.patch_bias=false",
    "+model.net.image.act=quick_gelu",
    "model.net.text.vocab_size=100",
    "model.net.text.max_len=16",
    "model.net.text.dim=32",
    "model.net.text.depth=2",
    "model.net.text.n_head=2",
    "model.net.text.mlp_ratio=4",
    "+model.net.text.act=quick_gelu",
]


def our_clip(**text) -> CLIP:
    image = VisionTransformer(
        0,
        32,
        3,
        patch_size=8,
        dim=64,
        depth=2,
        n_head=2,
        pre_norm=True,
        patch_bias=False,
        act="quick_gelu",
    )
    text = TextTransformer(
        100,
        **({"max_len": 16, "dim": 32, "depth": 2, "n_head": 2, "act": "quick_gelu", "pool": "argmax"} | text),
    )
    return CLIP(image, text, embed_dim=32).eval()


def save_open_clip(folder: Path, cfg: dict = OPEN_CLIP_CFG) -> open_clip.CLIP:
    """A random open_clip CLIP saved as ``open_clip.push_to_hf_hub`` writes it."""
    torch.manual_seed(0)
    model = open_clip.CLIP(**cfg).eval()
    folder.mkdir(parents=True)
    save_file(model.state_dict(), str(folder / "open_clip_model.safetensors"))
    (folder / "open_clip_config.json").write_text(json.dumps({"model_cfg": cfg}))
    return model


def captions() -> torch.Tensor:
    """Right-padded ids ending in the highest id (end-of-text), padding 0 also inside a caption."""
    tokens = torch.randint(1, 98, (3, 16))
    tokens[0, 2] = 0
    for row, end in enumerate((9, 15, 4)):
        tokens[row, end], tokens[row, end + 1 :] = 99, 0
    return tokens


def test_open_clip_weights_in_and_back_out_give_the_same_features(tmp_path):
    reference = save_open_clip(tmp_path / "open_clip")
    net = load_pretrained(our_clip(), tmp_path / "open_clip")
    x, t = torch.randn(2, 3, 32, 32), captions()
    with torch.no_grad():
        assert_same(net.encode_image(x), reference.encode_image(x, normalize=True))
        assert_same(net.encode_text(t), reference.encode_text(t, normalize=True))
        assert_same(net.scale(), reference.logit_scale.exp())
    export_pretrained(net, tmp_path / "out", {"mean": [0.5] * 3, "std": [0.25] * 3})
    back, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{tmp_path / 'out'}")
    back.eval()
    with torch.no_grad():
        assert_same(back.encode_image(x), reference.encode_image(x))
        assert_same(back.encode_text(t), reference.encode_text(t))
        assert_same(back.logit_scale, reference.logit_scale)
    assert preprocess.transforms[-1].mean == [0.5] * 3


def test_our_clip_exports_to_open_clip_with_end_of_text_pooling(tmp_path):
    """Our own CLIP (``pool="last"``: the end-of-text token ending our captions) goes out as
    open_clip's ``eos`` pooling and comes back in."""
    torch.manual_seed(0)
    net = our_clip(pool="last", act="quick_gelu")
    t = torch.randint(3, 99, (2, 16))
    t[0, 8], t[0, 9:], t[1, 15] = 2, 0, 2  # <eot> = CaptionTokenizer.eot_id, then <pad> = 0
    assert CaptionTokenizer.eot_id == CAPTION_EOT_ID
    export_pretrained(net, tmp_path / "out", {})
    back = open_clip.create_model(f"local-dir:{tmp_path / 'out'}").eval()
    again = load_pretrained(our_clip(pool="last"), tmp_path / "out")
    with torch.no_grad():
        assert_same(back.encode_text(t, normalize=True), net.encode_text(t))
        assert_same(again.encode_text(t), net.encode_text(t))


def test_open_clip_architecture_facts_no_tensor_shows_are_checked(tmp_path):
    save_open_clip(tmp_path / "open_clip")
    for net, needle in (
        (our_clip(act="gelu"), "text act 'quick_gelu', the net has 'gelu' (model.net.text.act)"),
        (our_clip(pool="last"), "text pooling 'argmax', the net has 'last' (model.net.text.pool)"),
        (our_clip(n_head=4), "text heads 2, the net has 4 (model.net.text.n_head)"),
    ):
        with pytest.raises(CheckpointError, match=re.escape(needle)):
            load_pretrained(net, tmp_path / "open_clip")


# ---------------------------------------------------------------------------------------------
# through attnlab-train


def finetune(tmp_path: Path, family: str, init_from: Path, *overrides: str):
    data = write_cifar(tmp_path / "cifar" / "cifar-10-batches-py", n=4).parent
    args = [
        f"experiment={family}_finetune_cifar10",
        f"model.init_from={init_from}",
        f"data.source.data_dir={data}",
        "data.img_size=32",
        "data.crop_padding=2",
        "data.batch_size=4",
        "data.source.val_size=10",
        "model.plot_images=0",
        *RECIPE_NET[family],
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        "trainer.log_every_n_steps=1",
        *QUIET,
        *overrides,
    ]
    return run_cli("train", args, tmp_path)


@pytest.mark.parametrize("family", FAMILIES)
def test_finetune_recipe_starts_from_a_timm_folder(family, tmp_path):
    torch.manual_seed(0)
    proc = finetune(tmp_path, family, saved(timm_reference(family, 1000), tmp_path / "timm"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "classification head does not fit" in proc.stdout + proc.stderr
    (run_dir,) = run_dirs(tmp_path, f"{family}_finetune_cifar10")
    assert "test/acc" in read_metrics(run_dir)


def test_clip_starts_from_an_open_clip_folder(tmp_path):
    """attnlab-train's CLIP recipe on image-caption pairs, configured as open_clip's architecture
    (a folder without tokenizer files: the data fits our caption tokenizer; open_clip's own comes
    with a folder that has one, tests/test_pretrained_clip.py)."""
    from conftest import write_pairs

    # our caption tokenizer's ids: its <eot> (2) ends a caption, which open_clip pools at as "eos"
    text = OPEN_CLIP_CFG["text_cfg"] | {"vocab_size": 512, "pool_type": "eos", "eos_id": 2}
    save_open_clip(tmp_path / "open_clip", OPEN_CLIP_CFG | {"text_cfg": text})
    pairs = write_pairs(tmp_path / "pairs")
    proc = run_cli(
        "train",
        [
            "experiment=clip_pairs",
            f"data.source.path={pairs}",
            "data.img_size=32",
            "data.max_len=16",
            "data.batch_size=4",
            "data.source.val_size=4",
            f"model.init_from={tmp_path / 'open_clip'}",
            *CLIP_NET,
            "model.net.text.vocab_size=512",
            "trainer.max_steps=2",
            "trainer.val_check_interval=2",
            *QUIET,
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "open_clip weights loaded" in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda tmp: tmp / "absent", "no such file or directory"),
        (lambda tmp: saved(timm_reference("swin"), tmp / "swin"), "a timm SwinTransformer (swin_tiny"),
        (
            lambda tmp: saved(timm_reference("vit", depth=3), tmp / "deep"),
            "does not match the configured model: unexpected blocks.2.",
        ),
        (
            lambda tmp: saved(timm_reference("vit", embed_dim=96, num_heads=3), tmp / "wide"),
            "checkpoint (96,) vs model (48,)",
        ),
        (
            lambda tmp: saved(timm_reference("vit", num_heads=6), tmp / "heads"),
            "6 attention heads, the net has 3",
        ),
        (
            lambda tmp: saved(timm_reference("vit", global_pool="avg"), tmp / "pooled"),
            "timm's head reads global_pool='avg then fc_norm', the net's reads 'token'",
        ),
        (lambda tmp: pickled(tmp / "model.pth"), "a pickle that holds more than tensors"),
        (lambda tmp: junk(tmp / "junk.safetensors"), "not a readable weights file"),
    ],
    ids=["missing", "architecture", "depth", "width", "heads", "pool", "pickle", "corrupt"],
)
def test_bad_timm_inputs_are_one_line_errors(make, needle, tmp_path):
    source = make(tmp_path)
    proc = finetune(tmp_path, "vit", source)
    assert_user_error(proc, needle)
    assert "planted code ran" not in proc.stdout + proc.stderr


class Planted:
    """An object only full unpickling rebuilds (and could run code while doing it)."""

    def __reduce__(self):
        return (print, ("planted code ran",))


def junk(path: Path) -> Path:
    path.write_bytes(b"not weights")
    return path


def pickled(path: Path) -> Path:
    path.write_bytes(pickle.dumps({"weights": Planted()}))
    return path


def test_one_reader_for_every_converters_weights_files(tmp_path):
    """``read_weights`` (transformers', timm's and open_clip's converters): safetensors, a sharded
    index, ``weights_only`` PyTorch files with a training script's wrapping and DDP's prefix, all
    the same tensors; a folder holding none of the names, a pickle and junk are one line each."""
    from attnlab.weights.hf_files import read_weights

    state = {"a.weight": torch.randn(2, 3), "b.bias": torch.randn(3)}
    save_file(state, str(tmp_path / "model.safetensors"))
    save_file({"a.weight": state["a.weight"]}, str(tmp_path / "part-1.safetensors"))
    save_file({"b.bias": state["b.bias"]}, str(tmp_path / "part-2.safetensors"))
    index = {"weight_map": {"a.weight": "part-1.safetensors", "b.bias": "part-2.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    torch.save({"state_dict": state}, tmp_path / "wrapped.pth")
    torch.save({"model": {f"module.{k}": v for k, v in state.items()}, "epoch": 3}, tmp_path / "ddp.pth")
    for source in ("model.safetensors", "model.safetensors.index.json", "wrapped.pth", "ddp.pth"):
        read = read_weights(tmp_path / source)
        assert read.keys() == state.keys() and all(torch.equal(read[k], state[k]) for k in state), source
    assert read_weights(tmp_path, ("open_clip_model.safetensors", "model.safetensors")).keys() == state.keys()
    for make, needle in (
        (lambda: tmp_path / "empty", "no weights in it (expected one of open_clip_model.safetensors)"),
        (lambda: pickled(tmp_path / "planted.pth"), "a pickle that holds more than tensors"),
        (lambda: junk(tmp_path / "junk.safetensors"), "not a readable weights file"),
    ):
        source = make()
        if source.name == "empty":
            source.mkdir()
        with pytest.raises(CheckpointError, match=re.escape(needle)):
            read_weights(source, ("open_clip_model.safetensors",))


def test_a_net_with_no_counterpart_is_refused_before_anything_is_written(tmp_path):
    from attnlab.models import Perceiver

    net = Perceiver(num_classes=2, img_size=8, in_chans=1, n_latents=2, dim=8, depth=1, n_head=1, n_bands=1)
    with pytest.raises(CheckpointError, match="a Perceiver has no counterpart in another library"):
        export_pretrained(net, tmp_path / "out", {})
    assert not (tmp_path / "out").exists()


def test_a_timm_folder_has_no_tokenizer_to_warn_about(tmp_path, caplog):
    """An image classifier takes no text: no "has no tokenizer files" notice (a CLIP still gets it)."""
    from attnlab.weights.init import init_artifacts

    folder = saved(timm_reference("vit"), tmp_path / "timm")
    with caplog.at_level(logging.WARNING):
        assert init_artifacts(str(folder), "attnlab.training.ImageClassificationTask") == {}
    assert "tokenizer" not in caplog.text
    with caplog.at_level(logging.WARNING):
        init_artifacts(str(folder), "attnlab.training.ContrastiveTask")
    assert "has no tokenizer files" in caplog.text
    (tmp_path / "empty").mkdir()
    for net in (ours("vit"), our_clip()):
        with pytest.raises(CheckpointError, match=r"an empty folder \(no weights, no config\)"):
            load_pretrained(net, tmp_path / "empty")
