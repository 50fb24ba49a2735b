"""``attnlab-classify ckpt_path=... text="..."`` (or ``input=<file> output=<file>``): the label
of each sentence, with its probability, from any sentence-classification run."""

from __future__ import annotations

from omegaconf import DictConfig

from attnlab.cli.common import inference_main, print_or_write, progress, read_sentences, trained_net
from attnlab.core.errors import CheckpointError


def classify(cfg: DictConfig) -> list[tuple[str, float]]:
    sentences = read_sentences(cfg)
    need = "attnlab-classify needs a sentence classifier"
    with trained_net(cfg, "TextClassificationTask", need) as (run, net, _):
        from attnlab.inference.text_classification import classify_sentences
        from attnlab.models import BertSequenceClassifier

        if not isinstance(net, BertSequenceClassifier):  # the same task also trains token taggers
            raise CheckpointError(f"checkpoint {run.path} holds a token tagger; {need}")
        max_len = run.artifacts.get("max_len", net.encoder.max_len)
        classes = run.artifacts["classes"]
        with progress(len(sentences), "classifying", show=cfg.input is not None) as advance:
            return classify_sentences(
                net, run.tokenizer, sentences, classes, max_len, cfg.batch_size, advance
            )


def show(cfg: DictConfig) -> None:
    print_or_write(cfg, lambda: [f"{label}\t{p:.4f}" for label, p in classify(cfg)], "labels")


main = inference_main("classify", ("text",), show)

if __name__ == "__main__":
    main()
