"""What machine a run is on, and the precision that suits it (bf16 only where the hardware multiplies
in it: Ampere GPUs on, CPUs with AMX or AVX512-BF16)."""

from __future__ import annotations

import logging
import os
import platform
import re
import time
from functools import cache
from typing import Any

import torch

log = logging.getLogger(__name__)


@cache
def native_bf16_cpu() -> bool:
    """Whether this CPU multiplies bf16 natively (AMX tiles or AVX512-BF16)."""
    cpu = torch.backends.cpu
    for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        fn = getattr(torch.cpu, probe, None) or getattr(cpu, probe, None)
        if fn is not None and fn():
            return True
    return False


@cache
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_names() -> list[str]:
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def machine_info() -> dict[str, Any]:
    """The facts a reported figure needs beside it: CPU, threads, bf16, GPUs, versions."""
    import lightning

    return {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_native_bf16": native_bf16_cpu(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "gpus": gpu_names(),
        "python": platform.python_version(),
        "torch": str(torch.__version__),
        "lightning": lightning.__version__,
        "platform": platform.platform(),
    }


def uses_gpu(accelerator: str) -> bool:
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())


def choose_precision(accelerator: str) -> tuple[str, str]:
    """The precision ``auto`` stands for on ``accelerator``, and why."""
    if uses_gpu(accelerator):
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return "bf16-mixed", f"GPU {gpu_names()[0]} supports bf16"
        return "16-mixed", "this GPU has no bf16: fp16 with loss scaling"
    if native_bf16_cpu():
        return "bf16-mixed", f"CPU {cpu_model()} multiplies bf16 natively (AMX/AVX512-BF16)"
    return "32-true", f"CPU {cpu_model()} has no native bf16 (bf16 matmul would be far slower than fp32)"


def resolve_precision(accelerator: str, precision: Any) -> str | Any:
    """``auto`` replaced by the precision that suits the hardware; bf16 on a CPU without it warned of."""
    if str(precision) == "auto":
        chosen, why = choose_precision(accelerator)
        log.info("trainer.precision=auto -> %s (%s)", chosen, why)
        return chosen
    if str(precision).startswith("bf16") and not uses_gpu(accelerator) and not native_bf16_cpu():
        log.warning(
            "trainer.precision=%s on CPU %s, which has no native bf16: expect it to be very "
            "slow (trainer.precision=auto picks 32-true here)",
            precision,
            cpu_model(),
        )
    return precision


# -- peak FLOP/s, the denominator of MFU ------------------------------------------------------------
# Dense (no 2:4 sparsity) tensor-core TFLOP/s from NVIDIA's datasheets, by the device name CUDA
# reports (lower case, first match); fp32 matmuls run as TF32 unless
# torch.get_float32_matmul_precision() is "highest". Lightning's table (``get_available_flops``)
# answers for the GPUs not here; it lists H200 and H100 NVL with sparsity, so they are here.
GPU_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    r"h[12]00 nvl": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    r"h100 pcie": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2},
    r"h[12]00": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},  # H100 SXM (HBM3), H200, GH200
    r"a100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    r"l40s": {"bf16": 362.1, "fp16": 362.1, "tf32": 183.0, "fp32": 91.6},
    r"l40\b": {"bf16": 181.0, "fp16": 181.0, "tf32": 90.5, "fp32": 90.5},
    r"\bl4\b": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    r"\ba10\b": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    r"rtx 4090": {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6},  # fp32 accumulate
    r"v100.*pcie": {"fp16": 112.0, "fp32": 14.0},
    r"v100": {"fp16": 125.0, "fp32": 15.7},  # SXM2
    r"\bt4\b": {"fp16": 65.0, "fp32": 8.1},
}
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


def compute_dtype(precision: Any) -> torch.dtype:
    """The dtype matmuls run in under a Trainer's ``precision`` ("bf16-mixed", "32-true", ...)."""
    prefixes = {"bf16": torch.bfloat16, "16": torch.float16, "64": torch.float64}
    return next((t for p, t in prefixes.items() if str(precision).startswith(p)), torch.float32)


def gpu_peak_flops(
    name: str, dtype: torch.dtype, device: torch.device | None = None
) -> tuple[float | None, str]:
    """Peak FLOP/s of the GPU called ``name`` (``device``: for Lightning's table, where attnlab's
    lacks it) in ``dtype``, and where the figure comes from."""
    kind = DTYPE_NAMES.get(dtype, str(dtype))
    tf32 = kind == "fp32" and torch.get_float32_matmul_precision() != "highest"
    for pattern, peaks in GPU_PEAK_TFLOPS.items():
        if re.search(pattern, name.lower()):
            if tf32 and "tf32" in peaks:  # GPUs before Ampere have no TF32: fp32 it is
                kind = "tf32"
            if kind not in peaks:
                return None, f"{name}: no {kind} figure (no {kind} tensor cores)"
            return peaks[kind] * 1e12, f"{name}: {peaks[kind]:g} TFLOP/s {kind} dense (datasheet)"
    from lightning.fabric.utilities.throughput import get_available_flops

    flops = get_available_flops(device or torch.device("cuda", torch.cuda.current_device()), dtype)
    if flops is None:
        return None, f"{name}: not in attnlab's or Lightning's table of GPUs"
    return float(flops), f"{name}: {flops / 1e12:g} TFLOP/s {kind} (Lightning's table)"


@cache
def cpu_matmul_flops(dtype: torch.dtype, threads: int, seconds: float = 0.2) -> float:
    """FLOP/s of a square matmul on ``threads`` (cached per count), the best repeat in ``seconds``."""
    n = 1024 if dtype == torch.float32 else 512
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen).to(dtype) for _ in range(2))
    a @ b
    best = float("inf")
    end = time.perf_counter() + seconds
    repeats = 0
    while repeats < 2 or (time.perf_counter() < end and repeats < 50):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
        repeats += 1
    return 2 * n**3 / best


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float | None, str]:
    """Peak matmul FLOP/s of ``device`` in ``dtype`` (MFU's denominator) and where it comes from."""
    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device), dtype, device)
    if device.type == "cpu":
        threads = torch.get_num_threads()
        flops = cpu_matmul_flops(dtype, threads)
        n = 1024 if dtype == torch.float32 else 512
        kind = DTYPE_NAMES.get(dtype, str(dtype))
        what = f"a {n}x{n} {kind} matmul measured on {threads} threads"
        return flops, f"{cpu_model()}: {flops / 1e9:.1f} GFLOP/s, {what}"
    return None, f"no peak known for a {device.type} device"
