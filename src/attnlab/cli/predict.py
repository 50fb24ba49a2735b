"""``attnlab-predict ckpt_path=... image=path.png`` (or a folder): the top-k classes of each image."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from attnlab.cli.common import (
    config_dir,
    exit_on_user_error,
    image_batches,
    quote_free_text,
    trained_net,
)
from attnlab.core.errors import ConfigError


def predict(cfg: DictConfig) -> list[tuple[Path, list[tuple[str, float]]]]:
    if not isinstance(cfg.top_k, int) or cfg.top_k < 1:
        raise ConfigError(f"top_k must be a positive integer, got {cfg.top_k!r}")
    need = "attnlab-predict needs an image classifier"
    with trained_net(cfg, "ImageClassificationTask", need) as (run, net, device):
        from attnlab.inference.classification import classify

        results = []
        for chunk, images in image_batches(cfg, run.artifacts, device, "predicting"):
            results += zip(chunk, classify(net, images, run.artifacts, cfg.top_k), strict=True)
        return results


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="predict")
def run(cfg: DictConfig) -> None:
    with exit_on_user_error():
        for path, top in predict(cfg):
            print(f"{path}: " + ", ".join(f"{name} {p:.3f}" for name, p in top))


def main() -> None:
    sys.argv = quote_free_text(sys.argv, ("image",))
    run()


if __name__ == "__main__":
    main()
