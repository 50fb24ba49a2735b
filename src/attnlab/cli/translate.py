"""``attnlab-translate ckpt_path=... text="Zwei Männer spielen Fußball."``, or ``input=F output=G``."""

from __future__ import annotations

from omegaconf import DictConfig

from attnlab.cli.common import (
    inference_main,
    positive_option,
    print_or_write,
    progress,
    read_sentences,
    trained_net,
)


def translate(cfg: DictConfig) -> list[str]:
    sentences = read_sentences(cfg)
    need = "attnlab-translate needs a translation model"
    with trained_net(cfg, "TranslationTask", need) as (run, net, device):
        from attnlab.inference.translation import translate_sentences

        task = run.config.model
        beam = positive_option(cfg, "beam_size", task.beam_size)
        alpha = task.length_penalty if cfg.length_penalty is None else cfg.length_penalty
        with progress(len(sentences), "translating", show=cfg.input is not None) as advance:
            return translate_sentences(
                net,
                run.tokenizer,
                sentences,
                beam,
                alpha,
                task.max_len_a,
                task.max_len_b,
                run.config.data.max_len,
                cfg.max_tokens,
                device,
                advance,
            )


main = inference_main(
    "translate",
    ("text", "input", "output"),
    lambda cfg: print_or_write(cfg, lambda: translate(cfg), "translations"),
)

if __name__ == "__main__":
    main()
