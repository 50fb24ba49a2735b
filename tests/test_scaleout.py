"""Every experiment under ``trainer=ddp_cpu`` and ``trainer=fsdp2`` (2 CPU processes), whole
``ddp_cpu`` runs of each family checked for what two processes must not get wrong, and each
architecture trained by 2 processes on halves of the same global batches as one process.

All the two-process work of the selected tests runs in one launch of ``scaleout_worker.py`` (an
interpreter start per process, not per run); the one-process references run here. The default run
takes a share of it (FAST_*), ``-m slow`` the rest.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from torchmetrics.text import SacreBLEUScore

from attnlab.cli.common import compose_train
from attnlab.core.config import fill_missing
from attnlab.data.text.translation import synthetic_pairs
from attnlab.data.vision.datasets import IDX_DATASETS
from conftest import (
    QUIET,
    ROOT,
    VISION_NETS,
    assert_ok,
    cli_env,
    read_metrics,
    run_cli,
    run_dirs,
    tiny,
    write_idx_dataset,
)
from scaleout_worker import evaluate_fixed, fit_fixed
from test_debug_matrix import EXPERIMENTS, tiny_overrides
from test_translation import fake_multi30k

STRATEGIES = ("ddp_cpu", "fsdp2")

# One experiment per architecture, trained on fixed batches; no dropout, so that one process and
# two compute the same function. Patch stems: the conv stem's BatchNorm normalises each
# process's half batch by its own statistics.
ARCHS = {
    "gpt": ("gpt_pydoc_char", ["model.net.dropout=0"]),
    "transformer": (
        "nmt_synthetic",
        ["model.net.dropout=0", "model.net.attn_dropout=0", "model.label_smoothing=0"],
    ),
    "seq2seq": ("nmt_bahdanau_multi30k", ["model.net.dropout=0", "model.label_smoothing=0"]),
    "bert": (
        "bert_finetune_sst2_scratch",
        ["model.net.encoder.dropout=0", "model.net.encoder.attn_dropout=0", "model.net.dropout=0"],
    ),
    "vit": ("vit_fashion_mnist", ["model.net.stem=patch", "model.net.drop_path=0"]),
    "deit": ("deit_fashion_mnist", ["model.net.stem=patch", "model.net.drop_path=0"]),
    "swin": (
        "swin_fashion_mnist",
        ["model.net.stem=patch", "model.net.drop_path=0", "model.label_smoothing=0"],
    ),
    "clip": ("clip_fashion_mnist", ["model.net.image.stem=patch", "model.net.image.drop_path=0"]),
}


def strategy_runs() -> list[tuple[str, str]]:
    """(experiment, strategy) pairs: every experiment under DDP; under FSDP2, which shards the net
    and the task's optimizer, one experiment per (task, net) pair: another dataset for the same
    pair shards the same modules."""
    pairs, sharded = [], set()
    each_arch = [experiment for experiment, _ in ARCHS.values()]  # the pair's own first
    for experiment in sorted(EXPERIMENTS, key=lambda e: e not in each_arch):
        pairs.append((experiment, "ddp_cpu"))
        model = compose_train([f"experiment={experiment}"]).model
        if (model._target_, model.net._target_) not in sharded:
            sharded.add((model._target_, model.net._target_))
            pairs.append((experiment, "fsdp2"))
    return pairs


STRATEGY_RUNS = strategy_runs()

# The default run's share of this file (the rest runs with `-m slow`, each covered by these): one
# experiment per strategy, the files of outputs gathered from both processes (confusion matrix,
# captions, translations), a sharded checkpoint resumed and read by one process, CLIP's gathered
# loss and a per-example loss trained like one process, and every family evaluated like one.
FAST_RUNS = {("gpt_pydoc_char", "ddp_cpu"), ("vit_fashion_mnist", "fsdp2")}
FAST_WHOLE = {"nmt_transformer_multi30k"}
FAST_FIXED = {("gpt", "ddp_cpu"), ("vit", "fsdp2"), ("clip", "ddp_cpu")}


def slow_unless(fast: bool) -> list[pytest.MarkDecorator]:
    return [] if fast else [pytest.mark.slow]


def jobs_read(test: str, params: dict[str, str]) -> list[str]:
    """The worker's jobs that a test reads, by its name and parameters."""
    arch, strategy, experiment = params.get("arch"), params.get("strategy"), params.get("experiment")
    return {
        "test_every_experiment_runs_its_fast_configuration_in_two_processes": [f"{experiment}-{strategy}"],
        "test_ddp_cpu_trains_gpt": ["gpt_two"],
        "test_ddp_cpu_trains_and_tests_synthetic_translation": ["nmt_two"],
        "test_ddp_cpu_trains_the_multi30k_experiments": [f"{experiment}"],
        "test_ddp_cpu_trains_and_tests_a_vision_transformer": ["vit_two"],
        "test_ddp_cpu_trains_and_tests_show_attend_and_tell": ["sat_two"],
        "test_two_processes_train_like_one_on_the_same_global_batches": [f"fixed:{arch}-{strategy}"],
        "test_a_sharded_run_resumed_from_its_shards_ends_where_the_uninterrupted_run_ends": [
            "vit_sharded",
            "vit_sharded_resumed",
        ],
        "test_a_sharded_checkpoint_loads_in_one_process_for_eval_and_predict": ["vit_sharded"],
        "test_two_processes_evaluate_like_one": [f"eval:{arch}"],
        "test_every_process_draws_its_own_random_stream": ["gpt_pydoc_char-ddp_cpu"],
    }.get(test, [])


def selected_jobs(session: pytest.Session) -> set[str]:
    """The jobs of this file's tests that this session runs (``-m``, ``-k`` or node ids select)."""
    here = [item for item in session.items if item.path.name == Path(__file__).name]
    params = [getattr(item, "callspec", None) for item in here]
    return {
        job
        for item, p in zip(here, params, strict=True)
        for job in jobs_read(item.originalname, p.params if p else {})
    }


STEPS = 4
# debug=fdr's limits (the debug configs themselves ask for one process)
FAST = ["trainer.fast_dev_run=true", "trainer.val_check_interval=1", "trainer.check_val_every_n_epoch=null"]
# The pictures drawn during evaluation: process 0 draws, every process computes (under FSDP2 a
# forward pass on process 0 alone would wait forever for the others)
PICTURES = ("model.plot_images=", "model.plot_sentences=", "model.plot_pairs=")
DRAWN = ("vit_", "deit_", "swin_", "clip_", "bert_", "nmt_", "sat_", "flamingo_")
UNDRAWN = ("vit_scenes",)  # multi-label: no attention pictures (no one class to name each by)


def pictures(experiment: str) -> list[str]:
    if experiment.startswith(("bert_", "nmt_")):
        return ["model.plot_sentences=1"]
    if experiment.startswith("clip_"):
        return ["model.plot_pairs=2"]
    if experiment.startswith("gpt"):  # gpt_ and gpt2_
        return []
    return ["model.plot_images=2"]


# Whole runs under trainer=ddp_cpu, longer than the fast configurations: validated and tested
# more than once, with their pictures and their files of outputs gathered from both processes.
VALIDATE_EVERY_3 = ["trainer.val_check_interval=3", "trainer.check_val_every_n_epoch=null"]
# the synthetic translation task, 30 steps of 512 target tokens (256 per process), validated every 10
NMT = [
    "experiment=nmt_synthetic",
    "data.source.train_size=600",
    "data.eval_max_tokens=512",
    "data.max_tokens=256",
    "model.net.dim=32",
    "model.net.mlp_ratio=2.0",
    "model.net.enc_depth=1",
    "model.net.dec_depth=1",
    "model.optim.scheduler.warmup_steps=5",
    "model.beam_size=2",
    "model.plot_sentences=1",
    "trainer.max_steps=30",
    "trainer.val_check_interval=10",
    "trainer.check_val_every_n_epoch=null",
]
TINY_TRANSFORMER = [
    "model.net.dim=32",
    "model.net.n_head=2",
    "model.net.mlp_ratio=2.0",
    "model.net.enc_depth=1",
    "model.net.dec_depth=1",
    "model.compile_loss=false",
]
TINY_SEQ2SEQ = [
    "model.net.dim=16",
    "model.net.enc_hidden=16",
    "model.net.dec_hidden=32",
    "model.net.attn_dim=16",
]
MULTI30K = {
    "nmt_transformer_multi30k": TINY_TRANSFORMER,
    "nmt_bahdanau_multi30k": TINY_SEQ2SEQ,
    "nmt_luong_multi30k": TINY_SEQ2SEQ,
}


def whole_runs(tmp: Path) -> dict[str, list[str]]:
    """The whole ``ddp_cpu`` runs, by task name, with the files their data needs written under ``tmp``."""
    multi30k = fake_multi30k(tmp / "multi30k")  # 300 / 20 / 20 pairs of the synthetic language pair
    runs = {
        "nmt_two": NMT,
        # GPT, 30 steps of a global batch of 32 windows, validated every 10 steps on 512 windows
        "gpt_two": tiny(
            "trainer.max_steps=30",
            "model.optim.optimizer.lr=3e-3",
            "model.optim.scheduler.warmup_steps=5",
            "data.batch_size=16",
            "data.val_batches=32",
        ),
        **{
            name: [
                f"experiment={name}",
                *model,
                f"data.source.data_dir={multi30k}",
                f"data.source.cache_dir={tmp}",
                "data.vocab_size=100",
                "data.max_tokens=256",
                "model.beam_size=2",
                "model.plot_sentences=1",
                "trainer.max_steps=6",
                *VALIDATE_EVERY_3,
            ]
            for name, model in MULTI30K.items()
        },
        # a ViT on 60 training and 20 test images: samplers from Lightning, metrics and the
        # confusion matrix synced
        "vit_two": [
            "experiment=vit_fashion_mnist",
            *VISION_NETS["vit"],
            f"data.source.data_dir={write_idx_dataset(tmp / 'fashion_mnist')}",
            "model.plot_images=2",
            "data.batch_size=8",
            "data.source.val_size=10",
            "trainer.max_steps=6",
            *VALIDATE_EVERY_3,
        ],
        # Show, Attend and Tell on scenes of fake IDX images: 12 validation and 12 test scenes
        # shared out by the 2 processes, captions gathered for BLEU/CIDEr, counts synced
        "sat_two": [
            "experiment=sat_scenes",
            *tiny_overrides("sat_scenes", tmp / "sat_two"),
            "trainer.max_steps=6",
            *VALIDATE_EVERY_3,
        ],
    }
    return {
        name: [
            *overrides,
            "trainer=ddp_cpu",
            *(o for o in QUIET if o not in overrides),  # tiny() has some of them: a key is deleted once
            "trainer.num_sanity_val_steps=1",
            f"task_name={name}",
            f"paths.root_dir={tmp}",
            f"paths.output_dir={tmp / name}",
        ]
        for name, overrides in runs.items()
    }


def save_fixed_batches(arch: str, tmp: Path) -> Path:
    """The task (its config and initial weights) and STEPS global batches of its experiment's data."""
    experiment, exact = ARCHS[arch]
    # no warm-up: full-size steps from the first, so that a wrong gradient shows in the next losses
    cfg = compose_train(
        [
            f"experiment={experiment}",
            *tiny_overrides(experiment, tmp / arch),
            *exact,
            "model.optim.scheduler=null",
            "seed=1",
            f"paths.root_dir={tmp}",
            f"paths.output_dir={tmp / arch}",
        ]
    )
    data: L.LightningDataModule = instantiate(cfg.data)
    data.prepare_data()
    data.setup("fit")
    fill_missing(cfg.model.net, data.model_kwargs(), "model.net")
    L.seed_everything(1)
    task = instantiate(cfg.model)
    batches = []
    for batch in data.train_dataloader():
        batches.append(data.on_after_batch_transfer(batch, 0))  # normalised, not augmented
        if len(batches) == STEPS:
            break
    model = OmegaConf.to_container(cfg.model, resolve=True)
    model["optim"]["compile"] = False
    file = tmp / f"{arch}.pt"
    saved = {"model": model, "state": task.state_dict(), "batches": batches, "dir": str(tmp)}
    torch.save({**saved, "data": OmegaConf.to_container(cfg.data, resolve=True)}, file)
    return file


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest):
    """Start the worker on the jobs of the selected tests; return its results and the files the
    one-process runs need."""
    tmp = tmp_path_factory.mktemp("scaleout")
    wanted = selected_jobs(request.session)
    runs = {}
    for experiment, strategy in STRATEGY_RUNS:
        name = f"{experiment}-{strategy}"
        if name not in wanted:  # nor its data written
            continue
        tiny = [o for o in tiny_overrides(experiment, tmp / name) if not o.startswith(PICTURES)]
        runs[name] = [
            f"experiment={experiment}",
            f"trainer={strategy}",
            *FAST,
            *QUIET,
            f"task_name={name}",
            f"paths.root_dir={tmp}",
            f"paths.output_dir={tmp / name}",
            *tiny,
            *pictures(experiment),
        ]
        ema = strategy == "fsdp2" and "ema" in (
            compose_train([f"experiment={experiment}"]).get("callbacks") or {}
        )
        if ema:  # refused with sharding (tested below)
            runs[name].append("~callbacks.ema")
    # a short FSDP2 run that writes sharded checkpoints, for the one-process tools below
    runs["vit_sharded"] = [
        "experiment=vit_fashion_mnist",
        "trainer=fsdp2",
        *QUIET,
        "~callbacks.ema",
        "task_name=vit_sharded",
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        "callbacks.model_checkpoint.save_top_k=-1",  # every validation's checkpoint
        "callbacks.model_checkpoint.monitor=step",
        "callbacks.model_checkpoint.mode=max",
        f"paths.root_dir={tmp}",
        f"paths.output_dir={tmp / 'vit_sharded'}",
        *tiny_overrides("vit_fashion_mnist", tmp / "vit_sharded"),
    ]
    # the same run resumed from its sharded step-2 checkpoint (each process its own shard)
    step_2 = tmp / "vit_sharded" / "checkpoints" / "step_000002.ckpt"
    runs["vit_sharded_resumed"] = [
        *(o for o in runs["vit_sharded"] if not o.startswith(("paths.output_dir=", "task_name="))),
        "task_name=vit_sharded_resumed",
        f"paths.output_dir={tmp / 'vit_sharded_resumed'}",
        f"ckpt_path={step_2}",
    ]
    runs.update(whole_runs(tmp))
    # every process's random draws in training (dropout, augmentation): their own stream each
    if "gpt_pydoc_char-ddp_cpu" in runs:
        runs["gpt_pydoc_char-ddp_cpu"].append("+callbacks.draws._target_=scaleout_worker.RandomDraws")
    runs = {name: overrides for name, overrides in runs.items() if name in wanted}
    archs = [a for a in ARCHS if f"eval:{a}" in wanted or any(f"fixed:{a}-{s}" in wanted for s in STRATEGIES)]
    files = {arch: save_fixed_batches(arch, tmp) for arch in archs}
    fixed = {
        f"{arch}-{strategy}": {"file": str(file), "trainer": [f"trainer={strategy}"]}
        for arch, file in files.items()
        for strategy in STRATEGIES
        if f"fixed:{arch}-{strategy}" in wanted
    }
    evals = {
        f"{arch}-ddp_cpu": {"file": str(file), "trainer": ["trainer=ddp_cpu"]}
        for arch, file in files.items()
        if f"eval:{arch}" in wanted
    }
    spec = tmp / "jobs.json"
    spec.write_text(json.dumps({"runs": runs, "fixed": fixed, "evals": evals}))
    env = {**cli_env(), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "tests")}
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    proc = subprocess.run(
        [*launch, str(ROOT / "tests" / "scaleout_worker.py"), str(spec)],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert_ok(proc)
    return json.loads(spec.with_suffix(".out.json").read_text()), files, tmp


@pytest.mark.parametrize(
    ("experiment", "strategy"), [pytest.param(*r, marks=slow_unless(r in FAST_RUNS)) for r in STRATEGY_RUNS]
)
def test_every_experiment_runs_its_fast_configuration_in_two_processes(two_processes, experiment, strategy):
    results, _, tmp = two_processes
    metrics = results[f"{experiment}-{strategy}"]
    stage = (
        "test/" if compose_train([f"experiment={experiment}"]).test else "val/"
    )  # a cost sweep tests nothing
    assert any(k.startswith(stage) for k in metrics), metrics
    if experiment.startswith(DRAWN) and experiment not in UNDRAWN:
        assert list((tmp / f"{experiment}-{strategy}").rglob("*.png")), "no picture drawn"


def check_translations(run_dir: Path, metrics: dict, refs: list[str]) -> list[str]:
    """test_translations.txt holds one line per test sentence, and test/bleu scores all of them."""
    hyps = (run_dir / "test_translations.txt").read_text(encoding="utf-8").split("\n")
    assert hyps[-1] == "" and len(hyps[:-1]) == len(refs)
    bleu = SacreBLEUScore()
    bleu.update(hyps[:-1], [[r] for r in refs])
    assert metrics["test/bleu"][-1][1] == pytest.approx(100 * float(bleu.compute()), abs=1e-3)
    return hyps[:-1]


@pytest.mark.slow
def test_ddp_cpu_trains_gpt(two_processes):
    m = read_metrics(two_processes[2] / "gpt_two")
    assert len(m["val/loss"]) == 3 and m["train/loss"]
    assert m["val/loss"][-1][1] < m["val/loss"][0][1] - 0.3  # a curve, not a plateau
    assert "test/loss" in m and "test/ppl" in m


@pytest.mark.slow
def test_ddp_cpu_trains_and_tests_synthetic_translation(two_processes):
    tmp = two_processes[2]
    run_dir = tmp / "nmt_two"
    m = read_metrics(run_dir)
    assert len(m["val/loss"]) == 3 and m["val/loss"][-1][1] < m["val/loss"][0][1] - 0.3
    refs = synthetic_pairs(60, seed=2)[1]
    hyps = check_translations(run_dir, m, refs)
    assert list((run_dir / "alignments").glob("*.png"))  # drawn by process 0, from gathered outputs
    # one process testing the best checkpoint gets the same figures and translations: each of the
    # two processes scored its half of the test set, and every sentence was counted once
    (best,) = (run_dir / "checkpoints").glob("step_*.ckpt")
    cwd = tmp / "nmt_eval"
    cwd.mkdir()
    assert_ok(run_cli("eval", [f"ckpt_path={best}"], cwd))
    (eval_dir,) = run_dirs(cwd, "eval")
    e = read_metrics(eval_dir)
    for key in ("test/loss", "test/bleu"):
        assert m[key][-1][1] == pytest.approx(e[key][-1][1], abs=1e-4), key
    assert check_translations(eval_dir, e, refs) == hyps


@pytest.mark.parametrize(
    "experiment", [pytest.param(e, marks=slow_unless(e in FAST_WHOLE)) for e in MULTI30K]
)
def test_ddp_cpu_trains_the_multi30k_experiments(two_processes, experiment):
    run_dir = two_processes[2] / experiment
    m = read_metrics(run_dir)
    assert len(m["val/loss"]) == 2 and "test/loss" in m and "test/bleu" in m
    check_translations(run_dir, m, synthetic_pairs(20, 2)[1])


def test_ddp_cpu_trains_and_tests_a_vision_transformer(two_processes):
    run_dir = two_processes[2] / "vit_two"
    m = read_metrics(run_dir)
    assert len(m["val/acc"]) == 2 and "test/acc_top5" in m
    matrix = (run_dir / "confusion_matrix.csv").read_text().splitlines()[1:]
    assert sum(int(v) for row in matrix for v in row.split(",")[1:]) == 20  # every test image, once
    assert len(list((run_dir / "attention").glob("*.png"))) == 2  # drawn by process 0


def test_ddp_cpu_trains_and_tests_show_attend_and_tell(two_processes):
    run_dir = two_processes[2] / "sat_two"
    m = read_metrics(run_dir)
    assert len(m["val/loss"]) == 2 and len(m["val/cider"]) == 2
    for key in ("test/loss", "test/bleu4", "test/cider", "test/exact_match", "test/grounding"):
        assert key in m, key
    captions = (run_dir / "test_captions.txt").read_text(encoding="utf-8").split("\n")
    assert len(captions) == 12 + 1  # every test scene once, gathered from both processes
    assert len(list((run_dir / "caption_attention").glob("*.png"))) == 2  # drawn by process 0


# Same global batches, same starting weights, AdamW: one process and two agree step by step.
# Per-example means (GPT, ViT, DeiT, Swin, BERT's classifier) and CLIP's loss over the gathered
# batch are the same function of the global batch, so only float rounding differs. Translation
# averages over target tokens, and each process over its own tokens: the mean of the two means
# weighs the tokens slightly differently. Largest relative gaps measured here over the 4 steps:
# 1.6e-7 for the per-example losses and CLIP, 7.9e-4 Transformer, 5.4e-5 seq2seq; the losses
# move by 4e-4 (BERT) to 1.0 (CLIP) against the same batches without learning.
TOLERANCE = {"transformer": 2e-3, "seq2seq": 2e-4}


@pytest.mark.parametrize(
    ("arch", "strategy"),
    [pytest.param(a, s, marks=slow_unless((a, s) in FAST_FIXED)) for a in ARCHS for s in STRATEGIES],
)
def test_two_processes_train_like_one_on_the_same_global_batches(two_processes, arch, strategy, tmp_path):
    results, files, _ = two_processes
    logging.getLogger("lightning").setLevel(logging.WARNING)
    saved = torch.load(files[arch], weights_only=False)
    one = fit_fixed(saved, ["trainer=cpu"], 0, 1)
    two = results[f"{arch}-{strategy}"]
    assert len(one) == len(two) == STEPS
    tolerance = TOLERANCE.get(arch, 1e-5)
    assert two == pytest.approx(one, rel=tolerance), (one, two)
    saved["model"]["optim"]["optimizer"]["lr"] = 0.0  # the same batches without learning: the steps matter
    frozen = fit_fixed(saved, ["trainer=cpu"], 0, 1)
    assert max(abs(a - b) / abs(a) for a, b in zip(one, frozen, strict=True)) > 10 * tolerance


def test_a_sharded_run_resumed_from_its_shards_ends_where_the_uninterrupted_run_ends(two_processes):
    _, _, tmp = two_processes
    want, got = read_metrics(tmp / "vit_sharded"), read_metrics(tmp / "vit_sharded_resumed")
    for key in ("val/loss", "val/acc", "test/loss", "test/acc"):
        assert [s for s, _ in got[key]] == [s for s, _ in want[key]], key
        values = [v for _, v in want[key]]
        # the net is 4 steps from random, its classes near ties: the sharded gradient's sums (in
        # another order after a resume) may flip one of the 10 images either way
        close = dict(rel=1e-4, abs=1e-5) if key.endswith("loss") else dict(abs=0.1 + 1e-6)
        assert [v for _, v in got[key]] == pytest.approx(values, **close), key


def test_a_sharded_checkpoint_loads_in_one_process_for_eval_and_predict(two_processes):
    _, _, tmp = two_processes
    ckpts = tmp / "vit_sharded" / "checkpoints"
    last = ckpts / "last.ckpt"
    assert last.is_dir() and (last / "meta.pt").is_file()  # a folder of shards
    proc = run_cli("eval", [f"ckpt_path={last}", "trainer.enable_progress_bar=false"], tmp)
    assert_ok(proc)
    assert "test/acc" in proc.stdout + proc.stderr
    image = tmp / "one.png"
    from PIL import Image

    Image.new("L", (28, 28), 128).save(image)
    proc = run_cli("predict", [f"ckpt_path={last}", f"image={image}"], tmp)
    assert_ok(proc)
    line = proc.stdout.strip().splitlines()[-1]  # "<image>: Coat 0.113, Bag 0.108, ..."
    assert line.startswith(f"{image}: ")
    top = [pair.rsplit(" ", 1) for pair in line.split(": ", 1)[1].split(", ")]
    probs = [float(p) for _, p in top]
    assert len(top) >= 3 and probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1.001
    assert {name for name, _ in top} <= set(IDX_DATASETS["fashion_mnist"]["classes"])


def test_trainer_configs_compose_with_their_strategies():
    fsdp = instantiate(compose_train(["trainer=fsdp"]).trainer.strategy, _convert_="partial")
    from attnlab.nn import TransformerBlock

    assert fsdp.kwargs["auto_wrap_policy"]._module_classes == {TransformerBlock}
    mp = compose_train(["trainer=fsdp2", "trainer.devices=4"]).trainer
    assert mp.strategy.data_parallel_size == 4 and mp.strategy.tensor_parallel_size == 1
    assert compose_train(["trainer=ddp_spawn"]).trainer.strategy == "ddp_spawn"
    assert os.path.isfile(ROOT / "conf" / "trainer" / "fsdp2.yaml")


def test_checkpoints_of_compiled_and_eager_nets_load_either_way(tmp_path):
    """``model.optim.compile=true`` compiles the net in place, so its state dict keeps the eager names
    (no ``_orig_mod.`` prefix): a checkpoint of either loads into the other."""
    cfg = compose_train(
        [
            "experiment=gpt_pydoc_char",
            *tiny_overrides("gpt_pydoc_char", tmp_path),
            f"paths.root_dir={tmp_path}",
            f"paths.output_dir={tmp_path}",
        ]
    )
    fill_missing(cfg.model.net, {"vocab_size": 50}, "model.net")
    compiled = instantiate(cfg.model, optim={"compile": True})
    compiled.setup("fit")
    eager = instantiate(cfg.model, optim={"compile": False})
    eager.setup("fit")
    assert compiled.net._compiled_call_impl is not None and eager.net._compiled_call_impl is None
    assert list(compiled.state_dict()) == list(eager.state_dict())
    assert not any("_orig_mod" in k for k in compiled.state_dict())
    torch.save({"state_dict": compiled.state_dict()}, tmp_path / "compiled.ckpt")
    eager.load_state_dict(torch.load(tmp_path / "compiled.ckpt")["state_dict"])
    compiled.load_state_dict(eager.state_dict())
    x = torch.randint(0, 50, (2, 8))
    assert torch.equal(eager.net(x), compiled.net.forward(x))  # .forward: the same weights, uncompiled


def test_weight_averaging_with_sharded_training_is_a_clear_error(tmp_path):
    overrides = [
        "experiment=vit_fashion_mnist",
        "trainer=fsdp2",
        *QUIET,
        *FAST,
        *tiny_overrides("vit_fashion_mnist", tmp_path),
    ]
    proc = run_cli("train", overrides, tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    printed = proc.stdout + proc.stderr
    assert printed.count("callbacks.ema: weight averaging keeps a full copy") == 1, printed[-3000:]
    assert "Initializing distributed" not in printed  # refused before a second process started


def test_a_csv_writer_in_a_new_process_continues_the_log(tmp_path):
    """ddp_spawn pickles the parent's logger into the fit's processes, then again into the test's:
    the test's writer appends its columns to the file that the fit's wrote."""
    import pickle

    from attnlab.training.loggers import CSVLogger

    parent = CSVLogger(tmp_path, name="csv", version="")
    parent.log_hyperparams({"lr": 0.1})  # before fit, in the parent
    spawned = pickle.dumps(parent)
    fit = pickle.loads(spawned)
    fit.log_metrics({"val/loss": 2.0}, step=10)
    fit.save()
    test = pickle.loads(spawned)
    test.log_metrics({"test/loss": 1.5}, step=20)
    test.save()
    rows = (tmp_path / "csv" / "metrics.csv").read_text().splitlines()
    assert rows == ["step,test/loss,val/loss", "10,,2.0", "20,1.5,"]


@pytest.mark.slow
def test_ddp_spawn_trains_and_tests_in_two_new_processes(tmp_path):
    from conftest import read_metrics, run_dirs, tiny

    proc = run_cli("train", [*tiny(), "trainer=ddp_spawn", "trainer.accelerator=cpu", "logger=csv"], tmp_path)
    assert_ok(proc)
    metrics = read_metrics(run_dirs(tmp_path, "gpt_pydoc_char")[0])
    assert len(metrics["val/loss"]) == 2 and "test/loss" in metrics


@pytest.mark.parametrize("arch", list(ARCHS))
def test_two_processes_evaluate_like_one(two_processes, arch):
    """The validation and test metrics of the same weights, by 2 processes and by one, on splits
    that do not divide by 2: each example counted once (no copies padding a process's share)."""
    results, files, _ = two_processes
    logging.getLogger("lightning").setLevel(logging.WARNING)
    one = evaluate_fixed(torch.load(files[arch], weights_only=False), ["trainer=cpu"])
    two = results[f"{arch}-ddp_cpu-eval"]
    assert set(one) == set(two) and any(k.startswith("test/") for k in one), (one, two)
    assert two == pytest.approx(one, rel=1e-5, abs=1e-6)


def test_every_process_draws_its_own_random_stream(two_processes):
    """The run is seeded once (the same initial weights everywhere); training then reseeds each
    process by its rank, or dropout, augmentation and masking would repeat on every process."""
    _, _, tmp = two_processes
    rank0, rank1 = json.loads((tmp / "gpt_pydoc_char-ddp_cpu" / "draws.json").read_text())
    assert rank0 and len(rank0) == len(rank1)
    assert all(a != b for a, b in zip(rank0, rank1, strict=True))
