import pytest
import torch
from torch import nn

from attnlab.nn import KVCache, MultiHeadAttention, causal_mask, scaled_dot_product_attention
from conftest import spec_refusal

B, T, C, H = 3, 7, 32, 4


def copied_pair(impl: str) -> tuple[MultiHeadAttention, nn.MultiheadAttention]:
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(C, H, batch_first=True).eval()
    ours = MultiHeadAttention(C, H, impl=impl).eval()
    with torch.no_grad():
        ours.in_proj.weight.copy_(ref.in_proj_weight)
        ours.in_proj.bias.copy_(ref.in_proj_bias)
        ours.out_proj.weight.copy_(ref.out_proj.weight)
        ours.out_proj.bias.copy_(ref.out_proj.bias)
    return ours, ref


def padding(lengths: list[int], t: int) -> torch.Tensor:
    return torch.arange(t)[None, :] >= torch.tensor(lengths)[:, None]  # True at padding


@pytest.mark.parametrize("impl", ["sdpa", "math"])
def test_self_attention_matches_torch_with_padding_and_causal(impl):
    ours, ref = copied_pair(impl)
    x = torch.randn(B, T, C)
    kpm = padding([7, 5, 3], T)
    future = ~causal_mask(T, T)  # torch: True = not allowed
    want, want_w = ref(x, x, x, key_padding_mask=kpm, attn_mask=future, average_attn_weights=False)
    got, _ = ours(x, key_padding_mask=kpm, causal=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    got_w = ours(x, key_padding_mask=kpm, causal=True, need_weights=True)[1]
    torch.testing.assert_close(got_w, want_w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["sdpa", "math"])
def test_cross_attention_matches_torch(impl):
    ours, ref = copied_pair(impl)
    x, memory = torch.randn(B, T, C), torch.randn(B, 11, C)
    kpm = padding([11, 4, 9], 11)
    want, _ = ref(x, memory, memory, key_padding_mask=kpm)
    got, _ = ours(x, memory, key_padding_mask=kpm)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_memory_of_another_width_matches_torch_kdim_vdim():
    """``kv_dim``: keys and values projected straight from a memory of 19 channels, as
    ``nn.MultiheadAttention(kdim=, vdim=)``; such a layer refuses self-attention."""
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(C, H, kdim=19, vdim=19, batch_first=True).eval()
    ours = MultiHeadAttention(C, H, kv_dim=19).eval()
    with torch.no_grad():
        ours.in_proj.weight.copy_(ref.q_proj_weight)
        ours.kv_proj.weight.copy_(torch.cat([ref.k_proj_weight, ref.v_proj_weight]))
        ours.in_proj.bias.copy_(ref.in_proj_bias[:C])
        ours.kv_proj.bias.copy_(ref.in_proj_bias[C:])
        ours.out_proj.load_state_dict(ref.out_proj.state_dict())
    x, memory = torch.randn(B, T, C), torch.randn(B, 11, 19)
    kpm = padding([11, 4, 9], 11)
    want, _ = ref(x, memory, memory, key_padding_mask=kpm)
    torch.testing.assert_close(ours(x, memory, key_padding_mask=kpm)[0], want, atol=1e-5, rtol=1e-5)
    cache = KVCache.of_memory(ours, memory)  # projected once, as a decoder's cross-attention
    torch.testing.assert_close(ours(x, cache=cache)[0], ours(x, memory)[0])
    with pytest.raises(ValueError, match="attends only to a memory"):
        ours(x)


def test_weights_sum_to_one_and_ignore_padding():
    ours, _ = copied_pair("math")
    x = torch.randn(B, T, C)
    kpm = padding([7, 5, 3], T)
    _, w = ours(x, key_padding_mask=kpm, need_weights=True)  # (B, H, T, T)
    torch.testing.assert_close(w.sum(-1), torch.ones(B, H, T))
    assert (w.masked_select(kpm[:, None, None, :].expand_as(w)) == 0).all()


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_path_equals_explicit_path(causal):
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 4, 9, 8) for _ in range(3))
    mask = torch.rand(2, 1, 9, 9) > 0.3
    mask[..., 0] = True  # every query keeps at least one key
    for m in (None, mask):
        fast, _ = scaled_dot_product_attention(q, k, v, mask=m, causal=causal, impl="sdpa")
        slow, w = scaled_dot_product_attention(q, k, v, mask=m, causal=causal, impl="math", need_weights=True)
        torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)
        if causal:
            assert (w.triu(diagonal=1) == 0).all()


@pytest.mark.parametrize("native_bf16", [True, False])
def test_auto_path_follows_dtype_and_cpu(monkeypatch, native_bf16):
    import attnlab.nn.attention as attention

    monkeypatch.setattr(attention, "native_bf16_cpu", lambda: native_bf16)
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        torch.nn.functional, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    q = torch.randn(1, 2, 4, 8)
    scaled_dot_product_attention(q, q, q, impl="auto")
    assert calls == [1]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scaled_dot_product_attention(q, q, q, impl="auto")
    # bf16: the explicit path where the CPU has native bf16, SDPA where it does not
    assert calls == ([1] if native_bf16 else [1, 1])


def test_cached_attention_equals_full_causal_attention():
    torch.manual_seed(2)
    attn = MultiHeadAttention(C, H).eval()
    x = torch.randn(2, T, C)
    full, _ = attn(x, causal=True)
    cache = KVCache()
    first, _ = attn(x[:, :4], causal=True, cache=cache)
    steps = [attn(x[:, i : i + 1], causal=True, cache=cache)[0] for i in range(4, T)]
    torch.testing.assert_close(torch.cat([first, *steps], dim=1), full, atol=1e-5, rtol=1e-5)
    assert len(cache) == T


def test_causal_mask_is_bottom_right_aligned():
    m = causal_mask(2, 4)
    assert m.tolist() == [[True, True, True, False], [True, True, True, True]]


def test_bad_head_split_is_refused():
    with pytest.raises(ValueError, match=r"^dim: must be divisible by n_head \(4\), got 30$"):
        MultiHeadAttention(30, 4)
    attention = "attnlab.nn.MultiHeadAttention"  # a value alone: refused by the signature's spec
    assert spec_refusal(attention, dim=0, n_head=1).startswith("model.net.dim=0: must be greater than 0")
    assert spec_refusal(attention, dim=8, n_head=0).startswith("model.net.n_head=0: must be greater than 0")
