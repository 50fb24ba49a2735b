"""Relative positions (RoPE, ALiBi, T5 buckets, none) and causal local and linear attention:
each against a reference (transformers' implementations, Press et al.'s slopes, the quadratic form),
their masks, their caches, and GPT trained with each through the CLI."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from attnlab.cli.compare import compare, parse_args
from attnlab.inference.decoding import generate
from attnlab.models import GPT
from attnlab.nn import (
    ALiBi,
    GlobalLocalAttention,
    LinearAttention,
    Rotary,
    SlidingWindowAttention,
    T5RelativeBias,
)
from attnlab.nn.linear_attention import FEATURE_MAPS, taylor_feature_map
from attnlab.nn.positions import alibi_slopes, relative_positions, t5_bucket
from conftest import (
    assert_ok,
    assert_user_error,
    bert_overrides,
    read_metrics,
    run_cli,
    run_dirs,
    run_main,
    spec_refusal,
    tiny,
)

QUIET = ["trainer.enable_progress_bar=false", "logger=csv"]  # beside TINY's quiet console
# (positions, attention): every position with full attention, every pattern with RoPE and NoPE
VARIANTS = [
    *[(p, "full") for p in ("learned", "sinusoidal", "rope", "alibi", "t5", "none")],
    *[(p, a) for a in ("sliding", "global_local", "linear") for p in ("rope", "none")],
    ("alibi", "sliding"),
    ("t5", "global_local"),
]


@pytest.fixture(autouse=True)
def one_thread():
    """Tensors of a few kilobytes: one thread is faster than several contending for busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def variant_id(v: tuple[str, ...]) -> str:
    return "-".join(v)


# ---- positions against their references ---------------------------------------------------------


def test_rope_matches_transformers_llama():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, num_attention_heads=4, rope_theta=10000.0, max_position_embeddings=256
    )
    q, k = torch.randn(2, 4, 9, 16), torch.randn(2, 4, 9, 16)
    pos = torch.arange(100, 109)  # positions past the start, as a cached decoding step has
    cos, sin = LlamaRotaryEmbedding(config)(q, pos[None])
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
    rope = Rotary(16)
    torch.testing.assert_close(rope.rotate(q, pos), q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rope.rotate(k, pos), k_ref, atol=1e-5, rtol=1e-5)


def test_rope_scores_depend_only_on_the_offset():
    rope, q, k = Rotary(8), torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(i: int, j: int) -> torch.Tensor:
        return (rope.rotate(q, torch.tensor([i])) * rope.rotate(k, torch.tensor([j]))).sum()

    torch.testing.assert_close(score(7, 3), score(107, 103), atol=1e-4, rtol=1e-4)


def test_alibi_slopes_are_press_et_al_s():
    assert alibi_slopes(8) == [2.0**-i for i in range(1, 9)]  # the paper's example
    # 6 heads: the 4-head slopes, then every other slope of 8 heads (Press et al.'s code)
    assert alibi_slopes(6) == [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    for n in (1, 2, 3, 5, 6, 7, 8, 12, 16, 20):
        ref = build_alibi_tensor(torch.ones(1, 2), n, torch.float32)[:, 0, 1]  # slope * position 1
        torch.testing.assert_close(torch.tensor(alibi_slopes(n)), ref)


def test_alibi_bias_grows_linearly_with_the_distance_to_the_key():
    relative = torch.arange(-5, 1)[None, :] - torch.zeros(3, 1, dtype=torch.long)  # key - query
    bias = ALiBi(4).bias(relative)  # (H, 3, 6)
    slopes = torch.tensor(alibi_slopes(4))
    torch.testing.assert_close(bias, slopes[:, None, None] * relative.float())
    symmetric = ALiBi(4, symmetric=True).bias(torch.tensor([-3, 3]))
    torch.testing.assert_close(symmetric[:, 0], symmetric[:, 1])


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_t5_buckets_and_bias_match_transformers(causal: bool):
    from transformers import T5Config
    from transformers.models.t5.modeling_t5 import T5Attention

    relative = torch.arange(-300, 300)
    ref = T5Attention._relative_position_bucket(relative, bidirectional=not causal)
    assert torch.equal(t5_bucket(relative, bidirectional=not causal), ref)

    config = T5Config(d_model=32, d_kv=8, num_heads=4, is_decoder=causal)
    torch.manual_seed(0)
    hf = T5Attention(config, has_relative_attention_bias=True)
    ours = T5RelativeBias(4, causal=causal)
    ours.table.weight.data.copy_(hf.relative_attention_bias.weight.data)
    t_q, t_k = 150, 150
    expected = hf.compute_bias(t_q, t_k)[0]  # (H, T_q, T_k)
    pos = torch.arange(t_q)
    torch.testing.assert_close(ours.bias(pos[None, :] - pos[:, None]), expected)


# ---- local attention: masks and the blocked path ------------------------------------------------


def local_layer(kind: str, window: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "sliding":
        return SlidingWindowAttention(16, 2, window=window).eval()
    return GlobalLocalAttention(16, 2, window=window, n_global=2).eval()


def may_attend(kind: str, i: int, j: int, window: int = 4) -> bool:
    return j <= i and (i - j < window or (kind == "global_local" and j < 2))


@pytest.mark.parametrize("kind", ["sliding", "global_local"])
def test_a_local_output_depends_only_on_its_window_and_the_past(kind: str):
    """Gradients of each output position wrt every input: non-zero exactly inside its window (and
    at the global tokens), zero outside and in the future; the blocked path (T > window)."""
    attn, t = local_layer(kind), 13
    x = torch.randn(1, t, 16)
    jac = torch.autograd.functional.jacobian(lambda z: attn(z, causal=True)[0], x)  # (1, T, C, 1, T, C)
    reach = jac[0, :, :, 0].abs().sum(dim=(1, 3)) > 0  # (T_out, T_in)
    expected = torch.tensor([[may_attend(kind, i, j) for j in range(t)] for i in range(t)])
    assert torch.equal(reach, expected)


@pytest.mark.parametrize("kind", ["sliding", "global_local"])
@pytest.mark.parametrize("positions", ["none", "rope", "alibi", "t5"])
def test_local_weights_stay_in_the_window_and_the_blocked_path_agrees(kind: str, positions: str):
    attn, t = local_layer(kind), 23  # not a multiple of the window: the last block padded
    pos = relative_positions(positions, 8, 2, causal=True)
    if pos is not None:
        torch.nn.init.normal_(pos.table.weight) if positions == "t5" else None
    x = torch.randn(2, t, 16)
    y_weights, weights = attn(x, causal=True, need_weights=True, positions=pos)  # every pair scored
    y_blocked, _ = attn(x, causal=True, positions=pos)  # blocks of the window
    allowed = torch.tensor([[may_attend(kind, i, j) for j in range(t)] for i in range(t)])
    assert (weights[..., ~allowed] == 0).all()
    assert (weights[..., allowed] > 0).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 2, t))
    torch.testing.assert_close(y_blocked, y_weights, atol=1e-5, rtol=1e-5)


# ---- linear attention ---------------------------------------------------------------------------


@pytest.mark.parametrize("feature_map", FEATURE_MAPS)
def test_linear_attention_equals_its_quadratic_form_and_its_recurrence(feature_map: str):
    torch.manual_seed(0)
    attn, t = LinearAttention(16, 2, feature_map=feature_map).eval(), 150  # past two chunks of 64
    x = torch.randn(2, t, 16)
    q, k, v = (z.view(2, t, 2, 8).transpose(1, 2) for z in attn.in_proj(x).split(16, dim=-1))
    phi = FEATURE_MAPS[feature_map]
    scores = (phi(q) @ phi(k).transpose(-1, -2)).tril()  # (B, H, T, T)
    y = (scores / scores.sum(-1, keepdim=True)) @ v
    expected = attn.out_proj(y.transpose(1, 2).reshape(2, t, 16))
    out, weights = attn(x, causal=True, need_weights=True)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(weights, scores / scores.sum(-1, keepdim=True))
    state = attn.new_cache()  # the same from the recurrent state, a prompt then one token at a time
    steps = [attn(x[:, :70], causal=True, cache=state)[0]]
    steps += [attn(x[:, i : i + 1], causal=True, cache=state)[0] for i in range(70, t)]
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, atol=1e-5, rtol=1e-4)


def test_linear_attention_refuses_a_set_mask_and_an_unknown_keyword():
    attn, x = LinearAttention(16, 2), torch.randn(1, 4, 16)
    attn(x, causal=True, attn_mask=None, key_padding_mask=None)  # a block's unset masks pass
    with pytest.raises(ValueError, match="no memory or masks"):
        attn(x, causal=True, key_padding_mask=torch.zeros(1, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="unexpected keyword argument 'key_pading_mask'"):
        attn(x, causal=True, key_pading_mask=None)


def test_taylor_features_give_softmax_kernel_to_second_order_and_keep_rope_relative():
    torch.manual_seed(0)
    q, k = torch.randn(5, 8) * 2, torch.randn(7, 8) * 2
    s = q @ k.T / 8**0.5
    kernel = taylor_feature_map(q) @ taylor_feature_map(k).T
    torch.testing.assert_close(kernel, 1 + s + s**2 / 2)
    assert taylor_feature_map(q).shape == (5, 1 + 8 + 36) and (kernel > 0).all()
    # RoPE before the features: the kernel of a query and a key depends on their offset alone
    rope = relative_positions("rope", 8, 1, causal=True)

    def weight(i: int, j: int) -> torch.Tensor:  # query 0 at position i, key 0 at position j
        qi, kj = rope.rotate(q[:1], torch.tensor([i])), rope.rotate(k[:1], torch.tensor([j]))
        return taylor_feature_map(qi) @ taylor_feature_map(kj).T

    torch.testing.assert_close(weight(3, 1), weight(12, 10))
    torch.testing.assert_close(weight(40, 0), weight(45, 5))


# ---- GPT with each variant ----------------------------------------------------------------------


def tiny_gpt(positions: str, attention: str, feature_map: str = "elu", max_len: int = 24) -> GPT:
    torch.manual_seed(0)
    return GPT(
        40,
        max_len=max_len,
        depth=2,
        n_head=2,
        dim=16,
        positions=positions,
        attention=attention,
        window=5,
        n_global=2,
        feature_map=feature_map,
    ).eval()


@pytest.mark.parametrize("variant", [*VARIANTS, ("rope", "linear", "taylor")], ids=variant_id)
def test_generation_with_the_cache_gives_the_tokens_of_recomputing(variant: tuple[str, ...]):
    """Past max_len too, where the window slides and the caches are rebuilt."""
    gpt, prompt = tiny_gpt(*variant), torch.randint(40, (2, 3))
    for temperature in (0.0, 1.0):
        with_cache, without = (
            generate(gpt, prompt, 40, temperature, use_cache=c, generator=torch.Generator().manual_seed(1))
            for c in (True, False)
        )
        assert torch.equal(with_cache, without)


@pytest.mark.parametrize("variant", VARIANTS, ids=variant_id)
def test_each_variant_is_causal_and_runs_past_its_training_length(variant: tuple[str, str]):
    gpt = tiny_gpt(*variant, max_len=16)
    idx = torch.randint(40, (1, 16))
    changed = torch.cat([idx[:, :10], torch.randint(40, (1, 6))], dim=1)
    torch.testing.assert_close(gpt(idx)[:, :10], gpt(changed)[:, :10])  # the future changes nothing
    if variant[0] != "learned":
        assert gpt(torch.randint(40, (1, 128))).shape == (1, 128, 40)  # 8x the training length


def test_sinusoidal_positions_do_not_drown_the_tokens():
    """GPT's tokens start at std 0.02 and the sinusoids at amplitude 1: scaled by sqrt(dim), as in
    the Transformer paper, the tokens keep a fair share of each input vector."""
    torch.manual_seed(0)
    net = GPT(65, max_len=64, depth=1, n_head=2, dim=128, positions="sinusoidal")
    idx = torch.randint(65, (4, 64))
    tokens = net.embed.tokens(idx) * net.embed.scale
    positions = net.embed.positions(64)
    assert net.embed.scale == pytest.approx(128**0.5)
    assert tokens.std() > 0.25 * positions.std()
    assert GPT(65, max_len=64, depth=1, n_head=2, dim=128).embed.scale == 1.0  # learned: nanoGPT's


@pytest.mark.parametrize("attention", ["full", "linear"])
def test_nope_tells_positions_apart_by_its_start_token(attention: str):
    """One token repeated: with no positions every place sees the same keys and values, so only
    the start token that opens the sequence can make the places differ."""
    gpt = tiny_gpt("none", attention)
    logits = gpt(torch.full((1, 12), 7))
    assert (logits[0, 1:] - logits[0, :-1]).abs().amax(-1).min() > 1e-4  # every place its own
    gpt.start_token = None
    flat = gpt(torch.full((1, 12), 7))
    torch.testing.assert_close(flat[0, 1:], flat[0, :-1].clone())  # without it, all alike


def test_learned_positions_refuse_inputs_past_their_table():
    with pytest.raises(ValueError, match="17 tokens exceeds the 16 learned positions"):
        tiny_gpt("learned", "full", max_len=16)(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"positions": "xpos"}, "model.net.positions="),
        ({"attention": "flash"}, "model.net.attention="),
        ({"attention": "sliding", "window": 0}, "model.net.window="),
        ({"attention": "linear", "feature_map": "relu"}, "model.net.feature_map="),
    ],
)
def test_bad_choices_name_the_field(kw: dict, needle: str):
    args = dict(vocab_size=40, max_len=16, depth=1, n_head=2, dim=16)
    assert spec_refusal("attnlab.models.GPT", **args, **kw).startswith(needle)


def test_linear_attention_refuses_positions_that_bias_the_scores():
    with pytest.raises(
        ValueError, match="^positions: alibi biases attention scores, which linear attention never forms"
    ):
        GPT(40, max_len=16, depth=1, n_head=2, dim=16, positions="alibi", attention="linear")


@pytest.mark.parametrize("variant", VARIANTS[:9], ids=variant_id)
def test_each_variant_trains_through_the_cli(variant: tuple[str, str], tmp_path: Path):
    """The default experiment's GPT with the variant: the training loss falls over 30 steps."""
    positions, attention = variant
    args = tiny(
        "trainer.max_steps=30",
        "model.optim.scheduler.warmup_steps=3",
        "model.optim.optimizer.lr=3e-3",
        "trainer.log_every_n_steps=1",
        f"model.net.positions={positions}",
        f"model.net.attention={attention}",
        "model.net.window=8",
        "model.net.n_global=2",
        "task_name=variant",
    )
    assert_ok(run_cli("train", [*args, *QUIET], tmp_path))
    (run_dir,) = run_dirs(tmp_path, "variant")
    metrics = read_metrics(run_dir)
    loss = [v for _, v in metrics["train/loss"]]
    assert sum(loss[-5:]) / 5 < sum(loss[:5]) / 5 - 0.5, loss
    assert "test/ppl" in metrics


def test_eval_at_longer_windows_and_learned_positions_past_their_table(tmp_path: Path, monkeypatch):
    """attnlab-eval lengths=[1,2,4]: test/ppl_x1.. for ALiBi; learned positions give x1 and say
    why x2 is skipped; a plain eval past the table is one line and exit status 2."""
    short = ["trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_test_batches=1"]
    for positions in ("alibi", "learned"):
        args = [*tiny(*short, f"model.net.positions={positions}", f"task_name={positions}"), *QUIET]
        assert_ok(run_cli("train", args, tmp_path))
    alibi = run_dirs(tmp_path, "alibi")[0] / "checkpoints" / "last.ckpt"
    learned = run_dirs(tmp_path, "learned")[0] / "checkpoints" / "last.ckpt"
    limits = ["trainer.limit_test_batches=1", "trainer.enable_progress_bar=false"]
    assert_ok(run_cli("eval", [f"ckpt_path={alibi}", "lengths=[1,2,4]", *limits], tmp_path))
    metrics = read_metrics(alibi.parent.parent)
    assert {f"eval/test/ppl_x{m}" for m in (1, 2, 4)} <= set(metrics), sorted(metrics)
    proc = run_cli("eval", [f"ckpt_path={learned}", "lengths=[1,2]", *limits], tmp_path)
    assert_ok(proc)
    assert "length x2 (32 tokens) skipped" in proc.stdout + proc.stderr
    assert "eval/test/ppl_x1" in read_metrics(learned.parent.parent)
    proc = run_cli("eval", [f"ckpt_path={learned}", "+data.max_len=32", *limits], tmp_path)
    assert_user_error(proc, "data.max_len=32: a sequence of 32 tokens exceeds the 16 learned positions")
    assert math.isfinite(metrics["eval/test/ppl_x4"][-1][1])
    # the extrapolation plot: perplexity against the number in each metric's name, a line per run
    figures = plot_figures(monkeypatch)
    compare(
        parse_args([str(alibi.parent.parent), "--plot", "eval/test/ppl_x*", "--out", str(tmp_path / "p.png")])
    )
    (ax,) = figures[0].axes
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == [1.0, 2.0, 4.0] and ax.get_xlabel() == "ppl_x"
    assert list(line.get_ydata()) == [metrics[f"eval/test/ppl_x{m}"][-1][1] for m in (1, 2, 4)]


def plot_figures(monkeypatch: pytest.MonkeyPatch) -> list:
    """The figures attnlab-compare draws, kept for the test to read."""
    import attnlab.training.plots

    figures, draw = [], attnlab.training.plots.curves_figure
    monkeypatch.setattr(
        attnlab.training.plots, "curves_figure", lambda *a, **k: figures.append(draw(*a, **k)) or figures[-1]
    )
    return figures


def test_cost_sweep_is_a_multirun_that_compare_plots_against_the_length(tmp_path: Path, monkeypatch):
    """attnlab-train -m experiment=gpt_long_context over lengths and attentions logs the training
    and generation cost of each run; attnlab-compare --x model.net.max_len draws one line per
    attention through every length, and a table of the cost metrics."""
    monkeypatch.chdir(tmp_path)
    status, out = run_main(
        "train",
        [
            "-m",
            "experiment=gpt_long_context",
            "data=pydoc_char",  # no download: the recipe's own data is tinyshakespeare
            *tiny("trainer.max_steps=3", "model.net.max_len=32,64", "model.net.attention=full,linear"),
            "trainer.enable_progress_bar=false",
            f"paths.root_dir={tmp_path}",
        ],
    )
    assert status == 0, out[-3000:]
    figures = plot_figures(monkeypatch)
    logs = str(tmp_path / "logs" / "gpt_long_context")
    args = ["--plot", "cost/train_ms_per_token", "--x", "model.net.max_len", "--out", str(tmp_path / "c.png")]
    table = compare(parse_args([logs, *args, "--format", "csv", "--metrics", "cost/generate_ms_per_token"]))
    (ax,) = figures[0].axes
    lines = {line.get_label(): list(line.get_xdata()) for line in ax.get_lines()}
    assert lines == {"attention=full": [32.0, 64.0], "attention=linear": [32.0, 64.0]}, lines
    assert ax.get_xlabel() == "model.net.max_len" and ax.get_xscale() == "log"
    header, *body = table.strip().splitlines()
    assert header == "model.net.attention,model.net.max_len,runs,cost/generate_ms_per_token", header
    assert len(body) == 4 and all(float(row.rsplit(",", 1)[1]) > 0 for row in body), table


# ---- the BERT encoder ---------------------------------------------------------------------------


@pytest.mark.parametrize("positions", ["rope", "alibi", "t5"])
def test_bert_with_relative_positions_ignores_padding_and_sees_order(positions: str):
    from attnlab.models import Bert

    torch.manual_seed(0)
    bert = Bert(30, pad_id=0, dim=16, depth=2, n_head=2, max_len=16, positions=positions).eval()
    for param in bert.parameters():  # scores far from uniform: order shows in the outputs
        torch.nn.init.normal_(param, std=0.5)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    padded = torch.cat([ids, torch.zeros(1, 3, dtype=torch.long)], dim=1)
    torch.testing.assert_close(bert(padded)[0][:, :5], bert(ids)[0], atol=1e-5, rtol=1e-5)
    swapped = torch.tensor([[5, 7, 6, 8, 9]])  # the same tokens in another order
    assert not torch.allclose(bert(swapped)[0][:, 0], bert(ids)[0][:, 0], atol=1e-4)
    assert {n for n, _ in bert.named_parameters() if "positions" in n} <= bert.no_weight_decay()


def test_bert_pretrains_with_t5_positions_through_the_cli(tmp_path: Path):
    args = [
        "experiment=bert_pretrain_sst2",
        *bert_overrides("bert_pretrain_sst2", tmp_path),
        "model.net.encoder.positions=t5",
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=1",
        "trainer.limit_test_batches=1",
        "extras.print_config=false",
        "~callbacks.rich_progress_bar",
        "logger=csv",
    ]
    assert_ok(run_cli("train", args, tmp_path))
