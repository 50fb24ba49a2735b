"""Resolution change through the timm format: a ViT trained on Fashion-MNIST at 28 pixels
(vit_fashion_mnist with the patch stem, 7x7 patches of 4), exported as timm saves a model, then
started from at 32 pixels with ``model.init_from`` (position embeddings resampled 7x7 -> 8x8 by
timm's ``resample_abs_pos_embed``) and fine-tuned briefly. Prints the test accuracy of the source
at 28, of the resampled weights at 32 before any fine-tuning, and after the fine-tune.

Goal: after the short fine-tune, the source's accuracy within noise (a few tenths of a point).

    uv run python benchmarks/resolution_change.py --data-dir ../shared/data/fashion_mnist
    uv run python benchmarks/resolution_change.py --steps 200 --finetune-steps 50 \
        model.optim.compile=false model.net.depth=2 data.batch_size=32  # a smoke run: any override, both
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from hydra.utils import instantiate

from attnlab.cli.common import compose_train
from attnlab.cli.train import train
from attnlab.inference.runs import TrainedRun
from attnlab.weights.pretrained import export_pretrained, load_pretrained

QUIET = [
    "extras.print_config=false",
    "~callbacks.rich_progress_bar",
    "~callbacks.model_summary",
    "trainer.enable_progress_bar=false",
    "logger=csv",
]


def run(root: Path, name: str, overrides: list[str]) -> tuple[dict[str, float], Path]:
    """``attnlab-train`` in this process; its final metrics and its output folder."""
    out = root / name
    cfg = compose_train(
        [f"task_name={name}", f"paths.root_dir={root}", f"paths.output_dir={out}", *QUIET, *overrides]
    )
    return train(cfg), out


@torch.no_grad()
def test_accuracy(net: torch.nn.Module, overrides: list[str]) -> float:
    """``net``'s test accuracy on the data ``overrides`` configure (its own statistics)."""
    data = instantiate(compose_train(overrides).data)
    data.prepare_data()
    data.setup("test")
    hits = total = 0
    for images, labels in data.test_dataloader():
        hits += (net(data.normalize(images)).argmax(-1) == labels).sum().item()
        total += len(labels)
    return hits / total


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data-dir", default="../shared/data/fashion_mnist")
    parser.add_argument("--steps", type=int, default=6000, help="training steps of the source at 28")
    parser.add_argument("--finetune-steps", type=int, default=500, help="fine-tuning steps at 32")
    parser.add_argument("--out", default=None, help="where runs go (default: a temporary folder)")
    parser.add_argument("overrides", nargs="*", help="attnlab-train overrides for both runs")
    args = parser.parse_args()
    root = Path(args.out or tempfile.mkdtemp(prefix="resolution_change_")).resolve()
    common = [
        "experiment=vit_fashion_mnist",
        f"data.source.data_dir={Path(args.data_dir).resolve()}",
        "model.net.stem=patch",
        *args.overrides,
    ]
    every = max(1, min(500, args.steps // 2))

    source, out = run(
        root,
        "source28",
        [*common, f"trainer.max_steps={args.steps}", f"trainer.val_check_interval={every}"],
    )
    print(f"source at 28 px ({args.steps} steps):              test acc {source['test/acc']:.4f}", flush=True)
    trained = TrainedRun(str(out / "checkpoints" / "last.ckpt"), root / "logs")
    export = export_pretrained(trained.net(), root / "timm_vit28", trained.artifacts)

    at32 = [*common, "data.img_size=32"]
    net = instantiate(compose_train(at32).model.net, num_classes=10, img_size=32, in_chans=1)
    before = test_accuracy(load_pretrained(net, export).eval(), at32)
    print(f"resampled to 32 px, not fine-tuned:            test acc {before:.4f}", flush=True)

    warmup = max(1, args.finetune_steps // 10)
    tuned, _ = run(
        root,
        "finetune32",
        [
            *at32,
            f"model.init_from={export}",
            f"trainer.max_steps={args.finetune_steps}",
            f"trainer.val_check_interval={max(1, args.finetune_steps // 2)}",
            "model.optim.optimizer.lr=3e-4",
            f"model.optim.scheduler.warmup_steps={warmup}",
            "callbacks.ema.multi_avg_fn.decay=0.99",
        ],
    )
    print(f"runs under {root}")
    print(f"fine-tuned at 32 px ({args.finetune_steps} steps): test acc {tuned['test/acc']:.4f}")


if __name__ == "__main__":
    main()
