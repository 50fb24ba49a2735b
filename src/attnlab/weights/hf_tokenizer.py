"""A run's tokenizer written beside its exported weights as transformers reads it: the HF
``tokenizers`` model as ``tokenizer.json`` and a ``tokenizer_config.json`` naming its class and
special tokens (the run's artifacts hold it as ``{"kind": ..., "tokenizer": <tokenizer.json>}``)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, processors

log = logging.getLogger("attnlab.pretrained")

_BERT_SPECIALS = {f"{name}_token": f"[{name.upper()}]" for name in ("unk", "sep", "pad", "cls", "mask")}
_GPT2_SPECIAL = "<|endoftext|>"


def write_tokenizer(artifacts: dict, out_dir: Path, family: str, max_len: int) -> dict[str, Any]:
    """Write the run's tokenizer for ``family`` ("gpt2" or "bert") into ``out_dir``; returns the
    model config's token ids it implies (``pad_token_id``, ...). A character-level tokenizer has no
    transformers counterpart: the weights go alone, with a notice."""
    state = json.loads(artifacts["tokenizer"]) if artifacts.get("tokenizer") else None
    if state is None or state["kind"] not in ("bpe", "wordpiece"):
        kind = state["kind"] if state else "no"
        log.warning(
            "a %s tokenizer has no transformers counterpart: the weights are exported without one", kind
        )
        return {}
    tok = Tokenizer.from_str(state["tokenizer"])
    config: dict[str, Any] = {"model_max_length": max_len}
    ids: dict[str, Any] = {}
    if family == "bert":
        lowercase = (json.loads(state["tokenizer"]).get("normalizer") or {}).get("lowercase", False)
        config.update(tokenizer_class="BertTokenizer", do_lower_case=bool(lowercase), **_BERT_SPECIALS)
        if tok.post_processor is None:  # ours adds [CLS] and [SEP] in the data; transformers' tokenizer does
            tok.post_processor = processors.TemplateProcessing(
                single="[CLS] $A [SEP]",
                pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                special_tokens=[(t, tok.token_to_id(t)) for t in ("[CLS]", "[SEP]")],
            )
        vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
        (out_dir / "vocab.txt").write_text("".join(f"{t}\n" for t, _ in vocab), encoding="utf-8")
        ids["pad_token_id"] = tok.token_to_id("[PAD]")
    else:
        config.update(tokenizer_class="GPT2Tokenizer", add_prefix_space=False)
        if (eos := tok.token_to_id(_GPT2_SPECIAL)) is not None:
            config.update(bos_token=_GPT2_SPECIAL, eos_token=_GPT2_SPECIAL, unk_token=_GPT2_SPECIAL)
            ids.update(bos_token_id=eos, eos_token_id=eos)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return ids
