"""The GPU paths CI never runs: every experiment's fast configuration under ``trainer=gpu`` in
bf16-mixed and in 16-mixed (fp16 with a gradient scaler: what ``precision: auto`` picks on GPUs
without bf16), one experiment per architecture compiled, and FSDP (``trainer=fsdp``) on the GPUs
there are. Skipped without CUDA; on a GPU machine run them alone (2 min 14 s on one H100):

    bash scripts/gpu_check.sh
"""

from __future__ import annotations

import logging

import pytest
import torch

from conftest import QUIET, run_main
from test_debug_matrix import EXPERIMENTS, tiny_overrides
from test_scaleout import ARCHS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh)"),
]
FAST = ["trainer.fast_dev_run=true", "trainer.val_check_interval=1", "trainer.check_val_every_n_epoch=null"]


def train_on_gpu(experiment: str, tmp_path, *overrides: str) -> None:
    logging.getLogger("lightning").setLevel(logging.WARNING)
    argv = [
        f"experiment={experiment}",
        *tiny_overrides(experiment, tmp_path),
        *FAST,
        *QUIET,
        f"paths.root_dir={tmp_path}",
        f"paths.output_dir={tmp_path / 'run'}",
        *overrides,
    ]
    status, out = run_main("train", argv)
    assert status == 0, out[-3000:]
    assert "test/" in out or list((tmp_path / "run").rglob("metrics.csv")), out[-3000:]


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_trains_on_a_gpu(experiment, precision, tmp_path):
    if precision == "bf16-mixed" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    train_on_gpu(experiment, tmp_path, "trainer=gpu", f"trainer.precision={precision}")


@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_architecture_trains_compiled_on_a_gpu(arch, tmp_path):
    experiment = ARCHS[arch][0]
    train_on_gpu(experiment, tmp_path, "trainer=gpu", "model.optim.compile=true")


@pytest.mark.parametrize("arch", ["gpt", "deit", "bert"])
def test_fsdp_trains_on_a_gpu(arch, tmp_path):
    """FSDP1 (``trainer=fsdp``) in one process, through its sharded clipping
    (``attnlab.training.optim.clip_gradients``). More GPUs: ``scripts/torchrun.sh``, as a user would;
    in this process Lightning would start the other ranks by re-running pytest."""
    ema = ["~callbacks.ema"] if arch == "deit" else []  # weight averaging is refused under FSDP
    train_on_gpu(ARCHS[arch][0], tmp_path, "trainer=fsdp", "trainer.devices=1", *ema)
