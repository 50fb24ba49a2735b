"""``attnlab-zeroshot ckpt_path=... image=path.png labels="t-shirt,sneaker"``: label probabilities
of an image (or each image of a folder); ``split=test [templates=<file>]``: top-1 and top-5
zero-shot accuracy on the run's test split."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig, open_dict

from attnlab.cli.common import (
    check_device,
    config_dir,
    exit_on_user_error,
    inference_device,
    progress,
    quote_free_text,
    resolve_checkpoint,
)
from attnlab.errors import CheckpointError, ConfigError

# torch and the model load after the options and the checkpoint's path are checked (quick errors)
if TYPE_CHECKING:
    from attnlab.inference.runs import TrainedRun
    from attnlab.models import CLIP


def load_clip(cfg: DictConfig) -> tuple[TrainedRun, CLIP, list[str]]:
    from attnlab.inference.runs import TrainedRun
    from attnlab.inference.zeroshot import read_templates
    from attnlab.tasks import ContrastiveTask

    device = inference_device(cfg.device)
    run = TrainedRun.for_cli(cfg, ContrastiveTask, need="attnlab-zeroshot needs a CLIP run")
    net = run.net()
    templates = read_templates(cfg.templates) if cfg.templates else list(run.artifacts["templates"])
    return run, net.to(device), templates


def label_images(cfg: DictConfig) -> list[tuple[Path, list[tuple[str, float]]]]:
    """Per image file, the labels with their probabilities, most likely first."""
    import torch

    from attnlab.data.vision.classification import normalize
    from attnlab.inference.classification import image_files, load_image
    from attnlab.inference.zeroshot import class_embeddings, parse_labels, zeroshot_probs

    labels = parse_labels(cfg.labels)
    run, net, templates = load_clip(cfg)
    folder = Path(str(cfg.image)).expanduser()
    files = image_files(folder)
    classifier = class_embeddings(net, run.tokenizer, run.artifacts["context_length"], labels, templates)
    device = next(net.parameters()).device
    results = []
    with progress(len(files), "labelling", show=folder.is_dir()) as advance:
        for start in range(0, len(files), cfg.batch_size):
            chunk = files[start : start + cfg.batch_size]
            images = torch.stack([load_image(f, run.artifacts) for f in chunk]).to(device)
            images = normalize(images, run.artifacts["mean"], run.artifacts["std"])
            probs = zeroshot_probs(net, images, classifier)
            for path, row in zip(chunk, probs.tolist(), strict=True):
                results.append((path, sorted(zip(labels, row, strict=True), key=lambda x: -x[1])))
            advance(len(chunk))
    return results


def score_split(cfg: DictConfig) -> dict[str, float]:
    """Top-1 and top-5 zero-shot accuracy on the run's ``split`` with the templates."""
    if cfg.split not in ("val", "test"):
        raise ConfigError(f"split must be 'val' or 'test', got {cfg.split!r}")
    import torch

    from attnlab.inference.zeroshot import class_embeddings, zeroshot_accuracy

    run, net, templates = load_clip(cfg)
    if not run.artifacts.get("classes"):
        raise CheckpointError(f"checkpoint {run.path}: its data has no classes to classify into")
    data_cfg = run.config.data.copy()
    if cfg.data_dir is not None:
        with open_dict(data_cfg):
            data_cfg.data_dir = str(cfg.data_dir)
    data = instantiate(data_cfg)
    data.load_artifacts(run.artifacts)
    data.setup("test")
    classes = run.artifacts["classes"]
    classifier = class_embeddings(net, data.tokenizer, data.context_length, classes, templates)
    device = next(net.parameters()).device
    features, labels = [], []
    loader = data.test_dataloader() if cfg.split == "test" else data.val_dataloader()
    for images, _, batch_labels in loader:
        features.append(net.encode_image(data.normalize(images.to(device))).float())
        labels.append(batch_labels.to(device))
    acc = zeroshot_accuracy(torch.cat(features), classifier, torch.cat(labels))
    return {
        "top1": acc[1],
        "top5": acc[5],
        "images": float(sum(len(x) for x in labels)),
        "templates": float(len(templates)),
    }


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="zeroshot")
def run(cfg: DictConfig) -> None:
    with exit_on_user_error():
        if (cfg.image is None) == (cfg.split is None):
            raise ConfigError(
                'give exactly one of image=<file or folder> (with labels="a,b,c") or split=test'
            )
        check_device(cfg.device)
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
            print(f"{path}: " + ", ".join(f"{name} {p:.3f}" for name, p in probs[: cfg.top_k]))


def main() -> None:
    sys.argv = quote_free_text(sys.argv, ("image", "labels", "templates"))
    run()


if __name__ == "__main__":
    main()
