"""Every debug config (fdr, limit, overfit, profiler) runs with one experiment of every kind of
model (task and net: the experiments of one kind differ in data and sizes, which
``test_scaleout.py`` runs every experiment through in its fast configuration), at a tiny size.

In-process (Hydra's compose API, then ``attnlab.cli.train.train``), no interpreter start-up each.
GPT experiments read Python's docs instead of their corpus; Multi30k ones a tiny fake corpus;
vision ones tiny fake IDX or CIFAR files, CLIP ones also a fake pairs file; BERT ones fake SST-2
files or the CoNLL fixture; captioning ones scenes made of fake IDX files.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from attnlab.cli.common import config_dir
from attnlab.cli.train import train
from attnlab.data.text.translation import synthetic_pairs
from conftest import (
    FLAMINGO_RECIPE,
    bert_overrides,
    captioning_overrides,
    clip_overrides,
    flamingo_overrides,
    vision_overrides,
)

CONF = Path(config_dir())
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
DEBUGS = sorted(p.stem for p in (CONF / "debug").glob("*.yaml") if p.stem != "default")

GPT_TINY = [
    "data/source=pydoc",
    "model.net.depth=1",
    "model.net.n_head=2",
    "model.net.dim=32",
    "model.net.max_len=16",
    "data.batch_size=4",
]
NMT_TINY = [
    "data.max_len=32",
    "data.max_tokens=256",
    "data.eval_max_tokens=512",
    "data.vocab_size=120",
    "model.compile_loss=false",
    "model.plot_sentences=1",
    "model.beam_size=2",
]
ARCH_TINY = {
    "transformer": [
        "model.net.dim=32",
        "model.net.n_head=2",
        "model.net.enc_depth=1",
        "model.net.dec_depth=1",
        "model.net.mlp_ratio=2.0",
    ],
    "seq2seq": [
        "model.net.dim=16",
        "model.net.enc_hidden=16",
        "model.net.dec_hidden=32",
        "model.net.attn_dim=16",
    ],
}


def fake_multi30k(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for split, n, seed in (("train", 200, 0), ("val", 12, 1), ("test_2016_flickr", 12, 2)):
        de, en = synthetic_pairs(n, seed)
        (d / f"{split}.de").write_text("\n".join(de) + "\n")
        (d / f"{split}.en").write_text("\n".join(en) + "\n")
    return d


def tiny_overrides(experiment: str, tmp: Path) -> list[str]:
    if experiment.startswith("bert_"):
        return bert_overrides(experiment, tmp)
    if experiment.startswith("clip_"):
        return clip_overrides(experiment, tmp)
    if experiment.startswith("sat_"):
        return captioning_overrides(experiment, tmp)
    if experiment in FLAMINGO_RECIPE:
        return flamingo_overrides(experiment, tmp)
    if experiment.startswith("gpt2_"):  # GPT-2's architecture, tiny, from scratch (not the hub's)
        return [*GPT_TINY, "data.max_len=16", "model.init_from=null"]
    if not experiment.startswith(("gpt_", "nmt_")):
        return vision_overrides(experiment, tmp)
    if experiment.startswith("gpt_"):
        return GPT_TINY
    arch = "transformer" if "transformer" in experiment or experiment == "nmt_synthetic" else "seq2seq"
    data = (
        ["data.source.train_size=200"]
        if "synthetic" in experiment
        else [f"data.source.data_dir={fake_multi30k(tmp / 'm30k')}"]
    )
    return [*NMT_TINY, *ARCH_TINY[arch], *data]


def one_of_each_kind() -> list[str]:
    """The first experiment of each (task, net) pair of classes, by name."""
    kinds: dict[tuple[str, str], str] = {}
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for name in EXPERIMENTS:
            model = compose("train", overrides=[f"experiment={name}"]).model
            kinds.setdefault((model._target_, model.net._target_), name)
    return sorted(kinds.values())


@pytest.mark.slow
@pytest.mark.parametrize("debug", DEBUGS)
@pytest.mark.parametrize("experiment", one_of_each_kind())
def test_debug_config_runs_with_experiment(experiment, debug, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    overrides = [
        f"experiment={experiment}",
        f"debug={debug}",
        f"paths.root_dir={tmp_path}",
        f"paths.output_dir={tmp_path / 'run'}",
        "extras.print_config=false",
        "~callbacks.rich_progress_bar",
        "~callbacks.model_summary",
        "trainer.enable_progress_bar=false",
        *tiny_overrides(experiment, tmp_path),
    ]
    if debug == "limit":  # anomaly detection is on in fdr too; over 20 RNN steps it costs a minute
        overrides.append("trainer.detect_anomaly=false")
    if debug == "overfit":  # the config as shipped, over fewer of its 200 steps: the suite's time
        overrides += ["trainer.max_steps=60", "trainer.val_check_interval=30"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    logging.getLogger("lightning").setLevel(logging.WARNING)
    metrics = train(cfg)
    assert cfg.task_name == "debug"
    assert any(k.startswith("test/") for k in metrics), metrics
    if debug != "fdr":  # fast_dev_run writes no checkpoints or logs by design
        assert (tmp_path / "run" / "csv" / "metrics.csv").is_file()
