"""``attnlab-classify ckpt_path=... text="..."`` (or ``input=<file> output=<file>``): the label
of each sentence, with its probability, from any sentence-classification run."""

from __future__ import annotations

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
from attnlab.core.errors import CheckpointError


def classify(cfg: DictConfig) -> list[tuple[str, float]]:
    sentences = read_sentences(cfg)
    need = "attnlab-classify needs a sentence classifier"
    with trained_net(cfg, "TextClassificationTask", need) as (run, net, _):
        from attnlab.inference.text_classification import classify_sentences
        from attnlab.models import BertSequenceClassifier

        if not isinstance(net, BertSequenceClassifier):  # the same task also trains token taggers
            raise CheckpointError(
                f"checkpoint {run.path} holds a token tagger; attnlab-classify needs a sentence classifier"
            )
        with progress(len(sentences), "classifying", show=cfg.input is not None) as advance:
            return classify_sentences(
                net,
                run.tokenizer,
                sentences,
                run.artifacts["classes"],
                run.artifacts.get("max_len", net.encoder.max_len),
                cfg.batch_size,
                advance,
            )


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="classify")
def run(cfg: DictConfig) -> None:
    with exit_on_user_error():
        path = free_output(cfg)
        lines = [f"{label}\t{p:.4f}" for label, p in classify(cfg)]
        if path is None:
            print("\n".join(lines))
        else:
            write_lines(path, lines)
            print(f"{len(lines)} labels written to {path}", file=sys.stderr)


def main() -> None:
    sys.argv = quote_free_text(sys.argv, ("text",))
    run()


if __name__ == "__main__":
    main()
