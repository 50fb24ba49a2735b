"""``attnlab-caption ckpt_path=... image=path.png`` (or a folder): each image's caption, and a
picture of where the captioner looked for each word."""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig

from attnlab.cli.common import image_batches, inference_main, positive_option, trained_net

log = logging.getLogger("attnlab.caption")


def caption(cfg: DictConfig) -> list[tuple[Path, str]]:
    """(image, caption) of every image ``image=`` names; the attention pictures written."""
    need = "attnlab-caption needs a captioning model"
    with trained_net(cfg, "CaptioningTask", need) as (run, net, device):
        from attnlab.data.vision.classification import normalize
        from attnlab.inference.captioning import caption_batch

        task_cfg, tok = run.config.model, run.tokenizer
        beam = positive_option(cfg, "beam_size", task_cfg.beam_size)
        results = []
        for chunk, raw in image_batches(cfg, run.artifacts, device, "captioning"):
            images = normalize(raw, run.artifacts["mean"], run.artifacts["std"])
            out = caption_batch(
                net, images, tok.bos_id, tok.eos_id, task_cfg.max_len, beam, task_cfg.length_penalty
            )
            for path, image, (ids, attn) in zip(chunk, raw, out, strict=True):
                results.append((path, tok.decode(ids)))
                if cfg.attention_dir is not None:
                    draw(path, image, [tok.decode([t]) or "?" for t in ids], attn, net.grid, cfg)
        return results


def draw(path: Path, image, words: list[str], attn, grid: tuple[int, int], cfg: DictConfig) -> None:
    """``<attention_dir>/<image name>_attention.png``: the image and each word's attention."""
    import matplotlib.pyplot as plt

    from attnlab.training.plots import caption_attention_figure

    out = Path(str(cfg.attention_dir)) / f"{path.stem}_attention.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig = caption_attention_figure(image.float().cpu() / 255, words, attn, grid)
    fig.savefig(out, dpi=cfg.dpi)
    plt.close(fig)
    log.info("attention of each word: %s", out)


main = inference_main(
    "caption", ("image", "attention_dir"), lambda cfg: [print(f"{p}: {t}") for p, t in caption(cfg)]
)

if __name__ == "__main__":
    main()
