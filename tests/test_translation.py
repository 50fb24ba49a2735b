"""Translation: RNN attention, the Transformer, decoding, BLEU, the parallel data and the CLI."""

import gzip
import hashlib
import http.server
import json
import threading
from functools import partial
from pathlib import Path

import pytest
import torch
from torchmetrics.text import SacreBLEUScore

from attnlab.core.errors import ConfigError, DataError
from attnlab.data.batching import TokenBatchSampler
from attnlab.data.sources import Builtin, Generated
from attnlab.data.text import translation as tr
from attnlab.data.text.tokenizers import CharTokenizer, SubwordTokenizer
from attnlab.data.text.translation import TranslationDataModule, read_parallel, synthetic_pairs
from attnlab.inference.decoding import beam_search, greedy_decode
from attnlab.models import Seq2Seq, Transformer
from attnlab.nn import AdditiveAttention, MultiplicativeAttention
from conftest import assert_ok, needs_shared, read_metrics, run_cli, run_dirs, spec_refusal

V, PAD, BOS, EOS = 40, 0, 2, 3


def sources(b: int = 4, s: int = 7, seed: int = 0) -> torch.Tensor:
    """A padded source batch: rows of different lengths, each ending in <eos>."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, V, (b, s), generator=g)
    for i in range(b):
        n = s - i % 3
        src[i, n - 1] = EOS
        src[i, n:] = PAD
    return src


def tiny_transformer(**kw) -> Transformer:
    torch.manual_seed(0)
    return Transformer(
        V, PAD, dim=32, n_head=4, enc_depth=2, dec_depth=2, mlp_ratio=2.0, dropout=0.0, max_len=64, **kw
    ).eval()


def tiny_seq2seq(attention: str = "additive", rnn: str = "gru") -> Seq2Seq:
    torch.manual_seed(0)
    return Seq2Seq(
        V,
        PAD,
        attention=attention,
        rnn=rnn,
        dim=16,
        enc_hidden=16,
        dec_hidden=32,
        attn_dim=16,
        dropout=0.0,
    ).eval()


# -- attention for RNNs ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "attn",
    [
        AdditiveAttention(8, 6, 5),
        MultiplicativeAttention(8, 6, "general"),
        MultiplicativeAttention(6, 6, "dot"),
    ],
)
def test_rnn_attention_weights_sum_to_one_and_skip_padding(attn):
    q_dim = 8 if not isinstance(attn, MultiplicativeAttention) or attn.kind == "general" else 6
    keys, query = torch.randn(3, 5, 6), torch.randn(3, q_dim)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] + [True] * 4])
    ctx, w = attn(query, keys, pad)
    assert ctx.shape == (3, 6) and w.shape == (3, 5)
    torch.testing.assert_close(w.sum(-1), torch.ones(3))
    assert (w[pad] == 0).all()
    torch.testing.assert_close(ctx[2], keys[2, 0])  # one real key: all weight on it
    torch.testing.assert_close(ctx, torch.einsum("bs,bsk->bk", w, keys))


def test_additive_attention_is_bahdanaus_formula():
    attn = AdditiveAttention(4, 3, 5)
    q, k = torch.randn(2, 4), torch.randn(2, 6, 3)
    wq, uk, v = attn.query_proj.weight, attn.key_proj, attn.v.weight
    scores = torch.tanh(q[:, None] @ wq.T + k @ uk.weight.T + uk.bias) @ v.T  # v^T tanh(W s + U h)
    _, w = attn(q, k, torch.zeros(2, 6, dtype=torch.bool))
    torch.testing.assert_close(w, scores.squeeze(-1).softmax(-1))


def test_dot_attention_with_mismatched_sizes_is_refused():
    with pytest.raises(ValueError, match="^dot attention needs the decoder state size"):
        MultiplicativeAttention(8, 6, "dot")


def test_dot_attention_names_the_decoder_size_it_needs():
    with pytest.raises(
        ValueError, match=r"^dec_hidden: dot attention needs .* 2 \* enc_hidden \(16\), got 12"
    ):
        Seq2Seq(V, attention="dot", enc_hidden=8, dec_hidden=12)


def test_unknown_attention_type_is_a_config_error():
    message = spec_refusal("attnlab.models.Seq2Seq", vocab_size=V, attention="concat")
    assert message.startswith("model.net.attention='concat': must be 'additive', 'general' or 'dot'")


# -- models ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_decoder_is_causal_and_ignores_source_padding(norm_first):
    net = tiny_transformer(norm_first=norm_first)
    src, tgt = sources(), torch.randint(4, V, (4, 6))
    logits = net(src, tgt)
    changed = tgt.clone()
    changed[:, 4] = (changed[:, 4] + 1 - 4) % (V - 4) + 4
    torch.testing.assert_close(net(src, changed)[:, :4], logits[:, :4])
    assert not torch.allclose(net(src, changed)[:, 4], logits[:, 4])
    padded = torch.cat([src, torch.full((4, 3), PAD)], dim=1)  # more padding: same translation
    torch.testing.assert_close(net(padded, tgt), logits, atol=1e-5, rtol=1e-5)


def tiny_dot_seq2seq() -> Seq2Seq:
    torch.manual_seed(0)
    return Seq2Seq(V, PAD, attention="dot", dim=16, enc_hidden=16, dec_hidden=32, dropout=0.0).eval()


@pytest.mark.parametrize(
    "make",
    [
        tiny_transformer,
        partial(tiny_transformer, positions="learned", norm_first=True),
        tiny_seq2seq,
        partial(tiny_seq2seq, "general", "lstm"),
        tiny_dot_seq2seq,
    ],
)
def test_step_by_step_decoding_equals_the_teacher_forced_pass(make):
    net = make()
    src, tgt = sources(), torch.randint(4, V, (4, 6))
    full = net(src, tgt)
    state, steps = net.start(src), []
    for t in range(tgt.size(1)):
        logits, state = net.step(tgt[:, t], state)
        steps.append(logits)
    steps = torch.stack(steps, dim=1)
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-4)
    scored = tgt != 5
    torch.testing.assert_close(net(src, tgt, scored), full[scored])


def test_seq2seq_teacher_forcing_below_one_feeds_its_own_guesses():
    net = Seq2Seq(V, PAD, dim=16, enc_hidden=16, dec_hidden=32, dropout=0.0, teacher_forcing=0.0).train()
    src, tgt = sources(), torch.randint(4, V, (4, 6))
    logits = net(src, tgt)
    assert logits.shape == (4, 6, V)
    changed = tgt.clone()
    changed[:, 3:] = 4  # never fed when the model feeds itself: the output cannot change
    torch.testing.assert_close(net(src, changed), logits)
    assert not torch.allclose(net.eval()(src, changed), net(src, tgt))  # fed when forced


def test_seq2seq_source_padding_does_not_change_the_output():
    net = tiny_seq2seq()
    src, tgt = sources(), torch.randint(4, V, (4, 6))
    padded = torch.cat([src, torch.full((4, 3), PAD)], dim=1)
    torch.testing.assert_close(net(padded, tgt), net(src, tgt), atol=1e-5, rtol=1e-5)
    (w,) = net.alignments(padded, tgt).values()  # (B, 1, T, S)
    torch.testing.assert_close(w.sum(-1), torch.ones(4, 1, 6))
    assert (w[(padded == PAD)[:, None, None, :].expand_as(w)] == 0).all()


def test_transformer_alignments_are_distributions_over_real_source_tokens():
    net = tiny_transformer()
    src, tgt = sources(), torch.randint(4, V, (4, 6))
    maps = net.alignments(src, tgt)
    assert list(maps) == ["layer 0", "layer 1"]
    for w in maps.values():
        assert w.shape == (4, 4, 6, 7)
        torch.testing.assert_close(w.sum(-1), torch.ones(4, 4, 6))
        assert (w[(src == PAD)[:, None, None, :].expand_as(w)] == 0).all()


# -- decoding --------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [tiny_transformer, tiny_seq2seq])
def test_beam_search_with_beam_one_is_greedy(make):
    net, src = make(), sources(6, 7, seed=1)
    greedy = greedy_decode(net, src, BOS, EOS, max_len=12)
    assert greedy == beam_search(net, src, BOS, EOS, max_len=12, beam_size=1)
    for s, g in zip(src, greedy, strict=True):
        # greedy: each token is the argmax after the ones before it, and it stops at <eos> (not
        # returned) or after max_len tokens
        assert len(g) <= 12 and EOS not in g
        want = g if len(g) == 12 else [*g, EOS]
        assert net(s[None], torch.tensor([[BOS, *g]]))[0].argmax(-1).tolist()[: len(want)] == want


@torch.no_grad()
def sequence_logprob(net, src: torch.Tensor, hyp: list[int], max_len: int) -> float:
    """log p(hyp <eos> | src), or log p(hyp | src) for a hypothesis cut at max_len (unfinished)."""
    targets = [*hyp, EOS] if len(hyp) < max_len else hyp
    logp = net(src[None], torch.tensor([[BOS, *targets[:-1]]])).log_softmax(-1)[0]
    return float(logp.gather(1, torch.tensor(targets)[:, None]).sum())


def test_wider_beams_find_more_likely_translations():
    net, src = tiny_transformer(), sources(6, 7, seed=2)
    greedy = greedy_decode(net, src, BOS, EOS, max_len=30)
    beam = beam_search(net, src, BOS, EOS, max_len=30, beam_size=6, alpha=0.0)
    for i in range(6):  # alpha 0: beam search ranks by total log-probability, as here
        beam_lp, greedy_lp = (sequence_logprob(net, src[i], h[i], 30) for h in (beam, greedy))
        assert beam_lp >= greedy_lp - 1e-4
    assert any(len(b) < 30 for b in beam) and beam != greedy  # some finished: the comparison has teeth


# -- BLEU and data ---------------------------------------------------------------------------------
def test_bleu_of_references_against_themselves_is_100():
    src, tgt = synthetic_pairs(50, seed=0)
    bleu = SacreBLEUScore()
    bleu.update(tgt, [[t] for t in tgt])
    assert float(bleu.compute()) == pytest.approx(1.0)
    bleu.reset()
    bleu.update(tgt[::-1], [[t] for t in tgt])
    assert float(bleu.compute()) < 0.5


def test_subword_tokenizer_round_trips_raw_text():
    lines = ["Zwei junge, weiße Männer sind im Freien.", "A man in an orange hat stares at something."]
    tok = SubwordTokenizer.fit(lines * 20, 120)
    for line in lines + ["Männer, Männer in orange Freien."]:
        assert tok.decode(tok.encode(line)) == line
    assert tok.decode([tok.bos_id, *tok.encode(lines[0]), tok.eos_id, tok.pad_id]) == lines[0]
    assert tok.unk_id in tok.encode("Zwei Männer!")  # an unseen character is <unk>, not an error


def test_token_batches_respect_the_budget_and_cover_every_pair_once():
    lengths = [(i * 7919) % 40 + 1 for i in range(500)]
    sampler = TokenBatchSampler(lengths, max_tokens=200, shuffle=True, seed=3)
    batches = list(sampler)
    assert sorted(i for b in batches for i in b) == list(range(500))
    assert all(len(b) * max(lengths[i] for i in b) <= 200 for b in batches)
    sampler.set_epoch(1)
    assert list(sampler) != batches  # reshuffled each epoch


def write_corpus(d: Path, pairs: dict[str, tuple[list[str], list[str]]]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for split, (de, en) in pairs.items():
        (d / f"{split}.de").write_text("".join(s + "\n" for s in de), encoding="utf-8")
        (d / f"{split}.en").write_text("".join(s + "\n" for s in en), encoding="utf-8")
    return d


def fake_multi30k(d: Path) -> Path:
    return write_corpus(
        d,
        {
            "train": synthetic_pairs(300, 0),
            "val": synthetic_pairs(20, 1),
            "test_2016_flickr": synthetic_pairs(20, 2),
        },
    )


def test_parallel_files_of_different_lengths_name_both_files(tmp_path):
    d = fake_multi30k(tmp_path)
    (d / "val.en").write_text("one line\n")
    with pytest.raises(DataError, match=r"val.de has 20 lines, .*val.en has 1"):
        read_parallel(d / "val.de", d / "val.en")
    dm = TranslationDataModule(
        Builtin("multi30k", data_dir=str(d), cache_dir=str(tmp_path / "cache")), vocab_size=100
    )
    with pytest.raises(DataError, match="parallel files differ in length"):
        dm.setup()


@pytest.mark.parametrize("damage", ["missing", "empty"])
def test_missing_or_empty_corpus_files_are_data_errors(tmp_path, damage):
    d = fake_multi30k(tmp_path / "m30k")
    if damage == "missing":
        (d / "train.de").unlink()
    else:
        (d / "train.de").write_text("")
    dm = TranslationDataModule(
        Builtin("multi30k", data_dir=str(d), cache_dir=str(tmp_path / "cache")), vocab_size=100
    )
    with pytest.raises(DataError, match="train.de"):
        dm.setup()


def test_long_pairs_are_dropped_from_training_and_truncated_in_test(tmp_path, caplog):
    de, en = synthetic_pairs(300, 0)
    de[0] = " ".join(["hund"] * 80) + "."
    de_t, en_t = synthetic_pairs(20, 2)
    de_t[0] = de[0]
    d = write_corpus(
        tmp_path / "m30k",
        {"train": (de, en), "val": synthetic_pairs(20, 1), "test_2016_flickr": (de_t, en_t)},
    )
    dm = TranslationDataModule(
        Builtin("multi30k", data_dir=str(d), cache_dir=str(tmp_path / "c")),
        vocab_size=100,
        max_len=40,
        max_tokens=200,
    )
    with caplog.at_level("WARNING"):
        dm.setup()
    assert "dropped 1 of 300 training pairs" in caplog.text
    assert "truncated 1 of 20 test pairs" in caplog.text
    assert len(dm.splits["train"]) == 299 and len(dm.splits["test"]) == 20
    assert len(dm.references("test")) == 20


def test_a_tokenizer_that_does_not_match_is_refused():
    dm = TranslationDataModule(Generated("synthetic"))
    with pytest.raises(DataError, match="not a translation vocabulary"):
        dm.load_artifacts({"tokenizer": CharTokenizer.fit("abc").to_json()})


def test_direction_is_chosen_by_config(tmp_path):
    d = fake_multi30k(tmp_path / "m30k")
    fwd = TranslationDataModule(
        Builtin("multi30k", data_dir=str(d), cache_dir=str(tmp_path / "c")), vocab_size=100
    )
    back = TranslationDataModule(
        Builtin("multi30k", data_dir=str(d), cache_dir=str(tmp_path / "c")),
        vocab_size=100,
        src_lang="en",
        tgt_lang="de",
    )
    fwd.setup(), back.setup()
    assert fwd.sources("val") == back.references("val") and fwd.references("val") == back.sources("val")
    assert fwd.tokenizer.to_json() == back.tokenizer.to_json()  # one joint vocabulary, cached
    assert list((tmp_path / "c").glob("bpe_multi30k_100_*.json"))
    assert not list(d.glob("bpe*"))  # nothing is written into the user's data directory
    with pytest.raises(ConfigError, match="src_lang"):
        TranslationDataModule(src_lang="fr")


def serve(directory: Path):
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(directory))
    handler.log_message = lambda *a: None
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def test_multi30k_downloads_gunzips_and_checks_sha256(tmp_path, monkeypatch):
    raw = fake_multi30k(tmp_path / "raw")
    site = tmp_path / "site"
    site.mkdir()
    sums = {}
    for f in raw.iterdir():
        (site / f"{f.name}.gz").write_bytes(gzip.compress(f.read_bytes()))
        sums[f.name] = hashlib.sha256(f.read_bytes()).hexdigest()
    httpd = serve(site)
    try:
        monkeypatch.setattr(tr, "MULTI30K_URL", f"http://127.0.0.1:{httpd.server_port}/{{name}}.gz")
        monkeypatch.setattr(tr, "MULTI30K_SHA256", sums)
        dm = TranslationDataModule(Builtin("multi30k", cache_dir=str(tmp_path / "cache")), vocab_size=100)
        dm.prepare_data()
        dm.setup()
        assert (tmp_path / "cache" / "multi30k" / "train.de").read_bytes() == (raw / "train.de").read_bytes()
        assert dm.references("test") == (raw / "test_2016_flickr.en").read_text().splitlines()
        sums_bad = {**sums, "val.en": "0" * 64}
        monkeypatch.setattr(tr, "MULTI30K_SHA256", sums_bad)
        (tmp_path / "cache" / "multi30k" / "val.en").unlink()
        with pytest.raises(DataError, match="checksum mismatch"):
            TranslationDataModule(
                Builtin("multi30k", cache_dir=str(tmp_path / "cache")), vocab_size=100
            ).prepare_data()
        assert not (tmp_path / "cache" / "multi30k" / "val.en").exists()
    finally:
        httpd.shutdown()


def test_shared_multi30k_reads_with_its_published_line_counts():
    d = needs_shared("multi30k")
    counts = [len(read_parallel(d / f"{s}.de", d / f"{s}.en")[0]) for s in tr.SPLITS["multi30k"]]
    assert counts == [29000, 1014, 1000]


# -- training end to end ---------------------------------------------------------------------------
NMT_TINY = [
    "experiment=nmt_synthetic",
    "logger=csv",
    "extras.print_config=false",
    "~callbacks.rich_progress_bar",
    "~callbacks.model_summary",
]


@pytest.fixture(scope="module")
def nmt_run(tmp_path_factory) -> Path:
    """The synthetic translation experiment as users run it, trained to convergence (400 steps)."""
    cwd = tmp_path_factory.mktemp("nmt")
    assert_ok(run_cli("train", NMT_TINY, cwd))
    (run_dir,) = run_dirs(cwd, "nmt_synthetic")
    return run_dir


def test_a_tiny_transformer_learns_the_synthetic_task(nmt_run: Path):
    m = read_metrics(nmt_run)
    assert m["test/bleu"][-1][1] > 90
    assert m["val/bleu_best"][-1][1] > 90 and m["val/loss"][-1][1] < m["val/loss"][0][1]
    assert len((nmt_run / "test_translations.txt").read_text().splitlines()) == 500
    assert len((nmt_run / "test_references.txt").read_text().splitlines()) == 500  # line by line
    pngs = sorted((nmt_run / "alignments").glob("*.png"))
    assert pngs and pngs[-1].read_bytes()[:4] == b"\x89PNG"


def test_translate_cli_text_and_file_modes(nmt_run: Path, tmp_path):
    ckpt = nmt_run / "checkpoints" / "last.ckpt"
    args = [f"ckpt_path={ckpt}", "text=blau hund läuft groß haus.", "beam_size=1"]
    proc = run_cli("translate", args, tmp_path)
    assert_ok(proc)  # (the shell has stripped the user's quotes: the entry point quotes for Hydra)
    assert proc.stdout.strip() == "House big runs dog blue."
    assert "translating" not in proc.stderr  # one sentence: no progress bar
    src, ref = synthetic_pairs(30, seed=7)
    (tmp_path / "in.de").write_text("\n".join(src) + "\n", encoding="utf-8")
    args = [f"ckpt_path={ckpt}", "input=in.de", "output=out.en"]  # the checkpoint's beam (4)
    assert_ok(run_cli("translate", args, tmp_path))
    out = (tmp_path / "out.en").read_text(encoding="utf-8").splitlines()
    assert len(out) == 30 and sum(o == r for o, r in zip(out, ref, strict=True)) >= 25
    # a file printed: standard output holds the translations alone, the progress goes to stderr
    printed = run_cli("translate", [f"ckpt_path={ckpt}", "input=in.de"], tmp_path)
    assert_ok(printed)
    assert printed.stdout.splitlines() == out
    assert "translating" in printed.stderr and "30/30" in printed.stderr
    again = run_cli("translate", args, tmp_path)  # never overwrites without being asked
    assert again.returncode == 2 and "exists" in again.stderr
    empty = tmp_path / "empty.de"
    empty.write_text("")
    bad = run_cli("translate", [f"ckpt_path={ckpt}", f"input={empty}"], tmp_path)
    assert bad.returncode == 2 and "is empty" in bad.stderr


def test_eval_scores_the_checkpoint_with_beam_search(nmt_run: Path):
    proc = run_cli("eval", [f"ckpt_path={nmt_run / 'checkpoints' / 'last.ckpt'}"], nmt_run)
    assert_ok(proc)
    (out,) = run_dirs(nmt_run, "eval")
    assert json.loads((out / "metrics.json").read_text())["test/bleu"] > 90


SEQ2SEQ_TINY = [
    "data=synthetic_translation",
    "model=seq2seq",
    "callbacks=translation",
    "logger=csv",
    "trainer.val_check_interval=1.0",
    "trainer.check_val_every_n_epoch=1",
    "model.plot_sentences=1",
    "extras.print_config=false",
    "~callbacks.rich_progress_bar",
    "~callbacks.model_summary",
]


def test_bahdanau_learns_the_synthetic_task(tmp_path):
    args = [
        *SEQ2SEQ_TINY,
        "model.net.dim=64",
        "model.net.enc_hidden=64",
        "model.net.dec_hidden=128",
        "model.net.attn_dim=64",
        "model.net.dropout=0.0",
        "model.optim.optimizer.lr=3e-3",
        "model.optim.scheduler.warmup_steps=20",
        "trainer.max_steps=260",  # val BLEU 98.7 at step 221 and 99.7 at 258 (test 99.6)
        "task_name=bahdanau",
        "model.compile_loss=true",
    ]  # the compiled training loss learns as the eager one
    assert_ok(run_cli("train", args, tmp_path))
    (run_dir,) = run_dirs(tmp_path, "bahdanau")
    m = read_metrics(run_dir)
    assert m["val/loss"][-1][1] < 0.5 * m["val/loss"][0][1]
    assert m["test/bleu"][-1][1] > 90


def test_unknown_attention_type_from_the_command_line(tmp_path):
    proc = run_cli("train", [*SEQ2SEQ_TINY, "model.net.attention=concat"], tmp_path)
    assert proc.returncode == 2
    assert "model.net.attention='concat': must be 'additive', 'general' or 'dot'" in proc.stdout + proc.stderr


def test_testing_after_fit_keeps_the_averaged_weights():
    from types import SimpleNamespace

    from lightning.pytorch.trainer.states import TrainerFn
    from torch.optim.swa_utils import get_ema_multi_avg_fn

    from attnlab.training.callbacks import WeightAveraging

    module = torch.nn.Linear(2, 2)
    ema = WeightAveraging(multi_avg_fn=get_ema_multi_avg_fn(0.9))
    ema._average_model = torch.optim.swa_utils.AveragedModel(module)
    averaged = {k: torch.zeros_like(v) for k, v in module.state_dict().items()}
    raw = {k: torch.ones_like(v) for k, v in module.state_dict().items()}
    ckpt = {
        "state_dict": averaged,
        "current_model_state": raw,
        "averaging_state": {"n_averaged": torch.tensor(3)},
    }
    module.load_state_dict(averaged)  # what Lightning restores from "state_dict"
    ema.on_load_checkpoint(SimpleNamespace(state=SimpleNamespace(fn=TrainerFn.TESTING)), module, ckpt)
    assert (module.weight == 0).all()  # Lightning's own callback would have loaded the raw weights
    ema.on_load_checkpoint(SimpleNamespace(state=SimpleNamespace(fn=TrainerFn.FITTING)), module, ckpt)
    assert (module.weight == 1).all()  # resuming training restores both
