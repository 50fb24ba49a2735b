"""Throughput, TFLOP/s and MFU in every run (``attnlab.training.callbacks.Throughput``), and the peaks MFU
is taken against (``attnlab.core.hardware``)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir

from attnlab.cli.common import config_dir
from attnlab.core.hardware import cpu_matmul_flops, gpu_peak_flops, peak_flops
from attnlab.training.callbacks import Throughput
from conftest import QUIET, VISION_NETS, assert_ok, run_cli, run_dirs, spec_refusal, tiny, write_image_folder


def throughput_columns(run: Path) -> dict[str, list[float]]:
    """The run's throughput columns in csv/metrics.csv, the rows that have them."""
    with open(run / "csv" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    names = [k for k in rows[0] if k.startswith("throughput/")]
    return {k: [float(r[k]) for r in rows if r[k]] for k in names}


def assert_logged(run: Path, items: str) -> None:
    columns = throughput_columns(run)
    assert set(columns) == {f"throughput/{items}_per_sec", "throughput/tflops_per_sec", "throughput/mfu"}
    for name, values in columns.items():
        assert values and all(math.isfinite(v) and v > 0 for v in values), (name, values)
    assert all(mfu < 1 for mfu in columns["throughput/mfu"])
    peak = yaml.safe_load((run / "machine.yaml").read_text())["peak_flops"]  # which peak MFU is of
    assert peak["tflops"] > 0 and "matmul measured" in peak["source"]


def test_a_text_run_logs_tokens_per_second_tflops_and_mfu(tmp_path, monkeypatch):
    """And waits for the device only at the logging steps (here every 5 of 20), the first step's
    end (where the clock starts) and before each validation."""
    waits = []
    monkeypatch.setattr(Throughput, "_sync", staticmethod(lambda module: waits.append(1)))
    args = tiny("trainer.log_every_n_steps=5", "logger=csv", "trainer.enable_progress_bar=false")
    proc = run_cli("train", [*args, "task_name=tput"], tmp_path)
    assert_ok(proc)
    (run,) = run_dirs(tmp_path, "tput")
    assert_logged(run, "tokens")
    assert len(throughput_columns(run)["throughput/mfu"]) == 4  # steps 5, 10, 15, 20
    assert len(waits) == 1 + 4 + 2  # the first step, 4 logging steps, 2 validations


def test_a_vision_run_logs_images_per_second_tflops_and_mfu(tmp_path):
    folder = write_image_folder(tmp_path / "pics", per_class=8)
    args = [
        "experiment=vit_fashion_mnist",
        "data=image_folder",
        f"data.source.path={folder}",
        "data.source.val_size=4",
        "data.batch_size=4",
        "model.net.patch_size=4",
        "model.plot_images=0",
        *VISION_NETS["vit"],
        "~callbacks.ema",
        "trainer.max_steps=6",
        "trainer.val_check_interval=6",
        "trainer.log_every_n_steps=2",
        "trainer.limit_test_batches=1",
        "task_name=tput_vit",
        *QUIET,
    ]
    proc = run_cli("train", args, tmp_path)
    assert_ok(proc)
    (run,) = run_dirs(tmp_path, "tput_vit")
    assert_logged(run, "images")


def test_every_experiment_runs_with_the_throughput_callback():
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        for path in sorted((Path(config_dir()) / "experiment").glob("*.yaml")):
            cfg = compose("train", overrides=[f"experiment={path.stem}"])
            assert cfg.callbacks.throughput._target_ == "attnlab.training.callbacks.Throughput", path.stem


def test_gpu_peaks_are_dense_datasheet_figures():
    bf16, fp32 = torch.bfloat16, torch.float32
    for name in ("NVIDIA H200", "NVIDIA H100 80GB HBM3"):
        assert gpu_peak_flops(name, bf16)[0] == pytest.approx(989.4e12)
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", bf16)[0] == pytest.approx(312e12)
    assert gpu_peak_flops("NVIDIA A10", bf16)[0] == pytest.approx(125e12)  # not the A100's, nor the A10G's
    assert gpu_peak_flops("Tesla V100-SXM2-16GB", bf16) == (
        None,
        "Tesla V100-SXM2-16GB: no bf16 figure (no bf16 tensor cores)",
    )
    precision = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")  # attnlab-train's: fp32 matmuls on TF32 tensor cores
        assert gpu_peak_flops("NVIDIA H100 80GB HBM3", fp32)[0] == pytest.approx(494.7e12)
        assert gpu_peak_flops("Tesla V100-SXM2-16GB", fp32)[0] == pytest.approx(15.7e12)  # no TF32
        torch.set_float32_matmul_precision("highest")
        assert gpu_peak_flops("NVIDIA H100 80GB HBM3", fp32)[0] == pytest.approx(66.9e12)
    finally:
        torch.set_float32_matmul_precision(precision)


def test_a_cpus_peak_is_measured_once_and_leaves_the_random_streams_alone():
    state = torch.get_rng_state()
    flops, source = peak_flops(torch.device("cpu"), torch.float32)
    assert flops > 0 and "1024x1024 fp32 matmul measured" in source
    assert torch.equal(torch.get_rng_state(), state)
    assert cpu_matmul_flops(torch.float32, torch.get_num_threads()) == flops  # cached


def test_a_peak_of_ones_own_must_be_positive():
    assert Throughput(peak_tflops=989.4).peak_tflops == 989.4
    refusal = spec_refusal("attnlab.training.callbacks.Throughput", peak_tflops=0)
    assert "peak_tflops=0: must be greater than 0" in refusal
