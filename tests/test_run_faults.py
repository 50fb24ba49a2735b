"""Faults met while training or running inference, each one line and exit status 2 (issue 55):
an error raised in a loader worker, a folder named like an image, ``lengths=`` of the wrong
kind, non-finite weights and losses, a label given twice, and the folder of a refused run."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from attnlab.cli.common import user_error
from attnlab.core.errors import CheckpointError, ConfigError, DataError
from conftest import QUIET, run_main, write_image_folder
from test_debug_matrix import tiny_overrides


def assert_one_line(status: int, out: str, *needles: str) -> str:
    """Exit 2, no traceback, exactly one ``error:`` line, holding the needles; returns it."""
    assert status == 2, f"exit {status}\n{out[-3000:]}"
    assert "Traceback" not in out, out[-3000:]
    errors = [line for line in out.splitlines() if "error: " in line]
    assert len(errors) == 1, out[-3000:]
    for needle in needles:
        assert needle in errors[0], f"{needle!r} not in {errors[0]!r}"
    return errors[0]


# ---- errors from loader workers -------------------------------------------------------------------


def test_an_error_reraised_from_a_loader_worker_is_its_own_line():
    from torch._utils import ExceptionWrapper

    try:
        raise DataError("x.png: not a readable image (image file is truncated)")
    except DataError:
        wrapped = ExceptionWrapper(where="in DataLoader worker process 1")
    with pytest.raises(DataError) as info:
        wrapped.reraise()
    assert "Original Traceback" in str(info.value)  # what torch makes of it
    err = user_error(info.value)
    assert type(err) is DataError and str(err) == "x.png: not a readable image (image file is truncated)"
    plain = ConfigError("Caught nothing: a message of the user's own")  # left as it is
    assert user_error(plain) is plain


def test_a_truncated_image_in_an_image_folder_is_one_line_from_the_workers(tmp_path):
    from attnlab.data.sampling import carve
    from attnlab.data.vision.datasets import scan_image_folder

    root = write_image_folder(tmp_path / "imgs", per_class=8, test=False)
    found, _ = scan_image_folder(str(root))
    val = {found["train"][0][i] for i in carve(len(found["train"][0]), [2], 1337)[0]}
    bad = next(f for f in found["train"][0] if f not in val)  # drawn in training, by a worker
    bad.write_bytes(bad.read_bytes()[:60])
    tiny = tiny_overrides("vit_fashion_mnist", tmp_path)[1:]
    tiny = [o for o in tiny if not o.startswith("data.source.val_size")]
    status, out = run_main(
        "train",
        [
            "experiment=vit_fashion_mnist",
            "data=image_folder",
            f"data.source.path={root}",
            "data.img_size=16",
            "data.source.val_size=2",
            "data.num_workers=1",
            "data.normalize.mean=[0.5]",
            "data.normalize.std=[0.5]",
            f"paths.root_dir={tmp_path}",
            *QUIET,
            *tiny,
            "test=false",
        ],
    )
    assert_one_line(status, out, f"error: {bad}: not a readable image", "data.source.on_bad_record=skip")
    assert "worker process" not in out


def test_a_folder_named_like_an_image_is_not_an_image(tmp_path):
    from attnlab.data.vision.datasets import scan_image_folder

    root = write_image_folder(tmp_path / "imgs", per_class=2, test=False)
    (root / "train" / "cat" / "x.png").mkdir()
    found, classes = scan_image_folder(str(root))
    files, _ = found["train"]
    assert classes == ["cat", "dog"] and len(files) == 4 and all(f.is_file() for f in files)


def test_a_folder_named_like_an_image_is_not_predicted_on(tmp_path):
    """``image=<folder>`` of attnlab-predict and attnlab-zeroshot lists the same way."""
    from attnlab.inference.classification import image_files
    from conftest import blank_image

    (tmp_path / "x.png").mkdir()
    with pytest.raises(DataError, match="a folder without images"):
        image_files(tmp_path)
    shoe = blank_image(tmp_path / "shoe.png")
    assert image_files(tmp_path) == [shoe]


# ---- attnlab-eval lengths= -----------------------------------------------------------------------


def test_lengths_takes_a_list_or_one_number_and_refuses_the_rest():
    from attnlab.cli.eval import length_multiples

    assert length_multiples(None) == []
    assert length_multiples(3) == [3]  # lengths=3: one multiple
    assert length_multiples(OmegaConf.create({"x": [1, 2, 4]}).x) == [1, 2, 4]
    for bad in ("abc", 0, [1, -2], [], [1.5], True):
        with pytest.raises(
            ConfigError, match=r"lengths must be a list of positive integers.*lengths=\[1,2,4\]"
        ):
            length_multiples(bad)


def test_lengths_on_a_run_without_max_len_says_it_needs_a_language_model(tmp_path):
    from attnlab.cli.eval import test_at_lengths

    run = SimpleNamespace(path=tmp_path / "vit.ckpt")
    data = OmegaConf.create({"_target_": "attnlab.data.FashionMNISTDataModule", "batch_size": 8})
    with pytest.raises(
        ConfigError, match=r"lengths needs a language model: .*vit.ckpt's data .*no data.max_len"
    ):
        test_at_lengths(OmegaConf.create({}), run, data, tmp_path, [1, 2])


# ---- non-finite weights and losses -----------------------------------------------------------------


def test_non_finite_weights_from_init_from_are_refused(tmp_path, monkeypatch):
    from attnlab.weights.init import load_init

    net = nn.Linear(2, 2)
    state = {"net.weight": torch.full((2, 2), math.nan), "net.bias": torch.zeros(2)}
    torch.save({"state_dict": state}, tmp_path / "nan.ckpt")  # one of our runs' checkpoints
    with pytest.raises(CheckpointError, match=r"model.init_from=.*nan.ckpt: weight holds NaN or infinite"):
        load_init(net, str(tmp_path / "nan.ckpt"))

    def infinite(net: nn.Module, source: str) -> None:  # another library's saved model
        with torch.no_grad():
            net.bias[1] = math.inf

    monkeypatch.setattr("attnlab.weights.init.load_pretrained", infinite)
    (tmp_path / "hf").mkdir()
    with pytest.raises(CheckpointError, match=r"model.init_from=.*hf: bias holds NaN or infinite"):
        load_init(nn.Linear(2, 2), str(tmp_path / "hf"))


def test_a_nan_training_loss_stops_the_run_and_keeps_the_checkpoints_before(tmp_path, monkeypatch):
    from attnlab.training.language_model import LanguageModelTask

    step = LanguageModelTask.training_step

    def diverges(self, batch, batch_idx):  # the loss of the third step is NaN
        loss = step(self, batch, batch_idx)
        return loss * math.nan if self.global_step >= 2 else loss

    monkeypatch.setattr(LanguageModelTask, "training_step", diverges)
    status, out = run_main(
        "train",
        [
            "experiment=gpt_pydoc_char",
            *QUIET,
            *tiny_overrides("gpt_pydoc_char", tmp_path),
            f"paths.root_dir={tmp_path}",
            "trainer.max_steps=4",
            "trainer.val_check_interval=2",
            "task_name=nan",
        ],
    )
    assert_one_line(status, out, "train/loss is nan at step 3", "lower model.optim.optimizer.lr", "are kept")
    (last,) = tmp_path.glob("logs/nan/runs/*/checkpoints/last.ckpt")  # the run folder is kept
    ckpt = torch.load(last, weights_only=True)
    assert ckpt["global_step"] == 2
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values() if v.is_floating_point())


# ---- attnlab-zeroshot labels= ----------------------------------------------------------------------


def test_a_label_given_twice_is_refused():
    from attnlab.inference.zeroshot import parse_labels

    assert parse_labels("t-shirt, sneaker") == ["t-shirt", "sneaker"]
    with pytest.raises(ConfigError, match="labels: 'a' given more than once"):
        parse_labels("a,b, a")


# ---- the folder of a refused run ----------------------------------------------------------------------


def test_a_refused_run_leaves_no_run_folder(tmp_path):
    status, out = run_main(
        "train",
        [
            "experiment=vit_fashion_mnist",
            f"paths.root_dir={tmp_path}",
            *QUIET,
            *tiny_overrides("vit_fashion_mnist", tmp_path),
            "model.net.mlp_ratio=0",
            "task_name=refused",
        ],
    )
    assert_one_line(status, out, "model.net.mlp_ratio=0: must be greater than 0")
    assert (tmp_path / "logs" / "refused" / "runs").is_dir()
    assert not list((tmp_path / "logs" / "refused" / "runs").iterdir())


def test_only_a_run_folder_inside_the_log_folder_is_ever_discarded(tmp_path):
    from attnlab.cli.common import own_run_folder

    def paths(output_dir: Path) -> object:
        return OmegaConf.create({"paths": {"log_dir": str(tmp_path / "logs"), "output_dir": str(output_dir)}})

    inside = tmp_path / "logs" / "t" / "runs" / "1"
    assert own_run_folder(paths(inside)) == inside
    assert own_run_folder(paths(tmp_path)) is None  # hydra.run.dir=.: the user's own folder
    assert own_run_folder(paths(tmp_path / "logs")) is None


def test_on_an_accelerator_the_loss_is_read_at_the_logging_interval_and_before_a_checkpoint():
    from attnlab.training.callbacks import FiniteLoss

    class Deferred(FiniteLoss):  # as on a GPU: the bad step kept on the device, read later
        def read_every_step(self, loss: torch.Tensor) -> bool:
            return False

    callback = Deferred()
    strategy = SimpleNamespace(reduce_boolean_decision=lambda decision, all: decision)
    trainer = SimpleNamespace(global_step=0, log_every_n_steps=50, strategy=strategy)
    for step, loss in [(1, 2.0), (2, math.inf), (3, math.nan), (4, 1.5)]:
        trainer.global_step = step
        callback.on_train_batch_end(trainer, None, {"loss": torch.tensor(loss)}, None, step - 1)
    callback.on_train_batch_end(trainer, None, {}, None, 4)  # a step the task skipped
    with pytest.raises(ConfigError, match="train/loss is inf at step 2: the training diverged"):
        callback.on_save_checkpoint(trainer, None, {})
    with pytest.raises(ConfigError, match="at step 2"):
        callback.on_validation_start(trainer, None)
    trainer.global_step = 50  # the logging interval
    with pytest.raises(ConfigError, match="at step 2"):
        callback.on_train_batch_end(trainer, None, {"loss": torch.tensor(1.0)}, None, 49)
    fine = Deferred()
    fine.on_train_batch_end(trainer, None, {"loss": torch.tensor(1.0)}, None, 49)
    fine.on_save_checkpoint(trainer, None, {})


@pytest.mark.parametrize(
    ("left", "removed"), [(None, True), ("csv/metrics.csv", False), ("checkpoints/last.ckpt", False)]
)
def test_a_refused_run_folder_is_removed_only_when_it_holds_no_result(tmp_path, left, removed):
    from attnlab.cli.common import exit_on_user_error

    run = tmp_path / "logs" / "t" / "runs" / "1"
    for name in (".hydra/config.yaml", "t.log", "config.yaml", "machine.yaml", "run.yaml"):
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text("x")
    (run / "csv" / "x3").mkdir(parents=True)  # an empty folder a logger made
    (run / "csv" / "hparams.yaml").write_text("x")  # what a logger records before the first step
    if left:
        (run / left).parent.mkdir(parents=True, exist_ok=True)
        (run / left).write_text("results")
    with pytest.raises(SystemExit) as info, exit_on_user_error(discard=run, console=True):
        raise ConfigError("refused")
    assert info.value.code == 2 and run.exists() != removed


def test_an_undecodable_image_is_named_without_pil_s_in_memory_file():
    """PIL names an image decoded from bytes by its ``<_io.BytesIO object at 0x...>``: left out."""
    from attnlab.data.vision.shards import decode_image

    with pytest.raises(DataError) as info:
        decode_image(b"hello", "train/dog/fake.jpg", None)
    assert str(info.value) == "train/dog/fake.jpg: not a readable image (cannot identify image file)"
