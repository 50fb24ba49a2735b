"""BERT: the encoder against transformers', masking and segment pairs, pre-training then
fine-tuning (weights and tokenizer carried over), fill-mask and classify, bad inputs."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from attnlab.cli.common import config_dir
from attnlab.data.sources import Files, SplitFiles
from attnlab.data.text.classification import SentenceClassificationDataModule, TokenClassificationDataModule
from attnlab.data.text.formats import read_corpus, read_tsv
from attnlab.data.text.masked_lm import (
    IS_NEXT,
    N_SPECIALS,
    NOT_NEXT,
    MaskedLMDataModule,
    SegmentPairs,
    mask_tokens,
)
from attnlab.data.text.tokenizers import WordPieceTokenizer
from attnlab.models.text.bert import Bert, BertPreTraining
from attnlab.weights.bert import load_hf_weights
from attnlab.weights.checkpoint import load_checkpoint, metadata
from conftest import (
    BERT_TINY,
    CONLL_FIXTURE,
    assert_user_error,
    needs_shared,
    read_metrics,
    run_cli,
    run_dirs,
    spec_refusal,
    write_sst2,
)
from test_classification import assert_refused, train_here

TOK = WordPieceTokenizer
TINY_RUN = [
    *BERT_TINY,
    "data.vocab_size=120",
    "data.max_tokens=128",
    "model.plot_sentences=0",
    "trainer.max_steps=6",
    "trainer.val_check_interval=3",
    "trainer.log_every_n_steps=2",
    "logger=csv",
    "~callbacks.rich_progress_bar",
    "~callbacks.model_summary",
    "extras.print_config=false",
]


# -- the model ------------------------------------------------------------------------------------
def hf_pair(pretraining: bool = True):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=16,
        hidden_act="gelu",
        pad_token_id=0,
    )
    hf = (transformers.BertForPreTraining if pretraining else transformers.BertModel)(cfg).eval()
    ours = Bert(50, 0, dim=32, depth=2, n_head=4, mlp_ratio=2.0, max_len=16)
    return hf, (BertPreTraining(ours) if pretraining else ours).eval()


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    ids = torch.randint(N_SPECIALS, 50, (3, 12))
    ids[1, 8:] = 0  # padding
    segments = torch.zeros_like(ids)
    segments[:, 6:] = 1
    return ids, segments


def test_encoder_equals_transformers_bert_model():
    hf, ours = hf_pair(pretraining=False)
    load_hf_weights(ours, hf)
    ids, segments = padded_batch()
    ref = hf(input_ids=ids, token_type_ids=segments, attention_mask=(ids != 0).long())
    x, _ = ours(ids, segments)
    torch.testing.assert_close(x, ref.last_hidden_state, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.pool(x), ref.pooler_output, atol=1e-5, rtol=0)


def test_pretraining_heads_equal_transformers_bert_for_pretraining():
    hf, ours = hf_pair(pretraining=True)
    load_hf_weights(ours, hf)
    ids, segments = padded_batch()
    ref = hf(input_ids=ids, token_type_ids=segments, attention_mask=(ids != 0).long())
    mlm, nsp = ours(ids, segments)
    torch.testing.assert_close(mlm, ref.prediction_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(nsp, ref.seq_relationship_logits, atol=1e-5, rtol=0)
    masked = ids == ids[0, 3]
    mlm_masked, _ = ours(ids, segments, masked)  # only the chosen positions, same values
    torch.testing.assert_close(mlm_masked, ref.prediction_logits[masked], atol=1e-5, rtol=0)


def test_padding_is_never_attended():
    net = Bert(50, 0, dim=32, depth=2, n_head=4, mlp_ratio=2.0, max_len=24).eval()
    ids, segments = padded_batch()
    x, _ = net(ids, segments)
    more_padding = torch.cat([ids, torch.zeros(3, 4, dtype=torch.long)], 1)
    x_more, _ = net(more_padding, torch.cat([segments, torch.ones(3, 4, dtype=torch.long)], 1))
    other_segments = segments.clone()
    other_segments[1, 8:] = 0  # what a padded position carries changes nothing for the real tokens
    x_other, _ = net(ids, other_segments)
    real = ids != 0
    torch.testing.assert_close(x_more[:, :12][real], x[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(x_other[real], x[real], atol=1e-6, rtol=0)
    _, weights = net(ids, segments, need_weights=True)
    assert all(w[1, :, :, 8:].max() == 0 for w in weights)  # no attention on padding keys


def test_mlm_head_is_tied_to_the_token_embedding():
    net = BertPreTraining(Bert(50, 0, dim=16, depth=1, n_head=2, mlp_ratio=2.0, max_len=8))
    names = [n for n, _ in net.named_parameters()]
    assert not any("mlm" in n and n.endswith("tokens.weight") for n in names)
    ids = torch.randint(N_SPECIALS, 50, (2, 6))
    mlm, _ = net(ids, torch.zeros_like(ids))
    mlm.sum().backward()
    assert net.encoder.embed.tokens.weight.grad.abs().sum() > 0


# -- the data -----------------------------------------------------------------------------------------
def test_masking_statistics_and_specials_never_masked():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(N_SPECIALS, 1000, (512, 64), generator=g)
    ids[:, 0], ids[:, 30], ids[:, 50:] = TOK.cls_id, TOK.sep_id, TOK.pad_id
    inputs, labels = mask_tokens(ids, 1000, 0.15, generator=g)
    candidates = ids >= N_SPECIALS
    chosen = labels != -100
    assert not chosen[~candidates].any() and torch.equal(inputs[~candidates], ids[~candidates])
    assert torch.equal(labels[chosen], ids[chosen])
    assert abs(chosen.sum() / candidates.sum() - 0.15) < 0.005
    as_mask = (inputs[chosen] == TOK.mask_id).float().mean()
    kept = (inputs[chosen] == ids[chosen]).float().mean()
    swapped = 1 - as_mask - kept
    assert abs(as_mask - 0.8) < 0.02 and abs(kept - 0.1) < 0.02 and abs(swapped - 0.1) < 0.02
    assert (inputs[chosen & (inputs != TOK.mask_id)] >= N_SPECIALS).all()  # random ids are words
    again, _ = mask_tokens(ids, 1000, 0.15)
    assert not torch.equal(again, inputs)  # drawn afresh


def corpus_docs() -> list[list[list[int]]]:
    rng = random.Random(1)
    return [
        [[rng.randrange(N_SPECIALS, 100) for _ in range(rng.randint(1, 6))] for _ in range(rng.randint(1, 4))]
        for _ in range(300)
    ]


def test_segment_pairs_are_balanced_and_segment_ids_right():
    torch.manual_seed(0)
    docs = [d for d in corpus_docs() if sum(map(len, d)) >= 2]
    pairs = SegmentPairs(docs, max_len=20, vocab_size=100)
    labels = []
    for i in range(len(docs)):
        for _ in range(4):
            ids, segments, label = pairs.pair(i)
            labels.append(label)
            assert len(ids) <= 20 and ids[0] == TOK.cls_id and ids[-1] == TOK.sep_id
            first_sep = ids.index(TOK.sep_id)
            assert ids.count(TOK.sep_id) == 2 and 1 < first_sep < len(ids) - 2  # A and B never empty
            assert segments == [0] * (first_sep + 1) + [1] * (len(ids) - first_sep - 1)
            if label == IS_NEXT and len(ids) < 20:  # untruncated: A then B is the document itself
                flat = [t for s in docs[i] for t in s]
                assert ids[1:first_sep] + ids[first_sep + 1 : -1] == flat
    assert set(labels) == {IS_NEXT, NOT_NEXT}
    assert abs(sum(labels) / len(labels) - 0.5) < 0.05


def test_corpus_formats(tmp_path):
    text = tmp_path / "c.txt"
    text.write_text("a b c.\nd e f.\n\n\ng h.\n\ni j k.\nl m.\n")
    assert read_corpus(text) == [["a b c.", "d e f."], ["g h."], ["i j k.", "l m."]]
    sst = write_sst2(tmp_path / "sst")
    docs = read_corpus(sst / "alps_train.tsv")
    assert len(docs) == 48 and all(len(d) == 1 for d in docs) and "\t" not in docs[0][0]
    examples = read_tsv(sst / "dev.tsv")
    assert {e.label for e in examples} == {0, 1} and examples[0].text.startswith("the ")


def test_pretraining_data_batches(tmp_path):
    sst = write_sst2(tmp_path / "sst", n=200)
    dm = MaskedLMDataModule(
        Files(["alps_train.tsv", "alps_dev.tsv"], data_dir=str(sst), val_size=0.1),
        vocab_size=100,
        max_len=16,
        max_tokens=64,
    )
    dm.setup()
    assert dm.model_kwargs()["encoder"]["pad_id"] == TOK.pad_id
    assert [dm.tokenizer.token(i) for i in range(N_SPECIALS)] == list(TOK.specials)
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"ids", "segments", "mlm_labels", "nsp_labels"}
    assert batch["ids"].shape == batch["segments"].shape == batch["mlm_labels"].shape
    assert batch["ids"].shape[1] <= 16 and len(batch["ids"]) >= 64 // 16  # budget: about 64 tokens
    sep = batch["ids"] == TOK.sep_id
    in_b = (torch.cumsum(sep, 1) - sep.long() >= 1) & (batch["ids"] != TOK.pad_id)  # after the first [SEP]
    assert torch.equal(batch["segments"].bool(), in_b)
    v1, v2 = (next(iter(dm.val_dataloader())) for _ in range(2))
    assert torch.equal(v1["ids"], v2["ids"])  # validation masks are fixed


def test_sentence_and_token_classification_data(tmp_path):
    sst = write_sst2(tmp_path / "sst")
    dm = SentenceClassificationDataModule(
        SplitFiles("alps_train.tsv", "alps_dev.tsv", "dev.tsv", data_dir=str(sst)),
        vocab_size=100,
        max_len=8,
        class_names=["negative", "positive"],
    )
    dm.setup()
    ids, segments, label = dm.splits["train"][0]
    assert ids[0] == TOK.cls_id and ids[-1] == TOK.sep_id and len(ids) <= 8 and set(segments) == {0}
    assert label in (0, 1) and dm.model_kwargs()["num_classes"] == 2
    ner = TokenClassificationDataModule(
        SplitFiles("train.txt", "dev.txt", "test.txt", data_dir=str(CONLL_FIXTURE)), vocab_size=200
    )
    ner.setup()
    assert {"O", "B-PER", "I-PER", "B-LOC", "B-ORG"} <= set(ner.classes)
    batch = next(iter(ner.train_dataloader()))
    labels = batch["labels"]
    assert labels.shape == batch["ids"].shape
    assert (labels[:, 0] == -100).all() and (labels[batch["ids"] == TOK.pad_id] == -100).all()


# -- training, fine-tuning, the CLIs ------------------------------------------------------------------
@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """A tiny pre-training run on fake SST-2 sentences; returns the working directory."""
    tmp = tmp_path_factory.mktemp("bert")
    sst = write_sst2(tmp / "sst", n=64)
    train_here(
        tmp,
        "bert_pretrain_sst2",
        "experiment=bert_pretrain_sst2",
        *TINY_RUN,
        f"data.source.data_dir={sst}",
        "model.plot_sentences=1",
    )
    return tmp


def last_ckpt(tmp: Path, task: str) -> Path:
    return run_dirs(tmp, task)[-1] / "checkpoints" / "last.ckpt"


def test_pretraining_logs_its_metrics_and_draws_attention(pretrained):
    run = run_dirs(pretrained, "bert_pretrain_sst2")[-1]
    metrics = read_metrics(run)
    for name in ("train/loss", "val/mlm_acc", "val/ppl", "val/nsp_acc", "test/mlm_acc", "test/nsp_acc"):
        assert name in metrics, name
    pictures = sorted(p.name for p in (run / "attention").glob("*.png"))
    assert pictures and any("cls" in p for p in pictures) and any("heads" in p for p in pictures)


def test_finetuning_starts_from_the_pretrained_encoder_and_tokenizer(pretrained, tmp_path):
    sst = pretrained / "sst"
    ckpt = last_ckpt(pretrained, "bert_pretrain_sst2")
    pre = load_checkpoint(ckpt)
    train_here(
        pretrained,
        "bert_finetune_sst2",
        "experiment=bert_finetune_sst2",
        *TINY_RUN,
        f"data.source.data_dir={sst}",
        "trainer.max_steps=1",
        "trainer.val_check_interval=1",
        "model.optim.optimizer.lr=0.0",
    )
    tuned = load_checkpoint(last_ckpt(pretrained, "bert_finetune_sst2"))
    enc = {k: v for k, v in pre["state_dict"].items() if k.startswith("net.encoder.")}
    assert enc and all(torch.equal(tuned["state_dict"][k], v) for k, v in enc.items())  # lr 0: identical
    tok = metadata(pre, ckpt)["artifacts"]["tokenizer"]
    assert metadata(tuned, ckpt)["artifacts"]["tokenizer"] == tok
    assert OmegaConf.create(metadata(tuned, ckpt)["config"]).model.init_from == str(ckpt)


def test_finetuning_from_scratch_learns_and_classify_labels_sentences(pretrained, tmp_path):
    sst = pretrained / "sst"
    train_here(
        pretrained,
        "scratch",
        "experiment=bert_finetune_sst2_scratch",
        *TINY_RUN,
        f"data.source.data_dir={sst}",
        "trainer.max_steps=150",
        "trainer.val_check_interval=50",
        "model.optim.optimizer.lr=3e-3",
        "model.plot_sentences=1",
        "model.net.encoder.dropout=0.0",
    )
    run = run_dirs(pretrained, "scratch")[-1]
    metrics = read_metrics(run)
    assert metrics["test/acc"][-1][1] > 0.9 and "test/f1" in metrics  # the adjective gives the label away
    assert list((run / "attention").glob("*_cls.png"))
    from attnlab.cli.eval import evaluate  # attnlab-eval rebuilds data and model from the checkpoint

    best = next((run / "checkpoints").glob("step_*.ckpt"))
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose("eval", overrides=[f"ckpt_path={best}", f"paths.output_dir={tmp_path / 'eval'}"])
    assert evaluate(cfg)["test/acc"] == pytest.approx(metrics["test/acc"][-1][1])
    inputs = tmp_path / "in.txt"
    inputs.write_text("the film was great and the plot too\nthe movie was awful and the cast too\n")
    out = tmp_path / "labels.tsv"
    ckpt = last_ckpt(pretrained, "scratch")
    proc = run_cli("classify", [f"ckpt_path={ckpt}", f"input={inputs}", f"output={out}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "classifying" in proc.stderr and "2/2" in proc.stderr  # a file: progress on stderr
    labels = [line.split("\t") for line in out.read_text().splitlines()]
    assert [lab for lab, _ in labels] == ["1", "0"]  # GLUE's labels: 1 positive, 0 negative
    # each printed probability is the model's probability of the printed label, the largest: here
    # recomputed one sentence at a time (no batch padding) from the checkpoint's net and tokenizer
    from attnlab.inference.runs import TrainedRun

    trained = TrainedRun(str(ckpt), pretrained / "logs")
    net, tokenizer, classes = trained.net(), trained.tokenizer, trained.artifacts["classes"]
    for sentence, (label, p) in zip(inputs.read_text().splitlines(), labels, strict=True):
        ids = torch.tensor([[TOK.cls_id, *tokenizer.encode(sentence), TOK.sep_id]])
        with torch.no_grad():
            probs = net(ids, torch.zeros_like(ids)).float().softmax(-1)[0]
        assert classes[int(probs.argmax())] == label, (sentence, probs)
        assert float(p) == pytest.approx(probs.max().item(), abs=1e-4), (sentence, probs)
    written = out.read_text()
    again = run_cli("classify", [f"ckpt_path={ckpt}", f"input={inputs}", f"output={out}"], tmp_path)
    assert again.returncode == 2 and f"output={out} exists (set overwrite=true" in again.stderr
    assert out.read_text() == written  # never replaced without being asked
    proc = run_cli("classify", [f"ckpt_path={ckpt}", "text=the plot was dull and the ending too"], tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith("0\t"), proc.stdout + proc.stderr[-2000:]
    assert proc.stdout.count("\n") == 1 and "classifying" not in proc.stderr  # one sentence: no bar


def test_fill_mask_gives_top_k_candidates(pretrained):
    from attnlab.cli.fill_mask import fill

    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose(
            "fill_mask",
            overrides=[
                f"ckpt_path={last_ckpt(pretrained, 'bert_pretrain_sst2')}",
                "text='the [MASK] was good and the [MASK] too'",
                "top_k=3",
            ],
        )
    fillings = fill(cfg)
    assert len(fillings) == 2 and all(len(top) == 3 for top in fillings)
    assert all(p2 <= p1 for top in fillings for (_, p1), (_, p2) in zip(top, top[1:], strict=False))
    assert all(tok not in TOK.specials for top in fillings for tok, _ in top)


def test_ner_fixture_experiment_tags_words(tmp_path):
    metrics = train_here(
        tmp_path,
        "ner",
        "experiment=bert_ner_fixture",
        f"data.source.data_dir={CONLL_FIXTURE}",
        "trainer.max_steps=120",
        "trainer.val_check_interval=40",
        "model.plot_sentences=0",
        "logger=csv",
        "~callbacks.rich_progress_bar",
        "extras.print_config=false",
    )
    assert metrics["test/acc"] > 0.9 and metrics["test/f1"] > 0.6


# -- bad input ---------------------------------------------------------------------------------------
def test_bad_tsv_files_are_named_with_the_line(tmp_path):
    bad = tmp_path / "bad.tsv"
    bad.write_text("sentence\tlabel\na fine film \t1\na bad one \tpositive\n")
    assert_refused(r"bad\.tsv:3: label 'positive' is not an integer", read_tsv, bad)
    bad.write_text("text\tlabel\na fine film \t1\n")
    assert_refused(r"bad\.tsv:1: no 'sentence'", read_tsv, bad)
    bad.write_text("sentence\tlabel\na fine film\n")
    assert_refused(r"bad\.tsv:2: 1 tab-separated columns", read_tsv, bad)
    bad.write_text("sentence\nfine\n")
    assert_refused(r"bad\.tsv:1: no 'label' column", read_tsv, bad)


def test_an_empty_corpus_is_refused(tmp_path):
    (tmp_path / "empty.txt").write_text("\n\n")
    dm = MaskedLMDataModule(Files(["empty.txt"], data_dir=str(tmp_path)), vocab_size=50)
    assert_refused(r"empty\.txt\) holds 0 document", dm.setup)


def classify_cfg(*overrides: str):
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        return compose("classify", overrides=list(overrides))


def test_fill_mask_without_mask_and_classify_bad_inputs(pretrained, tmp_path):
    from attnlab.cli.classify import classify

    ckpt = last_ckpt(pretrained, "bert_pretrain_sst2")
    proc = run_cli("fill_mask", [f"ckpt_path={ckpt}", "text=the movie was good ."], tmp_path)
    assert_user_error(proc, "has no [MASK] to fill")  # through the CLI: one line, exit status 2
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    assert_refused(f"input={empty} is empty", classify, classify_cfg(f"ckpt_path={ckpt}", f"input={empty}"))
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("un film tr\xe8s dr\xf4le\n".encode("latin-1"))
    assert_refused(
        f"input={latin} is not UTF-8", classify, classify_cfg(f"ckpt_path={ckpt}", f"input={latin}")
    )
    assert_refused(
        "attnlab-classify needs a sentence classifier",
        classify,
        classify_cfg(f"ckpt_path={ckpt}", "text=fine"),
    )
    assert_refused("exactly one of text=", classify, classify_cfg(f"ckpt_path={ckpt}"))


def test_a_pretrained_checkpoint_of_another_size_is_refused(pretrained):
    ckpt = last_ckpt(pretrained, "bert_pretrain_sst2")
    before = sorted(p.name for p in (ckpt.parent).iterdir())
    args = ["experiment=bert_finetune_sst2", *TINY_RUN, f"data.source.data_dir={pretrained / 'sst'}"]
    assert_refused(
        r"\(model\.init_from\) does not match.*embed\.tokens\.tokens\.weight",
        train_here,
        pretrained,
        "other_size",
        *args,
        "model.net.encoder.dim=24",
        f"model.init_from={ckpt}",
    )
    assert_refused(
        r"embed\.tokens\.tokens\.weight: checkpoint \(\d+, 16\) vs model \(200, 16\)",
        train_here,
        pretrained,
        "other_vocab",
        *args,
        "model.net.encoder.vocab_size=200",
        f"model.init_from={ckpt}",
    )
    assert sorted(p.name for p in (ckpt.parent).iterdir()) == before  # nothing lost
    assert_refused(
        "model.init_from=no_such_task: no run of that task",
        train_here,
        pretrained,
        "x",
        *args,
        "model.init_from=no_such_task",
    )


def test_model_rejects_bad_sizes():
    message = spec_refusal("attnlab.models.Bert", vocab_size=10, pad_id=0, dim=16, depth=0)
    assert message.startswith("model.net.depth=0: must be greater than 0")
    message = spec_refusal("attnlab.models.BertSequenceClassifier", num_classes=0)
    assert message.startswith("model.net.num_classes=0: must be greater than 0")


@pytest.mark.slow
def test_pretraining_loss_falls_on_sst2_sentences(tmp_path):
    sst = needs_shared("sst2_glue")
    train_here(
        tmp_path,
        "pre",
        "experiment=bert_pretrain_sst2",
        f"data.source.data_dir={sst}",
        *BERT_TINY,
        "data.max_tokens=1024",
        "data.vocab_size=2000",
        "model.plot_sentences=0",
        "trainer.max_steps=200",
        "trainer.val_check_interval=100",
        "model.optim.scheduler.warmup_steps=20",
        "logger=csv",
        "~callbacks.rich_progress_bar",
        "extras.print_config=false",
        "test=false",
    )
    val = dict(read_metrics(run_dirs(tmp_path, "pre")[-1])["val/mlm_loss"])
    assert val[199] < val[99] < 7.0  # well under log(2000) = 7.6 and still falling
