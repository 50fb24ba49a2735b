"""A small VGG-style convnet, DeiT's teacher on MNIST-sized data: where timm's ImageNet convnets
shrink a 28x28 image to 1x1, it keeps full resolution in its first stage and halves twice, so the
teacher sees the image at the scale of the student's 4-pixel patches."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from attnlab.core.specs import DropRate, NonNegativeInt, PositiveInt
from attnlab.models.vision.vit import ImageClassifier
from attnlab.nn import Dropout, conv_bn_relu, flops
from attnlab.nn.flops import Flops, Grad


class ConvNet(ImageClassifier):
    """Stages (``widths``) of two 3x3 conv-BN-ReLU layers, 2x2 max-pooling between stages, global
    average pooling, dropout and a linear head (none if ``num_classes=0``)."""

    def __init__(
        self,
        num_classes: NonNegativeInt,
        img_size: PositiveInt,
        in_chans: PositiveInt,
        widths: Sequence[PositiveInt] = (32, 64, 128),
        dropout: DropRate = 0.1,
    ) -> None:
        super().__init__()
        self.num_classes, self.img_size, self.in_chans = num_classes, img_size, in_chans
        stages, chans = [], in_chans
        for i, width in enumerate(widths):
            pool = [nn.MaxPool2d(2)] if i > 0 else []
            stages.append(nn.Sequential(*pool, conv_bn_relu(chans, width), conv_bn_relu(width, width)))
            chans = width
        self.stages = nn.Sequential(*stages)
        self.head_drop = Dropout(dropout)
        self.num_features = chans  # what forward_head(pre_logits=True) returns, as in timm
        self.head = nn.Linear(chans, num_classes) if num_classes else nn.Identity()

    def forward_features(self, images: Tensor) -> Tensor:
        # channels-last is the layout oneDNN's CPU convolutions are fastest in
        x = images.contiguous(memory_format=torch.channels_last)
        return self.stages(x)  # (B, C, H / 2^(stages-1), W / 2^(stages-1))

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        x = self.head_drop(x.mean(dim=(2, 3)))  # (B, C)
        return x if pre_logits else self.head(x)

    def flops(self, images: Tensor, grad: Grad = "all", head: bool = True) -> Flops:
        """Model FLOPs of a training step on ``images`` (B, C, H, W) (``attnlab.nn.flops``)."""
        b = images.size(0)
        f, _ = flops.convs(self.stages, b, images.size(-1), grad)
        return f + self.head_flops(b, grad) if head else f
