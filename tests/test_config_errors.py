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
    check_config,
    check_types,
    instantiate_trainer,
    mismatch,
    signature,
)
from attnlab.core.errors import ConfigError
from attnlab.core.signatures import static_signature
from attnlab.training.optim import Optimization
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

    def recording(node: DictConfig, path: str, imports: bool = True) -> None:
        paths.append(path)
        check(node, path, imports)

    monkeypatch.setattr(config_module, "check_types", recording)
    check_config(cfg)
    return set(paths)


def targets(cfg: DictConfig, *groups: str) -> set[str]:
    """The paths of the entries of ``groups`` (``callbacks``, ``logger``) that name a ``_target_``."""
    return {f"{g}.{k}" for g in groups for k, v in (cfg.get(g) or {}).items() if v and "_target_" in v}


# ---- types, before anything is built -------------------------------------------------------------

GPT = "gpt_pydoc_char"
NMT = "nmt_synthetic"
CLIP = "trainer.gradient_clip_val='abc': must be a valid integer or a valid number or null (lightning"

CASES = [
    # (experiment, override, the message)
    (
        GPT,
        "model.optim.optimizer.lr=abc",
        "model.optim.optimizer.lr='abc': must be a valid number (torch.optim.AdamW)",
    ),
    (
        NMT,
        "model.optim.optimizer.lr=abc",
        "model.optim.optimizer.lr='abc': must be a valid number (torch.optim.AdamW)",
    ),
    (
        GPT,
        "trainer.max_steps=abc",
        "trainer.max_steps='abc': must be a valid integer (lightning.pytorch.Trainer)",
    ),
    (
        NMT,
        "trainer.max_steps=abc",
        "trainer.max_steps='abc': must be a valid integer (lightning.pytorch.Trainer)",
    ),
    (
        GPT,
        "data.batch_size=abc",
        "data.batch_size='abc': must be a valid integer (attnlab.data.TextDataModule)",
    ),
    (
        NMT,
        "data.max_tokens=abc",
        "data.max_tokens='abc': must be a valid integer (attnlab.data.TranslationDataModule)",
    ),
    (GPT, "model.net.depth=2.5", "model.net.depth=2.5: must be a valid integer (attnlab.models.GPT)"),
    (
        NMT,
        "model.net.enc_depth=2.5",
        "model.net.enc_depth=2.5: must be a valid integer (attnlab.models.Transformer)",
    ),
    (
        GPT,
        "model.net.max_len=abc",  # not data.max_len, which interpolates it
        "model.net.max_len='abc': must be a valid integer (attnlab.models.GPT)",
    ),
    (
        GPT,
        "model.optim.scheduler.warmup_steps=abc",
        "model.optim.scheduler.warmup_steps='abc': must be a valid integer (attnlab.training.schedules.",
    ),
    (
        NMT,
        "model.optim.scheduler.warmup_steps=abc",
        "model.optim.scheduler.warmup_steps='abc': must be a valid integer (attnlab.training.schedules.",
    ),
    (GPT, "trainer.gradient_clip_val=abc", CLIP),
    (NMT, "trainer.gradient_clip_val=abc", CLIP),
    (GPT, "model.net.bias=maybe", "model.net.bias='maybe': must be a valid boolean (attnlab.models.GPT)"),
    (
        NMT,
        "model.net.norm_first=maybe",
        "model.net.norm_first='maybe': must be a valid boolean (attnlab.models.Transformer)",
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
    (
        GPT,
        "data.tokenizer=7",
        "data.tokenizer=7: must be a valid string or null (attnlab.data.TextDataModule)",
    ),
    (
        NMT,
        "data.source=7",
        "data.source=7: must be a _target_ node or null (attnlab.data.TranslationDataModule)",
    ),
    (
        GPT,
        "model.net.attn_impl=fast",
        "model.net.attn_impl='fast': must be 'auto', 'sdpa', 'flex' or 'math' (attnlab.models.GPT)",
    ),
    (
        GPT,
        "model.optim.optimizer.betas=[0.9,x]",
        "model.optim.optimizer.betas=[0.9, 'x']: must be a valid number at [1] (torch.optim.AdamW)",
    ),
    (
        NMT,
        "model.optim.weight_decay=x",
        "model.optim.weight_decay='x': must be a valid number (attnlab.training.optim.Optimization)",
    ),
    (
        GPT,
        "trainer.precision=bogus",
        "trainer.precision='bogus': must be 64, 32 or 16 or 'transformer-engine',",
    ),
    (
        GPT,
        "callbacks.model_checkpoint.save_top_k=x",
        "callbacks.model_checkpoint.save_top_k='x': must be a valid integer",
    ),
    # WandbLogger's hints name a class imported only for type checkers: checked one by one
    (NMT, "logger.wandb.name=3", "logger.wandb.name=3: must be a valid string or null"),
    (GPT, "+trainer.foo=1", "trainer.foo=1: lightning.pytorch.Trainer has no parameter 'foo'"),
    (
        GPT,
        "model.optim.optimizer._target_=torch.optim.Adamw",
        "model.optim.optimizer._target_='torch.optim.Adamw' cannot be imported",
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
    with pytest.raises(ConfigError, match=r"^trainer\.max_steps='abc': must be a valid integer \(lightning"):
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
        found = static_signature(target)
        if found is None:
            continue
        read.add(target)
        (sig, hints), (real, real_hints) = found, signature(target, "x")
        shape = [(p.name, p.kind, p.default is None) for p in sig.parameters.values()]
        assert shape == [(p.name, p.kind, p.default is None) for p in real.parameters.values()], target
        for name, hint in hints.items():  # names bound to what the reading does not evaluate: anything
            if hint is not Any and "Unseen" not in repr(hint):
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
    expected = {"trainer", "model", "model.net", "model.optim", "model.optim.optimizer", "data", *towers}
    expected |= {"model.optim.scheduler"} if cfg.model.optim.get("scheduler") else set()
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
        "model.optim.scheduler=null",
        "trainer.max_time=00:00:01:00",
        "model.optim.optimizer.lr=1",
        "seed=7",
        "model.net.dropout=0",
    )
    nodes = checked_nodes(cfg, monkeypatch)
    assert {"trainer", "model.net", "model.optim.optimizer"} <= nodes and "model.optim.scheduler" not in nodes
    assert (cfg.trainer.precision, cfg.trainer.max_time, cfg.model.optim.optimizer.lr) == (
        32,
        "00:00:01:00",
        1,
    )
    assert (cfg.model.optim.scheduler, cfg.seed, cfg.model.net.dropout) == (None, 7, 0)

    cfg = composed(
        "trainer.precision=bf16-mixed",
        "experiment=nmt_bahdanau_multi30k",
        "model.net.dropout=0",
        "+model.optim.optimizer.eps=1e-6",
    )
    assert {"trainer", "model.net", "model.optim.optimizer"} <= checked_nodes(cfg, monkeypatch)
    assert cfg.trainer.precision == "bf16-mixed" and cfg.model.net._target_ == "attnlab.models.Seq2Seq"
    assert (cfg.model.net.dropout, cfg.model.optim.optimizer.eps) == (0, 1e-6)


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
    with pytest.raises(NameError):  # a name typing cannot evaluate: the check reads it as any value
        get_type_hints(fn)
    assert set(signature(target, "x")[1]) == annotated


def test_a_hint_naming_an_unimported_type_checks_the_rest():
    node = OmegaConf.create({"_target_": f"{__name__}.hooked", "n": 2, "hooks": 5, "name": 3})
    with pytest.raises(ConfigError, match=r"^x\.hooks=5: must be a valid list or null \("):
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
    (GPT, "data.max_len=65", "data.max_len=65 is longer than model.net.max_len=64"),
    (
        "clip_pairs",
        "+model.net.text.max_len=8",
        "data.max_len=32 is longer than model.net.text.",
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
        (GPT, ("model.net.max_len=256",)),  # the data's max_len follows the model's
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


def test_what_an_annotation_expects_in_words():
    from pathlib import Path
    from typing import Literal

    from attnlab.core.specs import DropRate, PositiveInt

    assert mismatch(int | None, 2.5) == "must be a valid integer or null"
    assert mismatch(float | list[str], [1]) == "must be a valid number or a valid string at [0]"
    assert mismatch(Literal["a", "b"], "c") == "must be 'a' or 'b'"
    assert mismatch(tuple[float, ...], [0.1, "x"]) == "must be a valid number at [1]"
    assert mismatch(PositiveInt, 0) == "must be greater than 0"
    assert mismatch(DropRate, 1.0) == "must be less than 1"
    assert mismatch(int, True) == "must be a valid integer"  # strict: a bool is no int, "3" no number
    assert mismatch(float, "3") == "must be a valid number"
    assert mismatch(torch_module(), 3) == "must be a _target_ node"  # an object only a node builds
    for annotation, value in (
        (float, 3),
        (Path, "a/b"),
        (tuple[int, int], [1, 2]),
        (PositiveInt | None, None),
    ):
        assert mismatch(annotation, value) is None
    assert mismatch(PositiveInt, {"_target_": "x.y"}) is None  # built by a node, checked on its own


def torch_module() -> type:
    from torch import nn

    return nn.Module


# ---- ranges the constructors check, while building ------------------------------------------------


def test_optimizer_range_error_names_the_node():
    import functools

    import torch

    net = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=r"^model.optim.optimizer: Invalid learning rate: -1.0$"):
        Optimization(functools.partial(torch.optim.AdamW, lr=-1.0)).configure(net)
    bad_sched = functools.partial(warmup_cosine, warmup_steps=10, total_steps=100, min_lr_ratio=2.0)
    with pytest.raises(ConfigError, match=r"^model.optim.scheduler.min_lr_ratio=2.0: must be in \[0, 1\]$"):
        Optimization(torch.optim.SGD, bad_sched).configure(net)

    def raises_value_error(opt):
        raise ValueError("nope")

    with pytest.raises(ConfigError, match="^model.optim.scheduler: nope$"):
        Optimization(torch.optim.SGD, raises_value_error).configure(net)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            dict(warmup_steps=-3, total_steps=100),
            "model.optim.scheduler.warmup_steps=-3: must be a non-negative",
        ),
        (
            dict(warmup_steps=0, total_steps=0),
            "model.optim.scheduler.total_steps=0: must be a positive integer",
        ),
        (dict(warmup_steps=0, total_steps=-1), "trainer.max_steps=-1"),
        (dict(warmup_steps=0, total_steps=10, min_lr_ratio=-0.1), "model.optim.scheduler.min_lr_ratio=-0.1"),
    ],
)
def test_warmup_cosine_ranges(kwargs, message):
    import torch

    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        warmup_cosine(opt, **kwargs)
    with pytest.raises(ConfigError, match="model.optim.scheduler.warmup_steps=0: must be a positive integer"):
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
    # the data keys (issue 58): the model's vocabulary, one name for the source and each split size
    (GPT, "+data.block_size=32", "data.block_size was renamed data.max_len"),
    ("clip_pairs", "+data.context_length=16", "data.context_length was renamed data.max_len"),
    (NMT, "+data.corpus=synthetic", "data.corpus was renamed data.source"),
    ("vit_fashion_mnist", "+data.dataset=mnist", "data.dataset was renamed data.source"),
    # (a split size is its source's now: followed on to the name the DataModule takes)
    (GPT, "+data.val_fraction=0.1", "data.val_fraction was renamed data.source.val_size"),
    ("bert_pretrain_sst2", "+data.test_fraction=0.1", "data.test_fraction was renamed data.source.test_size"),
    (GPT, "+data.val_size=0.1", "data.val_size was renamed data.source.val_size"),
    (
        "gpt_scene_captions",
        "+data.captions.n_val=8",
        "data.captions.n_val was renamed data.captions.val_size",
    ),
    # removed (issue 58): the ViT's LayerNorm eps follows pre_norm
    ("vit_fashion_mnist", "+model.net.norm_eps=1e-6", "model.net.norm_eps was removed: pre_norm sets"),
    # the optimisation spec (issue 58): model.optim
    (GPT, "+model.weight_decay=0.1", "model.weight_decay was renamed model.optim.weight_decay"),
    ("vit_fashion_mnist", "+model.optimizer.lr=0.1", "model.optimizer was renamed model.optim.optimizer"),
]


@pytest.mark.parametrize("experiment,override,message", RENAMED_CASES, ids=[o for _, o, _ in RENAMED_CASES])
def test_an_old_name_in_a_config_names_the_new_one(experiment, override, message):
    assert config_error(f"experiment={experiment}", override).startswith(message)


def test_the_data_takes_the_models_max_len(monkeypatch):
    """The training window and the caption length are ``data.max_len``, as the model's table."""
    for experiment in (GPT, "clip_pairs"):
        assert "data" in checked_nodes(composed(f"experiment={experiment}", "data.max_len=16"), monkeypatch)


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
    optim = {"optimizer": {"_target_": "torch.optim.AdamW", "_partial_": True}, "weight_decay": 0.1}
    config = {
        "model": {"_target_": task, "net": old_net, **optim},  # before model.optim (issue 58)
        "data": {
            "_target_": "attnlab.data.TextDataModule",
            "corpus": "pydoc",
            "block_size": 16,
            "val_fraction": 0.1,
        },
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
    notices = [r.getMessage() for r in caplog.records if "older attnlab" in r.getMessage()]
    assert len(notices) == 1 and "model.net.n_head" not in notices[0], notices
    assert dict(run.config.model.net) == {"_target_": old_net["_target_"], **new_kwargs}
    assert run.config.data.max_len == 16 and run.config.data.source.val_size == 0.1  # the data's too
    assert "weight_decay" not in run.config.model and instantiate(run.config.model.optim).weight_decay == 0.1
    net = run.net()
    ids = torch.randint(1, 11, (2, 7))
    same = (lambda m: m(ids)) if kind == "gpt" else (lambda m: m(ids, ids))
    torch.testing.assert_close(same(net), same(trained))


def test_an_old_config_is_read_the_new_way_with_one_notice(caplog):
    """``read_saved`` (attnlab-eval, attnlab-compare): modules, moved and renamed keys, one walk."""
    from attnlab.core.legacy import read_saved

    old = {
        "model": {
            "_target_": "attnlab.tasks.LanguageModelTask",
            "net": {"_target_": "attnlab.models.GPT", "vocab_size": 11, "n_embd": 24},
            "weight_decay": 0.1,
        },
        "data": {"_target_": "attnlab.data.TextDataModule", "corpus": "pydoc", "val_fraction": 0.1},
    }
    with caplog.at_level("WARNING"):
        cfg = read_saved(old, "old/config.yaml")
    assert len([r for r in caplog.records if "older attnlab" in r.getMessage()]) == 1
    assert cfg.model._target_ == "attnlab.training.LanguageModelTask" and cfg.model.net.dim == 24
    assert cfg.model.optim == {"_target_": "attnlab.training.optim.Optimization", "weight_decay": 0.1}
    assert cfg.data.source == {"_target_": "attnlab.data.sources.Builtin", "name": "pydoc", "val_size": 0.1}
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert read_saved(cfg, "new/config.yaml") == cfg  # a new config: as it is, no notice
    assert not caplog.records


# ---- through the CLI: exit status 2, one `error:` line, no traceback ------------------------------


@pytest.mark.parametrize(
    "override,message",
    [
        # one of each kind (the messages themselves are tested in-process above): a type checked
        # before anything is built, and a range the optimizer checks while it is built
        (
            "model.optim.optimizer.lr=abc",
            "error: model.optim.optimizer.lr='abc': must be a valid number (torch.optim.AdamW)",
        ),
        ("model.optim.optimizer.lr=-1", "error: model.optim.optimizer: Invalid learning rate: -1"),
        # an old hyper-parameter name: without ``+`` Hydra would refuse the key as missing,
        # saying nothing of the new name
        ("model.net.n_embd=64", "error: model.net.n_embd was renamed model.net.dim"),
        ("+model.net.n_layer=2", "error: model.net.n_layer was renamed model.net.depth"),
        ("model.pretrained_ckpt=x.ckpt", "error: model.pretrained_ckpt was renamed model.init_from"),
        ("data.block_size=32", "error: data.block_size was renamed data.max_len"),
        ("model.optimizer.lr=1e-3", "error: model.optimizer.lr was renamed model.optim.optimizer.lr"),
        ("model.compile=true", "error: model.compile was renamed model.optim.compile"),
    ],
)
def test_cli_bad_value_exits_2_with_one_line(tmp_path, override, message):
    proc = run_cli("train", tiny(override, "logger=csv"), tmp_path)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    errors = [line for line in text.splitlines() if "error: " in line]
    assert len(errors) == 1 and message in errors[0], text[-3000:]


# ---- a nested net's refusal names its full key (issue 58) -----------------------------------------


def replaced(args: list[str], *overrides: str) -> list[str]:
    """``args`` with ``overrides`` in place of the entries for the same keys."""
    keys = {o.split("=", 1)[0] for o in overrides}
    return [a for a in args if a.split("=", 1)[0] not in keys] + list(overrides)


def one_error_line(status: int, out: str) -> str:
    assert status == 2 and "Traceback" not in out, out[-3000:]
    errors = [line for line in out.splitlines() if "error: " in line]
    assert len(errors) == 1, out[-3000:]
    return errors[0].split("error: ", 1)[1]


@pytest.mark.parametrize(
    "value,message",
    [
        ("0", "model.net.image.dim=0: must be greater than 0 (attnlab.models.VisionTransformer)"),
        ("abc", "model.net.image.dim='abc': must be a valid integer (attnlab.models.VisionTransformer)"),
    ],
)
def test_a_bad_value_in_clips_image_tower_names_its_full_key(tmp_path, value, message):
    args = ["experiment=clip_fashion_mnist", f"model.net.image.dim={value}", f"paths.root_dir={tmp_path}"]
    assert one_error_line(*run_main("train", [*args, *QUIET])) == message


def test_a_rule_tying_two_values_of_clips_image_tower_names_its_full_key(tmp_path):
    """``dim`` not divisible by ``n_head``: refused by the constructor, as a plain ValueError
    naming its argument, which the entry point names by the tower's key."""
    from conftest import clip_overrides

    args = replaced(
        clip_overrides("clip_fashion_mnist", tmp_path), "model.net.image.dim=18", "model.net.image.n_head=4"
    )
    out = run_main("train", ["experiment=clip_fashion_mnist", *args, f"paths.root_dir={tmp_path}", *QUIET])
    assert one_error_line(*out) == "model.net.image.dim: must be divisible by n_head (4), got 18"


def test_a_refusal_inside_flamingos_language_model_names_its_full_key(tmp_path):
    """Flamingo builds its GPT from a partial (``model.net.lm``): a value refused at composition
    and a rule refused by the GPT's constructor both name ``model.net.lm``."""
    from conftest import flamingo_overrides

    base = ["experiment=flamingo_scenes", f"paths.root_dir={tmp_path}", *QUIET]
    out = run_main("train", [*base, "model.net.lm.depth=0"])
    assert one_error_line(*out) == "model.net.lm.depth=0: must be greater than 0 (attnlab.models.GPT)"
    args = replaced(
        flamingo_overrides("flamingo_scenes", tmp_path), "model.net.lm.dim=18", "model.net.lm.n_head=4"
    )
    out = run_main("train", [*base, *args])
    assert one_error_line(*out) == "model.net.lm.dim: must be divisible by n_head (4), got 18"


def test_a_constructors_refusal_names_the_node_hydra_was_building():
    """``refusal``: Hydra's ``full_key`` (from the root, or relative to a node without a parent)
    and the argument the message starts with; a message naming no argument names the node."""
    from hydra.utils import instantiate

    from attnlab.core.config import refusal

    image = {"_target_": "attnlab.models.VisionTransformer", "img_size": 8, "in_chans": 1, "num_classes": 0}
    cfg = OmegaConf.create({"model": {"net": {"image": {**image, "dim": 18, "n_head": 4}}}})
    for node, key in ((cfg.model, "model"), (OmegaConf.create({"image": cfg.model.net.image}), "model.net")):
        with pytest.raises(Exception) as e:
            instantiate(node)
        assert str(refusal(e.value, key)) == "model.net.image.dim: must be divisible by n_head (4), got 18"
    cfg.model.net.image.update(dim=16, n_head=4, attn_impl="flex", attn_dropout=0.1)
    with pytest.raises(Exception) as e:
        instantiate(cfg.model)
    assert str(refusal(e.value, "model")).startswith(
        "model.net.image: attn_impl=flex has no attention dropout"
    )
    assert refusal(RuntimeError("a bug"), "model") is None


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


@pytest.mark.parametrize(
    "override,message",
    [
        ("data.val_size=3", "data.val_size: not a key of this config (did you mean data.source.val_size?)"),
        ("trainer.max_step=3", "trainer.max_step: not a key of this config (did you mean trainer.max_steps"),
        ("model.lora.r=0", "model.lora.r: model.lora is null here; give it whole: 'model.lora={r: ...}'"),
    ],
)
def test_a_key_the_config_lacks_is_one_line(tmp_path, override, message):
    """Hydra's own refusal is five lines and exit 1; attnlab-train's is one, exit 2."""
    status, out = run_main("train", [override, f"paths.root_dir={tmp_path}"])
    errors = [line for line in out.splitlines() if "error: " in line]
    assert status == 2 and len(errors) == 1 and f"error: {message}" in errors[0], out[-3000:]
    assert "not in struct" not in out, out[-3000:]
