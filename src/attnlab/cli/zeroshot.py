"""``attnlab-zeroshot ckpt_path=... image=path.png labels="t-shirt,sneaker"``: label probabilities
of an image (or each image of a folder), with a CLIP run or, ``init_from=<folder>``, a CLIP as
open_clip saves it (its weights and tokenizer, as they are); ``split=test [templates=<file>]``:
top-1 and top-5 zero-shot accuracy on a run's test split."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.utils import instantiate
from omegaconf import DictConfig, open_dict

from attnlab.cli.common import (
    check_device,
    image_batches,
    inference_device,
    inference_main,
    print_top,
    resolve_checkpoint,
)
from attnlab.core.errors import CheckpointError, ConfigError, DataError

# torch and the model load after the options and the checkpoint's path are checked (quick errors)
if TYPE_CHECKING:
    from attnlab.data.text.tokenizers import CaptionTokenizer
    from attnlab.inference.runs import TrainedRun
    from attnlab.models import CLIP

DEFAULT_TEMPLATE = "a photo of a {}."  # init_from's prompt without templates= (OpenAI CLIP's)


def load_clip(cfg: DictConfig) -> tuple[CLIP, CaptionTokenizer, dict[str, Any], list[str]]:
    """The CLIP, tokenizer, artifacts and prompt templates of a run, or of an open_clip ``init_from``."""
    from attnlab.inference.zeroshot import read_templates

    device = inference_device(cfg.device)
    if cfg.init_from is not None:
        net, tokenizer, artifacts = open_clip_folder(Path(str(cfg.init_from)).expanduser())
        templates = read_templates(cfg.templates) if cfg.templates else [DEFAULT_TEMPLATE]
        return net.to(device), tokenizer, artifacts, templates
    run, templates = clip_run(cfg)
    return run.net().to(device), run.tokenizer, run.artifacts, templates


def clip_run(cfg: DictConfig) -> tuple[TrainedRun, list[str]]:
    """The CLIP run ``ckpt_path`` names, and ``templates=`` or the run's held-out templates."""
    from attnlab.inference.runs import TrainedRun
    from attnlab.inference.zeroshot import read_templates
    from attnlab.training import ContrastiveTask

    run = TrainedRun.for_cli(cfg, ContrastiveTask, need="attnlab-zeroshot needs a CLIP run")
    return run, read_templates(cfg.templates) if cfg.templates else list(run.artifacts["templates"])


def open_clip_folder(folder: Path) -> tuple[CLIP, CaptionTokenizer, dict[str, Any]]:
    """Our CLIP, its tokenizer and preprocessing from a folder open_clip saved (``attnlab.weights.clip``)."""
    from attnlab.data.text.tokenizers import CaptionTokenizer, import_tokenizer
    from attnlab.weights.clip import clip_from_open_clip, preprocess

    if not folder.is_dir():
        raise ConfigError(f"init_from={folder}: not a folder (expected one open_clip saved)")
    try:
        net, artifacts = clip_from_open_clip(folder), preprocess(folder)
        tokenizer = import_tokenizer(folder)
    except (CheckpointError, DataError) as e:  # the converters name training's key; this one's is init_from
        raise type(e)(str(e).replace("model.init_from=", "init_from=")) from e
    if not isinstance(tokenizer, CaptionTokenizer):
        raise CheckpointError(
            f"init_from={folder}: no CLIP tokenizer in it (tokenizer.json, or vocab.json + merges.txt)"
        )
    return net, tokenizer, artifacts


def label_images(cfg: DictConfig) -> list[tuple[Path, list[tuple[str, float]]]]:
    """Per image file, the labels with their probabilities, most likely first."""
    from attnlab.data.vision.classification import normalize
    from attnlab.inference.zeroshot import class_embeddings, parse_labels, zeroshot_probs

    labels = parse_labels(cfg.labels)
    net, tokenizer, artifacts, templates = load_clip(cfg)
    classifier = class_embeddings(net, tokenizer, artifacts["context_length"], labels, templates)
    device = next(net.parameters()).device
    results = []
    for chunk, images in image_batches(cfg, artifacts, device, "labelling"):
        probs = zeroshot_probs(net, normalize(images, artifacts["mean"], artifacts["std"]), classifier)
        for path, row in zip(chunk, probs.tolist(), strict=True):
            results.append((path, sorted(zip(labels, row, strict=True), key=lambda x: -x[1])))
    return results


def score_split(cfg: DictConfig) -> dict[str, float]:
    """Top-1 and top-5 zero-shot accuracy on the run's ``split`` with the templates."""
    if cfg.split not in ("val", "test"):
        raise ConfigError(f"split must be 'val' or 'test', got {cfg.split!r}")
    import torch

    from attnlab.inference.zeroshot import class_embeddings, zeroshot_accuracy

    run, templates = clip_run(cfg)
    net = run.net().to(inference_device(cfg.device))
    if not run.artifacts.get("classes"):
        raise CheckpointError(f"checkpoint {run.path}: its data has no classes to classify into")
    data_cfg = run.config.data.copy()
    if cfg.data_dir is not None:
        with open_dict(data_cfg.source):  # a built-in set's files (issue 58: data.source.data_dir)
            data_cfg.source.data_dir = str(cfg.data_dir)
    data = instantiate(data_cfg)
    data.load_artifacts(run.artifacts)
    data.setup("test")
    classes = run.artifacts["classes"]
    classifier = class_embeddings(net, data.tokenizer, data.max_len, classes, templates)
    device = next(net.parameters()).device
    features, labels = [], []
    loader = data.test_dataloader() if cfg.split == "test" else data.val_dataloader()
    for images, _, batch_labels in loader:
        features.append(net.encode_image(data.normalize(images.to(device))).float())
        labels.append(batch_labels.to(device))
    acc = zeroshot_accuracy(torch.cat(features), classifier, torch.cat(labels))
    images = float(sum(len(x) for x in labels))
    return {"top1": acc[1], "top5": acc[5], "images": images, "templates": float(len(templates))}


def show(cfg: DictConfig) -> None:
    if (cfg.image is None) == (cfg.split is None):
        raise ConfigError('give exactly one of image=<file or folder> (with labels="a,b,c") or split=test')
    if cfg.init_from is not None and (cfg.ckpt_path is not None or cfg.split is not None):
        raise ConfigError(
            "init_from=<open_clip folder> labels images (image=...); ckpt_path and split= need a run"
        )
    check_device(cfg.device)
    if cfg.init_from is None:
        if cfg.ckpt_path is None:
            raise ConfigError("ckpt_path is required (a CLIP run), or init_from=<a folder open_clip saved>")
        resolve_checkpoint(cfg, "ContrastiveTask")
    import torch

    torch.set_grad_enabled(False)
    if cfg.split is not None:
        r = score_split(cfg)
        print(
            f"zero-shot {cfg.split}: top-1 {r['top1']:.4f}, top-5 {r['top5']:.4f} "
            f"({int(r['images'])} images, {int(r['templates'])} templates)"
        )
        return
    for path, probs in label_images(cfg):
        print_top(path, probs[: cfg.top_k])


main = inference_main("zeroshot", ("image", "labels", "templates"), show)

if __name__ == "__main__":
    main()
