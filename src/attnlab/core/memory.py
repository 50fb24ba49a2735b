"""Peak memory of a stretch of work: the GPU's allocations, or on a CPU the process's resident
memory (Linux's /proc: VmHWM, the high-water mark, restarted from VmRSS)."""

from __future__ import annotations

import torch


def process_mb(field: str) -> float:
    """A memory figure (VmRSS, VmHWM) of this process from /proc/self/status in MB; NaN without /proc."""
    try:
        for line in open("/proc/self/status").read().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def reset_peak_memory(device: torch.device | str) -> float:
    """Start counting the peak memory again; returns the baseline it is measured from (MB)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device) / 2**20
    try:  # Linux: VmHWM starts again from VmRSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return process_mb("VmRSS")


def peak_memory_mb(device: torch.device | str) -> float:
    """The peak since ``reset_peak_memory`` (MB; subtract its baseline for the stretch's own)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return process_mb("VmHWM")
