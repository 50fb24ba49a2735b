"""``attnlab-translate ckpt_path=... text="Zwei Männer spielen Fußball."``, or ``input=F output=G``."""

from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig

from attnlab.cli.common import (
    config_dir,
    exit_on_user_error,
    free_output,
    progress,
    quote_free_text,
    read_sentences,
    trained_net,
    write_lines,
)
from attnlab.core.errors import ConfigError

log = logging.getLogger("attnlab.translate")


def translate(cfg: DictConfig) -> list[str]:
    sentences = read_sentences(cfg)
    need = "attnlab-translate needs a translation model"
    with trained_net(cfg, "TranslationTask", need) as (run, net, device):
        from attnlab.inference.translation import translate_sentences

        tokenizer = run.tokenizer
        task_cfg = run.config.model
        beam = cfg.beam_size if cfg.beam_size is not None else task_cfg.beam_size
        if beam < 1:
            raise ConfigError(f"beam_size must be >= 1, got {beam}")
        alpha = cfg.length_penalty if cfg.length_penalty is not None else task_cfg.length_penalty
        with progress(len(sentences), "translating", show=cfg.input is not None) as advance:
            return translate_sentences(
                net,
                tokenizer,
                sentences,
                beam,
                alpha,
                task_cfg.max_len_a,
                task_cfg.max_len_b,
                run.config.data.max_len,
                cfg.max_tokens,
                device,
                advance,
            )


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="translate")
def run(cfg: DictConfig) -> None:
    with exit_on_user_error():
        path = free_output(cfg)
        out = translate(cfg)
        if path is None:
            print("\n".join(out))
        else:
            write_lines(path, out)
            log.info("%d translations written to %s", len(out), path)


def main() -> None:
    sys.argv = quote_free_text(sys.argv, ("text", "input", "output"))
    run()


if __name__ == "__main__":
    main()
