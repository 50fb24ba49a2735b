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

from attnlab.errors import CheckpointError
from attnlab.utils.checkpoint import load_checkpoint
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
                f"data.data_dir={idx}",
                "data.val_size=10",
                "model.distillation.teacher.run=null",
                f"+model.distillation.teacher.ckpt_path={ckpt}",
            ],
        ),
        "fine-tuning": (
            "train",
            [
                "experiment=bert_finetune_sst2",
                f"data.data_dir={write_sst2(tmp / 'sst2')}",
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
    (run / "config.yaml").write_text("model:\n  _target_: attnlab.tasks.LanguageModelTask\n")
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
