"""Any timm model as a network on the platform: ``model/net=timm`` with ``name=resnet18``."""

from __future__ import annotations

import copy
from typing import Any

import timm
import torch
from timm.layers import Attention
from timm.models.vision_transformer import VisionTransformer
from torch import Tensor, nn

from attnlab.core.specs import NonNegativeInt, PositiveInt
from attnlab.models.vision.vit import grid_centres
from attnlab.nn import health
from attnlab.nn.flops import Flops, Grad


class TimmModel(nn.Module):
    """``timm.create_model(name)`` with the data's classes, channels and (where the model takes
    one) image size, randomly initialised; ``kwargs``: the timm model's further arguments."""

    def __init__(
        self,
        name: str,
        num_classes: NonNegativeInt,
        img_size: PositiveInt,
        in_chans: PositiveInt,
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if not timm.is_model(name):
            close = timm.list_models(f"*{name}*")[:5]
            hint = f" (close: {', '.join(close)})" if close else " (timm.list_models() lists them)"
            raise ValueError(f"name: {name!r} is not a timm model{hint}")
        self.name, self.num_classes, self.img_size, self.in_chans = name, num_classes, img_size, in_chans
        self._flops: dict[tuple, Flops] = {}  # measured per input shape (``flops``)
        args = {"num_classes": num_classes, "in_chans": in_chans, **(kwargs or {})}
        try:
            try:
                self.model = timm.create_model(name, pretrained=False, img_size=img_size, **args)
            except TypeError as e:  # convnets take any image size and have no img_size argument
                if "img_size" not in str(e):
                    raise
                self.model = timm.create_model(name, pretrained=False, **args)
        except TypeError as e:
            raise ValueError(f"kwargs: timm model {name!r} refused them: {e}") from e
        self.probe()
        for m in self.model.modules():  # timm's ViT attention, recorded (``attnlab.nn.health``)
            if isinstance(m, Attention):
                m.register_forward_hook(record_attention)
        if isinstance(self.model, VisionTransformer):  # its patches' centres, in pixels
            gh, gw = self.model.patch_embed.grid_size
            centres = grid_centres(gh, gw, img_size / gh, self.model.num_prefix_tokens)
            health.give_positions(self.model.blocks, centres)

    @torch.no_grad()
    def probe(self) -> None:
        """One image through the net at build time: a net whose downsampling leaves nothing of the
        data's image size fails here in one line, not at the first (compiled) training step."""
        training = self.model.training
        self.model.eval()  # batch norm takes a batch of one
        try:
            self.model(torch.zeros(1, self.in_chans, self.img_size, self.img_size))
        except RuntimeError as e:
            reason = str(e).splitlines()[0]
            raise ValueError(
                f"name: {self.name!r} cannot take {self.img_size}x{self.img_size} images "
                f"({reason}): raise the data's img_size or choose another model"
            ) from e
        finally:
            self.model.train(training)

    @property
    def num_features(self) -> int:
        """Width of ``forward_head(x, pre_logits=True)``."""
        return getattr(self.model, "head_hidden_size", None) or self.model.num_features

    def no_weight_decay(self) -> set[str]:
        declared = getattr(self.model, "no_weight_decay", None)
        return {f"model.{n}" for n in declared()} if callable(declared) else set()

    def forward_features(self, images: Tensor) -> Tensor:
        return self.model.forward_features(images)

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        return self.model.forward_head(x, pre_logits=pre_logits)

    def forward(self, images: Tensor) -> Tensor:
        return self.model(images)

    def flops(self, images: Tensor, grad: Grad = "all", head: bool = True) -> Flops:
        """Model FLOPs of a training step on ``images`` (B, C, H, W), measured on a meta-device copy
        once per input shape (timm has too many architectures to count by hand)."""
        key = (tuple(images.shape), grad, head)
        if key not in self._flops:
            self._flops[key] = measure_on_meta(self, images.shape, grad, head)
        return self._flops[key]


def record_attention(module: Attention, args: tuple[Tensor, ...], output: Tensor) -> None:
    """A forward hook on timm's ``Attention``: while attention is recorded, the weights of the
    first rows as timm's math path computes them (the output, from whichever kernel, stays)."""
    if health.is_recording():
        _record(module, args[0][: health.rows()])


@torch.compiler.disable
def _record(module: Attention, x: Tensor) -> None:
    b, t, _ = x.shape
    q, k, _ = module.qkv(x).reshape(b, t, 3, module.num_heads, module.head_dim).permute(2, 0, 3, 1, 4)
    scores = (module.q_norm(q) * module.scale) @ module.k_norm(k).transpose(-2, -1)
    health.record(module, scores.softmax(-1))


def measure_on_meta(net: TimmModel, shape: torch.Size, grad: Grad, head: bool) -> Flops:
    """``TimmModel.flops``: a forward (and backward unless ``grad="none"``) of a meta copy of ``net``."""
    from torch.utils.flop_counter import FlopCounterMode

    trained = grad == "all"
    memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), trained) for p in net.parameters()}
    memo |= {id(b): torch.empty_like(b, device="meta") for b in net.buffers()}
    meta = copy.deepcopy(net, memo)
    images = torch.empty(shape, device="meta", requires_grad=grad == "input")
    counter = FlopCounterMode(display=False)
    with counter, torch.set_grad_enabled(grad != "none"):
        out = meta(images) if head else meta.forward_head(meta.forward_features(images), pre_logits=True)
        forward = counter.get_total_flops()
        if grad != "none":
            out.float().sum().backward()
    return Flops(forward, counter.get_total_flops() - forward)
