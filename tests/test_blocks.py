"""The shared block library: numerics against torch's reference layers with copied weights."""

import pytest
import torch
from torch import nn

from attnlab.nn import (
    KVCache,
    MultiHeadAttention,
    TransformerBlock,
    causal_mask,
    scaled_dot_product_attention,
)

D, H, F = 32, 4, 64


def copy_attn(ours: MultiHeadAttention, ref: nn.MultiheadAttention) -> None:
    ours.in_proj.weight.copy_(ref.in_proj_weight)
    ours.in_proj.bias.copy_(ref.in_proj_bias)
    ours.out_proj.load_state_dict(ref.out_proj.state_dict())


@torch.no_grad()
@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_block_equals_torch_encoder_layer(norm_first):
    torch.manual_seed(0)
    ref = nn.TransformerEncoderLayer(D, H, F, dropout=0.0, batch_first=True, norm_first=norm_first).eval()
    ours = TransformerBlock(D, H, F, norm_first=norm_first, act_layer=nn.ReLU).eval()
    copy_attn(ours.attn, ref.self_attn)
    ours.mlp.fc1.load_state_dict(ref.linear1.state_dict())
    ours.mlp.fc2.load_state_dict(ref.linear2.state_dict())
    ours.norm1.load_state_dict(ref.norm1.state_dict())
    ours.norm2.load_state_dict(ref.norm2.state_dict())
    x = torch.randn(3, 9, D)
    pad = torch.arange(9)[None] >= torch.tensor([9, 6, 2])[:, None]
    got, _ = ours(x, padding_mask=pad)
    want = ref(x, src_key_padding_mask=pad)
    keep = ~pad  # torch's fast path may zero padded positions; compare the real ones
    torch.testing.assert_close(got[keep], want[keep], atol=1e-5, rtol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_block_equals_torch_decoder_layer_and_caches_agree(norm_first):
    torch.manual_seed(1)
    ref = nn.TransformerDecoderLayer(D, H, F, dropout=0.0, batch_first=True, norm_first=norm_first).eval()
    ours = TransformerBlock(D, H, F, norm_first=norm_first, cross_attention=True, act_layer=nn.ReLU).eval()
    copy_attn(ours.attn, ref.self_attn)
    copy_attn(ours.cross_attn, ref.multihead_attn)
    ours.mlp.fc1.load_state_dict(ref.linear1.state_dict())
    ours.mlp.fc2.load_state_dict(ref.linear2.state_dict())
    for mine, theirs in ((ours.norm1, ref.norm1), (ours.norm_cross, ref.norm2), (ours.norm2, ref.norm3)):
        mine.load_state_dict(theirs.state_dict())
    x, memory = torch.randn(2, 7, D), torch.randn(2, 5, D)
    mem_pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    want = ref(x, memory, tgt_mask=~causal_mask(7, 7), memory_key_padding_mask=mem_pad)
    got, w = ours(x, causal=True, memory=memory, memory_padding_mask=mem_pad, need_weights=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert w.cross_attn.shape == (2, H, 7, 5) and (w.cross_attn[1, ..., 3:] == 0).all()
    # step by step: self-attention cache grows, cross-attention keys/values projected once
    cache, cross = KVCache(), KVCache.of_memory(ours.cross_attn, memory)
    steps = [
        ours(x[:, t : t + 1], causal=True, cache=cache, memory_padding_mask=mem_pad, cross_cache=cross)[0]
        for t in range(7)
    ]
    torch.testing.assert_close(torch.cat(steps, 1), want, atol=1e-5, rtol=1e-5)
    assert len(cache) == 7 and len(cross) == 5


@pytest.mark.parametrize("impl", ["sdpa", "math"])
def test_float_bias_is_added_to_the_scores_and_combines_with_boolean_masks(impl):
    torch.manual_seed(2)
    q, k, v = (torch.randn(2, 3, 6, 8) for _ in range(3))
    bias = torch.randn(3, 6, 6)  # e.g. a relative-position bias per head
    scores = q @ k.transpose(-2, -1) / 8**0.5 + bias
    want = scores.masked_fill(~causal_mask(6, 6), float("-inf")).softmax(-1) @ v
    got, _ = scaled_dot_product_attention(q, k, v, mask=bias, causal=True, impl=impl)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # a float mask of 0 / -inf is the boolean mask
    allowed = torch.rand(2, 1, 6, 6) > 0.4
    allowed[..., 0] = True
    as_float = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    a, _ = scaled_dot_product_attention(q, k, v, mask=allowed, impl=impl)
    b, _ = scaled_dot_product_attention(q, k, v, mask=as_float, impl=impl)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_multi_head_attention_takes_a_float_bias_with_padding():
    torch.manual_seed(3)
    attn = MultiHeadAttention(D, H).eval()
    x = torch.randn(2, 5, D)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    bias = torch.randn(H, 5, 5)
    _, w = attn(x, attn_mask=bias, key_padding_mask=pad, need_weights=True)
    assert (w[1, ..., 3:] == 0).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(2, H, 5))
    _, w0 = attn(x, key_padding_mask=pad, need_weights=True)
    assert not torch.allclose(w, w0)  # the bias changed the weights


def test_drop_path_drops_whole_branches_in_training_only():
    torch.manual_seed(4)
    block = TransformerBlock(D, H, F, drop_path=0.5)
    x = torch.randn(64, 3, D)
    block.eval()
    a, _ = block(x)
    torch.testing.assert_close(block(x)[0], a)
    block.train()
    y, _ = block(x)
    assert not torch.allclose(y, a)
