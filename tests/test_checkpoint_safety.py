"""No checkpoint runs code: a planted sharded-checkpoint folder (``meta.pt`` beside a ``.metadata``
whose pickle calls ``os.system``) and a planted single-file checkpoint are refused with one line,
exit status 2, by every entry point that reads a checkpoint.

The entry points run in this process (their console-script ``main()`` with ``sys.argv`` set, as the
installed ``attnlab-*`` scripts call them), so the ten of them cost one interpreter start.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from attnlab.core.errors import CheckpointError
from attnlab.weights.checkpoint import load_checkpoint
from conftest import blank_image, run_main, write_idx_dataset, write_sst2

MARKER = "pwned"


class Payload:
    """What an attacker pickles: unpickling it runs a shell command that leaves a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def plant_folder(folder: Path, marker: Path) -> Path:
    """A 'sharded checkpoint' as the loaders recognise one, whose metadata pickle runs code."""
    folder.mkdir(parents=True)
    torch.save({}, folder / "meta.pt")
    (folder / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    return folder


def plant_file(path: Path, marker: Path) -> Path:
    """A single-file checkpoint with the payload beside a state dict."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": {}, "attnlab": Payload(marker)}, path)
    return path


@pytest.fixture
def planted(tmp_path: Path) -> dict[str, Path]:
    marker = tmp_path / MARKER
    return {"folder": plant_folder(tmp_path / "e", marker), "file": plant_file(tmp_path / "e.ckpt", marker)}


def entry_points(tmp: Path, ckpt: str) -> dict[str, tuple[str, list[str]]]:
    """Every way a user hands a checkpoint to attnlab."""
    idx = write_idx_dataset(tmp / "idx")
    image = blank_image(tmp / "shoe.png")
    return {
        "train ckpt_path": ("train", [f"ckpt_path={ckpt}"]),
        "DeiT teacher": (
            "train",
            [
                "experiment=deit_fashion_mnist",
                f"data.source.data_dir={idx}",
                "data.source.val_size=10",
                "model.distillation.teacher.run=null",
                f"+model.distillation.teacher.ckpt_path={ckpt}",
            ],
        ),
        "fine-tuning": (
            "train",
            [
                "experiment=bert_finetune_sst2",
                f"data.source.data_dir={write_sst2(tmp / 'sst2')}",
                f"model.init_from={ckpt}",
            ],
        ),
        "eval": ("eval", [f"ckpt_path={ckpt}"]),
        "generate": ("generate", [f"ckpt_path={ckpt}", "prompt=a"]),
        "translate": ("translate", [f"ckpt_path={ckpt}", "text=Hallo"]),
        "predict": ("predict", [f"ckpt_path={ckpt}", f"image={image}"]),
        "fill-mask": ("fill-mask", [f"ckpt_path={ckpt}", "text=a [MASK] ."]),
        "classify": ("classify", [f"ckpt_path={ckpt}", "text=good"]),
        "zeroshot": ("zeroshot", [f"ckpt_path={ckpt}", f"image={image}", "labels=a,b"]),
    }


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_every_entry_point_refuses_a_planted_checkpoint(kind, planted, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name, (module, argv) in entry_points(tmp_path, str(planted[kind])).items():
        status, out = run_main(module, argv)
        assert not (tmp_path / MARKER).exists(), f"{name}: the planted {kind} ran code"
        assert status == 2, f"{name}: exit {status}\n{out[-3000:]}"
        assert "Traceback" not in out and str(planted[kind]) in out, f"{name}:\n{out[-3000:]}"


def test_ckpt_path_last_refuses_a_planted_folder_under_logs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "logs/gpt_pydoc_char/runs/x"
    plant_folder(run / "checkpoints/last.ckpt", tmp_path / MARKER)
    # a planted run folder can claim any task: attnlab-generate takes the newest language-model run
    (run / "config.yaml").write_text("model:\n  _target_: attnlab.training.LanguageModelTask\n")
    for module in ("train", "eval", "generate"):
        status, out = run_main(module, ["ckpt_path=last"])
        assert not (tmp_path / MARKER).exists(), f"{module} ckpt_path=last ran code"
        assert status == 2 and "not allowed in checkpoint metadata" in out, f"{module}:\n{out[-3000:]}"


def test_a_real_sharded_checkpoint_still_loads(tmp_path):
    """The restricted reader takes what torch.distributed.checkpoint writes (weights, optimizer
    state, plain values) and Lightning's meta.pt."""
    state = {
        "state_dict": {"net.w": torch.randn(3, 4), "net.b": torch.zeros(4, dtype=torch.bfloat16)},
        "optimizer_states": [
            {
                "state": {0: {"step": torch.tensor(3.0)}},
                "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0]}],
            }
        ],
    }
    with pytest.warns(UserWarning):  # no process group: torch warns it saves as one process
        dcp.save(state, checkpoint_id=tmp_path / "last.ckpt", no_dist=True)
    torch.save({"global_step": 7, "attnlab": {"config": "x"}}, tmp_path / "last.ckpt" / "meta.pt")
    ckpt = load_checkpoint(tmp_path / "last.ckpt")
    assert torch.equal(ckpt["state_dict"]["net.w"], state["state_dict"]["net.w"])
    assert ckpt["state_dict"]["net.b"].dtype == torch.bfloat16
    assert ckpt["optimizer_states"][0]["param_groups"][0]["betas"] == (0.9, 0.95)
    assert ckpt["global_step"] == 7


def test_a_code_running_value_inside_a_shard_is_refused(tmp_path):
    """torch's planner unpickles a shard's non-tensor values with weights_only=False."""
    with pytest.warns(UserWarning):
        dcp.save(
            {"state_dict": {"w": torch.ones(2)}, "hook": Payload(tmp_path / MARKER)},
            checkpoint_id=tmp_path / "c",
            no_dist=True,
        )
    torch.save({}, tmp_path / "c" / "meta.pt")
    with pytest.raises(CheckpointError, match="corrupt or not a PyTorch checkpoint"):
        load_checkpoint(tmp_path / "c")
    assert not (tmp_path / MARKER).exists()


def test_a_metadata_pointing_outside_its_folder_is_refused(tmp_path):
    with pytest.warns(UserWarning):
        dcp.save({"state_dict": {"w": torch.ones(2)}}, checkpoint_id=tmp_path / "c", no_dist=True)
    torch.save({}, tmp_path / "c" / "meta.pt")
    meta = (tmp_path / "c" / ".metadata").read_bytes().replace(b"__0_0.distcp", b"../_0.distcp")
    (tmp_path / "c" / ".metadata").write_bytes(meta)
    with pytest.raises(CheckpointError, match="outside the folder"):
        load_checkpoint(tmp_path / "c")


def test_an_empty_checkpoint_file_says_so(tmp_path):
    (tmp_path / "zero.ckpt").touch()
    with pytest.raises(CheckpointError, match=r"zero.ckpt is empty \(0 bytes\)"):
        load_checkpoint(tmp_path / "zero.ckpt")


# ---- a checkpoint's own config names the code ---------------------------------------------------

# what a planted config may name, each passing Hydra's own blocklist: a pickle beside the checkpoint
# loaded with weights_only=False, a file written or copied anywhere
ATTACKS = {
    "torch.load": lambda tmp: {
        "_target_": "torch.load",
        "f": str(tmp / "payload.pkl"),
        "weights_only": False,
    },
    "builtins.open": lambda tmp: {"_target_": "builtins.open", "file": str(tmp / MARKER), "mode": "w"},
    "shutil.copy": lambda tmp: {
        "_target_": "shutil.copy",
        "src": str(tmp / "payload.pkl"),
        "dst": str(tmp / MARKER),
    },
    # the same function reached through an attnlab module's import of torch
    "attnlab.weights.checkpoint.torch.load": lambda tmp: {
        "_target_": "attnlab.weights.checkpoint.torch.load",
        "f": str(tmp / "payload.pkl"),
        "weights_only": False,
    },
}

# the task each inference entry point serves: the planted run claims it, so it gets past the check
# of the recorded task to where the net would be built
TASK_OF = {
    "eval": "LanguageModelTask",
    "export": "LanguageModelTask",
    "generate": "LanguageModelTask",
    "translate": "TranslationTask",
    "predict": "ImageClassificationTask",
    "fill-mask": "MaskedLMTask",
    "classify": "TextClassificationTask",
    "caption": "CaptioningTask",
    "zeroshot": "ContrastiveTask",
}


def plant_config_checkpoint(path: Path, task: str, attack: dict) -> Path:
    """A checkpoint that loads safely (plain tensors and strings) but whose saved config builds
    ``attack`` as the net's dropout: Hydra would call it while rebuilding the net."""
    import yaml

    config = {
        "model": {
            "_target_": f"attnlab.training.{task}",
            "net": {"_target_": "attnlab.models.GPT", "vocab_size": 8, "dropout": attack},
        },
        "data": {"_target_": "attnlab.data.TextDataModule"},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": {}, "attnlab": {"config": yaml.safe_dump(config), "artifacts": {}}}, path)
    return path


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_no_entry_point_builds_what_a_checkpoint_config_names(attack, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "payload.pkl").write_bytes(pickle.dumps(Payload(tmp_path / MARKER)))
    image = blank_image(tmp_path / "shoe.png")
    extra = {
        "generate": ["prompt=a"],
        "translate": ["text=Hallo"],
        "predict": [f"image={image}"],
        "fill-mask": ["text=a [MASK] ."],
        "classify": ["text=good"],
        "caption": [f"image={image}"],
        "zeroshot": [f"image={image}", "labels=a,b"],
        "export": [f"out={tmp_path / 'exported'}"],
    }
    for module, task in TASK_OF.items():
        ckpt = plant_config_checkpoint(
            tmp_path / module / "run/checkpoints/last.ckpt", task, ATTACKS[attack](tmp_path)
        )
        status, out = run_main(module, [f"ckpt_path={ckpt}", *extra.get(module, [])])
        assert not (tmp_path / MARKER).exists(), f"{module}: the planted {attack} ran"
        assert status == 2, f"{module}: exit {status}\n{out[-3000:]}"
        line = f"model.net.dropout._target_='{attack}' in {ckpt} is not allowed"
        assert line in out and "Traceback" not in out, f"{module}:\n{out[-3000:]}"
    assert not (tmp_path / "exported").exists()


def test_a_deit_teacher_is_not_built_from_what_its_config_names(tmp_path, monkeypatch):
    from attnlab.core.errors import ConfigError
    from attnlab.training.distillation import load_teacher

    (tmp_path / "payload.pkl").write_bytes(pickle.dumps(Payload(tmp_path / MARKER)))
    ckpt = plant_config_checkpoint(
        tmp_path / "t.ckpt", "ImageClassificationTask", ATTACKS["torch.load"](tmp_path)
    )
    with pytest.raises(
        ConfigError, match=r"model\.net\.dropout\._target_='torch.load' in .*t.ckpt is not allowed"
    ):
        load_teacher(ckpt_path=str(ckpt), log_dir=str(tmp_path))
    assert not (tmp_path / MARKER).exists()


def test_every_recipe_target_is_allowed():
    """The allow-list takes every ``_target_`` the shipped configs name, so a checkpoint of any
    recipe (and a sweep over it) rebuilds; a new config naming something else fails here first."""
    import yaml

    from attnlab.core.targets import is_allowed, targets

    conf = Path(__file__).resolve().parents[1] / "conf"
    found = {
        t
        for path in conf.rglob("*.yaml")
        for _, t in targets(yaml.safe_load(path.read_text(encoding="utf-8")) or {}, "")
        if isinstance(t, str)
    }
    assert len(found) > 40
    assert not [t for t in sorted(found) if not is_allowed(t)]


def test_the_allow_list_refuses_code_by_any_name():
    from attnlab.core.targets import is_allowed

    refused = [
        "os.system",
        "subprocess.run",
        "numpy.save",
        "torch.serialization.load",
        "torch.nn.modules.module.torch.load",  # torch.nn's own import of torch
        "attnlab.data.text.shards.SplitWriter",  # an attnlab class that writes files, not a net
        "attnlab.weights.checkpoint.Path",  # a class imported into an attnlab module
        "hydra.utils.instantiate",
        "lightning.pytorch.Trainer.fit",
    ]
    assert [t for t in refused if is_allowed(t)] == []
    assert all(
        map(is_allowed, ["torch.optim.AdamW", "timm.layers.Mlp", "torch.nn.GELU", "attnlab.models.GPT"])
    )


def test_a_sweep_folder_whose_overrides_name_code_is_refused(tmp_path, monkeypatch):
    """``attnlab-sweep resume=`` builds trials from the overrides the sweep folder saved."""
    from omegaconf import OmegaConf

    monkeypatch.chdir(tmp_path)
    (tmp_path / "payload.pkl").write_bytes(pickle.dumps(Payload(tmp_path / MARKER)))
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    attack = f"model.net.dropout={{_target_:torch.load,f:'{tmp_path / 'payload.pkl'}',weights_only:false}}"
    OmegaConf.save({"overrides": ["hparams_search=gpt_optuna", attack]}, sweep / "sweep.yaml")
    status, out = run_main("sweep", [f"resume={sweep}"])
    assert not (tmp_path / MARKER).exists()
    assert (
        status == 2
        and f"model.net.dropout._target_='torch.load' in {sweep / 'sweep.yaml'} is not allowed" in out
    ), out
    assert "Traceback" not in out
