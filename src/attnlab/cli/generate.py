"""``attnlab-generate ckpt_path=... prompt="ROMEO:" max_new_tokens=500``: sample from a language model."""

from __future__ import annotations

from omegaconf import DictConfig

from attnlab.cli.common import inference_main, positive_option, trained_net
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
    positive_option(cfg, "num_samples")


def generate(cfg: DictConfig) -> list[str]:
    check_options(cfg)
    with trained_net(cfg, "LanguageModelTask", "attnlab-generate needs a language model") as (run, net, _):
        from attnlab.inference.generation import generate_text

        options = ("max_new_tokens", "temperature", "top_k", "top_p", "num_samples", "seed", "use_cache")
        return generate_text(net, run.tokenizer, str(cfg.prompt), **{k: cfg[k] for k in options})


def show(cfg: DictConfig) -> None:
    print(("\n" + "-" * 60 + "\n").join(generate(cfg)))


main = inference_main("generate", ("prompt",), show)

if __name__ == "__main__":
    main()
