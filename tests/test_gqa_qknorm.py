"""Grouped-/multi-query attention (``n_kv_head``) and QK-norm (``qk_norm``) in ``MultiHeadAttention``
(issue 60): against transformers' ``LlamaAttention`` and timm's ``Attention`` with copied weights,
the cache of n_kv_head heads, and the refusals of bad values."""

from functools import partial

import pytest
import torch
from torch import nn

from attnlab.models import GPT, VisionTransformer
from attnlab.nn import MultiHeadAttention, Rotary
from conftest import run_main, spec_refusal, tiny

DIM, HEADS, B, T = 32, 4, 2, 7


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("n_kv_head", [1, 2, HEADS])
def test_gqa_equals_llamas_attention(n_kv_head, rope):
    """Llama's attention, its rotary embedding either the identity (cos 1, sin 0) or Llama's own
    RoPE against ours (both turn dims i and i + D/2 together)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=DIM, num_attention_heads=HEADS, num_key_value_heads=n_kv_head, attention_bias=True
    )
    config._attn_implementation = "eager"
    theirs = LlamaAttention(config, layer_idx=0).eval()
    ours = MultiHeadAttention(DIM, HEADS, n_kv_head=n_kv_head, impl="math").eval()
    assert ours.in_proj.out_features == (HEADS + 2 * n_kv_head) * DIM // HEADS
    with torch.no_grad():
        for p in ("weight", "bias"):
            parts = [getattr(getattr(theirs, f"{n}_proj"), p) for n in "qkv"]
            getattr(ours.in_proj, p).copy_(torch.cat(parts))
            getattr(ours.out_proj, p).copy_(getattr(theirs.o_proj, p))
    x = torch.randn(B, T, DIM)
    head_dim = DIM // HEADS
    if rope:
        cos_sin = LlamaRotaryEmbedding(config)(x, torch.arange(T)[None].expand(B, -1))
        positions = Rotary(head_dim, base=config.rope_parameters["rope_theta"])
    else:
        cos_sin, positions = (torch.ones(B, T, head_dim), torch.zeros(B, T, head_dim)), None
    causal = torch.full((T, T), float("-inf")).triu(1).expand(B, 1, T, T)
    with torch.no_grad():
        expected, _ = theirs(x, position_embeddings=cos_sin, attention_mask=causal)
        got, _ = ours(x, causal=True, positions=positions)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_default_attention_is_unchanged():
    """n_kv_head unset is n_head: the same parameters (one in_proj of 3 dim rows, no norms) and
    the same numbers as n_kv_head = n_head."""
    torch.manual_seed(0)
    a = MultiHeadAttention(DIM, HEADS)
    b = MultiHeadAttention(DIM, HEADS, n_kv_head=HEADS)
    b.load_state_dict(a.state_dict())
    assert list(a.state_dict()) == ["in_proj.weight", "in_proj.bias", "out_proj.weight", "out_proj.bias"]
    assert a.in_proj.out_features == 3 * DIM
    x = torch.randn(B, T, DIM)
    assert torch.equal(a(x, causal=True)[0], b(x, causal=True)[0])


@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_cached_generation_equals_recomputation_with_gqa(positions):
    torch.manual_seed(0)
    net = GPT(50, max_len=16, depth=2, n_head=4, dim=32, n_kv_head=2, positions=positions).eval()
    idx = torch.randint(0, 50, (B, 10))
    with torch.no_grad():
        full = net(idx)
        caches = net.new_caches()
        steps = [net(idx[:, :4], caches)] + [net(idx[:, i : i + 1], caches) for i in range(4, 10)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    assert caches[0].k.shape == (B, 2, 10, 8)  # n_kv_head heads are kept, not n_head


def cache_numel(n_kv_head: int | None) -> int:
    torch.manual_seed(0)
    net = GPT(50, max_len=16, depth=2, n_head=8, dim=64, n_kv_head=n_kv_head).eval()
    caches = net.new_caches()
    with torch.no_grad():
        net(torch.randint(0, 50, (B, 12)), caches)
    return sum(c.k.numel() + c.v.numel() for c in caches)


def test_a_gpt_with_a_quarter_of_the_kv_heads_caches_four_times_less():
    assert cache_numel(None) == 4 * cache_numel(2)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_qk_norm_equals_timms_attention(kind):
    from timm.models.vision_transformer import Attention

    norm = partial(nn.RMSNorm if kind == "rmsnorm" else nn.LayerNorm, eps=1e-6)
    theirs = Attention(DIM, HEADS, qkv_bias=True, qk_norm=True, norm_layer=norm).eval()
    ours = MultiHeadAttention(DIM, HEADS, qk_norm=kind).eval()
    with torch.no_grad():  # the norms' affine parameters away from 1 and 0, so they count
        for p in theirs.parameters():
            p.normal_()
    state = theirs.state_dict()
    renamed = {
        k.replace("qkv.", "in_proj.").replace("proj.", "out_proj.", k.startswith("proj.")): v
        for k, v in state.items()
    }
    ours.load_state_dict(renamed)
    x = torch.randn(B, T, DIM)
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[0], theirs(x), atol=1e-5, rtol=0)


def test_qk_norm_true_is_layernorm_and_vit_takes_both():
    assert isinstance(MultiHeadAttention(DIM, HEADS, qk_norm=True).q_norm, nn.LayerNorm)
    vit = VisionTransformer(
        10, 16, 3, patch_size=8, dim=DIM, depth=1, n_head=HEADS, n_kv_head=1, qk_norm="rmsnorm"
    )
    attn = vit.blocks[0].attn
    assert attn.n_kv_head == 1 and isinstance(attn.k_norm, nn.RMSNorm)
    assert vit(torch.randn(1, 3, 16, 16)).shape == (1, 10)


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match=r"^n_kv_head: must divide n_head \(4\), got 3$"):
        MultiHeadAttention(DIM, HEADS, n_kv_head=3)
    for target in ("attnlab.models.GPT", "attnlab.models.Perceiver"):
        message = spec_refusal(target, n_kv_head=0)
        assert message.startswith("model.net.n_kv_head=0: must be greater than 0"), message
        message = spec_refusal(target, qk_norm="l2")
        assert message.startswith("model.net.qk_norm='l2': must be"), message


def test_the_cli_refuses_n_kv_head_not_dividing_n_head_in_one_line(tmp_path):
    argv = ["experiment=gpt_pydoc_char", *tiny("model.net.n_kv_head=3")]  # tiny: n_head 2
    status, out = run_main("train", [*argv, f"paths.root_dir={tmp_path}", "logger=csv"])
    assert status == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    errors = [line for line in out.splitlines() if "error: " in line]
    assert len(errors) == 1 and "model.net.n_kv_head: must divide n_head (2), got 3" in errors[0], out[-3000:]
    assert "Instantiating" not in out, out[-3000:]  # refused at composition, before anything is built


def test_a_timm_vit_with_qk_norm_loads_and_exports_with_it():
    import timm

    from attnlab.weights.timm_vision import load_timm_weights, timm_args

    args = dict(img_size=16, patch_size=8, embed_dim=DIM, depth=1, num_heads=HEADS, num_classes=10)
    theirs = timm.create_model("vit_tiny_patch16_224", pretrained=False, qk_norm=True, **args).eval()
    with torch.no_grad():  # the norms' affine parameters away from 1 and 0, so they count
        for name, p in theirs.named_parameters():
            if "_norm." in name:
                p.normal_()
    ours = VisionTransformer(10, 16, 3, patch_size=8, dim=DIM, depth=1, n_head=HEADS, qk_norm="layernorm")
    load_timm_weights(ours.eval(), theirs)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=1e-5, rtol=0)
    assert timm_args(ours)[1]["qk_norm"] is True


def test_cross_attention_from_a_cached_memory_equals_the_memory_with_gqa_and_qk_norm():
    from attnlab.nn import KVCache

    attn = MultiHeadAttention(DIM, HEADS, n_kv_head=1, qk_norm="rmsnorm").eval()
    x, memory = torch.randn(B, 3, DIM), torch.randn(B, 5, DIM)
    cache = KVCache.of_memory(attn, memory)
    assert cache.k.shape == (B, 1, 5, DIM // HEADS)
    with torch.no_grad():
        torch.testing.assert_close(attn(x, cache=cache)[0], attn(x, memory)[0])
