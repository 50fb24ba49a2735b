"""The attention backends against the explicit softmax (``math``), outputs and gradients within 1e-5
in fp32: FlexAttention (``attn_impl: flex``) for every attention variant, decoding with the caches
too, and a CPU's flash kernel in pieces for causal ALiBi and T5 (``nn/flash_pieces.py``).
FlexAttention runs eagerly here (``flex.COMPILE`` off): compiling it on a CPU takes minutes, and
its compiled CPU kernel has no backward; the compiled forward is checked inside a compiled GPT
(ALiBi, full), and in the slow tests also alone and with T5 in a sliding window."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from attnlab.models import GPT, Bert, SwinTransformer
from attnlab.nn import MultiHeadAttention, attention, flex
from attnlab.nn.attention import choose_impl
from attnlab.nn.flash_pieces import BLOCK, flash_pieces, t5_reach
from attnlab.nn.positions import relative_positions, t5_bucket
from conftest import run_main, spec_refusal, tiny

TOL = dict(atol=1e-5, rtol=1e-5)
GPT_VARIANTS = [
    *[(p, "full") for p in ("learned", "rope", "alibi", "t5")],
    *[(p, a) for a in ("sliding", "global_local") for p in ("rope", "alibi", "t5")],
]


@pytest.fixture(autouse=True)
def eager_flex(monkeypatch):
    monkeypatch.setattr(flex, "COMPILE", False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tensors of kilobytes
    yield
    torch.set_num_threads(threads)


def set_impl(net: nn.Module, impl: str) -> nn.Module:
    for m in net.modules():
        if isinstance(m, MultiHeadAttention):
            m.impl = impl
    return net


def grads(
    net: nn.Module, inputs: tuple[torch.Tensor, ...], out_fn
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The output and the gradients of a fixed random projection of it wrt every parameter and
    every floating input."""
    net.zero_grad(set_to_none=True)
    inputs = tuple(x.detach().requires_grad_() if x.is_floating_point() else x for x in inputs)
    y = out_fn(*inputs)
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    (y * w).sum().backward()
    gs = [p.grad for p in net.parameters() if p.grad is not None]
    gs += [x.grad for x in inputs if x.is_floating_point()]
    return y.detach(), gs


def assert_same_path(net: nn.Module, inputs: tuple[torch.Tensor, ...], out_fn) -> None:
    y_math, g_math = grads(set_impl(net, "math"), inputs, out_fn)
    y_flex, g_flex = grads(set_impl(net, "flex"), inputs, out_fn)
    torch.testing.assert_close(y_flex, y_math, **TOL)
    assert len(g_flex) == len(g_math) > 0
    for a, b in zip(g_flex, g_math, strict=True):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize(
    "case", ["plain", "causal", "padding", "causal+padding", "bool mask", "float mask", "cross"]
)
def test_multi_head_attention_flex_equals_math(case: str):
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 2)
    x, memory = torch.randn(2, 9, 16), torch.randn(2, 6, 16)
    padding = torch.zeros(2, 9, dtype=torch.bool)
    padding[1, 6:] = True
    kwargs = {
        "plain": {},
        "causal": {"causal": True},
        "padding": {"key_padding_mask": padding},
        "causal+padding": {"causal": True, "key_padding_mask": padding},
        "bool mask": {"attn_mask": torch.rand(2, 1, 9, 9) > 0.3},
        "float mask": {"attn_mask": torch.randn(2, 9, 9)},
    }.get(case)
    if case == "bool mask":
        kwargs["attn_mask"][..., 0] = True  # every query sees a key
    if case == "cross":
        assert_same_path(attn, (x, memory), lambda x, m: attn(x, m, key_padding_mask=padding[:, :6])[0])
    else:
        assert_same_path(attn, (x,), lambda x: attn(x, **kwargs)[0])


@pytest.mark.parametrize("variant", GPT_VARIANTS, ids="-".join)
def test_every_gpt_variant_flex_equals_math_training_and_decoding(variant: tuple[str, str]):
    torch.manual_seed(0)
    positions, attention = variant
    gpt = GPT(40, max_len=24, depth=2, n_head=2, dim=16, positions=positions, attention=attention, window=5)
    if positions == "t5":
        nn.init.normal_(gpt.positions.table.weight)  # zeros at init would hide a wrong bucket
    idx = torch.randint(40, (2, 20))  # past the window: the blocked path against the block mask
    assert_same_path(gpt, (idx,), gpt)
    gpt.eval()
    with torch.no_grad():  # the caches: a prompt, then one token at a time
        steps = {}
        for impl in ("math", "flex"):
            set_impl(gpt, impl)
            caches = gpt.new_caches()
            logits = [gpt(idx[:, :7], caches)]
            logits += [gpt(idx[:, i : i + 1], caches) for i in range(7, 20)]
            steps[impl] = torch.cat(logits, dim=1)
        torch.testing.assert_close(steps["flex"], steps["math"], **TOL)
        torch.testing.assert_close(steps["flex"], gpt(idx), **TOL)


@pytest.mark.parametrize("positions", ["alibi", "t5"])
def test_bert_with_a_bias_and_padding_flex_equals_math(positions: str):
    torch.manual_seed(0)
    bert = Bert(30, dim=16, depth=2, n_head=2, max_len=16, dropout=0, attn_dropout=0, positions=positions)
    if positions == "t5":
        nn.init.normal_(bert.positions.table.weight)
    ids = torch.randint(5, 30, (2, 12))
    ids[0, 9:] = 0  # padding, never attended
    assert_same_path(bert, (ids,), lambda ids: bert(ids)[0])


def test_swin_window_attention_flex_equals_math():
    torch.manual_seed(0)
    swin = SwinTransformer(
        3, 16, 1, patch_size=2, dim=16, depths=(2,), n_head=(2,), window_size=4, drop_path=0
    )
    assert_same_path(swin, (torch.randn(2, 1, 16, 16),), swin)


def test_flex_refuses_attention_dropout_naming_the_key():
    with pytest.raises(ValueError, match="attn_impl=flex has no attention dropout"):
        MultiHeadAttention(16, 2, dropout=0.1, impl="flex")
    message = spec_refusal("attnlab.nn.MultiHeadAttention", dim=16, n_head=2, impl="flash")
    assert message.startswith("model.net.impl='flash': must be 'auto', 'sdpa', 'flex' or 'math'")


def test_auto_takes_flex_for_a_bias_on_a_gpu_only_and_says_so(caplog, monkeypatch):
    monkeypatch.setattr(attention, "_announced", set())  # said once per process: say it here
    q = torch.randn(1, 2, 4, 8)
    with caplog.at_level(logging.INFO, logger="attnlab.nn.attention"):
        assert choose_impl("auto", q, need_weights=False, fused_only=True, dropout=False) in ("sdpa", "math")
    assert "attn_impl=auto takes" in caplog.text
    meta = torch.empty(1, 2, 4, 8, device="meta")
    meta_cuda = type("Q", (), {"device": torch.device("cuda"), "dtype": torch.bfloat16})()
    assert choose_impl("auto", meta_cuda, need_weights=False, fused_only=True, dropout=False) == "flex"
    assert choose_impl("auto", meta_cuda, need_weights=False, fused_only=True, dropout=True) == "sdpa"
    assert choose_impl("auto", meta_cuda, need_weights=False, fused_only=False, dropout=False) == "sdpa"
    assert choose_impl("flex", meta, need_weights=True, fused_only=True, dropout=False) == "math"


def test_attention_maps_come_from_math_under_flex():
    torch.manual_seed(0)
    gpt = set_impl(GPT(40, max_len=16, depth=1, n_head=2, dim=16, positions="alibi"), "flex").eval()
    attn = gpt.blocks[0].attn
    x = torch.randn(1, 10, 16)
    y, weights = attn(x, causal=True, need_weights=True, positions=gpt.positions)
    assert weights.shape == (1, 2, 10, 10)
    torch.testing.assert_close(attn(x, causal=True, positions=gpt.positions)[0], y, **TOL)


@pytest.mark.slow
def test_compiled_flex_forward_equals_math_on_a_cpu(monkeypatch):
    """The fused kernel itself (compiled, inference: a CPU has no compiled backward)."""
    monkeypatch.setattr(flex, "COMPILE", True)
    torch.manual_seed(0)
    attn = MultiHeadAttention(32, 2).eval()
    positions = relative_positions("alibi", 16, 2, causal=True)
    x = torch.randn(1, 256, 32)
    with torch.no_grad():
        y_math = set_impl(attn, "math")(x, causal=True, positions=positions)[0]
        y_flex = set_impl(attn, "flex")(x, causal=True, positions=positions)[0]
    torch.testing.assert_close(y_flex, y_math, **TOL)


@pytest.mark.parametrize(
    "variant",
    [("alibi", "full"), pytest.param(("t5", "sliding"), marks=pytest.mark.slow)],  # alibi-full: seconds
    ids="-".join,
)
def test_flex_inside_a_compiled_gpt_equals_math(variant: tuple[str, str], monkeypatch):
    """The whole model compiled (``model.optim.compile``), FlexAttention with it: strided heads gave wrong
    outputs and a bias computed in the graph did not lower on a CPU until worked around."""
    monkeypatch.setattr(flex, "COMPILE", True)
    torch.manual_seed(0)
    positions, attention = variant
    gpt = GPT(40, max_len=64, depth=2, n_head=2, dim=64, positions=positions, attention=attention, window=8)
    idx = torch.randint(40, (2, 64))
    with torch.no_grad():
        expected = set_impl(gpt.eval(), "math")(idx)
        compiled = torch.compile(set_impl(gpt, "flex"))(idx)
    torch.testing.assert_close(compiled, expected, **TOL)


@pytest.mark.parametrize("positions", ["alibi", "t5"])
def test_causal_bias_through_the_cpu_flash_kernel_in_pieces_equals_math(positions: str, monkeypatch):
    """Past two blocks of queries, so that far keys, the T5 constant and the diagonal all occur."""
    torch.manual_seed(0)
    gpt = GPT(40, max_len=2 * BLOCK + 50, depth=1, n_head=2, dim=16, positions=positions)
    if positions == "t5":
        nn.init.normal_(gpt.positions.table.weight)
    calls = []
    monkeypatch.setattr(attention, "flash_pieces", lambda *a: calls.append(1) or flash_pieces(*a))
    idx = torch.randint(40, (2, 2 * BLOCK + 50))
    y_math, g_math = grads(set_impl(gpt, "math"), (idx,), gpt)
    y_sdpa, g_sdpa = grads(set_impl(gpt, "sdpa"), (idx,), gpt)
    assert calls  # the pieces ran
    torch.testing.assert_close(y_sdpa, y_math, **TOL)
    for a, b in zip(g_sdpa, g_math, strict=True):  # T5's table sums many scores: relative
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_t5_bias_is_constant_from_its_reach():
    t5 = relative_positions("t5", 8, 2, causal=True)
    buckets = t5_bucket(-torch.arange(1000), False, t5.num_buckets, t5.max_distance)
    reach = t5_reach(t5)
    assert (buckets[reach:] == buckets[-1]).all() and buckets[reach - 1] != buckets[-1]


def test_the_cli_refuses_flex_with_attention_dropout_in_one_line(tmp_path):
    argv = ["experiment=gpt_pydoc_char", *tiny("model.net.dropout=0.1", "model.net.attn_impl=flex")]
    status, out = run_main("train", [*argv, f"paths.root_dir={tmp_path}", "logger=csv"])
    assert status == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    errors = [line for line in out.splitlines() if "error: " in line]
    assert len(errors) == 1 and "attn_impl=flex has no attention dropout" in errors[0], out[-3000:]
