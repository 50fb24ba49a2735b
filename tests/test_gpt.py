import pytest
import torch
import torch.nn.functional as F

from attnlab.data.text.corpora import python_docs
from attnlab.data.text.tokenizers import CharTokenizer
from attnlab.inference.decoding import generate, sample_next
from attnlab.models import GPT
from attnlab.nn import KVCache
from conftest import spec_refusal


def tiny_gpt(**kw) -> GPT:
    torch.manual_seed(0)
    args = dict(vocab_size=50, max_len=16, depth=2, n_head=2, dim=32)
    return GPT(**{**args, **kw}).eval()


def test_logits_shape_and_weight_tying():
    net = tiny_gpt()
    assert net(torch.randint(0, 50, (3, 16))).shape == (3, 16, 50)
    h = torch.randn(2, 32)
    torch.testing.assert_close(net.embed.unembed(h), h @ net.embed.tokens.weight.T)
    # the output layer is the token table: no second (vocab, width) matrix anywhere
    assert [n for n, p in net.named_parameters() if p.shape == (50, 32)] == ["embed.tokens.weight"]


@pytest.mark.parametrize("impl", ["sdpa", "math"])
def test_future_tokens_do_not_change_earlier_logits(impl):
    net = tiny_gpt(attn_impl=impl)
    x = torch.randint(0, 50, (2, 16))
    y = x.clone()
    y[:, 10:] = (y[:, 10:] + 1) % 50
    a, b = net(x), net(y)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_sdpa_and_math_paths_give_the_same_logits():
    x = torch.randint(0, 50, (2, 16))
    a = tiny_gpt(attn_impl="sdpa")(x)
    b = tiny_gpt(attn_impl="math")(x)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_incremental_forward_with_cache_equals_full_forward():
    net = tiny_gpt()
    x = torch.randint(0, 50, (2, 12))
    caches = [KVCache() for _ in net.blocks]
    parts = [net(x[:, :5], caches)] + [net(x[:, i : i + 1], caches) for i in range(5, 12)]
    torch.testing.assert_close(torch.cat(parts, 1), net(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, None, None), (1.0, 5, None), (0.8, None, 0.9)])
def test_generation_with_cache_equals_generation_without(temperature, top_k, top_p):
    net = tiny_gpt()
    prompt = torch.randint(0, 50, (2, 3))
    # 40 new tokens run well past max_len 16, where the window slides
    outs = [
        generate(
            net,
            prompt,
            40,
            temperature,
            top_k,
            top_p,
            use_cache=c,
            generator=torch.Generator().manual_seed(7),
        )
        for c in (True, False)
    ]
    assert outs[0].shape == (2, 43)
    assert torch.equal(outs[0], outs[1])


def test_mlp_ratio_sets_the_mlp_width():
    assert tiny_gpt().blocks[0].mlp.fc1.out_features == 4 * 32  # GPT-2's 4x by default
    assert tiny_gpt(mlp_ratio=2.5).blocks[0].mlp.fc1.out_features == 80


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(500, 1)
    g = torch.Generator().manual_seed(0)
    assert set(sample_next(logits, 1.0, top_k=2, generator=g).unique().tolist()) == {0, 1}
    # softmax: p0=0.64, p1=0.24: top_p 0.7 needs the first two tokens, never the third
    assert set(sample_next(logits, 1.0, top_p=0.7, generator=g).unique().tolist()) == {0, 1}
    assert sample_next(logits[:1], 0.0).item() == 0


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"max_len": 0}, "max_len"),
        ({"depth": -1}, "depth"),
        ({"mlp_ratio": 0.0}, "mlp_ratio"),
        ({"dropout": 1.0}, "dropout"),
    ],
)
def test_bad_config_names_the_field(kw, field):
    args = dict(vocab_size=50, max_len=16, depth=2, n_head=2, dim=32)
    assert spec_refusal("attnlab.models.GPT", **{**args, **kw}).startswith(f"model.net.{field}=")


def test_a_width_the_heads_do_not_divide_is_refused():
    with pytest.raises(ValueError, match="^dim"):
        tiny_gpt(dim=30, n_head=4)


def test_context_longer_than_max_len_is_refused():
    with pytest.raises(ValueError, match="17 tokens exceeds the 16 learned positions"):
        tiny_gpt()(torch.zeros(1, 17, dtype=torch.long))


def test_loss_falls_on_real_text():
    text = python_docs()[:20000]
    tok = CharTokenizer.fit(text)
    data = torch.tensor(tok.encode(text))
    torch.manual_seed(0)
    net = GPT(tok.vocab_size, max_len=32, depth=2, n_head=2, dim=64).train()
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    starts = torch.randint(0, len(data) - 33, (16,))
    x = torch.stack([data[s : s + 32] for s in starts])
    y = torch.stack([data[s + 1 : s + 33] for s in starts])
    losses = []
    for _ in range(30):
        loss = F.cross_entropy(net(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 4.0  # about log(vocab) at init
    assert losses[-1] < 0.75 * losses[0]
