"""Attention health (issue 59): closed forms, recording beside any backend, and a real run's log."""

import csv
import math

import pytest
import torch
from torch import nn

from attnlab.nn import ALiBi, MultiHeadAttention, SlidingWindowAttention, T5RelativeBias, health
from attnlab.training.attention_health import AttentionHealth
from conftest import ROOT, assert_ok, read_metrics, run_cli, run_dirs, tiny


def metrics_of(weights: torch.Tensor, q_pos=None, k_pos=None) -> dict[str, float]:
    layer = nn.Identity()
    with health.recording(layer) as records:
        health.record(layer, weights, q_pos, k_pos)
    return {k.split("/")[1]: v for k, v in health.flat(health.per_head(records)).items() if k.count("/") == 1}


def test_uniform_attention_over_t_keys():
    t = 10
    got = metrics_of(torch.full((2, 3, t, t), 1 / t))
    mean_distance = (t * t - 1) / (3 * t)  # E|i - j| for i, j uniform on 0..t-1
    assert got["entropy"] == pytest.approx(math.log(t), rel=1e-6)
    assert got["distance"] == pytest.approx(mean_distance, rel=1e-6)
    assert got["first_token"] == got["max_weight"] == pytest.approx(1 / t)


def test_attention_to_the_previous_token_only():
    t = 9  # queries 1..8, each on the key before it
    weights = torch.eye(t)[:-1].expand(2, 4, -1, -1)  # (B, H, t - 1, t): row i -> key i
    got = metrics_of(weights, q_pos=torch.arange(1, t), k_pos=torch.arange(t))
    assert got == pytest.approx(
        {"entropy": 0.0, "distance": 1.0, "first_token": 1 / (t - 1), "max_weight": 1.0}
    )


def test_pixel_positions_and_tokens_without_one():
    """A class token (NaN position) is left out as a query and as a key (its mass renormalised);
    a patch at (0, 0) attending half to itself, half to (3, 4): 2.5 pixels."""
    pos = torch.tensor([[float("nan")] * 2, [0.0, 0.0], [3.0, 4.0]])
    w = torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.25, 0.25], [0.0, 0.0, 1.0]])[None, None]
    assert metrics_of(w, pos, pos)["distance"] == pytest.approx((2.5 + 0.0) / 2)


def zero_query(m: nn.Module) -> nn.Module:
    with torch.no_grad():
        m.in_proj.weight[: m.dim] = 0  # q = 0: every score 0, uniform over the keys a query sees
        m.in_proj.bias[: m.dim] = 0
    return m


@pytest.mark.parametrize("impl", ["sdpa", "math"])
def test_causal_uniform_through_multi_head_attention(impl):
    """Query i sees keys 0..i uniformly: entropy log(i + 1), distance i / 2, first token 1 / (i + 1)."""
    t = 12
    m = zero_query(MultiHeadAttention(16, 2, impl=impl)).eval()
    with health.recording(m, rows=2) as records:
        m(torch.randn(5, t, 16), causal=True)
    (r,) = records
    assert r.layer == "MultiHeadAttention" and r.weights.shape == (2, 2, t, t)
    i = torch.arange(t, dtype=torch.float64)
    h = health.flat(health.per_head(records))
    assert h["attn/entropy"] == pytest.approx(torch.log(i + 1).mean().item(), rel=1e-5)
    assert h["attn/distance/MultiHeadAttention/h1"] == pytest.approx((t - 1) / 4, rel=1e-5)
    assert h["attn/first_token"] == pytest.approx((1 / (i + 1)).mean().item(), rel=1e-5)


def attention_kinds():
    """(name, module, forward kwargs): causal, padding, sliding window, ALiBi, T5, GQA."""
    pad = torch.arange(10)[None, :] >= torch.tensor([10, 7, 4, 10])[:, None]
    for impl in ("sdpa", "math"):
        yield (
            f"causal-padding-{impl}",
            MultiHeadAttention(32, 4, impl=impl),
            dict(causal=True, key_padding_mask=pad),
        )
        yield f"gqa-{impl}", MultiHeadAttention(32, 4, impl=impl, n_kv_head=2), dict(causal=True)
        yield f"window-{impl}", SlidingWindowAttention(32, 4, window=3, impl=impl), dict(causal=True)
        yield f"alibi-{impl}", MultiHeadAttention(32, 4, impl=impl), dict(causal=True, positions=ALiBi(4))
        yield f"t5-{impl}", MultiHeadAttention(32, 4, impl=impl), dict(positions=T5RelativeBias(4, False))


@pytest.mark.parametrize(
    "name,m,kwargs", list(attention_kinds()), ids=lambda x: x if isinstance(x, str) else ""
)
def test_recording_leaves_the_output_bit_identical_and_records_the_math_paths_weights(name, m, kwargs):
    m.train()  # attention dropout on: its random stream must be left alone too
    m.dropout = 0.1
    x = torch.randn(4, 10, 32)
    torch.manual_seed(1)
    want, _ = m(x, **kwargs)
    want_next = torch.rand(3)
    torch.manual_seed(1)
    with health.recording(m, rows=3) as records:
        got, _ = m(x, **kwargs)
    assert torch.equal(got, want) and torch.equal(torch.rand(3), want_next)
    m.eval()
    sliced = {k: v[:3] if k == "key_padding_mask" else v for k, v in kwargs.items()}
    _, weights = m(x[:3], need_weights=True, **sliced)
    (r,) = records
    if "key_padding_mask" in kwargs:  # padding queries' rows are left out
        weights = weights.masked_fill(kwargs["key_padding_mask"][:3, None, :, None], float("nan"))
    torch.testing.assert_close(r.weights, weights.float(), equal_nan=True)


def test_only_the_recorded_net_records_and_nothing_without_a_recording():
    a, b = MultiHeadAttention(8, 2).eval(), MultiHeadAttention(8, 2).eval()
    x = torch.randn(2, 5, 8)
    with health.recording(a) as records:
        a(x), b(x)  # b: a teacher, say
    assert [r.layer for r in records] == ["MultiHeadAttention"] and not health.is_recording()
    health.record(a, torch.ones(1, 1, 1, 1))  # outside a recording: nothing, no error


def test_a_compiled_attention_records_too():
    m = MultiHeadAttention(16, 2).eval()
    m.compile(backend="eager")  # dynamo's graph, its break around the recording; no inductor
    x = torch.randn(3, 5, 16)
    want, _ = m(x, causal=True)
    with health.recording(m, rows=2) as records:
        got, _ = m(x, causal=True)
    assert torch.equal(got, want) and [r.weights.shape for r in records] == [(2, 2, 5, 5)]


@pytest.mark.parametrize("off", ["~callbacks.attention_health", "callbacks.attention_health=null"])
def test_a_user_switches_it_off(off, tmp_path):
    from hydra import compose, initialize_config_dir

    from attnlab.cli.train import instantiate_group

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        on, cfg = (compose("train", [f"paths.output_dir={tmp_path}", *o]) for o in ([], [off]))
    assert any(isinstance(c, AttentionHealth) for c in instantiate_group(on, "callbacks"))
    assert not any(isinstance(c, AttentionHealth) for c in instantiate_group(cfg, "callbacks"))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("health")
    args = tiny("model.net.depth=2", "trainer.max_steps=4", "trainer.val_check_interval=2", "logger=csv")
    assert_ok(run_cli("train", [*args, "trainer.enable_progress_bar=false", "task_name=health"], tmp))
    (run,) = run_dirs(tmp, "health")
    return run


def test_a_run_logs_every_layer_and_head_at_every_validation(tiny_run):
    logged = read_metrics(tiny_run)
    for metric in health.METRICS:
        for key in (f"attn/{metric}", f"attn/{metric}/blocks.1.attn", f"attn/{metric}/blocks.0.attn/h1"):
            assert [step for step, _ in logged[key]] == [1, 3], key  # 2 validations, no sanity check
    assert 0 < logged["attn/entropy"][0][1] <= math.log(16)  # max_len 16: at most log T nats
    with open(tiny_run / "csv" / "metrics.csv") as f:
        assert "val/loss" in next(csv.reader(f))


def test_a_run_draws_its_heat_maps_once(tiny_run):
    assert [p.name for p in (tiny_run / "figures").iterdir()] == ["attention_health.png"]


def test_the_final_line_keeps_the_means_not_every_head(tiny_run):
    (final,) = [line for line in (tiny_run / "health.log").read_text().splitlines() if "final: " in line]
    assert "attn/entropy " in final and "attn/entropy/" not in final, final
