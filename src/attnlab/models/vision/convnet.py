"""A small VGG-style convnet for small images: DeiT's teacher on MNIST-sized data.

timm's ImageNet convnets shrink a 28x28 image to 1x1 before their last stage (a stride-4 stem, then
three more halvings); this one keeps full resolution in its first stage and halves twice, so the
teacher sees the image at the scale of the student's 4-pixel patches.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from attnlab.core.specs import DropRate, NonNegativeInt, PositiveInt
from attnlab.nn import Dropout, conv_bn_relu, flops
from attnlab.nn.flops import Flops, Grad


class ConvNet(nn.Module):
    """Stages of two 3x3 conv-BN-ReLU layers, 2x2 max-pooling between stages, global average
    pooling and a linear head.

    Args:
        num_classes, img_size, in_chans: from the data when left ``???``; ``num_classes=0``: no
            head (``forward`` returns the pooled features).
        widths: channels of each stage (each stage after the first halves the resolution).
        dropout: before the head.
    """

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

    def forward(self, images: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(images))

    def flops(self, images: Tensor, grad: Grad = "all", head: bool = True) -> Flops:
        """Model FLOPs of a training step on ``images`` (B, C, H, W) (``attnlab.nn.flops``): the
        convolutions (the first on the pixels: no input gradient) and the head unless
        ``head=False``. ``grad="none"``: forward only (DeiT's teacher, Flamingo's encoder)."""
        b = images.size(0)
        f, _ = flops.convs(self.stages, b, images.size(-1), grad)
        if head and isinstance(self.head, nn.Linear):
            f = f + flops.linear_layer(self.head, b, grad)
        return f
