"""attnlab takes back its own exports, and ``attnlab-export`` never leaves a half-written or
hijacked folder behind.

Round trips: a tiny net of each family with a counterpart (GPT in the default config, BERT, ViT,
DeiT, Swin, CLIP from scratch and CLIP from an open_clip folder) exported as ``attnlab-export``
writes it, then loaded into a fresh net of the same config through ``model.init_from``'s own
path (``load_init``): the same logits within 1e-5; a CLIP's tokenizer comes back with
it and ``attnlab-zeroshot init_from=<export>`` reads the folder.

The command: a tiny GPT run's checkpoint (written here, no training) exported in this process:
symlinks in ``out=`` refused, ``<out>.partial`` moved into place at the end, an earlier export
replaced only once the new one is complete, a full disk or an unwritable folder one line."""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from attnlab.weights.init import init_artifacts, load_init
from conftest import run_main


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def export_and_back(net: nn.Module, fresh: nn.Module, out: Path, artifacts: dict) -> nn.Module:
    """``net`` exported into ``out``, then ``out`` loaded into ``fresh`` as ``model.init_from``
    does (``fresh`` is the same config built with another seed: nothing matches by chance)."""
    from attnlab.weights.pretrained import export_pretrained

    export_pretrained(net.eval(), out, artifacts)
    load_init(fresh, str(out))
    return fresh.eval()


def seeded(seed: int, build):
    torch.manual_seed(seed)
    return build()


# ---- one test per family ------------------------------------------------------------------------


def test_a_default_gpt_comes_back_from_its_export(tmp_path):
    """The default config's GPT (no biases, exact GELU) exports as GPT-2 with zero biases; a GPT
    of that config takes them back (GPT-2's own, non-zero, are still refused)."""
    from attnlab.core.errors import CheckpointError
    from attnlab.models import GPT
    from attnlab.weights.pretrained import load_pretrained

    def build():
        return GPT(40, max_len=16, depth=2, n_head=2, dim=16)

    net = seeded(0, build)
    assert net.norm.bias is None  # the default config: bias false
    back = export_and_back(net, seeded(1, build), tmp_path / "out", {})
    ids = torch.randint(0, 40, (2, 12))
    with torch.no_grad():
        assert_same(back(ids), net(ids))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["activation_function"] == "gelu"
    from safetensors.torch import load_file, save_file

    state = load_file(tmp_path / "out" / "model.safetensors")
    state["transformer.h.1.mlp.c_fc.bias"][3] = 0.5
    save_file(state, tmp_path / "out" / "model.safetensors")
    with pytest.raises(
        CheckpointError, match=r"GPT-2 has biases \(transformer\.h\.1\.mlp\.c_fc\.bias is not"
    ):
        load_pretrained(build(), tmp_path / "out")


@pytest.mark.parametrize("kind", ["Bert", "BertPreTraining", "BertSequenceClassifier", "BertTokenClassifier"])
def test_a_bert_comes_back_from_its_export(kind, tmp_path):
    from attnlab.data.text.tokenizers import WordPieceTokenizer, tokenizer_from_json
    from attnlab.models import Bert, BertPreTraining, BertSequenceClassifier, BertTokenClassifier

    tokenizer = WordPieceTokenizer.fit(["a good film", "the plot was bad , too", "a film"] * 4, 60)

    def build():
        encoder = Bert(vocab_size=tokenizer.vocab_size, dim=16, depth=2, n_head=2, mlp_ratio=2.0, max_len=32)
        if kind == "Bert":
            return encoder
        if kind == "BertPreTraining":
            return BertPreTraining(encoder)
        return {"BertSequenceClassifier": BertSequenceClassifier, "BertTokenClassifier": BertTokenClassifier}[
            kind
        ](encoder, 3)

    net = seeded(0, build)
    artifacts = {"tokenizer": tokenizer.to_json(), "classes": ["neg", "mid", "pos"]}
    back = export_and_back(net, seeded(1, build), tmp_path / "out", artifacts)
    ids = torch.randint(6, tokenizer.vocab_size, (2, 9))
    segments = torch.zeros_like(ids)
    with torch.no_grad():
        ours, theirs = net(ids, segments), back(ids, segments)
    for a, b in zip(*(x if isinstance(x, tuple) else (x,) for x in (ours, theirs)), strict=True):
        if isinstance(a, torch.Tensor):
            assert_same(b, a)
    again = tokenizer_from_json(
        init_artifacts(str(tmp_path / "out"), "attnlab.training.MaskedLMTask")["tokenizer"]
    )
    assert again.encode("the plot was good") == tokenizer.encode("the plot was good")


@pytest.mark.parametrize("family", ["vit", "deit", "swin"])
def test_a_vision_net_comes_back_from_its_export(family, tmp_path, caplog):
    from test_pretrained_vision import ours

    net = seeded(0, lambda: ours(family))
    artifacts = {"classes": list("abcdefghij"), "mean": [0.4] * 3, "std": [0.2] * 3}
    with caplog.at_level(logging.WARNING):
        back = export_and_back(net, seeded(1, lambda: ours(family)), tmp_path / "out", artifacts)
        assert init_artifacts(str(tmp_path / "out"), "attnlab.training.ImageClassificationTask") == {}
    assert "tokenizer" not in caplog.text  # an image classifier has no tokenizer to miss
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert_same(back(x), net(x))


def scratch_clip(vocab_size: int, max_len: int = 16):
    """Our CLIP as conf/model/clip.yaml builds it, with open_clip's image stem (patch, no bias)."""
    from attnlab.models import CLIP, TextTransformer, VisionTransformer

    image = VisionTransformer(
        0, 32, 3, patch_size=8, dim=32, depth=2, n_head=2, mlp_ratio=2.0, patch_bias=False
    )
    text = TextTransformer(vocab_size, max_len=max_len, dim=16, depth=2, n_head=2, mlp_ratio=2.0)
    return CLIP(image, text, embed_dim=8)


def assert_same_clip(a, b, tokens: torch.Tensor) -> None:
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert_same(b.encode_image(x), a.encode_image(x))
        assert_same(b.encode_text(tokens), a.encode_text(tokens))
        assert_same(b.scale(), a.scale())


def test_a_clip_from_scratch_comes_back_with_its_tokenizer(tmp_path, caplog, monkeypatch):
    """Its caption tokenizer, fitted on the run's captions, goes out as tokenizer.json: training
    from the export keeps it, and attnlab-zeroshot init_from=<export> labels images with it."""
    from attnlab.cli.zeroshot import open_clip_folder
    from attnlab.data.text.tokenizers import CaptionTokenizer, tokenizer_from_json
    from test_pretrained_clip import write_images

    tokenizer = CaptionTokenizer.fit(["a red square", "two blue circles", "a green dot"] * 5, 300)
    net = seeded(0, lambda: scratch_clip(tokenizer.vocab_size))
    artifacts = {"tokenizer": tokenizer.to_json(), "mean": [0.5] * 3, "std": [0.25] * 3, "context_length": 16}
    with caplog.at_level(logging.INFO):
        back = export_and_back(
            net, seeded(1, lambda: scratch_clip(tokenizer.vocab_size)), tmp_path / "out", artifacts
        )
    assert "preprocess_cfg holds the run's data's mean [0.5, 0.5, 0.5]" in caplog.text
    assert "open_clip's get_tokenizer does not read it" in caplog.text
    tokens, _ = tokenizer.encode_captions(["a red dot", "two green squares"], 16)
    assert_same_clip(net, back, tokens)
    again = tokenizer_from_json(
        init_artifacts(str(tmp_path / "out"), "attnlab.training.ContrastiveTask")["tokenizer"]
    )
    assert isinstance(again, CaptionTokenizer) and again.to_json() == tokenizer.to_json()
    (
        zeroshot_net,
        zeroshot_tokenizer,
        preprocess,
    ) = open_clip_folder(tmp_path / "out")
    assert preprocess["mean"] == [0.5] * 3 and preprocess["context_length"] == 16
    assert zeroshot_tokenizer.encode_captions(["a red dot"], 16)[0].tolist() == tokens[:1].tolist()
    assert_same_clip(net, zeroshot_net, tokens)
    write_images(tmp_path / "photos", 1)
    monkeypatch.chdir(tmp_path)
    args = [
        f"init_from={tmp_path / 'out'}",
        f"image={tmp_path / 'photos'}",
        "labels='red,blue'",
        "device=cpu",
    ]
    status, printed = run_main("zeroshot", args)
    assert status == 0 and "0.png: " in printed, printed


def test_a_clip_from_an_open_clip_folder_comes_back_with_openai_s_tokenizer(tmp_path, caplog):
    """Fine-tuned from an open_clip folder (OpenAI CLIP's tokenizer, 49,408 tokens), its export
    holds that tokenizer: training from it keeps the vocabulary, zero-shot reads it; the
    normalisation it holds is the one its weights were last trained with, said in one notice."""
    from attnlab.cli.zeroshot import open_clip_folder
    from attnlab.data.text.tokenizers import CaptionTokenizer, tokenizer_from_json
    from attnlab.weights.clip import clip_from_open_clip
    from conftest import write_open_clip

    write_open_clip(tmp_path / "open_clip")
    source = init_artifacts(str(tmp_path / "open_clip"), "attnlab.training.ContrastiveTask")
    net = clip_from_open_clip(tmp_path / "open_clip")
    artifacts = source | {"mean": [0.3] * 3, "std": [0.3] * 3, "context_length": 77}
    with caplog.at_level(logging.INFO):
        back = export_and_back(
            net, seeded(1, lambda: clip_from_open_clip(tmp_path / "open_clip")), tmp_path / "out", artifacts
        )
    assert "open_clip's own (get_tokenizer)" in caplog.text and "preprocess_cfg holds" in caplog.text
    tokenizer = tokenizer_from_json(
        init_artifacts(str(tmp_path / "out"), "attnlab.training.ContrastiveTask")["tokenizer"]
    )
    assert isinstance(tokenizer, CaptionTokenizer) and tokenizer.vocab_size == 49408
    tokens, _ = tokenizer.encode_captions(["a photo of a dog", "two cats!"], 77)
    assert tokens[0, 0] == 49406
    assert_same_clip(net, back, tokens)
    zeroshot_net, zeroshot_tokenizer, preprocess = open_clip_folder(tmp_path / "out")
    assert preprocess["mean"] == [0.3] * 3 and zeroshot_tokenizer.eot_id == 49407
    assert_same_clip(net, zeroshot_net, tokens)


# ---- attnlab-export's folder --------------------------------------------------------------------

GPT_NET = {
    "_target_": "attnlab.models.GPT",
    "vocab_size": 20,
    "max_len": 16,
    "depth": 1,
    "n_head": 2,
    "dim": 16,
}


def gpt_checkpoint(path: Path, **net: object) -> Path:
    """What a tiny LanguageModelTask run saves, without training it."""
    import yaml

    from attnlab.models import GPT

    config = {
        "model": {"_target_": "attnlab.training.LanguageModelTask", "net": GPT_NET | net},
        "data": {"_target_": "attnlab.data.TextDataModule"},
    }
    torch.manual_seed(0)
    state = GPT(**{k: v for k, v in (GPT_NET | net).items() if k != "_target_"}).state_dict()
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"config": yaml.safe_dump(config), "artifacts": {}}
    torch.save({"state_dict": {f"net.{k}": v for k, v in state.items()}, "attnlab": meta}, path)
    return path


@pytest.fixture
def ckpt(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return gpt_checkpoint(tmp_path / "run" / "last.ckpt")


def export(ckpt: Path, out: Path, *extra: str) -> tuple[int, str]:
    return run_main("export", [f"ckpt_path={ckpt}", f"out={out}", *extra])


def assert_one_line(status: int, printed: str, needle: str) -> None:
    assert status == 2 and "Traceback" not in printed, printed
    errors = [line for line in printed.splitlines() if "error:" in line]
    assert len(errors) == 1 and needle in errors[0], printed


def leftovers(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir() if ".partial" in p.name)


def test_export_refuses_symlinks_in_out(ckpt, tmp_path):
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text("precious")
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert_one_line(*export(ckpt, tmp_path / "link"), "is a symlink")
    assert not any((tmp_path / "real").iterdir())
    assert export(ckpt, tmp_path / "out")[0] == 0
    (tmp_path / "out" / "config.json").unlink()
    (tmp_path / "out" / "config.json").symlink_to(elsewhere)  # planted
    assert_one_line(*export(ckpt, tmp_path / "out", "overwrite=true"), "holds a symlink, config.json ->")
    assert elsewhere.read_text() == "precious" and leftovers(tmp_path) == []


def test_export_writes_a_partial_folder_moved_into_place(ckpt, tmp_path):
    """A killed export's ``.partial`` does not block the next; overwrite=true replaces an earlier
    export (only that: a folder with other files is refused); a refused export leaves nothing."""
    out = tmp_path / "out"
    (tmp_path / "out.partial").mkdir()
    (tmp_path / "out.partial" / "model.safetensors").write_text("half written by a killed export")
    status, printed = export(ckpt, out)
    assert status == 0, printed
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert leftovers(tmp_path) == []
    first = (out / "model.safetensors").stat().st_ino
    assert_one_line(*export(ckpt, out), "is not an empty folder (set overwrite=true")
    assert export(ckpt, out, "overwrite=true")[0] == 0
    assert (out / "model.safetensors").stat().st_ino != first and leftovers(tmp_path) == []
    (out / "notes.md").write_text("mine")
    assert_one_line(*export(ckpt, out, "overwrite=true"), "holds notes.md, which no export writes")
    assert (out / "notes.md").read_text() == "mine"
    rope = gpt_checkpoint(tmp_path / "rope" / "last.ckpt", positions="rope")
    assert_one_line(*export(rope, tmp_path / "refused"), "GPT-2 has learned positions")
    assert not (tmp_path / "refused").exists() and leftovers(tmp_path) == []


def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


class FullDiskProgram:
    def save(self, *args, **kwargs) -> None:
        no_space()


@pytest.mark.parametrize("fmt", ["native", "onnx"])
def test_a_full_disk_or_an_unwritable_out_is_one_line_and_leaves_nothing(fmt, ckpt, tmp_path, monkeypatch):
    """ENOSPC while writing (after a first file, natively), and a folder it may not write in:
    one line, exit 2, no ``.partial``; an earlier export under overwrite=true stays as it was."""
    assert export(ckpt, tmp_path / "earlier")[0] == 0
    before = sorted((p.name, p.read_bytes()) for p in (tmp_path / "earlier").iterdir())
    with monkeypatch.context() as m:
        if fmt == "native":
            m.setattr("attnlab.weights.hf_files.save_file", no_space)
        else:
            m.setattr(torch.onnx, "export", lambda *a, **k: FullDiskProgram())
        for out, extra in ((tmp_path / "new", []), (tmp_path / "earlier", ["overwrite=true"])):
            assert_one_line(*export(ckpt, out, f"format={fmt}", *extra), "No space left on device")
        assert not (tmp_path / "new").exists() and leftovers(tmp_path) == []
    assert sorted((p.name, p.read_bytes()) for p in (tmp_path / "earlier").iterdir()) == before
    real_mkdir = Path.mkdir

    def read_only(self, *args, **kwargs):
        if self.name.endswith(".partial"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", read_only)
    assert_one_line(*export(ckpt, tmp_path / "locked", f"format={fmt}"), "Permission denied")
    assert leftovers(tmp_path) == [] and not (tmp_path / "locked").exists()
