"""A run resumed from a checkpoint part-way through an epoch ends exactly where the uninterrupted
run ends: the same batches, the same random draws (dropout, crops, mixup, masking), the same
averaged weights, and one CSV history.

Each family (and the ViT with RandAugment in two loader workers) trains its tiny configuration
for 60 steps, keeping every validation's checkpoint; a second run resumes from the one at step 15
(part-way through an epoch) and must log the same curves and test metrics as the first.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import QUIET, read_metrics, run_main
from test_debug_matrix import tiny_overrides

FAMILIES = [
    "gpt_pydoc_char",
    "vit_fashion_mnist",
    "clip_fashion_mnist",
    "bert_pretrain_sst2",
    "bert_finetune_sst2_scratch",
    "nmt_synthetic",
]


def train(experiment: str, tmp: Path, *extra: str, source: bool = True) -> Path:
    """``source=False``: without the tiny data's ``data.source`` and vocabulary (``extra`` names
    another source, shards that bring their own)."""
    own = ("data.source.", "data.vocab_size=")
    data = [o for o in tiny_overrides(experiment, tmp / "data") if source or not o.startswith(own)]
    status, out = run_main(
        "train",
        [
            f"experiment={experiment}",
            "task_name=resume",
            f"paths.root_dir={tmp}",
            *QUIET,
            *data,
            "trainer.max_steps=60",
            "trainer.val_check_interval=15",
            "trainer.check_val_every_n_epoch=null",
            "callbacks.model_checkpoint.save_top_k=-1",
            "callbacks.model_checkpoint.monitor=step",
            "callbacks.model_checkpoint.mode=max",
            "test=true",
            *extra,
        ],
    )
    assert status == 0, out[-3000:]
    return sorted((tmp / "logs" / "resume" / "runs").iterdir())[-1]


# per-image RandAugment in two loader workers: the draws are seeded per (epoch, image), not by
# how far each worker had got
WORKERS = ["data.rand_augment=rand-m9-mstd0.5-inc1", "data.num_workers=2"]


CASES = [*((e, []) for e in FAMILIES), ("vit_fashion_mnist", WORKERS)]


@pytest.mark.parametrize(("experiment", "extra"), CASES)
def test_resuming_mid_epoch_ends_where_the_uninterrupted_run_ends(experiment, extra, tmp_path):
    full = train(experiment, tmp_path, *extra)
    (mid,) = (full / "checkpoints").glob("step_000015.ckpt")
    resumed = train(experiment, tmp_path, *extra, f"ckpt_path={mid}")
    want, got = read_metrics(full), read_metrics(resumed)
    assert sorted(got) == sorted(want)
    for key in want:
        if key.startswith(("train/", "val/", "test/")) and not key.endswith("_step_time"):
            assert [s for s, _ in got[key]] == [s for s, _ in want[key]], key
            values = [v for _, v in want[key]]
            assert [v for _, v in got[key]] == pytest.approx(values, rel=1e-4, abs=1e-5), key
