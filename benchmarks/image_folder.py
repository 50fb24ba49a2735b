"""Images of any size from disk: does the lazy loader keep a ViT fed, from a folder and from tar shards?

Writes ``--count`` JPEGs of mixed sizes (sides 24-96 pixels, Fashion-MNIST images resized) as an
ImageFolder tree (``train/<class>/`` and a test split a tenth its size), then prints:

(a) the ``data=image_folder`` loader's images/s: ``--workers`` loader workers decoding each file,
    timm's random resized crop to 32 pixels, flip and RandAugment (``rand-m9-mstd0.5``), then
    normalisation, random erasing and mixup/cutmix on the batch, as training runs them;
(b) the training images/s of the vit_fashion_mnist net (model/net=vit_mini) at img_size 32 on this
    machine (forward, loss, backward, AdamW step on random images), and the ratio (a)/(b): above
    1.0 the loader keeps up;
(c) the same set written as tar shards (``attnlab-prepare --mode images``'s code; images/s written),
    and the ``data=image_shards`` loader's images/s;
(d) with ``--train-steps N``: the experiment trained N steps from the folder and from the shards
    (same seed), its test accuracy from each (they should agree within noise).

    uv run python benchmarks/image_folder.py [--count 20000] [--workers 2] [--train-steps 0]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]


def write_folder(root: Path, count: int, data_dir: str, seed: int = 0) -> None:
    """``count`` training and ``count // 10`` test JPEGs, each a Fashion-MNIST image resized to a
    random side of 24-96 pixels (its aspect changed a little), in ``root/<split>/<class>/``."""
    from attnlab.data.vision.datasets import load_idx_dataset

    data = load_idx_dataset("fashion_mnist", data_dir, "/tmp/attnlab-image-folder-cache")
    rng = np.random.default_rng(seed)
    for split, images, labels, n in (
        ("train", data.train_images, data.train_labels, count),
        ("test", data.test_images, data.test_labels, max(count // 10, 10)),
    ):
        for c in data.classes:
            (root / split / c.replace("/", "-")).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            k = i % len(labels)
            w, h = rng.integers(24, 97, 2)
            img = Image.fromarray(images[k, 0].numpy()).resize((int(w), int(h)), Image.BILINEAR)
            img.save(root / split / data.classes[labels[k]].replace("/", "-") / f"{i:06d}.jpg", quality=90)


def datamodule(source: str, path: Path, workers: int, batch: int, val_size: int):
    from attnlab.data import ImageFilesDataModule
    from attnlab.data.sources import Folder, StreamedShards

    dm = ImageFilesDataModule(
        Folder(str(path), val_size) if source == "folder" else StreamedShards(str(path)),
        img_size=32,
        in_chans=1,
        batch_size=batch,
        auto_augment="rand-m9-mstd0.5",
        random_erasing=0.25,
        mixup={"mixup_alpha": 0.8, "cutmix_alpha": 1.0},
        num_workers=workers,
    )
    dm.setup("fit")
    dm.trainer = None
    return dm


def loader_images_per_s(dm, batches: int) -> float:
    """Batches through the loader and the on-device batch transforms; the first (workers starting)
    not timed."""
    it = iter(dm.train_dataloader())
    dm.trainer = type("Training", (), {"training": True})()
    dm.on_after_batch_transfer(next(it), 0)
    t0 = time.perf_counter()
    n = 0
    for _ in range(batches):
        x, _ = dm.on_after_batch_transfer(next(it), 0)
        n += len(x)
    rate = n / (time.perf_counter() - t0)
    dm.trainer = None
    return rate


def vit_images_per_s(batch: int, steps: int) -> float:
    """Training images/s of the vit_fashion_mnist net at 32x32, one channel, fp32."""
    import torch.nn.functional as F
    from hydra.utils import instantiate

    from attnlab.cli.common import compose_train

    net_cfg = compose_train(["experiment=vit_fashion_mnist"]).model.net
    net = instantiate(net_cfg, img_size=32, in_chans=1, num_classes=10).train()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    x, y = torch.randn(batch, 1, 32, 32), torch.randint(0, 10, (batch,))
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        F.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:  # warm-up: allocator, oneDNN primitive caches
            times.append(time.perf_counter() - t0)
    return batch / statistics.median(times)


def train_accuracy(data: list[str], steps: int, out: Path) -> float:
    from attnlab.cli.common import compose_train
    from attnlab.cli.train import train

    cfg = compose_train(
        [
            "experiment=vit_fashion_mnist",
            *data,
            "data.img_size=32",
            "data.in_chans=1",
            "model.optim.compile=false",
            f"trainer.max_steps={steps}",
            f"trainer.val_check_interval={max(steps // 2, 1)}",
            "trainer.enable_progress_bar=false",
            "~callbacks.rich_progress_bar",
            "extras.print_config=false",
            "logger=csv",
            f"paths.output_dir={out}",
        ]
    )
    return train(cfg)["test/acc"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", type=int, default=20_000, help="training JPEGs to write")
    p.add_argument("--workers", type=int, default=2, help="loader workers")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--batches", type=int, default=30, help="batches timed per loader")
    p.add_argument("--steps", type=int, default=10, help="ViT training steps timed")
    p.add_argument("--train-steps", type=int, default=0, help="(d): steps of a folder vs shards training")
    p.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data" / "fashion_mnist"))
    p.add_argument("--workdir", default="/tmp/attnlab-image-folder")
    args = p.parse_args()
    from attnlab.core.hardware import cpu_model
    from attnlab.data.vision.shards import prepare_images

    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    folder, shards = work / "images", work / "shards"
    t0 = time.perf_counter()
    write_folder(folder, args.count, args.data_dir)
    print(
        f"wrote {args.count} + {max(args.count // 10, 10)} JPEGs (24-96 px) "
        f"in {time.perf_counter() - t0:.1f} s"
    )
    print(
        f"{cpu_model()}, {torch.get_num_threads()} torch threads, batch {args.batch}, {args.workers} workers"
    )
    val = min(1000, args.count // 10)
    batches = min(args.batches, max(1, (args.count - val) // args.batch - 2))

    folder_rate = loader_images_per_s(datamodule("folder", folder, args.workers, args.batch, val), batches)
    print(
        "(a) image_folder loader (decode, RandomResizedCrop 32, flip, RandAugment, erasing, mixup): "
        f"{folder_rate:,.0f} images/s"
    )
    vit_rate = vit_images_per_s(args.batch, args.steps)
    print(
        f"(b) vit_mini training at 32x32, fp32: {vit_rate:,.0f} images/s; "
        f"loader/training {folder_rate / vit_rate:.2f}x"
    )

    t0 = time.perf_counter()
    manifest = prepare_images(folder, shards, val_size=val)
    seconds = time.perf_counter() - t0
    n = sum(e["count"] for entries in manifest["splits"].values() for e in entries)
    shard_rate = loader_images_per_s(datamodule("shards", shards, args.workers, args.batch, val), batches)
    print(
        f"(c) tar shards written at {n / seconds:,.0f} images/s; "
        f"image_shards loader: {shard_rate:,.0f} images/s "
        f"({shard_rate / folder_rate:.2f}x the folder's; loader/training {shard_rate / vit_rate:.2f}x)"
    )
    if args.train_steps:
        folder_acc = train_accuracy(
            ["data=image_folder", f"data.source.path={folder}", f"data.source.val_size={val}"]
            + [f"data.num_workers={args.workers}"],
            args.train_steps,
            work / "run_folder",
        )
        shard_acc = train_accuracy(
            ["data=image_shards", f"data.source.path={shards}", f"data.num_workers={args.workers}"],
            args.train_steps,
            work / "run_shards",
        )
        print(
            f"(d) {args.train_steps} steps: test/acc {folder_acc:.4f} from the folder, "
            f"{shard_acc:.4f} from the shards"
        )


if __name__ == "__main__":
    sys.exit(main())
