"""A value of the wrong type or range anywhere in the config is one line naming the key, exit 2."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from attnlab.cli.common import config_dir
from attnlab.errors import ConfigError
from attnlab.tasks.optim import build_optimizers
from attnlab.tasks.schedules import warmup_cosine, warmup_inverse_sqrt
from attnlab.utils.config import check_config, describe, instantiate_trainer
from conftest import run_cli, tiny

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
    (GPT, "model.net.n_layer=2.5", "model.net.n_layer=2.5: expected an int (attnlab.models.GPT n_layer)"),
    (
        NMT,
        "model.net.n_enc_layers=2.5",
        "model.net.n_enc_layers=2.5: expected an int (attnlab.models.Transformer n_enc_layers)",
    ),
    (
        GPT,
        "model.net.block_size=abc",  # not data.block_size, which interpolates it
        "model.net.block_size='abc': expected an int (attnlab.models.GPT block_size)",
    ),
    (
        GPT,
        "model.scheduler.warmup_steps=abc",
        "model.scheduler.warmup_steps='abc': expected an int (attnlab.tasks.schedules.warmup_cosine",
    ),
    (
        NMT,
        "model.scheduler.warmup_steps=abc",
        "model.scheduler.warmup_steps='abc': expected an int (attnlab.tasks.schedules.warmup_cosine",
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
        "+model.net.n_layers=3",
        "model.net.n_layers=3: attnlab.models.GPT has no parameter 'n_layers' (did you mean n_layer?)",
    ),
    (
        NMT,
        "+model.net.n_layers=3",
        "model.net.n_layers=3: attnlab.models.Transformer has no parameter 'n_layers'",
    ),
    (GPT, "data.tokenizer=7", "data.tokenizer=7: expected a string (attnlab.data.TextDataModule tokenizer)"),
    (NMT, "data.corpus=7", "data.corpus=7: expected a string (attnlab.data.TranslationDataModule corpus)"),
    (GPT, "model.net.attn_impl=fast", "model.net.attn_impl='fast': expected one of 'auto', 'sdpa', 'math'"),
    (GPT, "model.optimizer.betas=[0.9,x]", "model.optimizer.betas=[0.9, 'x']: expected a list of 2 floats"),
    (NMT, "model.weight_decay=x", "model.weight_decay='x': expected a float (attnlab.tasks.TranslationTask"),
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


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_shipped_experiments_pass(experiment):
    cfg = composed(f"experiment={experiment}")
    net = cfg.model.net  # BERT: the encoder's vocabulary; CLIP: the text tower's
    net = net.encoder if "encoder" in net else net.text if "text" in net else net
    filled_by_data = "vocab_size" if "vocab_size" in net.keys() else "num_classes"
    assert cfg.trainer.precision == "auto" and net._get_node(filled_by_data)._is_missing()
    check_config(cfg)


@pytest.mark.parametrize(
    "overrides",
    [
        ("trainer=ddp_cpu", "logger=many", "debug=overfit"),
        ("trainer=gpu", "callbacks=translation", "debug=profiler"),
    ],
)
def test_shipped_group_options_pass(overrides):
    check_config(composed(*overrides))


def test_legal_values_pass():
    check_config(
        composed(
            "trainer.precision=32",
            "model.scheduler=null",
            "trainer.max_time=00:00:01:00",
            "model.optimizer.lr=1",
            "seed=7",
            "model.net.dropout=0",
        )
    )
    check_config(
        composed(
            "trainer.precision=bf16-mixed",
            "experiment=nmt_bahdanau_multi30k",
            "model.net.dropout=0",
            "+model.optimizer.eps=1e-6",
        )
    )


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
    warmup_cosine(opt, 0, 1, 0.0), warmup_cosine(opt, 5, 10, 1.0), warmup_inverse_sqrt(opt, 1)


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


# ---- through the CLI: exit status 2, one `error:` line, no traceback ------------------------------


@pytest.mark.parametrize(
    "override,message",
    [
        # one of each kind (the messages themselves are tested in-process above): a type checked
        # before anything is built, and a range the optimizer checks while it is built
        ("model.optimizer.lr=abc", "error: model.optimizer.lr='abc': expected a float (torch.optim.AdamW"),
        ("model.optimizer.lr=-1", "error: model.optimizer: Invalid learning rate: -1"),
    ],
)
def test_cli_bad_value_exits_2_with_one_line(tmp_path, override, message):
    proc = run_cli("train", tiny(override, "logger=csv"), tmp_path)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    errors = [line for line in text.splitlines() if "error: " in line]
    assert len(errors) == 1 and message in errors[0], text[-3000:]
