"""transformers' GPT-2 and BERT in and out: random tiny models saved by ``save_pretrained`` are
imported through ``model.init_from`` (our logits equal theirs, fp32, 1e-5), fine-tuned by the
recipes, exported back by ``attnlab-export`` (transformers loads them and gives our logits again,
ONNX Runtime too); their tokenizers give transformers' ids; bad inputs are one line."""

from __future__ import annotations

import copy
import json
import random
import tempfile
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import open_dict

from attnlab.cli.common import compose_train
from attnlab.inference.decoding import generate
from conftest import (
    QUIET,
    assert_ok,
    assert_user_error,
    run_cli,
    run_dirs,
    run_main,
    sentences,
    write_hf_bert,
    write_hf_gpt2,
    write_sst2,
)

GPT_SIZES = ["model.net.dim=16", "model.net.depth=2", "model.net.n_head=2", "model.net.max_len=32"]
BERT_SIZES = [
    "model.net.encoder.dim=16",
    "model.net.encoder.depth=2",
    "model.net.encoder.n_head=2",
    "model.net.encoder.mlp_ratio=2.0",
    "model.net.encoder.max_len=64",
]
FAST = [
    *QUIET,
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "trainer.limit_test_batches=1",
    "trainer.num_sanity_val_steps=0",
]


def write_shakespeare(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    text = "".join(f"ROMEO:\n{s}\n\n" for s in sentences(300)) * 2
    (folder / "input.txt").write_text(text, encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> Path:
    return write_hf_gpt2(tmp_path_factory.mktemp("gpt2"), dim=16, depth=2, n_head=2, max_len=32)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> Path:
    return write_hf_bert(tmp_path_factory.mktemp("bert"), dim=16, depth=2, n_head=2, max_len=64)


def task_from(experiment: str, *overrides: str):
    """The task ``attnlab-train`` would build (``model.init_from`` loaded in its constructor),
    its tokenizer filled in from the weights' folder as ``build_datamodule`` does."""
    from attnlab.data.text.tokenizers import tokenizer_from_json
    from attnlab.weights.init import init_artifacts

    out = tempfile.mkdtemp()
    cfg = compose_train([f"experiment={experiment}", f"paths.output_dir={out}", *overrides])
    tokenizer = tokenizer_from_json(init_artifacts(cfg.model.init_from, cfg.model._target_)["tokenizer"])
    with open_dict(cfg):
        if "encoder" in cfg.model.net:
            cfg.model.net.encoder.vocab_size, cfg.model.net.encoder.pad_id = (
                tokenizer.vocab_size,
                tokenizer.pad_id,
            )
            cfg.model.net.num_classes = 2
        else:
            cfg.model.net.vocab_size = tokenizer.vocab_size
    return instantiate(cfg.model).eval(), tokenizer


# ---- in -----------------------------------------------------------------------------------------


def test_gpt2_imported_gives_transformers_logits_and_greedy_tokens(gpt2_dir):
    from transformers import GPT2LMHeadModel

    task, tokenizer = task_from("gpt2_finetune_shakespeare", f"model.init_from={gpt2_dir}", *GPT_SIZES)
    hf = GPT2LMHeadModel.from_pretrained(gpt2_dir).eval()
    ids = torch.tensor([tokenizer.encode("But soft, what light through yonder window breaks?")[:20]])
    with torch.no_grad():
        torch.testing.assert_close(task.net(ids), hf(ids).logits, atol=1e-5, rtol=0)
        ours = generate(task.net, ids[:, :4], max_new_tokens=12, temperature=0)
        theirs = hf.generate(ids[:, :4], max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert ours.tolist() == theirs.tolist()


def test_bert_imported_gives_transformers_logits(bert_dir, tmp_path):
    from transformers import BertForSequenceClassification

    task, tokenizer = task_from("bert_hf_finetune_sst2", f"model.init_from={bert_dir}", *BERT_SIZES)
    hf = BertForSequenceClassification.from_pretrained(bert_dir).eval()
    rows = [
        [tokenizer.cls_id, *tokenizer.encode(s), tokenizer.sep_id]
        for s in ("a good film", "the plot was bad , too")
    ]
    ids = torch.full((2, max(map(len, rows))), tokenizer.pad_id)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    with torch.no_grad():
        theirs = hf(ids, attention_mask=(ids != tokenizer.pad_id).long()).logits
        torch.testing.assert_close(task.net(ids), theirs, atol=1e-5, rtol=0)

    # Google's original files (bert-base-uncased's) name LayerNorm's parameters gamma and beta
    from safetensors.torch import load_file, save_file

    from attnlab.weights.pretrained import load_pretrained

    old_names = tmp_path / "gamma_beta"
    old_names.mkdir()
    state = load_file(bert_dir / "model.safetensors")
    renamed = {
        k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
        for k, v in state.items()
    }
    save_file(renamed, old_names / "model.safetensors")
    (old_names / "config.json").write_text((bert_dir / "config.json").read_text())
    again = copy.deepcopy(task.net)
    for p in again.parameters():
        p.data.zero_()
    load_pretrained(again, old_names)
    with torch.no_grad():
        torch.testing.assert_close(again(ids), theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
@pytest.mark.parametrize("files", ["tokenizer.json", "vocab files"])
def test_imported_tokenizers_give_transformers_ids(family, files, gpt2_dir, bert_dir, tmp_path):
    from transformers import AutoTokenizer

    from attnlab.data.text.tokenizers import import_tokenizer

    folder = gpt2_dir if family == "gpt2" else bert_dir
    if files == "vocab files":  # GPT-2's vocab.json + merges.txt, BERT's vocab.txt, no tokenizer.json
        reference = AutoTokenizer.from_pretrained(folder)
        (tmp_path / "tok").mkdir()
        reference.save_pretrained(tmp_path / "tok")
        if family == "gpt2":
            reference.backend_tokenizer.model.save(str(tmp_path / "tok"))
        else:  # BERT's vocab.txt: one token a line, in id order
            vocab = sorted(reference.get_vocab().items(), key=lambda kv: kv[1])
            (tmp_path / "tok" / "vocab.txt").write_text("".join(f"{t}\n" for t, _ in vocab))
        (tmp_path / "tok" / "tokenizer.json").unlink()
        folder = tmp_path / "tok"
        needed = ("vocab.json", "merges.txt") if family == "gpt2" else ("vocab.txt",)
        assert all((folder / f).is_file() for f in needed), sorted(p.name for p in folder.iterdir())
    ours = import_tokenizer(folder)
    theirs = AutoTokenizer.from_pretrained(gpt2_dir if family == "gpt2" else bert_dir)
    lines = sentences()
    assert ours.encode_batch(lines) == theirs(lines, add_special_tokens=False)["input_ids"]
    if family == "bert":
        assert (ours.pad_id, ours.unk_id, ours.cls_id, ours.sep_id) == (0, 3, 4, 5)


# ---- the recipes, and out -----------------------------------------------------------------------


def test_gpt2_recipe_fine_tunes_and_exports_to_transformers(gpt2_dir, tmp_path):
    from transformers import AutoTokenizer, GPT2LMHeadModel

    from attnlab.inference.runs import TrainedRun

    data = write_shakespeare(tmp_path / "shakespeare")
    args = ["experiment=gpt2_finetune_shakespeare", f"model.init_from={gpt2_dir}", *GPT_SIZES]
    args += [f"data.source.data_dir={data}", "data.max_len=16", "sample.max_new_tokens=5", *FAST]
    assert_ok(run_cli("train", args, tmp_path))
    (run,) = run_dirs(tmp_path, "gpt2_finetune_shakespeare")
    ckpt = run / "checkpoints" / "last.ckpt"
    status, out = run_main("export", [f"ckpt_path={ckpt}", f"out={tmp_path / 'hf'}"])
    assert status == 0, out
    ours = TrainedRun(str(ckpt), tmp_path / "logs")
    hf, hf_tok = (
        GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval(),
        AutoTokenizer.from_pretrained(tmp_path / "hf"),
    )
    text = "ROMEO: what light through yonder window"
    assert hf_tok(text)["input_ids"] == ours.tokenizer.encode(text)
    ids = torch.tensor([ours.tokenizer.encode(text)])
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ours.net()(ids), atol=1e-5, rtol=0)
        tuned = ours.net().embed.tokens.weight
    start = GPT2LMHeadModel.from_pretrained(gpt2_dir).transformer.wte.weight
    assert not torch.equal(tuned, start)  # it trained


@pytest.mark.slow
def test_bert_recipe_fine_tunes_and_exports_to_transformers_and_onnx(bert_dir, tmp_path):
    import onnxruntime
    from transformers import AutoTokenizer, BertForSequenceClassification

    from attnlab.inference.runs import TrainedRun

    args = ["experiment=bert_hf_finetune_sst2", f"model.init_from={bert_dir}", *BERT_SIZES]
    args += [f"data.source.data_dir={write_sst2(tmp_path / 'sst2')}", "model.plot_sentences=0", *FAST]
    assert_ok(run_cli("train", args, tmp_path))
    (run,) = run_dirs(tmp_path, "bert_hf_finetune_sst2")
    ckpt = run / "checkpoints" / "last.ckpt"
    for fmt in ("native", "onnx"):
        status, out = run_main("export", [f"ckpt_path={ckpt}", f"out={tmp_path / fmt}", f"format={fmt}"])
        assert status == 0, out
    ours = TrainedRun(str(ckpt), tmp_path / "logs")
    net = ours.net()
    hf = BertForSequenceClassification.from_pretrained(tmp_path / "native").eval()
    hf_tok = AutoTokenizer.from_pretrained(tmp_path / "native")
    batch = hf_tok(["a gripping , funny film .", "the plot was dull"], padding=True, return_tensors="pt")
    with torch.no_grad():
        mine = net(batch["input_ids"])
        torch.testing.assert_close(hf(**batch).logits, mine, atol=1e-5, rtol=0)
    assert hf.config.id2label == {0: "0", 1: "1"}
    session = onnxruntime.InferenceSession(str(tmp_path / "onnx" / "model.onnx"))
    (onnx_logits,) = session.run(None, {"ids": batch["input_ids"].numpy()})
    torch.testing.assert_close(torch.from_numpy(onnx_logits), mine, atol=1e-5, rtol=0)


# ---- bad input ----------------------------------------------------------------------------------


def test_bad_weights_are_one_line(gpt2_dir, bert_dir, tmp_path, monkeypatch):
    vocab = json.loads((gpt2_dir / "config.json").read_text())["vocab_size"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = write_shakespeare(tmp_path / "shakespeare")
    pickle_dir = tmp_path / "pickled"
    pickle_dir.mkdir()
    torch.save({"w": torch.zeros(2), "plan": random.Random(0)}, pickle_dir / "pytorch_model.bin")
    base = ["experiment=gpt2_finetune_shakespeare", f"data.source.data_dir={data}", "data.max_len=16", *FAST]
    cases = [
        ([f"model.init_from={tmp_path / 'nowhere'}", *GPT_SIZES], "no such file or directory"),
        (["model.init_from=gpt2", *GPT_SIZES], "could not be fetched from the Hugging Face hub"),
        ([f"model.init_from={bert_dir}", *GPT_SIZES], "config.json describes a bert model"),
        (
            [f"model.init_from={gpt2_dir}", *GPT_SIZES, "model.net.dim=32"],
            f"transformer.wte.weight is ({vocab}, 16) but the model's embed.tokens.weight is ({vocab}, 32)",
        ),
        ([f"model.init_from={pickle_dir}", *GPT_SIZES], "a pickle that holds more than tensors"),
        ([f"model.init_from={gpt2_dir}", *GPT_SIZES, "model.net.positions=rope"], "GPT-2 has learned"),
        (
            [f"model.init_from={gpt2_dir}", *GPT_SIZES, "model.optim.freeze=[embedding]"],
            "'embedding' names no",
        ),
        (
            [f"model.init_from={gpt2_dir}", *GPT_SIZES, "model.optim.lr_decay=1.5"],
            "model.optim.lr_decay=1.5: must be less than or equal to 1",
        ),
    ]
    for overrides, needle in cases:
        proc = run_cli("train", [*base, *overrides], tmp_path)
        assert_user_error(proc, needle)
        assert len([line for line in proc.stdout.splitlines() if "error:" in line]) == 1


@pytest.mark.parametrize("kw", [{"positions": "none"}, {"positions": "t5"}, {"attention": "sliding"}])
def test_a_gpt_that_is_not_gpt2s_layout_is_not_exported_as_gpt2(kw: dict, tmp_path):
    from attnlab.core.errors import CheckpointError
    from attnlab.models import GPT
    from attnlab.weights.pretrained import export_pretrained

    net = GPT(40, max_len=16, depth=1, n_head=2, dim=16, **kw)
    with pytest.raises(CheckpointError, match="attnlab-export: GPT-2 has learned positions and full"):
        export_pretrained(net, tmp_path / "out", {})


def test_export_refuses_a_folder_that_holds_files(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("")
    status, out = run_main("export", ["ckpt_path=whatever.ckpt", f"out={tmp_path / 'out'}"])
    assert status == 2 and "is not an empty folder" in out, out


# ---- layer-wise LR decay and freezing -----------------------------------------------------------


def test_layer_wise_lr_decay_and_freezing(bert_dir):
    task, _ = task_from(
        "bert_hf_finetune_sst2",
        f"model.init_from={bert_dir}",
        *BERT_SIZES,
        "model.optim.lr_decay=0.5",
        "model.optim.freeze=[embed,blocks.0]",
        "model.optim.scheduler=null",
    )
    task.train()
    opt = task.configure_optimizers()["optimizer"]
    base = 3e-5
    lr_of = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    names = dict(task.named_parameters())
    expect = {
        "net.encoder.blocks.1.attn.in_proj.weight": base * 0.5,
        "net.encoder.pooler.weight": base,
        "net.head.weight": base,
    }
    for name, lr in expect.items():
        assert lr_of[id(names[name])] == pytest.approx(lr), name
    frozen = [n for n in names if n.startswith(("net.encoder.embed.", "net.encoder.blocks.0."))]
    assert frozen and all(id(names[n]) not in lr_of and not names[n].requires_grad for n in frozen)
    before = {n: names[n].detach().clone() for n in frozen}
    ids = torch.randint(6, 100, (2, 7))
    task.net(ids).sum().backward()
    opt.step()
    assert all(names[n].grad is None and torch.equal(names[n], before[n]) for n in frozen)
    assert names["net.head.weight"].grad is not None


def test_an_image_classifier_exports_to_onnx(tmp_path):
    """The ONNX graph of a ViT run gives its logits in ONNX Runtime, for another batch size too."""
    import onnxruntime

    from attnlab.inference.runs import TrainedRun
    from conftest import vision_overrides

    args = ["experiment=vit_fashion_mnist", *vision_overrides("vit_fashion_mnist", tmp_path), *FAST]
    assert_ok(run_cli("train", [*args, "~callbacks.ema"], tmp_path))
    (run,) = run_dirs(tmp_path, "vit_fashion_mnist")
    ckpt = run / "checkpoints" / "last.ckpt"
    status, out = run_main("export", [f"ckpt_path={ckpt}", f"out={tmp_path / 'onnx'}", "format=onnx"])
    assert status == 0, out
    images = torch.randn(3, 1, 28, 28)
    session = onnxruntime.InferenceSession(str(tmp_path / "onnx" / "model.onnx"))
    (logits,) = session.run(None, {"images": images.numpy()})
    with torch.no_grad():
        expected = TrainedRun(str(ckpt), tmp_path / "logs").net()(images)
    torch.testing.assert_close(torch.from_numpy(logits), expected, atol=1e-5, rtol=0)


def test_a_head_of_another_size_starts_fresh_with_a_notice(bert_dir, caplog):
    """2 classes in the file, 3 configured: the encoder is the file's, the head its own, said once."""
    from transformers import BertModel

    from attnlab.models import Bert, BertSequenceClassifier
    from attnlab.weights.pretrained import load_pretrained

    vocab = json.loads((bert_dir / "config.json").read_text())["vocab_size"]
    net = BertSequenceClassifier(
        Bert(vocab_size=vocab, dim=16, depth=2, n_head=2, mlp_ratio=2.0, max_len=64), 3
    )
    head = net.head.weight.detach().clone()
    with caplog.at_level("WARNING", logger="attnlab.pretrained"):
        load_pretrained(net, bert_dir)
    assert "head.weight (classifier.weight is (2, 16), the model's (3, 16))" in caplog.text
    assert torch.equal(net.head.weight, head)
    hf = BertModel.from_pretrained(bert_dir)
    assert torch.equal(net.encoder.embed.tokens.tokens.weight, hf.embeddings.word_embeddings.weight)


def test_an_empty_folder_or_one_without_weights_says_so(tmp_path):
    """Not what a config.json that is not there would lack ("activation_function is 'gelu_new'")."""
    from attnlab.core.errors import CheckpointError
    from attnlab.models import GPT, Bert
    from attnlab.weights.pretrained import load_pretrained

    (tmp_path / "empty").mkdir()
    (tmp_path / "tokenizer_only").mkdir()
    (tmp_path / "tokenizer_only" / "tokenizer.json").write_text("{}")
    for net in (
        GPT(40, max_len=16, depth=1, n_head=2, dim=16),
        Bert(vocab_size=40, dim=16, depth=1, n_head=2),
    ):
        with pytest.raises(CheckpointError, match=r"empty: an empty folder \(no weights, no config\)$"):
            load_pretrained(net, tmp_path / "empty")
        with pytest.raises(CheckpointError, match="tokenizer_only: no weights in it"):
            load_pretrained(net, tmp_path / "tokenizer_only")
