"""Multi-process runs: FSDP's wrap policy from config, and runs started from a Hydra multirun."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import get_class
from omegaconf import read_write
from torch import nn

# what Lightning's launcher sets in the process that starts the other ranks
LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")
_env_before_first_job: dict[str, str | None] | None = None


def relaunch_this_multirun_job() -> None:
    """Make DDP start this multirun job's ranks, each with this job's configuration.

    Lightning starts ranks > 0 by re-running the command line with ``hydra.run.dir`` set to
    ``HydraConfig.get().run.dir``. In a multirun that command line still holds ``-m`` and every
    swept value, so rank 1 ran a sweep of its own: other hyperparameters than rank 0, written to
    another directory. Here the command line becomes this job's overrides and the run directory
    this job's directory. From the second job on, the previous job's process group and launch
    variables are cleared too: left in place, Lightning took the job for a rank that something
    else had started and launched no second process.
    """
    global _env_before_first_job
    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return
    if _env_before_first_job is None:
        _env_before_first_job = {k: os.environ.get(k) for k in LAUNCH_ENV}
    else:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        for key, value in _env_before_first_job.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    given = set(sys.argv[1:])  # Hydra lists a deletion `~key` as `~key=null` (delete only if null)
    sys.argv[1:] = [
        o[: -len("=null")] if o.startswith("~") and o.endswith("=null") and o[: -len("=null")] in given else o
        for o in hydra_cfg.overrides.task
    ]
    with read_write(hydra_cfg):
        hydra_cfg.run.dir = hydra_cfg.runtime.output_dir


def module_classes(*paths: str) -> set[type]:
    """The classes named by dotted paths, as a set: the form of FSDP's ``auto_wrap_policy`` and
    ``activation_checkpointing_policy`` in Lightning's ``FSDPStrategy``."""
    return {get_class(p) for p in paths}


@contextmanager
def unsharded(module: nn.Module) -> Iterator[None]:
    """The full parameters of an FSDP2-sharded net (the root unit) and of every unit inside it,
    held until the end, for code that reaches into submodules outside their ``forward`` or calls
    them a different number of times on each process (decoding until <eos>, pictures). Gathering
    is collective: every process enters; inside, no unit gathers again as long as the code calls
    submodules and methods that are not registered FSDP forward methods (a call through the root's
    hooks shards again the units it did not run). Unsharded: nothing to do."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not units:
        yield
        return
    root = units[0]
    root.set_reshard_after_forward(False)  # every unit: stay gathered after each forward
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
        root.set_reshard_after_forward(True)
        root.set_reshard_after_forward(False, recurse=False)  # FSDP's own choice for a root
