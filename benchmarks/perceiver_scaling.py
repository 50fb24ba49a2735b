"""How the Perceiver's time per image grows with the number of pixels, beside ViT's.

The Perceiver of experiment=perceiver_fashion_mnist and the ViT of experiment=vit_fashion_mnist
(the reference, same patch size at every side) classify images of 28, 56 and 112 pixels a side
(4x and 16x the pixels of 28): the median time of a forward pass over a batch, per image, in
inference (no gradients). The Perceiver's cross-attention reads every pixel once from a fixed
number of latents, so its time should grow about linearly with the pixels (the growth exponent
``log(t / t_28) / log(pixels / 28^2)`` near 1); ViT's self-attention over (side / patch)^2 tokens
grows towards quadratically (exponent towards 2 once attention dominates the MLPs).

    uv run python benchmarks/perceiver_scaling.py
    uv run python benchmarks/perceiver_scaling.py --sides 28,56,112,224 --batch 16 --device cuda
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from hydra.utils import instantiate

from attnlab.cli.common import compose_train

NETS = {"perceiver": "perceiver_fashion_mnist", "vit": "vit_fashion_mnist"}  # name -> experiment


def build(experiment: str, side: int) -> torch.nn.Module:
    """The experiment's net for one-channel images of ``side`` pixels and 10 classes."""
    cfg = compose_train([f"experiment={experiment}"])
    return instantiate(cfg.model.net, num_classes=10, img_size=side, in_chans=1)


def ms_per_image(net: torch.nn.Module, side: int, batch: int, iters: int, device: str) -> float:
    """Median forward time over ``iters`` batches (after 2 warm-up ones), per image, in ms."""
    x = torch.randn(batch, 1, side, side, device=device)
    net = net.to(device).eval()
    times = []
    with torch.no_grad():
        for i in range(iters + 2):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
            net(x)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000 / batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sides", default="28,56,112", help="image sides, comma-separated; the first is the base"
    )
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    sides = [int(s) for s in args.sides.split(",")]
    torch.manual_seed(0)
    print(f"device {args.device}, batch {args.batch}, median of {args.iters}; forward ms per image")
    print(f"{'side':>5} {'pixels':>7} | " + " | ".join(f"{n:>9} {'x base':>7} {'exp':>5}" for n in NETS))
    base: dict[str, float] = {}
    for side in sides:
        cells = []
        for name, experiment in NETS.items():
            ms = ms_per_image(build(experiment, side), side, args.batch, args.iters, args.device)
            base.setdefault(name, ms)
            growth = ms / base[name]
            pixel_ratio = (side / sides[0]) ** 2
            exponent = math.log(growth) / math.log(pixel_ratio) if pixel_ratio > 1 else float("nan")
            cells.append(f"{ms:9.3f} {growth:7.2f} {exponent:5.2f}")
        print(f"{side:>5} {side * side:>7} | " + " | ".join(cells))
    print("exp: log(time / time at the first side) / log(pixels / its pixels); 1 = linear, 2 = quadratic")


if __name__ == "__main__":
    main()
