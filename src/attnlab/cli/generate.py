"""``attnlab-generate ckpt_path=... prompt="ROMEO:" max_new_tokens=500``: sample from a language model."""

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
from attnlab.core.specs import is_int, is_number


def check_options(cfg: DictConfig) -> None:
    """The sampling options, before the checkpoint is read: a wrong one is one line naming it."""
    if not is_int(cfg.max_new_tokens) or cfg.max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens must be an integer >= 0, got {cfg.max_new_tokens!r}")
    if not is_number(cfg.temperature) or cfg.temperature < 0:
        raise ConfigError(f"temperature must be a number >= 0 (0 = greedy), got {cfg.temperature!r}")
    if cfg.top_k is not None and (not is_int(cfg.top_k) or cfg.top_k <= 0):
        raise ConfigError(f"top_k must be a positive integer or null, got {cfg.top_k!r}")
    if cfg.top_p is not None and (not is_number(cfg.top_p) or not 0.0 < cfg.top_p <= 1.0):
        raise ConfigError(f"top_p must be in (0, 1] or null, got {cfg.top_p!r}")
    if not is_int(cfg.num_samples) or cfg.num_samples < 1:
        raise ConfigError(f"num_samples must be a positive integer, got {cfg.num_samples!r}")


def generate(cfg: DictConfig) -> list[str]:
    check_options(cfg)
    with trained_net(cfg, "LanguageModelTask", "attnlab-generate needs a language model") as (run, net, _):
        from attnlab.inference.generation import generate_text

        return generate_text(
            net,
            run.tokenizer,
            str(cfg.prompt),
            cfg.max_new_tokens,
            cfg.temperature,
            cfg.top_k,
            cfg.top_p,
            cfg.num_samples,
            cfg.seed,
            cfg.use_cache,
        )


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="generate")
def run(cfg: DictConfig) -> None:
    with exit_on_user_error():
        for i, text in enumerate(generate(cfg)):
            if i:
                print("-" * 60)
            print(text)


def main() -> None:
    sys.argv = quote_free_text(sys.argv, ("prompt",))
    run()


if __name__ == "__main__":
    main()
