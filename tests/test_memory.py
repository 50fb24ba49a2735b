"""A training process's memory stays flat: freed heap pages go back to the kernel every few
dozen steps (``benchmarks/memory_growth.py`` measures it over a varying-shape recipe)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from attnlab.core.cpu import keep_freed_memory, release_freed_memory
from attnlab.training.callbacks import ReleaseFreedMemory


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc (Linux)")
def test_freed_blocks_inside_the_heap_go_back_to_the_kernel():
    """Blocks of many sizes, every other one freed: the heap keeps its top (and so its free pages
    in between) until trimmed, as after steps of varying batch shapes."""
    keep_freed_memory()  # as in training: blocks up to 32 MiB from the heap, never trimmed
    blocks = [torch.ones(1000 + 37 * i, 250) for i in range(200)]  # 1-8 MB each, touched
    del blocks[::2]
    before = rss_mb()
    assert release_freed_memory()
    assert rss_mb() < before - 300, (before, rss_mb())
    del blocks


def test_the_callback_releases_every_n_steps_and_after_validation(monkeypatch):
    calls = []
    monkeypatch.setattr("attnlab.training.callbacks.release_freed_memory", lambda: calls.append(1))
    callback = ReleaseFreedMemory(every_n_steps=50)
    for step in range(1, 151):
        callback.on_train_batch_end(SimpleNamespace(global_step=step), None)
    assert len(calls) == 3
    callback.on_validation_end(None, None)
    assert len(calls) == 4
