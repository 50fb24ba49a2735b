"""``attnlab-classify ckpt_path=... text="..."`` (or ``input=<file> output=<file>``): the label
of each sentence, with its probability, from any sentence-classification run."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from attnlab.cli.common import (
    check_device,
    config_dir,
    exit_on_user_error,
    free_output,
    inference_device,
    progress,
    quote_free_text,
    read_sentences,
    resolve_checkpoint,
    write_lines,
)
from attnlab.errors import CheckpointError


def classify(cfg: DictConfig) -> list[tuple[str, float]]:
    sentences = read_sentences(cfg)
    check_device(cfg.device)
    resolve_checkpoint(cfg, "TextClassificationTask")
    # torch and the model load after the options and the checkpoint's path are checked (quick errors)
    import torch

    from attnlab.inference.runs import TrainedRun
    from attnlab.inference.text_classification import classify_sentences
    from attnlab.models import BertSequenceClassifier
    from attnlab.tasks import TextClassificationTask

    with torch.no_grad():  # inference only; the caller's autograd mode is left as it was
        device = inference_device(cfg.device)
        run = TrainedRun.for_cli(
            cfg, TextClassificationTask, need="attnlab-classify needs a sentence classifier"
        )
        net = run.net().to(device)
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
