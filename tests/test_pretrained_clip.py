"""open_clip's folder (as ``open_clip.push_to_hf_hub`` writes it) brings its tokenizer with its
weights, and ``attnlab-zeroshot init_from=<folder>`` classifies images as open_clip does; no
downloads: the vocabulary is the one installed with open_clip, the model random and tiny."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import open_clip
import pytest
import torch
from hydra import compose, initialize_config_dir
from PIL import Image

from attnlab.cli.common import config_dir
from attnlab.data.text.tokenizers import tokenizer_from_json
from attnlab.inference.runs import TrainedRun
from attnlab.weights.init import init_artifacts
from conftest import QUIET, clip_overrides, run_cli, run_dirs, run_main, vision_overrides, write_open_clip


def captions(n: int) -> list[str]:
    """Varied captions: case, punctuation, numbers, contractions, accents, runs of whitespace, and
    some longer than open_clip's 77 tokens (cut, keeping the end-of-text)."""
    rng = random.Random(0)
    words = "a A photo PHOTO of the dog Dog's cats sitting on mat BLUE café naïve it's don't we'll".split()
    marks = [",", ".", "!", "?", "...", ";", ":", " - ", "(", ")", "'", '"', "&", "#1", "%"]
    out = []
    for i in range(n):
        parts = []
        for _ in range(rng.randint(1, 120 if i % 25 == 0 else 15)):
            r = rng.random()
            parts.append(
                rng.choice(words) if r < 0.6 else rng.choice(marks) if r < 0.8 else str(rng.randint(0, 2026))
            )
        out.append(
            rng.choice(["", " ", "  "])
            + rng.choice([" ", "  ", "\t", "\n"]).join(parts)
            + rng.choice(["", " "])
        )
    return out


@pytest.mark.parametrize("files", ["tokenizer.json", "vocab.json + merges.txt"])
def test_open_clip_folder_brings_its_tokenizer_with_open_clips_ids(tmp_path, files):
    write_open_clip(tmp_path / "open_clip", files)
    artifacts = init_artifacts(str(tmp_path / "open_clip"), "attnlab.training.ContrastiveTask")
    ours = tokenizer_from_json(artifacts["tokenizer"])  # as the CLIP data loads it
    texts = captions(300)
    ids, cut = ours.encode_captions(texts, 77)
    reference = open_clip.get_tokenizer("ViT-B-32")(texts)
    assert cut > 0, "no caption long enough to be cut"
    assert torch.equal(ids, reference), [
        t for t, a, b in zip(texts, ids, reference, strict=True) if not torch.equal(a, b)
    ][:3]
    assert (ours.sot_id, ours.eot_id, ours.pad_id, ours.vocab_size) == (49406, 49407, 0, 49408)


def write_images(folder: Path, n: int = 3) -> list[Path]:
    """RGB PNGs at the model's 32 pixels (no resizing on either side)."""
    folder.mkdir()
    generator = torch.Generator().manual_seed(1)
    paths = []
    for i in range(n):
        pixels = torch.randint(0, 256, (32, 32, 3), dtype=torch.uint8, generator=generator)
        Image.fromarray(pixels.numpy()).save(folder / f"{i}.png")
        paths.append(folder / f"{i}.png")
    return paths


def open_clip_probs(
    model: open_clip.CLIP, paths: list[Path], labels: list[str], templates: list[str]
) -> torch.Tensor:
    """open_clip's zero-shot: its classifier from the templates, its image features, its scale."""
    from open_clip.zero_shot_classifier import build_zero_shot_classifier

    with torch.no_grad():
        classifier = build_zero_shot_classifier(
            model, open_clip.get_tokenizer("ViT-B-32"), labels, templates, device="cpu", use_tqdm=False
        )  # (E, K)
        images = torch.stack([torch.from_numpy(np.array(Image.open(p))) for p in paths])
        images = images.permute(0, 3, 1, 2).float() / 255
        mean, std = torch.tensor(open_clip.OPENAI_DATASET_MEAN), torch.tensor(open_clip.OPENAI_DATASET_STD)
        features = model.encode_image((images - mean[:, None, None]) / std[:, None, None], normalize=True)
        return (model.logit_scale.exp() * features @ classifier).softmax(-1)


def test_zeroshot_from_an_open_clip_folder_gives_open_clips_probabilities(tmp_path):
    from attnlab.cli.zeroshot import label_images

    model = write_open_clip(tmp_path / "open_clip")
    paths = write_images(tmp_path / "photos")
    labels, templates = ["cat", "dog", "red car"], ["a photo of a {}.", "a blurry photo of the {}!"]
    (tmp_path / "prompts.txt").write_text("\n".join(templates) + "\n")
    reference = open_clip_probs(model, paths, labels, templates)
    args = [
        f"init_from={tmp_path / 'open_clip'}",
        f"image={tmp_path / 'photos'}",
        "labels=cat,dog,red car",
        f"templates={tmp_path / 'prompts.txt'}",
        "device=cpu",
    ]
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):  # the CLI quotes free text
        cfg = compose(
            "zeroshot",
            overrides=[a.replace("labels=cat,dog,red car", "labels='cat,dog,red car'") for a in args],
        )
    results = label_images(cfg)  # what the CLI prints, unrounded
    ours = torch.tensor([[dict(probs)[label] for label in labels] for _, probs in results])
    assert [path for path, _ in results] == paths
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)
    proc = run_cli("zeroshot", args, tmp_path)  # the command itself
    assert proc.returncode == 0, proc.stderr[-2000:]
    top = [line.split(": ", 1)[1].split(" ")[0] for line in proc.stdout.splitlines()]
    assert top == [labels[i].split()[0] for i in reference.argmax(-1)], proc.stdout


def test_zeroshot_init_from_refuses_a_run_option(tmp_path):
    write_open_clip(tmp_path / "open_clip")
    proc = run_cli("zeroshot", [f"init_from={tmp_path / 'open_clip'}", "split=test"], tmp_path)
    assert proc.returncode == 2 and "ckpt_path and split= need a run" in proc.stderr, proc.stderr


# ---- attnlab-export of a vision run and a CLIP run ------------------------------------------------

FAST = [
    *QUIET,
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "trainer.limit_test_batches=1",
    "trainer.num_sanity_val_steps=0",
]


def train_and_export(tmp_path: Path, experiment: str, overrides: list[str]) -> tuple[TrainedRun, Path]:
    """A short run of ``experiment``, exported by ``attnlab-export`` into tmp_path/<experiment>."""
    proc = run_cli("train", [f"experiment={experiment}", *overrides, *FAST], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (run,) = run_dirs(tmp_path, experiment)
    ckpt, out = run / "checkpoints" / "last.ckpt", tmp_path / experiment
    status, printed = run_main("export", [f"ckpt_path={ckpt}", f"out={out}"])
    assert status == 0, printed
    return TrainedRun(str(ckpt), tmp_path / "logs"), out


@pytest.mark.slow
def test_a_vit_run_exports_to_timm_with_the_cli(tmp_path):
    import timm

    overrides = [*vision_overrides("vit_fashion_mnist", tmp_path), "model.net.stem=patch", "~callbacks.ema"]
    ours, out = train_and_export(tmp_path, "vit_fashion_mnist", overrides)
    model = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    images = torch.randn(3, 1, 28, 28)
    with torch.no_grad():
        torch.testing.assert_close(model(images), ours.net()(images), atol=1e-5, rtol=0)
    assert list(model.pretrained_cfg["mean"]) == list(ours.artifacts["mean"])


@pytest.mark.slow
def test_a_clip_run_exports_to_open_clip_with_the_cli(tmp_path):
    """open_clip's image tower (patch stem without bias); our caption tokenizer, fitted on the run's
    captions, has no open_clip counterpart: the folder holds it as tokenizer.json for attnlab, and
    captions are encoded with it (its ids, its end-of-text pooled as open_clip's ``eos``)."""
    overrides = [
        *clip_overrides("clip_pairs", tmp_path),
        "model.net.image.stem=patch",
        "+model.net.image.patch_bias=false",
    ]
    ours, out = train_and_export(tmp_path, "clip_pairs", overrides)
    again = init_artifacts(str(out), "attnlab.training.ContrastiveTask")["tokenizer"]
    assert again == ours.artifacts["tokenizer"]
    model = open_clip.create_model(f"local-dir:{out}").eval()
    net = ours.net()
    images = torch.randn(2, 3, 16, 16)
    tokens, _ = ours.tokenizer.encode_captions(
        ["a red square", "two blue circles, side by side"], ours.artifacts["context_length"]
    )
    with torch.no_grad():
        torch.testing.assert_close(
            model.encode_image(images, normalize=True), net.encode_image(images), atol=1e-5, rtol=0
        )
        torch.testing.assert_close(
            model.encode_text(tokens, normalize=True), net.encode_text(tokens), atol=1e-5, rtol=0
        )


def test_a_clip_with_open_clips_tokenizer_exports_its_end_of_text_id(tmp_path):
    """A CLIP fine-tuned with open_clip's imported tokenizer and pooled at the last token goes out
    with ``eos_id`` 49407, open_clip's end-of-text (our own tokenizer's would be 2)."""
    from attnlab.models import CLIP, TextTransformer, VisionTransformer
    from attnlab.weights.pretrained import export_pretrained

    write_open_clip(tmp_path / "open_clip")
    artifacts = init_artifacts(str(tmp_path / "open_clip"), "attnlab.training.ContrastiveTask")
    image = VisionTransformer(0, 32, 3, patch_size=8, dim=16, depth=1, n_head=2, patch_bias=False)
    net = CLIP(image, TextTransformer(49408, max_len=77, dim=16, depth=1, n_head=2, pool="last"), 8).eval()
    export_pretrained(net, tmp_path / "out", artifacts)
    model = open_clip.create_model(f"local-dir:{tmp_path / 'out'}").eval()
    tokens = open_clip.get_tokenizer(f"local-dir:{tmp_path / 'out'}")(["a photo of a dog", "two cats!"])
    assert model.text_eos_id == 49407
    with torch.no_grad():
        torch.testing.assert_close(
            model.encode_text(tokens, normalize=True), net.encode_text(tokens), atol=1e-5, rtol=0
        )


def test_zeroshot_init_from_names_its_own_key(tmp_path):
    """A planted pickle in the folder is refused naming ``init_from=`` (zero-shot's key), not
    training's ``model.init_from=``; nothing in it runs."""
    import pickle

    from attnlab.cli.zeroshot import open_clip_folder
    from attnlab.core.errors import CheckpointError
    from test_pretrained_vision import Planted

    folder = tmp_path / "open_clip"
    write_open_clip(folder)
    (folder / "open_clip_model.safetensors").unlink()
    (folder / "open_clip_pytorch_model.bin").write_bytes(pickle.dumps({"weights": Planted()}))
    with pytest.raises(CheckpointError) as refused:
        open_clip_folder(folder)
    message = str(refused.value)
    assert message.startswith(f"init_from={folder}") and "a pickle that holds more than tensors" in message
