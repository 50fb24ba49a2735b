"""Training images/s of our ViT, DeiT and Swin against timm's models of the same configuration,
side by side in one run, in fp32 and (where the CPU multiplies bf16 natively, or with --bf16)
under bf16 autocast; and how fast the Fashion-MNIST loader feeds augmented batches.

The configurations are the Fashion-MNIST experiments' nets, composed from conf/ (model/net/vit_mini,
deit_mini, swin_mini), with timm's linear patch embedding (the experiments' convolutional stem has
no timm counterpart): forward, cross-entropy, backward and a fused AdamW step on random images.
Goal: our models at least as fast as timm's (ratio >= 1.0).

Run it alone: a busy second core slows torch's two threads.

    uv run python benchmarks/vision_train.py [--data-dir ../shared/data/fashion_mnist]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext

import timm
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn

from attnlab.cli.common import compose_train
from attnlab.core.hardware import cpu_model, native_bf16_cpu


def experiment_net(experiment: str) -> DictConfig:
    """The net an experiment trains, composed as ``attnlab-train`` composes it."""
    return compose_train([f"experiment={experiment}"]).model.net


def pairs() -> list[tuple[str, int, Callable[[], nn.Module], Callable[[], nn.Module]]]:
    """(name, image size, our model, timm's model), 1 channel, 10 classes, no stochastic depth."""
    vit, deit, swin = (experiment_net(f"{name}_fashion_mnist") for name in ("vit", "deit", "swin"))
    data = dict(num_classes=10, in_chans=1)

    def ours(net: DictConfig, size: int) -> Callable[[], nn.Module]:
        return lambda: instantiate(net, img_size=size, stem="patch", drop_path=0.0, **data)

    def timm_vit(name: str, net: DictConfig) -> Callable[[], nn.Module]:
        return lambda: timm.create_model(
            name,
            img_size=28,
            patch_size=net.patch_size,
            embed_dim=net.dim,
            depth=net.depth,
            num_heads=net.n_head,
            mlp_ratio=net.mlp_ratio,
            **data,
        )

    def timm_swin() -> nn.Module:
        return timm.create_model(
            "swin_tiny_patch4_window7_224",
            img_size=32,
            patch_size=swin.patch_size,
            embed_dim=swin.dim,
            depths=tuple(swin.depths),
            num_heads=tuple(swin.n_head),
            window_size=swin.window_size,
            mlp_ratio=swin.mlp_ratio,
            drop_path_rate=0.0,
            **data,
        )

    return [
        ("ViT", 28, ours(vit, 28), timm_vit("vit_tiny_patch16_224", vit)),
        ("DeiT", 28, ours(deit, 28), timm_vit("deit_tiny_distilled_patch16_224", deit)),
        ("Swin", 32, ours(swin, 32), timm_swin),
    ]


def training_step(net: nn.Module, size: int, bf16: bool, batch: int) -> Callable[[], float]:
    """A closure that runs one training step of ``net`` on fixed random images, returning its seconds."""
    torch.manual_seed(0)
    net.train()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
    x, y = torch.randn(batch, 1, size, size), torch.randint(0, 10, (batch,))

    def step() -> float:
        t0 = time.perf_counter()
        with torch.autocast("cpu", torch.bfloat16) if bf16 else nullcontext():
            out = net(x)
        # timm's distilled ViT returns both heads' logits while training; ours averages in forward
        logits = (out[0] + out[1]) / 2 if isinstance(out, tuple) else out
        F.cross_entropy(logits.float(), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    return step


def paired_images_per_s(
    ours: nn.Module, theirs: nn.Module, size: int, bf16: bool, batch: int, steps: int
) -> tuple[float, float]:
    """Images/s of both models, their steps interleaved: a CPU whose speed drifts (another tenant,
    clocks) slows both alike, where timing one model after the other tilted ratios by 3-5%."""
    a, b = training_step(ours, size, bf16, batch), training_step(theirs, size, bf16, batch)
    for _ in range(3):  # warm-up: allocator, oneDNN primitive caches
        a(), b()
    ours_s, theirs_s = [], []
    for _ in range(steps):
        ours_s.append(a())
        theirs_s.append(b())
    return batch / statistics.median(ours_s), batch / statistics.median(theirs_s)


def loader_images_per_s(data_dir: str, batch: int, batches: int) -> float:
    from attnlab.data import ImageClassificationDataModule
    from attnlab.data.sources import Builtin

    dm = ImageClassificationDataModule(
        Builtin("fashion_mnist", data_dir),
        batch_size=batch,
        crop_padding=2,
        hflip=0.5,
        rand_augment="rand-m9-mstd0.5-inc1",
        random_erasing=0.25,
        mixup={"mixup_alpha": 0.8, "cutmix_alpha": 1.0},
    )
    dm.setup("fit")
    dm.trainer = type("Training", (), {"training": True})()
    it = iter(dm.train_dataloader())
    t0 = time.perf_counter()
    for _ in range(batches):
        dm.on_after_batch_transfer(next(it), 0)
    return batch * batches / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--data-dir", default=None, help="Fashion-MNIST IDX files, for the loader figure")
    p.add_argument(
        "--bf16", action="store_true", help="measure bf16 also on a CPU without native bf16 (it crawls)"
    )
    args = p.parse_args()
    precisions = [False]
    if args.bf16 or native_bf16_cpu():
        precisions.append(True)
    else:
        print(f"{cpu_model()} has no native bf16: fp32 only (--bf16 to measure it anyway)")
    torch.set_float32_matmul_precision("high")
    print(
        f"training images/s, batch {args.batch}, {args.steps} steps, {torch.get_num_threads()} threads, "
        f"{cpu_model()}"
    )
    print(f"{'model':<6} {'precision':<10} {'attnlab':>9} {'timm':>9} {'ratio':>7} {'goal':>6}")
    for name, size, ours, theirs in pairs():
        for bf16 in precisions:
            a, r = paired_images_per_s(ours(), theirs(), size, bf16, args.batch, args.steps)
            verdict = "ok" if a / r >= 1.0 else "MISSED"
            print(
                f"{name:<6} {'bf16-mixed' if bf16 else '32-true':<10} {a:9.0f} {r:9.0f} {a / r:7.2f} "
                f"{1.0:5.1f}x {verdict}"
            )
    if args.data_dir:
        rate = loader_images_per_s(args.data_dir, args.batch, 20)
        print(
            f"\nFashion-MNIST loader (crop, flip, RandAugment, erasing, mixup/cutmix): {rate:,.0f} images/s, "
            "in the training process (num_workers 0)"
        )


if __name__ == "__main__":
    main()
