"""LoRA (``model.lora``): our adapters on GPT-2, BERT and timm's ViT weights equal PEFT's on
transformers' and timm's models with the same weights and the same adapters (fp32 logits, 1e-5),
before and after one optimizer step; bad values are one line; a LoRA run resumes where the
uninterrupted one ends and evaluates; its export, merged or as a PEFT adapter folder, loads in
transformers with the LoRA model's logits."""

from __future__ import annotations

import re
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn

from attnlab.training.base import Task
from attnlab.training.optim import Optimization
from attnlab.weights.lora import adapter_layers
from conftest import QUIET, read_metrics, run_main, write_hf_gpt2
from test_debug_matrix import GPT_TINY

LR = 0.5  # SGD: one step moves every trained parameter visibly
SPEC = {"r": 4, "alpha": 8, "targets": ["qkv", "proj", "mlp"]}


def randomised(model: nn.Module) -> nn.Module:
    """No weight left at its initial value (a LayerNorm's ones, zero biases), as trained ones are
    not: what ``model.init_from`` fills is told from what it leaves by the values."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def lora_task(net: nn.Module, folder: Path, spec: dict = SPEC) -> Task:
    """The base of every task, as ``attnlab-train`` builds one: the weights, then the adapters."""
    return Task(net, Optimization(partial(torch.optim.SGD, lr=LR)), init_from=str(folder), lora=spec).eval()


def same_adapters(task: Task, peft_model: nn.Module, renames: list[tuple[str, str]]) -> None:
    """Random adapters (B too: PEFT starts it at zero) in ours, copied into PEFT's layers."""
    torch.manual_seed(2)
    with torch.no_grad():
        for name, layer in adapter_layers(task.net).items():
            theirs = name
            for pattern, new in renames:
                theirs = re.sub(pattern, new, theirs)
            other = peft_model.base_model.model.get_submodule(theirs)
            for part in ("lora_A", "lora_B"):
                nn.init.normal_(getattr(layer, part)["default"].weight, std=0.2)
                getattr(other, part)["default"].weight.copy_(getattr(layer, part)["default"].weight)


def assert_steps_alike(task: Task, peft_model: nn.Module, ours, theirs, loss) -> None:
    """Equal logits before and after one SGD step of each on its own loss, the same parameters
    trained (ours through the task's optimizer)."""
    trained = [p for p in peft_model.parameters() if p.requires_grad]
    assert sum(p.numel() for p in task.parameters() if p.requires_grad) == sum(p.numel() for p in trained)
    before = ours()
    torch.testing.assert_close(before, theirs(), atol=1e-5, rtol=0)
    optimizer = task.configure_optimizers()["optimizer"]
    loss(before).backward()
    optimizer.step()
    loss(theirs()).backward()
    torch.optim.SGD(trained, lr=LR).step()
    with torch.no_grad():
        after = ours()
        torch.testing.assert_close(after, theirs(), atol=1e-5, rtol=0)
        assert (after - before).abs().max() > 1e-2  # it trained


def test_gpt_lora_equals_peft_on_transformers_gpt2(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    from attnlab.models import GPT

    config = GPT2Config(n_embd=16, n_layer=2, n_head=2, n_positions=32, vocab_size=60)
    randomised(GPT2LMHeadModel(config)).save_pretrained(tmp_path)
    net = GPT(60, max_len=32, depth=2, n_head=2, dim=16, bias=True, act="gelu_tanh")
    task = lora_task(net, tmp_path)
    hf = GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    peft = get_peft_model(
        hf, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True)
    )
    renames = [
        (r"^blocks\.", "transformer.h."),
        (r"in_proj$", "c_attn"),
        (r"out_proj$", "c_proj"),
        (r"fc1$", "c_fc"),
        (r"fc2$", "c_proj"),
    ]
    same_adapters(task, peft, renames)
    ids = torch.randint(0, 60, (2, 12), generator=torch.Generator().manual_seed(0))

    def next_token(logits: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 60), ids[:, 1:].reshape(-1))

    assert_steps_alike(task, peft, lambda: task.net(ids), lambda: peft(ids).logits, next_token)


def test_bert_lora_equals_peft_on_transformers_bert_with_a_new_head(tmp_path):
    """The classifier head, new (the folder holds a BertModel), trains with the adapters, as
    PEFT's ``modules_to_save`` does. (The adapters sit on layers both have: BERT's attention
    output and MLP; transformers keeps q, k and v as three layers where ours packs them in one.)"""
    from peft import LoraConfig, get_peft_model
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    from attnlab.models import Bert, BertSequenceClassifier

    config = BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout=0.0,
    )
    randomised(BertModel(config)).save_pretrained(tmp_path)
    encoder = Bert(50, dim=16, depth=2, n_head=2, mlp_ratio=2.0, max_len=32, dropout=0.0, attn_dropout=0.0)
    task = lora_task(
        BertSequenceClassifier(encoder, 2, dropout=0.0), tmp_path, SPEC | {"targets": ["proj", "mlp"]}
    )
    hf = BertForSequenceClassification.from_pretrained(tmp_path, num_labels=2).eval()
    with torch.no_grad():
        hf.classifier.weight.copy_(task.net.head.weight)
        hf.classifier.bias.copy_(task.net.head.bias)
    targets = ["attention.output.dense", "intermediate.dense", "output.dense"]
    peft = get_peft_model(hf, LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=targets))
    renames = [
        (r"^encoder\.blocks\.", "bert.encoder.layer."),
        (r"attn\.out_proj$", "attention.output.dense"),
        (r"mlp\.fc1$", "intermediate.dense"),
        (r"mlp\.fc2$", "output.dense"),
    ]
    same_adapters(task, peft, renames)
    ids = torch.randint(1, 50, (3, 10), generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 1, 1])
    assert_steps_alike(
        task,
        peft,
        lambda: task.net(ids),
        lambda: peft(input_ids=ids).logits,
        lambda logits: nn.functional.cross_entropy(logits, labels),
    )


def test_vit_lora_equals_peft_on_timm_vit(tmp_path):
    import timm
    from peft import LoraConfig, get_peft_model
    from timm.models import save_for_hf

    from attnlab.models import VisionTransformer

    size = dict(img_size=32, in_chans=3, patch_size=8, num_classes=10)
    reference = timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, embed_dim=48, depth=2, num_heads=3, **size
    )
    save_for_hf(randomised(reference), tmp_path, safe_serialization=True)
    task = lora_task(VisionTransformer(dim=48, depth=2, n_head=3, **size), tmp_path)
    theirs = r".*\.(attn\.qkv|attn\.proj|mlp\.fc1|mlp\.fc2)"
    peft = get_peft_model(reference.eval(), LoraConfig(r=4, lora_alpha=8, target_modules=theirs))
    same_adapters(task, peft, [(r"in_proj$", "qkv"), (r"out_proj$", "proj")])
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([3, 7])
    assert_steps_alike(
        task, peft, lambda: task.net(x), lambda: peft(x), lambda z: nn.functional.cross_entropy(z, labels)
    )


def test_the_gpt2_recipe_trains_under_two_percent_of_gpt2_small():
    from hydra.utils import instantiate

    from attnlab.cli.common import compose_train
    from attnlab.weights.lora import add_adapters

    cfg = compose_train(["experiment=gpt2_lora_shakespeare"])
    with torch.device("meta"):  # GPT-2 small's shape, no memory
        net = instantiate(cfg.model.net, vocab_size=50257)
        add_adapters(net, cfg.model.lora)
    trained = sum(p.numel() for p in net.parameters() if p.requires_grad)
    assert trained / sum(p.numel() for p in net.parameters()) < 0.02


# ---- through the entry points -------------------------------------------------------------------


def lora_run(tmp: Path, *extra: str, lora: str = "{r:2,alpha:4,targets:[qkv,proj,mlp]}") -> tuple[int, str]:
    return run_main(
        "train",
        [
            "experiment=gpt_pydoc_char",
            "task_name=lora",
            f"paths.root_dir={tmp}",
            *QUIET,
            *GPT_TINY,
            f"model.lora={lora}",
            *extra,
        ],
    )


@pytest.mark.parametrize(
    ("lora", "needle"),
    [
        ("{r:0,targets:[qkv]}", "error: model.lora={'r': 0, 'targets': ['qkv']}: must be greater than 0"),
        ("{r:2,targets:[qkv,wq]}", "error: model.lora.targets: 'wq' names no layer of the GPT (short names"),
        ("{r:2,rank:2,targets:[qkv]}", "error: model.lora={'r': 2, 'rank': 2, 'targets': ['qkv']}: must be"),
    ],
)
def test_bad_lora_values_are_one_line(lora, needle, tmp_path):
    status, out = lora_run(tmp_path, "trainer.max_steps=1", lora=lora)
    assert status == 2, out[-2000:]
    (line,) = [line for line in out.splitlines() if "error:" in line]
    assert needle in line


def test_a_lora_run_resumed_ends_where_the_uninterrupted_run_ends_and_evaluates(tmp_path):
    steps = ["trainer.max_steps=12", "trainer.val_check_interval=4", "trainer.check_val_every_n_epoch=null"]
    steps += ["model.optim.optimizer.lr=1e-2", "data.val_batches=2", "trainer.limit_test_batches=2"]
    steps += ["sample.max_new_tokens=4"]
    keep = ["callbacks.model_checkpoint.save_top_k=-1", "callbacks.model_checkpoint.monitor=step"]
    keep += ["callbacks.model_checkpoint.mode=max", "test=true"]
    status, out = lora_run(tmp_path, *steps, *keep)
    assert status == 0, out[-3000:]
    assert re.search(r"model\.lora: [\d,]+ of [\d,]+ parameters train \(\d+\.\d\d%\)", out)
    full = sorted((tmp_path / "logs" / "lora" / "runs").iterdir())[-1]
    (mid,) = (full / "checkpoints").glob("step_000004.ckpt")
    status, out = lora_run(tmp_path, *steps, *keep, f"ckpt_path={mid}")
    assert status == 0, out[-3000:]
    resumed = sorted((tmp_path / "logs" / "lora" / "runs").iterdir())[-1]
    want, got = read_metrics(full), read_metrics(resumed)
    assert sorted(got) == sorted(want) and len(want["val/loss"]) == 3
    for key in want:
        if key.startswith(("train/", "val/", "test/")) and not key.endswith("_step_time"):
            assert [s for s, _ in got[key]] == [s for s, _ in want[key]], key
            assert [v for _, v in got[key]] == pytest.approx([v for _, v in want[key]], rel=1e-4, abs=1e-5), (
                key
            )
    last = full / "checkpoints" / "last.ckpt"
    status, out = run_main(
        "eval", [f"ckpt_path={last}", f"paths.root_dir={tmp_path}", "trainer.limit_test_batches=2"]
    )
    assert status == 0, out[-3000:]
    assert "test/loss" in out


def test_the_export_merged_and_kept_apart_loads_in_transformers_and_peft(tmp_path):
    from peft import PeftModel
    from transformers import GPT2LMHeadModel

    from attnlab.inference.runs import TrainedRun
    from test_pretrained_text import FAST, GPT_SIZES, write_shakespeare

    gpt2 = write_hf_gpt2(tmp_path / "gpt2", dim=16, depth=2, n_head=2, max_len=32)
    args = ["experiment=gpt2_lora_shakespeare", f"model.init_from={gpt2}", f"paths.root_dir={tmp_path}"]
    args += [*GPT_SIZES, f"data.source.data_dir={write_shakespeare(tmp_path / 'text')}", "data.max_len=16"]
    args += [*FAST, "sample.max_new_tokens=2", "model.optim.optimizer.lr=0.05", "model.lora.alpha=64"]
    status, out = run_main("train", args)
    assert status == 0, out[-3000:]
    (ckpt,) = (tmp_path / "logs" / "gpt2_lora_shakespeare" / "runs").glob("*/checkpoints/last.ckpt")
    for merge in ("true", "false"):
        status, out = run_main("export", [f"ckpt_path={ckpt}", f"out={tmp_path / merge}", f"merge={merge}"])
        assert status == 0, out[-3000:]
    run = TrainedRun(str(ckpt), tmp_path / "logs")
    lora_net = run.net(merge=False)
    assert adapter_layers(lora_net)
    bare = tmp_path / "bare"  # the base weights alone (transformers applies the adapters of a folder)
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tmp_path / "false" / name, bare / name)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = lora_net(ids)
        base = GPT2LMHeadModel.from_pretrained(bare).eval()
        assert (base(ids).logits - want).abs().max() > 1e-2  # the adapters changed the model
        torch.testing.assert_close(run.net()(ids), want, atol=1e-5, rtol=0)
        for folder in ("true", "false"):
            exported = GPT2LMHeadModel.from_pretrained(tmp_path / folder).eval()
            torch.testing.assert_close(exported(ids).logits, want, atol=1e-5, rtol=0)
        kept = PeftModel.from_pretrained(base, tmp_path / "false").eval()
        torch.testing.assert_close(kept(ids).logits, want, atol=1e-5, rtol=0)
    status, out = run_main(
        "export", [f"ckpt_path={ckpt}", f"out={tmp_path / 'onnx'}", "merge=false", "format=onnx"]
    )
    assert status == 2 and "error: merge=false: an ONNX graph" in out


def test_adapters_with_no_one_counterpart_layer_are_refused_kept_apart(tmp_path):
    """BERT's packed q, k and v are three layers in transformers: a qkv adapter has no PEFT
    counterpart there (it exports merged)."""
    from attnlab.core.errors import CheckpointError
    from attnlab.models import Bert, BertSequenceClassifier
    from attnlab.weights.export import export_adapters
    from attnlab.weights.lora import add_adapters

    net = BertSequenceClassifier(Bert(40, dim=16, depth=1, n_head=2, max_len=16), 2)
    add_adapters(net, {"r": 2, "targets": ["qkv"]})
    with pytest.raises(CheckpointError, match=r"encoder\.blocks\.0\.attn\.in_proj has no one counterpart"):
        export_adapters(net, {"r": 2, "targets": ["qkv"]}, tmp_path, {})


def test_a_run_without_adapters_has_none_to_keep_apart(trained, tmp_path):
    ckpt = trained / "checkpoints" / "last.ckpt"
    status, out = run_main("export", [f"ckpt_path={ckpt}", f"out={tmp_path / 'x'}", "merge=false"])
    assert status == 2 and "trained no LoRA adapters (model.lora) to keep apart" in out, out[-2000:]
