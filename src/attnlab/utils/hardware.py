"""What machine a run is on, and the precision that suits it.

bf16 pays only where the hardware multiplies in it: GPUs from Ampere on, and CPUs with AMX or
AVX512-BF16. Elsewhere torch's CPU bf16 matmul falls back to a generic kernel far slower than
fp32 (README, "Same command, same model, any machine", has the figures), so a bf16 recipe would
crawl there.
"""

from __future__ import annotations

import logging
import os
import platform
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
    if not torch.cuda.is_available():
        return []
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
    if accelerator in ("gpu", "cuda"):
        return True
    return accelerator == "auto" and torch.cuda.is_available()


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
    """Replace ``auto`` with the precision that suits the hardware (one notice line); warn when
    bf16 is asked for on a CPU that lacks it."""
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
