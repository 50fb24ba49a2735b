"""``attnlab-fill-mask ckpt_path=... text="the movie was [MASK] ."``: the top-k fillings of each
[MASK] of a BERT pre-training run, with their probabilities."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from attnlab.cli.common import (
    config_dir,
    exit_on_user_error,
    quote_free_text,
    trained_net,
)
from attnlab.core.errors import ConfigError


def fill(cfg: DictConfig) -> list[list[tuple[str, float]]]:
    if not isinstance(cfg.top_k, int) or cfg.top_k < 1:
        raise ConfigError(f"top_k must be a positive integer, got {cfg.top_k!r}")
    with trained_net(cfg, "MaskedLMTask", "attnlab-fill-mask needs a BERT pre-training run") as (run, net, _):
        from attnlab.inference.text_classification import fill_mask

        return fill_mask(net, run.tokenizer, str(cfg.text), cfg.top_k, net.encoder.max_len)


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="fill_mask")
def run(cfg: DictConfig) -> None:
    with exit_on_user_error():
        for n, top in enumerate(fill(cfg)):
            print(f"[MASK] {n + 1}: " + ", ".join(f"{token} {p:.3f}" for token, p in top))


def main() -> None:
    sys.argv = quote_free_text(sys.argv, ("text",))
    run()


if __name__ == "__main__":
    main()
