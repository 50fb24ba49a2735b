"""DeiT's hard-label distillation (Touvron et al. 2021) and the teachers it learns from."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.core.errors import CheckpointError, ConfigError
from attnlab.core.run_paths import find_last
from attnlab.core.specs import DropRate
from attnlab.models.contracts import DistillationHeads
from attnlab.weights.checkpoint import require_task
from attnlab.weights.hf_files import read_weights

log = logging.getLogger(__name__)


class HardDistillation:
    """DeiT's hard distillation: loss = (1 - alpha) CE(class logits, labels) + alpha CE(distillation logits,
    argmax teacher(x)); the ``teacher`` is frozen and not saved with the student."""

    def __init__(self, teacher: nn.Module, alpha: DropRate = 0.5) -> None:
        self.teacher = teacher.eval().requires_grad_(False)
        self.alpha = alpha

    def check_student(self, student: nn.Module) -> None:
        """The teacher must see the same images and predict the same classes as the student."""
        if not isinstance(student, DistillationHeads):
            raise ConfigError(
                "model.distillation needs a student with a distillation token "
                f"(attnlab.models.DistilledVisionTransformer), got {type(student).__name__}"
            )
        fields = ("num_classes", "in_chans", "img_size")
        theirs = [getattr(self.teacher, f, None) for f in fields]
        ours = [getattr(student, f) for f in fields]
        if theirs[2] is None:  # a convnet from timm weights takes any image size
            theirs[2] = ours[2]
        if theirs != ours:
            raise ConfigError(
                f"model.distillation.teacher predicts {theirs[0]} classes of {theirs[1]}x{theirs[2]}"
                f"x{theirs[2]} images, the student {ours[0]} classes of {ours[1]}x{ours[2]}x{ours[2]}; "
                "train the teacher on the same data and image size"
            )

    def loss(
        self,
        cls_logits: Tensor,
        dist_logits: Tensor,
        targets: Tensor,
        images: Tensor,
        label_smoothing: float = 0.0,
    ) -> Tensor:
        """``targets``: class ids (B,) or mixed label distributions (B, K) after mixup."""
        base = F.cross_entropy(cls_logits.float(), targets, label_smoothing=label_smoothing)
        with torch.no_grad():
            teacher_labels = self.teacher(images).argmax(-1)
        distilled = F.cross_entropy(dist_logits.float(), teacher_labels)
        return (1 - self.alpha) * base + self.alpha * distilled


def load_teacher(
    run: str | None = None,
    ckpt_path: str | None = None,
    timm_name: str | None = None,
    weights: str | None = None,
    log_dir: str = "logs",
) -> nn.Module:
    """A frozen classifier to distil from: the newest ``run`` of an attnlab task, a ``ckpt_path``, or a timm
    ``timm_name`` with ``weights`` (its classes and input size the student's data's)."""
    if sum(x is not None for x in (run, ckpt_path, timm_name)) != 1:
        raise ConfigError("model.distillation.teacher: set exactly one of run, ckpt_path and timm_name")
    if timm_name is not None:
        return timm_teacher(timm_name, weights)
    from attnlab.inference.runs import TrainedRun

    if run is not None:
        try:
            ckpt_path = str(find_last(Path(log_dir), f"{run}/runs/*/checkpoints/last.ckpt"))
        except CheckpointError:
            raise ConfigError(
                f"model.distillation.teacher.run={run}: no checkpoint of a run of that task under "
                f"{log_dir}; train the teacher first"
            ) from None
    trained = TrainedRun(str(ckpt_path), Path(log_dir))
    need = "model.distillation.teacher needs an image classifier"
    require_task(trained.meta, trained.path, ("ImageClassificationTask",), need)
    net = trained.net()  # an image classifier's: it has num_classes
    log.info("teacher from %s: %s, %d classes", ckpt_path, type(net).__name__, net.num_classes)
    return net


def timm_teacher(timm_name: str, weights: str | None) -> nn.Module:
    """A timm classifier with the trained ``weights`` (a state dict file), its classes and input
    channels read off them."""
    from attnlab.models.vision.timm_model import TimmModel

    if weights is None:
        raise ConfigError(
            "model.distillation.teacher.weights: a timm teacher needs trained weights "
            "(a random one teaches nothing); give a .pth or .safetensors file"
        )
    if not Path(weights).is_file():
        raise ConfigError(f"model.distillation.teacher.weights={weights}: no such file")
    state = read_weights(Path(weights), key="model.distillation.teacher.weights")
    heads = [v for k, v in state.items() if k.endswith(("fc.weight", "head.weight", "classifier.weight"))]
    first = next((v for v in state.values() if v.dim() == 4), None)
    if not heads or first is None:
        raise ConfigError(
            f"model.distillation.teacher.weights={weights}: no classifier head or first "
            "convolution found in it"
        )
    # convnets take any image size; TimmModel needs one only for models with position tables
    model = TimmModel(timm_name, num_classes=heads[-1].size(0), img_size=224, in_chans=first.size(1))
    try:
        model.model.load_state_dict(state)
    except RuntimeError as e:
        raise ConfigError(
            f"model.distillation.teacher.weights={weights} does not fit timm's {timm_name}: "
            f"{str(e).splitlines()[0]}"
        ) from None
    model.img_size = None  # any size goes through a convnet
    return model.eval()
