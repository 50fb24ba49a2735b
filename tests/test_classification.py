"""Image classification end to end: the loss, DeiT distillation, training, prediction, bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from attnlab.core.errors import ConfigError
from attnlab.models import DistilledVisionTransformer, SwinTransformer, VisionTransformer
from attnlab.training.distillation import HardDistillation
from conftest import (
    QUIET,
    VISION_NETS,
    assert_ok,
    assert_user_error,
    needs_shared,
    read_metrics,
    run_cli,
    run_dirs,
    run_main,
    spec_refusal,
    write_idx,
    write_idx_dataset,
    write_image_folder,
)

SMALL = dict(num_classes=10, img_size=28, in_chans=1, patch_size=7, dim=32, depth=2, n_head=2)

# a ViT small enough for a few CPU steps on 16x16 ImageFolder pictures
TINY_VISION = [
    "experiment=vit_fashion_mnist",
    "data=image_folder",
    "data.source.val_size=4",
    "data.batch_size=8",
    "model.net.patch_size=4",
    *VISION_NETS["vit"],
    "model.plot_images=2",
    "trainer.max_steps=6",
    "trainer.val_check_interval=3",
    "trainer.log_every_n_steps=1",
    "logger=csv",
    "extras.print_config=false",
    "~callbacks.rich_progress_bar",
    "~callbacks.model_summary",
]


class FixedTeacher(torch.nn.Module):
    num_classes, in_chans, img_size = 10, 1, 28

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.logits


def test_distillation_loss_learns_the_teachers_argmax():
    torch.manual_seed(0)
    teacher_logits = torch.randn(4, 10)
    distill = HardDistillation(FixedTeacher(teacher_logits), alpha=0.3)
    cls, dist, labels = torch.randn(4, 10), torch.randn(4, 10), torch.tensor([1, 2, 3, 4])
    expected = 0.7 * F.cross_entropy(cls, labels) + 0.3 * F.cross_entropy(dist, teacher_logits.argmax(-1))
    torch.testing.assert_close(distill.loss(cls, dist, labels, torch.zeros(4, 1, 28, 28)), expected)
    # not the labels, not the teacher's probabilities: its hard decision
    wrong = 0.7 * F.cross_entropy(cls, labels) + 0.3 * F.cross_entropy(dist, labels)
    assert not torch.allclose(distill.loss(cls, dist, labels, torch.zeros(4, 1, 28, 28)), wrong)


def test_teacher_of_other_classes_or_size_and_students_without_a_token_are_refused():
    student = DistilledVisionTransformer(**SMALL)
    HardDistillation(FixedTeacher(torch.zeros(1, 10))).check_student(student)
    other = FixedTeacher(torch.zeros(1, 7))
    other.num_classes = 7
    with pytest.raises(ConfigError, match="teacher predicts 7 classes of 1x28x28 images, the student 10"):
        HardDistillation(other).check_student(student)
    bigger = FixedTeacher(torch.zeros(1, 10))
    bigger.img_size = 32
    with pytest.raises(ConfigError, match="1x32x32"):
        HardDistillation(bigger).check_student(student)
    with pytest.raises(ConfigError, match="needs a student with a distillation token"):
        HardDistillation(FixedTeacher(torch.zeros(1, 10))).check_student(VisionTransformer(**SMALL))


@pytest.mark.parametrize("kind", ["vit", "deit", "swin"])
def test_loss_falls_on_a_real_batch(kind):
    from attnlab.data.vision.datasets import load_idx_dataset

    splits = load_idx_dataset("fashion_mnist", str(needs_shared("fashion_mnist")), "data")
    x = (splits.train_images[:64].float() / 255 - 0.286) / 0.353
    y = splits.train_labels[:64]
    torch.manual_seed(0)
    if kind == "swin":
        x = F.interpolate(x, size=32, mode="bilinear")
        net = SwinTransformer(
            10, 32, 1, patch_size=4, dim=32, depths=(2, 2), n_head=(2, 4), window_size=4, drop_path=0.0
        )
    else:
        net = (DistilledVisionTransformer if kind == "deit" else VisionTransformer)(**SMALL)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0], losses[::8]


def write_quadrant_idx(folder, n_train: int = 240, n_test: int = 40):
    """Fashion-MNIST's IDX files holding 4 classes of 28x28 noise with one bright quadrant, the
    class: every image equally bright, so only where the light is tells them apart."""
    import numpy as np

    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = (np.arange(n) % 4).astype(np.uint8)
        images = rng.integers(0, 80, (n, 28, 28)).astype(np.uint8)
        for image, y in zip(images, labels, strict=True):
            row, col = divmod(int(y), 2)
            image[14 * row : 14 * row + 14, 14 * col : 14 * col + 14] += 150
        write_idx(folder / f"{prefix}-images-idx3-ubyte.gz", images)
        write_idx(folder / f"{prefix}-labels-idx1-ubyte.gz", labels)
    return folder


def test_a_tiny_vit_run_learns_generated_images(tmp_path):
    """Convergence without the shared data: attnlab-train's ViT recipe (conv stem, EMA of the
    weights validated and tested), cut to a one-block ViT and 40 steps, learns which quadrant is
    bright: from guessing (1 in 4) to (nearly) every validation and test image."""
    data = write_quadrant_idx(tmp_path / "quadrants")
    status, out = run_main(
        "train",
        [
            "experiment=vit_fashion_mnist",
            "task_name=quadrants",
            f"paths.root_dir={tmp_path}",
            *QUIET,
            f"data.source.data_dir={data}",
            "data.source.val_size=40",
            "data.batch_size=32",
            "data.crop_padding=0",  # no augmentation: a flip moves the bright quadrant, the class
            "data.hflip=0.0",
            *VISION_NETS["vit"],
            "model.net.drop_path=0.0",
            "model.plot_images=0",
            "model.optim.optimizer.lr=1e-2",
            "model.optim.scheduler.warmup_steps=5",
            "trainer.max_steps=40",
            "trainer.val_check_interval=10",
            "trainer.log_every_n_steps=5",
            "trainer.precision=32-true",
        ],
    )
    assert status == 0, out[-3000:]
    (run_dir,) = run_dirs(tmp_path, "quadrants")
    metrics = read_metrics(run_dir)
    losses = [v for _, v in metrics["train/loss"]]
    assert losses[-1] < 0.5 * losses[0], losses
    val = [v for _, v in metrics["val/acc"]]
    assert val[0] < 0.6 and val[-1] >= 0.9, val  # after 10 steps not yet, after 40 learnt
    assert metrics["test/acc"][-1][1] >= 0.9, metrics["test/acc"]


def test_train_then_predict_on_an_image_folder(tmp_path):
    data = write_image_folder(tmp_path / "pets", classes=("cat", "dog"))
    proc = run_cli("train", [*TINY_VISION, f"data.source.path={data}", "task_name=pets"], tmp_path)
    assert_ok(proc)
    (run_dir,) = run_dirs(tmp_path, "pets")
    metrics = read_metrics(run_dir)
    for key in ("train/loss", "val/acc", "val/acc_top5", "val/acc_best", "test/acc", "test/acc_class/cat"):
        assert key in metrics, sorted(metrics)
    assert (run_dir / "confusion_matrix.csv").read_text().splitlines()[0] == "true\\predicted,cat,dog"
    assert sorted(p.name for p in (run_dir / "attention").glob("*.png")) == [
        "step000003.png",
        "step000006.png",
    ]

    gray = tmp_path / "gray.png"  # the model takes RGB: converted, and said so
    Image.open(next((data / "test" / "dog").glob("*.png"))).convert("L").save(gray)
    proc = run_cli("predict", ["ckpt_path=last", f"image={gray}"], tmp_path)
    assert_ok(proc)
    assert "converted" in proc.stderr and "predicting" not in proc.stderr  # one image: no bar
    line = proc.stdout.strip()
    assert line.startswith(f"{gray}: ") and {"cat", "dog"} <= set(line.replace(",", " ").split())
    probs = [float(t) for t in line.split(": ", 1)[1].replace(",", " ").split() if t[0].isdigit()]
    assert len(probs) == 2 and abs(sum(probs) - 1) < 1e-3  # top_k 5 clipped to the 2 classes
    proc = run_cli("predict", ["ckpt_path=last", f"image={data / 'test' / 'cat'}", "top_k=1"], tmp_path)
    assert_ok(proc)
    lines = proc.stdout.splitlines()  # a folder: one line per image on stdout, progress on stderr
    assert len(lines) == 12 and all(line.startswith(str(data / "test" / "cat")) for line in lines)
    assert "predicting" in proc.stderr and "12/12" in proc.stderr
    (tmp_path / "notes.png").write_text("not an image")
    assert_user_error(
        run_cli("predict", ["ckpt_path=last", f"image={tmp_path / 'notes.png'}"], tmp_path),
        "notes.png: not a readable image",
    )


def train_here(tmp_path, task_name: str, *overrides: str) -> dict[str, float]:
    """``attnlab-train`` in this process (no interpreter start-up), writing under tmp_path/logs."""
    from hydra import compose, initialize_config_dir

    from attnlab.cli.common import config_dir
    from attnlab.cli.train import train

    out = tmp_path / "logs" / task_name / "runs" / str(len(run_dirs(tmp_path, task_name)))
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[
                f"task_name={task_name}",
                f"paths.root_dir={tmp_path}",
                f"paths.output_dir={out}",
                "trainer.enable_progress_bar=false",
                *overrides,
            ],
        )
    return train(cfg)


def assert_refused(match: str, fn, *args) -> None:
    """``fn(*args)`` fails with an input error (Hydra may wrap it) whose message matches."""
    import re

    from attnlab.cli.common import user_error

    with pytest.raises(Exception) as info:
        fn(*args)
    err = user_error(info.value)
    assert err is not None and re.search(match, str(err)), info.value


def without_net_sizes(args: list[str]) -> list[str]:
    return [a for a in args if not a.startswith("model.net.")]


def test_deit_distils_from_the_newest_teacher_run_and_refuses_a_mismatched_one(tmp_path, monkeypatch):
    from attnlab.training.distillation import load_teacher

    monkeypatch.chdir(tmp_path)
    data = write_image_folder(tmp_path / "pets", classes=("cat", "dog"))
    three = write_image_folder(tmp_path / "three", classes=("a", "b", "c"))
    # fp32: under bf16-mixed timm's test_resnet turns the loss NaN by step 2 on these flat images,
    # which now stops the run (it used to train on NaN unnoticed)
    teacher = [
        "model/net=timm",
        "model.net.name=test_resnet",
        "model.plot_images=0",
        "trainer.precision=32-true",
    ]
    # two runs of the teacher task: an older one of 3 classes, then a newer one of the student's 2
    # (timm's net takes none of the ViT's size keys)
    for folder in (three, data):
        train_here(
            tmp_path,
            "teacher",
            *without_net_sizes(TINY_VISION),
            *teacher,
            f"data.source.path={folder}",
            "trainer.max_steps=3",
            "test=false",
        )
    older, newer = (run / "checkpoints" / "last.ckpt" for run in run_dirs(tmp_path, "teacher"))
    assert older.stat().st_mtime < newer.stat().st_mtime
    assert load_teacher(run="teacher", log_dir=str(tmp_path / "logs")).num_classes == 2
    deit = [
        "model/net=deit_mini",
        "+model.distillation._target_=attnlab.training.distillation.HardDistillation",
        "+model.distillation.teacher._target_=attnlab.training.distillation.load_teacher",
        "+model.distillation.teacher.run=teacher",
        f"+model.distillation.teacher.log_dir={tmp_path / 'logs'}",
        *VISION_NETS["vit"],  # again after model/net=deit_mini, which resets the sizes
    ]
    # the 3-class teacher would be refused: training at all means the newest was taken
    metrics = train_here(tmp_path, "student", *TINY_VISION, *deit, f"data.source.path={data}")
    assert "test/acc" in metrics
    proc = run_cli("eval", ["ckpt_path=last"], tmp_path)  # the newest run: the student, without its teacher
    assert_ok(proc)
    (result,) = (tmp_path / "logs" / "eval" / "runs").glob("*/metrics.json")
    assert "student" in result.read_text() and '"test/acc"' in result.read_text()
    assert_refused(
        "teacher predicts 2 classes of 3x16x16 images, the student 3 classes",
        train_here,
        tmp_path,
        "student3",
        *TINY_VISION,
        *deit,
        f"data.source.path={three}",
    )


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["model.net.patch_size=5"], r"^model.net.img_size: must be divisible by patch_size \(5\), got 16$"),
        (
            ["model/net=swin_mini", "model.net.dim=12", "model.net.window_size=3"],
            r"^model.net.window_size: must divide the feature map of stage 1 \(4x4 tokens\), got 3",
        ),
    ],
)
def test_bad_model_sizes_are_one_line_errors(tmp_path, monkeypatch, overrides, needle):
    """In-process: the message; the CLI's exit status 2 for any such error is tested in test_cli."""
    monkeypatch.chdir(tmp_path)
    data = write_image_folder(tmp_path / "pets", per_class=3)
    base = without_net_sizes(TINY_VISION) if "model/net=swin_mini" in overrides else TINY_VISION
    assert_refused(
        needle,
        train_here,
        tmp_path,
        "bad",
        *base,
        f"data.source.path={data}",
        "data.source.val_size=2",
        *overrides,
    )


def test_timm_teacher_from_a_weights_file(tmp_path):
    import timm

    from attnlab.training.distillation import load_teacher

    reference = timm.create_model("test_resnet", num_classes=10, in_chans=1).eval()
    torch.save(reference.state_dict(), tmp_path / "teacher.pth")
    teacher = load_teacher(timm_name="test_resnet", weights=str(tmp_path / "teacher.pth"))
    assert (teacher.num_classes, teacher.in_chans) == (10, 1)
    x = torch.randn(2, 1, 28, 28)
    torch.testing.assert_close(teacher(x), reference(x))
    HardDistillation(teacher).check_student(DistilledVisionTransformer(**SMALL))  # a convnet takes any size
    with pytest.raises(ConfigError, match="needs trained weights"):
        load_teacher(timm_name="test_resnet")
    with pytest.raises(ConfigError, match="exactly one of run, ckpt_path and timm_name"):
        load_teacher(run="a", timm_name="test_resnet")


def test_corrupt_idx_file_is_a_one_line_error(tmp_path):
    folder = write_idx_dataset(tmp_path / "fm")
    path = folder / "train-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:100])
    args = ["experiment=vit_fashion_mnist", f"data.source.data_dir={folder}", "logger=csv"]
    assert_user_error(run_cli("train", args, tmp_path), "train-images-idx3-ubyte.gz: cannot be read as gzip")


def test_ema_warm_up_follows_the_weights_early_and_settles_at_the_decay():
    from torch.optim.swa_utils import AveragedModel

    from attnlab.training.callbacks import ema_with_warmup

    net = torch.nn.BatchNorm1d(1)  # a float weight and an integer buffer (num_batches_tracked)
    average = AveragedModel(net, multi_avg_fn=ema_with_warmup(0.998), use_buffers=True)
    average.update_parameters(net)  # the first update copies
    with torch.no_grad():
        net.weight.fill_(0.0)
    average.update_parameters(net)  # n = 1: decay 2/11, not 0.998
    torch.testing.assert_close(average.module.weight, torch.tensor([2 / 11]))
    for _ in range(5000):
        average.update_parameters(net)
    update = ema_with_warmup(0.998)
    a, c = [torch.ones(1)], [torch.zeros(1)]
    update(a, c, torch.tensor(5000))  # late: the configured decay
    torch.testing.assert_close(a[0], torch.tensor([0.998]))
    assert average.module.weight.abs().item() < 1e-3
    # a decay out of [0, 1] is refused by its spec when the config is checked, before training
    refusal = spec_refusal("attnlab.training.callbacks.ema_with_warmup", decay=1.5)
    assert refusal.startswith("model.net.decay=1.5: "), refusal
