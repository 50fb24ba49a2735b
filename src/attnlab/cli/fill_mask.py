"""``attnlab-fill-mask ckpt_path=... text="the movie was [MASK] ."``: the top-k fillings of each
[MASK] of a BERT pre-training run, with their probabilities."""

from __future__ import annotations

from omegaconf import DictConfig

from attnlab.cli.common import inference_main, positive_option, print_top, trained_net


def fill(cfg: DictConfig) -> list[list[tuple[str, float]]]:
    top_k = positive_option(cfg, "top_k")
    with trained_net(cfg, "MaskedLMTask", "attnlab-fill-mask needs a BERT pre-training run") as (run, net, _):
        from attnlab.inference.text_classification import fill_mask

        return fill_mask(net, run.tokenizer, str(cfg.text), top_k, net.encoder.max_len)


def show(cfg: DictConfig) -> None:
    for n, top in enumerate(fill(cfg)):
        print_top(f"[MASK] {n + 1}", top)


main = inference_main("fill_mask", ("text",), show)

if __name__ == "__main__":
    main()
