"""``attnlab-predict ckpt_path=... image=path.png`` (or a folder): the top-k classes of each image."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from attnlab.cli.common import image_batches, inference_main, positive_option, print_top, trained_net


def predict(cfg: DictConfig) -> list[tuple[Path, list[tuple[str, float]]]]:
    top_k = positive_option(cfg, "top_k")
    need = "attnlab-predict needs an image classifier"
    with trained_net(cfg, "ImageClassificationTask", need) as (run, net, device):
        from attnlab.inference.classification import classify

        results = []
        for chunk, images in image_batches(cfg, run.artifacts, device, "predicting"):
            results += zip(chunk, classify(net, images, run.artifacts, top_k), strict=True)
        return results


main = inference_main("predict", ("image",), lambda cfg: [print_top(*r) for r in predict(cfg)])

if __name__ == "__main__":
    main()
