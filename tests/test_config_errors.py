"""A value of the wrong type or range anywhere in the config is one line naming the key, exit 2."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_type_hints

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf

import attnlab.core.config as config_module
from attnlab.cli.common import config_dir
from attnlab.core.config import (
    _imported_signature,
    _source_signature,
    _type_hints,
    check_config,
    check_types,
    describe,
    instantiate_trainer,
)
from attnlab.core.errors import ConfigError
from attnlab.training.optim import build_optimizers
from attnlab.training.schedules import warmup_cosine, warmup_inverse_sqrt
from conftest import QUIET, run_cli, run_main, tiny

if TYPE_CHECKING:  # as optuna and wandb import some of the types their hints name
    from collections.abc import Callable

CONF = Path(config_dir())
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def composed(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=["paths.output_dir=/tmp/attnlab-unused", *overrides])


def config_error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        check_config(composed(*overrides))
    message = str(e.value)
    assert "\n" not in message
    return message


def checked_nodes(cfg: DictConfig, monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """``check_config(cfg)``, passing; the paths of the ``_target_`` nodes whose values it checked."""
    paths: list[str] = []
    check = config_module.check_types

    def recording(node: DictConfig, path: str) -> None:
        paths.append(path)
        check(node, path)

    monkeypatch.setattr(config_module, "check_types", recording)
    check_config(cfg)
    return set(paths)


def targets(cfg: DictConfig, *groups: str) -> set[str]:
    """The paths of the entries of ``groups`` (``callbacks``, ``logger``) that name a ``_target_``."""
    return {f"{g}.{k}" for g in groups for k, v in (cfg.get(g) or {}).items() if v and "_target_" in v}


# ---- types, before anything is built -------------------------------------------------------------

GPT = "gpt_pydoc_char"
NMT = "nmt_synthetic"
CLIP = "trainer.gradient_clip_val='abc': expected an int, a float or null (lightning.pytorch.Trainer"

CASES = [
    # (experiment, override, the message)
    (GPT, "model.optimizer.lr=abc", "model.optimizer.lr='abc': expected a float (torch.optim.AdamW lr)"),
    (NMT, "model.optimizer.lr=abc", "model.optimizer.lr='abc': expected a float (torch.optim.AdamW lr)"),
    (
        GPT,
        "trainer.max_steps=abc",
        "trainer.max_steps='abc': expected an int (lightning.pytorch.Trainer max_steps)",
    ),
    (
        NMT,
        "trainer.max_steps=abc",
        "trainer.max_steps='abc': expected an int (lightning.pytorch.Trainer max_steps)",
    ),
    (
        GPT,
        "data.batch_size=abc",
        "data.batch_size='abc': expected an int (attnlab.data.TextDataModule batch_size)",
    ),
    (
        NMT,
        "data.max_tokens=abc",
        "data.max_tokens='abc': expected an int (attnlab.data.TranslationDataModule max_tokens)",
    ),
    (GPT, "model.net.depth=2.5", "model.net.depth=2.5: expected an int (attnlab.models.GPT depth)"),
    (
        NMT,
        "model.net.enc_depth=2.5",
        "model.net.enc_depth=2.5: expected an int (attnlab.models.Transformer enc_depth)",
    ),
    (
        GPT,
        "model.net.max_len=abc",  # not data.block_size, which interpolates it
        "model.net.max_len='abc': expected an int (attnlab.models.GPT max_len)",
    ),
    (
        GPT,
        "model.scheduler.warmup_steps=abc",
        "model.scheduler.warmup_steps='abc': expected an int (attnlab.training.schedules.warmup_cosine",
    ),
    (
        NMT,
        "model.scheduler.warmup_steps=abc",
        "model.scheduler.warmup_steps='abc': expected an int (attnlab.training.schedules.warmup_cosine",
    ),
    (GPT, "trainer.gradient_clip_val=abc", CLIP),
    (NMT, "trainer.gradient_clip_val=abc", CLIP),
    (GPT, "model.net.bias=maybe", "model.net.bias='maybe': expected a bool (attnlab.models.GPT bias)"),
    (
        NMT,
        "model.net.norm_first=maybe",
        "model.net.norm_first='maybe': expected a bool (attnlab.models.Transformer norm_first)",
    ),
    (
        GPT,
        "+model.net.depths=3",
        "model.net.depths=3: attnlab.models.GPT has no parameter 'depths' (did you mean depth?)",
    ),
    (
        NMT,
        "+model.net.n_layers=3",
        "model.net.n_layers=3: attnlab.models.Transformer has no parameter 'n_layers'",
    ),
    (GPT, "data.tokenizer=7", "data.tokenizer=7: expected a string (attnlab.data.TextDataModule tokenizer)"),
    (NMT, "data.corpus=7", "data.corpus=7: expected a string (attnlab.data.TranslationDataModule corpus)"),
    (
        GPT,
        "model.net.attn_impl=fast",
        "model.net.attn_impl='fast': expected one of 'auto', 'sdpa', 'flex', 'math'",
    ),
    (GPT, "model.optimizer.betas=[0.9,x]", "model.optimizer.betas=[0.9, 'x']: expected a list of 2 floats"),
    (
        NMT,
        "model.weight_decay=x",
        "model.weight_decay='x': expected a float (attnlab.training.TranslationTask",
    ),
    (GPT, "trainer.precision=bogus", "trainer.precision='bogus': expected one of 64, 32, 16,"),
    (
        GPT,
        "callbacks.model_checkpoint.save_top_k=x",
        "callbacks.model_checkpoint.save_top_k='x': expected an int",
    ),
    # WandbLogger's hints name a class imported only for type checkers: checked one by one
    (NMT, "logger.wandb.name=3", "logger.wandb.name=3: expected a string or null"),
    (GPT, "+trainer.foo=1", "trainer.foo=1: lightning.pytorch.Trainer has no parameter 'foo'"),
    (
        GPT,
        "model.optimizer._target_=torch.optim.Adamw",
        "model.optimizer._target_='torch.optim.Adamw' cannot be imported",
    ),
]


@pytest.mark.parametrize("experiment,override,message", CASES, ids=[f"{e}:{o}" for e, o, _ in CASES])
def test_wrong_type_is_one_line_naming_key_value_and_type(experiment, override, message):
    assert message in config_error(f"experiment={experiment}", override)


@pytest.mark.parametrize("experiment,override,message", CASES, ids=[f"{e}:{o}" for e, o, _ in CASES])
def test_the_quick_check_refuses_the_same_or_leaves_it_to_the_full_one(experiment, override, message):
    """``check_config(cfg, imports=False)``, the entry points' check before torch loads."""
    try:
        check_config(composed(f"experiment={experiment}", override), imports=False)
    except ConfigError as e:
        assert message in str(e)


def test_the_quick_check_finds_a_wrong_trainer_value():
    with pytest.raises(ConfigError, match=r"^trainer\.max_steps='abc': expected an int \(lightning"):
        check_config(composed("trainer.max_steps=abc"), imports=False)


def all_targets(node: Any) -> set[str]:
    if isinstance(node, dict):
        found = {node["_target_"]} if isinstance(node.get("_target_"), str) else set()
        return found.union(*(all_targets(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(all_targets(v) for v in node))
    return set()


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_signatures_read_from_the_source_agree_with_the_imported_ones(experiment):
    """Where the quick check reads a constructor's signature from its source, the parameters,
    their None defaults and each annotation it evaluates are the imported constructor's."""
    cfg = composed(f"experiment={experiment}")
    check_config(cfg, imports=False)  # no shipped experiment is refused by it
    read = set()
    for target in sorted(all_targets(OmegaConf.to_container(cfg))):
        found = _source_signature(target)
        if found is None:
            continue
        read.add(target)
        (sig, hints, trainer), (real, real_hints, real_trainer) = found, _imported_signature(target, "x")
        shape = [(p.name, p.kind, p.default is None) for p in sig.parameters.values()]
        assert shape == [(p.name, p.kind, p.default is None) for p in real.parameters.values()], target
        assert trainer == real_trainer, target
        for name, hint in hints.items():  # names from outside the standard library accept anything
            if hint is not Any and "_Unseen" not in repr(hint):
                assert hint == real_hints[name], (target, name, hint, real_hints[name])
    assert "lightning.pytorch.Trainer" in read  # (a net that inherits its __init__ is left to the full check)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_shipped_experiments_pass(experiment, monkeypatch):
    cfg = composed(f"experiment={experiment}")
    net = cfg.model.net  # BERT: the encoder's vocabulary; CLIP: the text tower's
    tower = next((net[k] for k in ("encoder", "text") if isinstance(net.get(k), DictConfig)), None)
    net = tower if tower is not None else net  # Show, Attend and Tell's encoder is a name ("cnn")
    filled_by_data = "vocab_size" if "vocab_size" in net.keys() else "num_classes"
    assert cfg.task_name == experiment
    assert cfg.trainer.precision == "auto" and net._get_node(filled_by_data)._is_missing()
    towers = {
        f"model.net.{k}" for k in ("encoder", "image", "text") if isinstance(cfg.model.net.get(k), DictConfig)
    }
    expected = {"trainer", "model", "model.net", "model.optimizer", "data", *towers}
    expected |= {"model.scheduler"} if cfg.model.get("scheduler") else set()
    assert checked_nodes(cfg, monkeypatch) >= expected | targets(cfg, "callbacks", "logger")


@pytest.mark.parametrize(
    "overrides,values",
    [
        (  # the debug configs keep one CPU process, whatever the trainer option
            ("trainer=ddp_cpu", "logger=many", "debug=overfit"),
            {"trainer.strategy": "ddp", "trainer.devices": 1, "trainer.overfit_batches": 1},
        ),
        (
            ("trainer=gpu", "callbacks=translation", "debug=profiler"),
            {
                "trainer.accelerator": "cpu",
                "trainer.profiler": "simple",
                "callbacks.model_checkpoint.monitor": "val/bleu",
            },
        ),
    ],
)
def test_shipped_group_options_pass(overrides, values, monkeypatch):
    cfg = composed(*overrides)
    assert {key: OmegaConf.select(cfg, key) for key in values} == values
    nodes = checked_nodes(cfg, monkeypatch)
    assert nodes >= {"trainer", "model.net", "logger.csv", *targets(cfg, "callbacks", "logger")}
    assert "logger.wandb" in nodes if "logger=many" in overrides else "logger.wandb" not in nodes


def test_legal_values_pass(monkeypatch):
    cfg = composed(
        "trainer.precision=32",
        "model.scheduler=null",
        "trainer.max_time=00:00:01:00",
        "model.optimizer.lr=1",
        "seed=7",
        "model.net.dropout=0",
    )
    nodes = checked_nodes(cfg, monkeypatch)
    assert {"trainer", "model.net", "model.optimizer"} <= nodes and "model.scheduler" not in nodes
    assert (cfg.trainer.precision, cfg.trainer.max_time, cfg.model.optimizer.lr) == (32, "00:00:01:00", 1)
    assert (cfg.model.scheduler, cfg.seed, cfg.model.net.dropout) == (None, 7, 0)

    cfg = composed(
        "trainer.precision=bf16-mixed",
        "experiment=nmt_bahdanau_multi30k",
        "model.net.dropout=0",
        "+model.optimizer.eps=1e-6",
    )
    assert {"trainer", "model.net", "model.optimizer"} <= checked_nodes(cfg, monkeypatch)
    assert cfg.trainer.precision == "bf16-mixed" and cfg.model.net._target_ == "attnlab.models.Seq2Seq"
    assert (cfg.model.net.dropout, cfg.model.optimizer.eps) == (0, 1e-6)


# ---- a hint naming a type only type checkers import: the parameter is still checked --------------


def hooked(n: int = 1, hooks: list[Callable[[], None]] | None = None, name: str | Callable[[], str] = "x"):
    """A target whose hints name ``Callable``, imported here only for type checkers."""


@pytest.mark.parametrize(
    "target",
    [
        f"{__name__}.hooked",
        "lightning.pytorch.loggers.WandbLogger",  # Run
        "lightning.pytorch.strategies.FSDPStrategy",  # CPUOffload, _SHARDING_STRATEGY
        "optuna.samplers.TPESampler",  # Callable
    ],
)
def test_every_annotated_parameter_has_a_hint(target):
    obj = get_object(target)
    sig = inspect.signature(obj)
    annotated = {n for n, p in sig.parameters.items() if p.annotation is not inspect.Parameter.empty}
    fn = obj.__init__ if inspect.isclass(obj) else obj
    with pytest.raises(NameError):  # what makes the type check read the hints one by one
        get_type_hints(fn)
    assert set(_type_hints(fn, sig)) == annotated


def test_a_hint_naming_an_unimported_type_checks_the_rest():
    node = OmegaConf.create({"_target_": f"{__name__}.hooked", "n": 2, "hooks": 5, "name": 3})
    with pytest.raises(ConfigError, match=r"^x\.hooks=5: expected a list of items or null \("):
        check_types(node, "x")
    node.hooks = None  # ``name`` may be a Callable, which a config cannot rule out: any value passes
    assert check_types(node, "x") is None


# ---- the data's sequence length against the model's position table --------------------------------

LENGTHS = [
    # (experiment, override, the message)
    (
        "bert_pretrain_sst2",
        "data.max_len=256",
        "data.max_len=256 is longer than model.net.encoder.max_len=128",
    ),
    (
        "bert_finetune_sst2",
        "data.max_len=129",
        "data.max_len=129 is longer than model.net.encoder.max_len=128",
    ),
    ("bert_ner_fixture", "model.net.encoder.max_len=32", "data.max_len=48 is longer than model.net.encoder"),
    (NMT, "data.max_len=65", "data.max_len=65 is longer than model.net.max_len=64"),
    (
        "nmt_transformer_multi30k",
        "model.net.max_len=100",
        "data.max_len=128 is longer than model.net.max_len=100",
    ),
    (GPT, "data.block_size=65", "data.block_size=65 is longer than model.net.max_len=64"),
    (
        "clip_pairs",
        "+model.net.text.max_len=8",
        "data.context_length=32 is longer than model.net.text.",
    ),
]


@pytest.mark.parametrize("experiment,override,message", LENGTHS, ids=[f"{e}:{o}" for e, o, _ in LENGTHS])
def test_data_longer_than_the_position_table(experiment, override, message):
    assert config_error(f"experiment={experiment}", override).startswith(message)


def test_the_length_message_names_both_keys_and_the_fix():
    assert config_error(f"experiment={NMT}", "data.max_len=65") == (
        "data.max_len=65 is longer than model.net.max_len=64 (the model's position table): "
        "lower data.max_len or raise model.net.max_len"
    )


@pytest.mark.parametrize(
    "experiment,overrides",
    [
        (NMT, ("data.max_len=64",)),  # as long as the table: fits
        ("bert_ner_fixture", ("data.max_len=128",)),
        ("nmt_luong_multi30k", ("data.max_len=1000",)),  # an RNN has no position table
        (GPT, ("model.net.max_len=256",)),  # the data's block_size follows the model's max_len
    ],
)
def test_data_that_fits_the_position_table_passes(experiment, overrides, monkeypatch):
    cfg = composed(f"experiment={experiment}", *overrides)
    assert "model.net" in checked_nodes(cfg, monkeypatch)


@pytest.mark.parametrize(
    "experiment,override,message",
    [
        (
            "bert_ner_fixture",
            "data.max_len=200",
            "data.max_len=200 is longer than model.net.encoder.max_len=128",
        ),
        (NMT, "data.max_len=100", "data.max_len=100 is longer than model.net.max_len=64"),
    ],
)
def test_cli_refuses_a_long_max_len_before_training(tmp_path, experiment, override, message):
    status, out = run_main(
        "train", [f"experiment={experiment}", override, f"paths.root_dir={tmp_path}", *QUIET]
    )
    assert status == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    errors = [line for line in out.splitlines() if "error: " in line]
    assert len(errors) == 1 and f"error: {message}" in errors[0], out[-3000:]
    assert "Instantiating datamodule" not in out, out[-3000:]  # nothing built before it
    # the refused run's folder (Hydra's config and the log, nothing else) is removed
    assert not list(tmp_path.glob(f"logs/{experiment}/runs/*")), "a refused run left its folder"


def test_describe():
    from typing import Literal

    assert describe(int | None) == "an int or null"
    assert describe(float | list[str]) == "a float or a list of strings"
    assert describe(Literal["a", "b"], ("auto",)) == "one of 'a', 'b', 'auto'"
    assert describe(tuple[float, ...]) == "a list of floats"


# ---- ranges the constructors check, while building ------------------------------------------------


def test_optimizer_range_error_names_the_node():
    import functools

    import torch

    net = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=r"^model.optimizer: Invalid learning rate: -1.0$"):
        build_optimizers(net, functools.partial(torch.optim.AdamW, lr=-1.0), None, 0.0)
    bad_sched = functools.partial(warmup_cosine, warmup_steps=10, total_steps=100, min_lr_ratio=2.0)
    with pytest.raises(ConfigError, match=r"^model.scheduler.min_lr_ratio=2.0: must be in \[0, 1\]$"):
        build_optimizers(net, torch.optim.SGD, bad_sched, 0.0)

    def raises_value_error(opt):
        raise ValueError("nope")

    with pytest.raises(ConfigError, match="^model.scheduler: nope$"):
        build_optimizers(net, torch.optim.SGD, raises_value_error, 0.0)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(warmup_steps=-3, total_steps=100), "model.scheduler.warmup_steps=-3: must be a non-negative"),
        (dict(warmup_steps=0, total_steps=0), "model.scheduler.total_steps=0: must be a positive integer"),
        (dict(warmup_steps=0, total_steps=-1), "trainer.max_steps=-1"),
        (dict(warmup_steps=0, total_steps=10, min_lr_ratio=-0.1), "model.scheduler.min_lr_ratio=-0.1"),
    ],
)
def test_warmup_cosine_ranges(kwargs, message):
    import torch

    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        warmup_cosine(opt, **kwargs)
    with pytest.raises(ConfigError, match="model.scheduler.warmup_steps=0: must be a positive integer"):
        warmup_inverse_sqrt(opt, 0)
    # the edges of each range are legal: the multipliers of the first steps
    assert [warmup_cosine(opt, 0, 1, 0.0).lr_lambdas[0](s) for s in (0, 1, 2)] == [1.0, 0.0, 0.0]
    constant = warmup_cosine(opt, 5, 10, 1.0).lr_lambdas[0]
    assert [constant(s) for s in (0, 4, 5, 10, 11)] == pytest.approx([1 / 6, 5 / 6, 1.0, 1.0, 1.0])
    assert [warmup_inverse_sqrt(opt, 1).lr_lambdas[0](s) for s in (0, 3)] == [1.0, 0.5]


@pytest.mark.parametrize(
    "override,message",
    [
        ("trainer.max_steps=-5", "trainer: `max_steps` must be a non-negative integer or -1"),
        ("trainer.val_check_interval=-1", "trainer: You have passed invalid value -1 for val_check_interval"),
        ("trainer.precision=bogus", "trainer: Precision 'bogus' is invalid."),
    ],
)
def test_trainer_range_errors_are_config_errors(override, message):
    node = composed("trainer.accelerator=cpu", "trainer.precision=32-true", override).trainer
    with pytest.raises(ConfigError) as e:
        instantiate_trainer(node, logger=False, callbacks=[])
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "group,override,message",
    [
        (
            "callbacks",
            "callbacks.model_checkpoint.save_top_k=-5",
            "callbacks.model_checkpoint: Invalid value for save_top_k=-5",
        ),
        ("callbacks", "callbacks.model_checkpoint.mode=up", "callbacks.model_checkpoint: `mode` can be"),
        (
            "logger",
            "++logger.wandb.offline=true ++logger.wandb.log_model=true",
            "logger.wandb: Providing log_model=True and offline=True is an invalid configuration",
        ),
    ],
)
def test_callback_and_logger_range_errors_name_the_entry(tmp_path, monkeypatch, group, override, message):
    from attnlab.cli.train import instantiate_group

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    cfg = composed(f"paths.output_dir={tmp_path}", *override.split())
    with pytest.raises(ConfigError) as e:
        instantiate_group(cfg, group)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


# ---- the hyper-parameters' old names (issue 28): one line naming the new one ---------------------

RENAMED_CASES = [
    (GPT, "+model.net.n_embd=64", "model.net.n_embd was renamed model.net.dim"),
    (GPT, "+model.net.n_layer=2", "model.net.n_layer was renamed model.net.depth"),
    (GPT, "+model.net.block_size=32", "model.net.block_size was renamed model.net.max_len"),
    (NMT, "+model.net.d_model=64", "model.net.d_model was renamed model.net.dim"),
    (NMT, "+model.net.n_dec_layers=1", "model.net.n_dec_layers was renamed model.net.dec_depth"),
    (
        NMT,
        "+model.net.d_ff=256",
        "model.net.d_ff was renamed model.net.mlp_ratio (now a ratio: the MLP is int(mlp_ratio * dim) wide)",
    ),
    ("nmt_luong_multi30k", "+model.net.emb_dim=64", "model.net.emb_dim was renamed model.net.dim"),
    ("bert_pretrain_sst2", "+model.net.encoder.mlp_dim=64", "model.net.encoder.mlp_dim was renamed"),
    ("swin_fashion_mnist", "+model.net.n_heads=[1,2]", "model.net.n_heads was renamed model.net.n_head"),
    ("clip_pairs", "+model.net.text.context_length=8", "model.net.text.context_length was renamed"),
    ("bert_finetune_sst2", "+model.pretrained_ckpt=x.ckpt", "model.pretrained_ckpt was renamed"),
]


@pytest.mark.parametrize("experiment,override,message", RENAMED_CASES, ids=[o for _, o, _ in RENAMED_CASES])
def test_an_old_name_in_a_config_names_the_new_one(experiment, override, message):
    assert config_error(f"experiment={experiment}", override).startswith(message)


def test_the_data_keeps_its_own_block_size_and_context_length(monkeypatch):
    """``data.block_size`` (the training window) and ``data.context_length`` (the caption length)
    are data keys, not the model's old names."""
    for experiment, key in ((GPT, "data.block_size=32"), ("clip_pairs", "data.context_length=16")):
        assert "data" in checked_nodes(composed(f"experiment={experiment}", key), monkeypatch)


# a run saved before the rename: its config (in the checkpoint, as attnlab-eval and the inference
# CLIs read it) names the model's hyper-parameters the old way
OLD_RUNS = {
    "gpt": (
        "attnlab.training.LanguageModelTask",
        {
            "_target_": "attnlab.models.GPT",
            "vocab_size": 11,
            "block_size": 16,
            "n_layer": 2,
            "n_head": 2,
            "n_embd": 24,
        },
        {"vocab_size": 11, "max_len": 16, "depth": 2, "n_head": 2, "dim": 24},
    ),
    "transformer": (
        "attnlab.training.TranslationTask",
        {
            "_target_": "attnlab.models.Transformer",
            "vocab_size": 11,
            "pad_id": 0,
            "d_model": 24,
            "n_head": 2,
            "n_enc_layers": 1,
            "n_dec_layers": 2,
            "d_ff": 40,  # not a whole multiple of the width: the ratio must give 40 back
            "max_len": 32,
        },
        {
            "vocab_size": 11,
            "pad_id": 0,
            "dim": 24,
            "n_head": 2,
            "enc_depth": 1,
            "dec_depth": 2,
            "mlp_ratio": 40 / 24,
            "max_len": 32,
        },
    ),
}


@pytest.mark.parametrize("kind", sorted(OLD_RUNS))
def test_a_run_saved_under_the_old_names_still_loads(kind, tmp_path, caplog):
    import torch
    import yaml
    from hydra.utils import instantiate

    from attnlab.inference.runs import TrainedRun

    task, old_net, new_kwargs = OLD_RUNS[kind]
    torch.manual_seed(0)
    trained = instantiate({"_target_": old_net["_target_"], **new_kwargs}).eval()
    path = tmp_path / "old.ckpt"
    config = {
        "model": {"_target_": task, "net": old_net},
        "data": {"_target_": "attnlab.data.TextDataModule", "block_size": 16},
    }
    torch.save(
        {
            "state_dict": {f"net.{k}": v for k, v in trained.state_dict().items()},
            "attnlab": {"config": yaml.safe_dump(config), "artifacts": {}},
        },
        path,
    )
    with caplog.at_level("WARNING", logger="attnlab.inference.runs"):
        run = TrainedRun(str(path), tmp_path)
    notices = [r.getMessage() for r in caplog.records if "old hyper-parameter names" in r.getMessage()]
    assert len(notices) == 1 and "model.net.n_head" not in notices[0], notices
    assert dict(run.config.model.net) == {"_target_": old_net["_target_"], **new_kwargs}
    assert run.config.data.block_size == 16  # the data's window is no old name
    net = run.net()
    ids = torch.randint(1, 11, (2, 7))
    same = (lambda m: m(ids)) if kind == "gpt" else (lambda m: m(ids, ids))
    torch.testing.assert_close(same(net), same(trained))


# ---- through the CLI: exit status 2, one `error:` line, no traceback ------------------------------


@pytest.mark.parametrize(
    "override,message",
    [
        # one of each kind (the messages themselves are tested in-process above): a type checked
        # before anything is built, and a range the optimizer checks while it is built
        ("model.optimizer.lr=abc", "error: model.optimizer.lr='abc': expected a float (torch.optim.AdamW"),
        ("model.optimizer.lr=-1", "error: model.optimizer: Invalid learning rate: -1"),
        # an old hyper-parameter name: without ``+`` Hydra would refuse the key as missing,
        # saying nothing of the new name
        ("model.net.n_embd=64", "error: model.net.n_embd was renamed model.net.dim"),
        ("+model.net.n_layer=2", "error: model.net.n_layer was renamed model.net.depth"),
        ("model.pretrained_ckpt=x.ckpt", "error: model.pretrained_ckpt was renamed model.init_from"),
    ],
)
def test_cli_bad_value_exits_2_with_one_line(tmp_path, override, message):
    proc = run_cli("train", tiny(override, "logger=csv"), tmp_path)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    errors = [line for line in text.splitlines() if "error: " in line]
    assert len(errors) == 1 and message in errors[0], text[-3000:]


# ---- attnlab-generate's options, checked before the checkpoint is read ----------------------------


@pytest.mark.parametrize(
    "value,shown", [("0", "0"), ("-2", "-2"), ("1.5", "1.5"), ("abc", "'abc'"), ("true", "True")]
)
def test_generate_refuses_a_bad_num_samples(tmp_path, value, shown):
    status, out = run_main("generate", [f"ckpt_path={tmp_path / 'none.ckpt'}", f"num_samples={value}"])
    assert status == 2 and "Traceback" not in out, out[-3000:]
    assert out.strip() == f"error: num_samples must be a positive integer, got {shown}"


def test_generate_takes_a_positive_num_samples(tmp_path):
    status, out = run_main("generate", [f"ckpt_path={tmp_path / 'none.ckpt'}", "num_samples=3"])
    assert status == 2 and "num_samples" not in out and "none.ckpt" in out, out[-3000:]
