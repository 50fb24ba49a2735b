"""ViT, DeiT and Swin: shapes, the window machinery, and equality with timm's models."""

from __future__ import annotations

import pytest
import timm
import torch

from attnlab.models import ConvNet, DistilledVisionTransformer, SwinTransformer, TimmModel, VisionTransformer
from attnlab.nn import ConvStem
from attnlab.nn.window_attention import (
    WindowAttention,
    relative_position_index,
    shifted_window_mask,
    window_partition,
    window_reverse,
)
from attnlab.weights.timm_vision import load_timm_weights
from conftest import spec_refusal

VIT = dict(num_classes=10, img_size=28, in_chans=1, patch_size=7, dim=48, depth=2, n_head=3)
SWIN = dict(
    num_classes=10,
    img_size=32,
    in_chans=3,
    patch_size=2,
    dim=24,
    depths=(2, 2, 2),
    n_head=(2, 4, 8),
    window_size=4,
)


def timm_vit(name: str, **kwargs) -> torch.nn.Module:
    return timm.create_model(
        name,
        **kwargs,
        pretrained=False,
        num_classes=10,
        img_size=28,
        in_chans=1,
        patch_size=7,
        embed_dim=48,
        depth=2,
        num_heads=3,
    ).eval()


@pytest.mark.parametrize(
    ("ours", "name", "pool"),
    [
        (VisionTransformer, "vit_tiny_patch16_224", {}),
        # the mean patch token (timm's without fc_norm: the tokens are normalised before the mean)
        (VisionTransformer, "vit_tiny_patch16_224", {"global_pool": "avg"}),
        (DistilledVisionTransformer, "deit_tiny_distilled_patch16_224", {}),
    ],
)
def test_vit_and_deit_equal_timm_with_copied_weights(ours, name, pool):
    torch.manual_seed(0)
    reference = timm_vit(name, **pool, **({"fc_norm": False} if pool else {}))
    model = load_timm_weights(ours(**VIT, **pool), reference).eval()
    x = torch.randn(4, 1, 28, 28)
    with torch.no_grad():
        torch.testing.assert_close(
            model.forward_features(x), reference.forward_features(x), atol=1e-5, rtol=0
        )
        torch.testing.assert_close(model(x), reference(x), atol=1e-5, rtol=0)
        torch.testing.assert_close(
            model.forward_head(model.forward_features(x), pre_logits=True),
            reference.forward_head(reference.forward_features(x), pre_logits=True),
            atol=1e-5,
            rtol=0,
        )


def test_swin_equals_timm_with_copied_weights():
    torch.manual_seed(0)
    reference = timm.create_model(
        "swin_tiny_patch4_window7_224",
        pretrained=False,
        num_classes=10,
        img_size=32,
        in_chans=3,
        patch_size=2,
        embed_dim=24,
        depths=(2, 2, 2),
        num_heads=(2, 4, 8),
        window_size=4,
    ).eval()
    model = load_timm_weights(SwinTransformer(**SWIN), reference).eval()
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        features = model.forward_features(x)
        torch.testing.assert_close(features, reference.forward_features(x).flatten(1, 2), atol=1e-5, rtol=0)
        torch.testing.assert_close(model(x), reference(x), atol=1e-5, rtol=0)


def test_patch_count_and_shapes():
    model = VisionTransformer(**VIT)
    assert model.patch_embed.num_patches == 16
    x = torch.randn(2, 1, 28, 28)
    assert model.forward_features(x).shape == (2, 17, 48)
    assert model(x).shape == (2, 10)
    maps = model.attention_maps(x)
    assert len(maps) == 2 and maps[0].shape == (2, 3, 17, 17)
    torch.testing.assert_close(maps[0].sum(-1), torch.ones(2, 3, 17))
    pictures = model.patch_attention(x)
    assert {k: v.shape for k, v in pictures.items()} == {"[CLS], last block": (2, 4, 4), "rollout": (2, 4, 4)}
    deit = DistilledVisionTransformer(**VIT)
    assert deit.forward_features(x).shape == (2, 18, 48)
    cls_logits, dist_logits = deit.forward_heads(x)
    torch.testing.assert_close(deit(x), (cls_logits + dist_logits) / 2)
    swin = SwinTransformer(**SWIN)
    assert swin.forward_features(torch.randn(2, 3, 32, 32)).shape == (2, 16, 96)  # 16x16 -> 8x8 -> 4x4
    headless = SwinTransformer(**{**SWIN, "num_classes": 0})  # a backbone (CLIP's image tower)
    assert headless(torch.randn(2, 3, 32, 32)).shape == (2, headless.num_features) == (2, 96)
    assert [m.shape for m in swin.attention_maps(torch.randn(2, 3, 32, 32))[::2]] == [
        (2 * 16, 2, 16, 16),
        (2 * 4, 4, 16, 16),
        (2 * 1, 8, 16, 16),
    ]
    windows = swin.patch_attention(torch.randn(2, 3, 32, 32))
    assert list(windows) == ["windows, block 1", "shifted windows, block 2"]
    plain, shifted = windows.values()  # each window shares out its queries' average attention, 1
    torch.testing.assert_close(plain.view(2, 4, 4, 4, 4).sum(dim=(2, 4)), torch.ones(2, 4, 4))
    torch.testing.assert_close(shifted.sum(dim=(1, 2)), torch.full((2,), 16.0))


def test_conv_stem_gives_the_patch_tokens_row_by_row():
    vit = VisionTransformer(**{**VIT, "patch_size": 4, "stem": "conv"}).eval()
    assert isinstance(vit.patch_embed, ConvStem) and vit.patch_embed.num_patches == 49
    x = torch.randn(2, 1, 28, 28)
    assert vit.forward_features(x).shape == (2, 50, 48) and vit(x).shape == (2, 10)
    tokens = vit.patch_embed(x)  # (B, 49, D): a change in the top-left patch stays near it
    x2 = x.clone()
    x2[:, :, :4, :4] += 1.0
    changed = (vit.patch_embed(x2) - tokens).abs().amax(dim=(0, 2)).view(7, 7) > 0
    assert changed[0, 0] and not changed[4:].any() and not changed[:, 4:].any()  # a 4-token reach
    with pytest.raises(ValueError, match=r"^patch_size: must be a power of two >= 2 for a conv stem, got 7"):
        VisionTransformer(**{**VIT, "stem": "conv"})
    message = spec_refusal("attnlab.models.VisionTransformer", **{**VIT, "stem": "hybrid"})
    assert message.startswith("model.net.stem='hybrid': must be 'patch', 'conv' or 'conv_full'")


def test_full_resolution_conv_stem_sees_the_image_before_the_first_stride():
    vit = VisionTransformer(**{**VIT, "patch_size": 4, "stem": "conv_full"}).eval()
    stem = vit.patch_embed
    assert isinstance(stem, ConvStem) and stem.num_patches == 49
    first, last = stem.convs[0][0], stem.convs[-1][0]
    assert first.stride == (1, 1) and first.out_channels == 48 // 4
    assert last.out_channels == 48 and len(stem.convs) == 5  # full resolution, then 2 halvings
    x = torch.randn(2, 1, 28, 28)
    assert vit.forward_features(x).shape == (2, 50, 48)
    x2 = x.clone()
    x2[:, :, :4, :4] += 1.0  # the extra 3x3 conv reaches one pixel further, not a token further
    changed = (stem(x2) - stem(x)).abs().amax(dim=(0, 2)).view(7, 7) > 0
    assert changed[0, 0] and not changed[4:].any() and not changed[:, 4:].any()
    swin = SwinTransformer(**{**SWIN, "stem": "conv_full"}).eval()
    assert swin.patch_embed.convs[0][0].stride == (1, 1) and swin(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_swin_conv_stem_feeds_the_windows_a_normalised_map():
    swin = SwinTransformer(**{**SWIN, "stem": "conv"}).eval()
    assert isinstance(swin.patch_embed, ConvStem) and swin.patch_embed.grid_size == 16
    x = torch.randn(2, 3, 32, 32)
    tokens = swin.patch_embed(x)  # (B, 256, D), layer-normed as Swin's patch embedding
    assert tokens.shape == (2, 256, 24)
    torch.testing.assert_close(tokens.mean(-1), torch.zeros(2, 256), atol=1e-5, rtol=0)
    assert swin(x).shape == (2, 10) and swin.forward_features(x).shape == (2, 16, 96)
    message = spec_refusal("attnlab.models.SwinTransformer", **{**SWIN, "stem": "hybrid"})
    assert message.startswith("model.net.stem='hybrid': must be 'patch', 'conv' or 'conv_full'")


def test_convnet_keeps_resolution_in_its_first_stage():
    net = ConvNet(num_classes=10, img_size=28, in_chans=1, widths=(8, 16, 32)).eval()
    x = torch.randn(2, 1, 28, 28)
    assert net.forward_features(x).shape == (2, 32, 7, 7)
    assert net.forward_head(net.forward_features(x), pre_logits=True).shape == (2, 32)
    assert net(x).shape == (2, 10)
    message = spec_refusal("attnlab.models.ConvNet", num_classes=10, img_size=28, in_chans=1, widths=[8, 0])
    assert message.startswith("model.net.widths=[8, 0]: must be greater than 0 at [1]")
    headless = ConvNet(num_classes=0, img_size=28, in_chans=1, widths=(8, 16, 32)).eval()
    assert headless(x).shape == (2, 32) and not any(k.startswith("head") for k in headless.state_dict())
    message = spec_refusal("attnlab.models.ConvNet", num_classes=-1, img_size=28, in_chans=1)
    assert message.startswith("model.net.num_classes=-1: must be greater than or equal to 0")


def test_window_partition_round_trip():
    x = torch.randn(2, 8, 12, 5)
    windows = window_partition(x, 4)
    assert windows.shape == (2 * 6, 16, 5)
    torch.testing.assert_close(windows[1].view(4, 4, 5), x[0, :4, 4:8])  # second window: next to the right
    torch.testing.assert_close(window_reverse(windows, 4, 8, 12), x)


def test_relative_position_index_counts_offsets():
    idx = relative_position_index(3)
    assert idx.shape == (9, 9) and idx.min() == 0 and idx.max() == 24
    assert (idx.diagonal() == 12).all()  # offset (0, 0): the table's centre
    assert idx[0, 8] == 0 and idx[8, 0] == 24  # (-2, -2) and (+2, +2)


def test_shift_mask_separates_regions_that_wrapped_around():
    mask = shifted_window_mask(8, 4, 2)  # 4 windows of 16 tokens
    assert mask[0].all()  # the top-left window holds one region only
    last = mask[-1]  # the bottom-right window mixes 4 regions, 4 tokens each
    assert last.sum() == 4 * 16 and last[0, 0] and not last[0, 2] and not last[0, 8]


def test_shifted_windows_do_not_see_across_window_borders():
    """Changing a token in one window leaves a non-neighbouring window's output unchanged, with
    and without the shift (the shift moves windows by half; tokens that wrapped are masked)."""
    torch.manual_seed(0)
    for shift in (0, 2):
        attn = WindowAttention(16, 2, size=8, window=4, shift=shift).eval()
        x = torch.randn(1, 8, 8, 16)
        y = attn(x.view(1, 64, 16))[0].view(8, 8, 16)
        x2 = x.clone()
        x2[0, 0, 0] += 10.0  # top-left corner token
        y2 = attn(x2.view(1, 64, 16))[0].view(8, 8, 16)
        changed = (y2 - y).abs().sum(-1) > 1e-6
        if shift == 0:
            assert changed[:4, :4].all() and not changed[4:].any() and not changed[:, 4:].any()
        else:  # the corner wrapped to the bottom-right window, but only its region sees it
            assert changed.sum() > 0 and not changed[2:6, 2:6].any()
            assert changed[:2, :2].all() and not changed[6:, 6:].any()


def test_window_attention_refuses_a_set_block_argument_and_an_unknown_keyword():
    attn, x = WindowAttention(16, 2, size=8, window=4), torch.randn(1, 64, 16)
    attn(x, attn_mask=None, key_padding_mask=None, causal=False, cache=None, positions=None)
    with pytest.raises(ValueError, match="no masks, caches or other positions"):
        attn(x, causal=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'casual'"):
        attn(x, casual=False)


def test_first_swin_block_output_of_a_far_window_ignores_a_changed_pixel():
    torch.manual_seed(0)
    model = SwinTransformer(**SWIN).eval()
    x = torch.randn(1, 3, 32, 32)
    block = model.layers[0].blocks[0]
    tokens = model.patch_embed(x)
    y = block(tokens)[0].view(16, 16, -1)
    x2 = x.clone()
    x2[0, :, 0, 0] += 5.0  # a pixel of patch (0, 0), in the first window
    y2 = block(model.patch_embed(x2))[0].view(16, 16, -1)
    changed = (y2 - y).abs().sum(-1) > 1e-6
    assert changed[:4, :4].any() and not changed[4:].any() and not changed[:, 4:].any()


def test_bad_sizes_are_config_errors():
    with pytest.raises(ValueError, match=r"^img_size: must be divisible by patch_size \(5\), got 28"):
        VisionTransformer(**{**VIT, "patch_size": 5})
    with pytest.raises(
        ValueError, match=r"^window_size: must divide the feature map of stage 1 \(16x16 tokens\), got 3"
    ):
        SwinTransformer(**{**SWIN, "window_size": 3})
    with pytest.raises(ValueError, match=r"^n_head: one entry per stage of depths \(3\), got 2$"):
        SwinTransformer(**{**SWIN, "n_head": (2, 4)})
    with pytest.raises(ValueError, match=r"^n_head: stage 2's width 48 is not divisible by its 5 heads$"):
        SwinTransformer(**{**SWIN, "n_head": (2, 5, 8)})
    with pytest.raises(ValueError, match="^name: 'no_such_net' is not a timm model"):
        TimmModel("no_such_net", num_classes=10, img_size=32, in_chans=3)


def test_a_timm_model_too_deep_for_the_image_size_is_refused_at_build_time():
    """ConvNeXt's four downsamplings leave nothing of a 28x28 image: refused with one line when
    the net is built, not at the first (compiled) training step with a long traceback."""
    with pytest.raises(
        ValueError, match=r"^name: 'convnext_atto' cannot take 28x28 images .* raise the data's img_size"
    ):
        TimmModel("convnext_atto", num_classes=10, img_size=28, in_chans=1)
    assert TimmModel("convnext_atto", num_classes=10, img_size=32, in_chans=1).model.training


def test_timm_model_takes_the_data_shape():
    net = TimmModel("test_resnet", num_classes=7, img_size=32, in_chans=1)
    assert net(torch.randn(2, 1, 32, 32)).shape == (2, 7)
    pooled = net.forward_head(net.forward_features(torch.randn(2, 1, 32, 32)), pre_logits=True)
    assert pooled.shape == (2, net.num_features)  # what CLIP's projection is sized from
    vit = TimmModel(
        "vit_tiny_patch16_224", num_classes=5, img_size=32, in_chans=3, kwargs={"patch_size": 8, "depth": 1}
    )
    assert vit(torch.randn(2, 3, 32, 32)).shape == (2, 5)
    assert "model.pos_embed" in vit.no_weight_decay()
