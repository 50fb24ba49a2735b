"""``attnlab-generate ckpt_path=... prompt="ROMEO:" max_new_tokens=500``: sample from a language model."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from attnlab.cli.common import (
    check_device,
    config_dir,
    exit_on_user_error,
    inference_device,
    quote_free_text,
    resolve_checkpoint,
)
from attnlab.errors import ConfigError
from attnlab.utils.checks import is_int, is_number


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
    check_device(cfg.device)
    resolve_checkpoint(cfg, "LanguageModelTask")
    # torch and the model load after the options and the checkpoint's path are checked (quick errors)
    import torch

    from attnlab.inference.generation import generate_text
    from attnlab.inference.runs import TrainedRun
    from attnlab.tasks import LanguageModelTask

    with torch.no_grad():  # inference only; the caller's autograd mode is left as it was
        device = inference_device(cfg.device)
        run = TrainedRun.for_cli(cfg, LanguageModelTask, need="attnlab-generate needs a language model")
        net = run.net().to(device)
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
