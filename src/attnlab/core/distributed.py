"""Multi-process runs: FSDP's wrap policy, ranks of a Hydra multirun job, submitit launcher jobs
(torch imported inside the functions: ``attnlab.cli.train`` imports this before the config check)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import get_class
from omegaconf import read_write

from attnlab.core.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

# what Lightning's launcher sets in the process that starts the other ranks
LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")
_env_before_first_job: dict[str, str | None] | None = None


def relaunch_this_multirun_job() -> None:
    """Make DDP start this multirun job's ranks with this job's overrides and run directory (Lightning
    would re-run the whole sweep), the previous job's process group and launch variables cleared."""
    global _env_before_first_job
    if not HydraConfig.initialized() or submitit_executor():
        return  # a submitit job's ranks are started by submitit (srun, or its local controller)
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return
    if _env_before_first_job is None:
        _env_before_first_job = {k: os.environ.get(k) for k in LAUNCH_ENV}
    else:
        import torch.distributed as dist

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
    """The classes named by dotted paths, as a set (``FSDPStrategy``'s ``auto_wrap_policy``)."""
    return {get_class(p) for p in paths}


@contextmanager
def unsharded(module: nn.Module) -> Iterator[None]:
    """Hold the full parameters of an FSDP2-sharded net and its units (collective: every process enters)
    for code calling submodules outside ``forward`` or unevenly (decoding, pictures)."""
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


# ---- jobs sent by Hydra's submitit launcher (conf/hydra/launcher/, attnlab.cli.train) -------------


def submitit_executor() -> str | None:
    """``slurm`` or ``local`` in a process that submitit started for a job, else None."""
    return os.environ.get("SUBMITIT_EXECUTOR") or None


def export_local_ranks() -> None:
    """Give a ``submitit_local`` job's processes torch's rank variables, as torchrun would."""
    if submitit_executor() != "local":
        return
    from submitit import JobEnvironment
    from submitit.helpers import TorchDistributedEnvironment

    if JobEnvironment().num_tasks < 2:
        return
    env = TorchDistributedEnvironment()
    env.master_addr = "127.0.0.1"  # one machine: not its host name, which may not resolve
    env.export(set_cuda_visible_devices=False, overwrite=True)


def check_job_tasks(trainer: Any) -> None:
    """In a submitit job: as many tasks per node as ``trainer.devices`` (one array size per multirun)."""
    if not submitit_executor():
        return
    from submitit import JobEnvironment

    env = JobEnvironment()
    per_node = env.num_tasks // max(env.num_nodes, 1)
    devices = trainer.get("devices")
    if _count(devices) and devices != per_node:
        raise ConfigError(
            f"trainer.devices={devices} but this job runs {per_node} task(s) per node: the launcher "
            "gives every job of a multirun the same size; sweep trainer.devices in multiruns of their own"
        )


def cluster_plugins() -> list[Any]:
    """Under ``submitit_slurm``: Lightning's SLURM environment without its own requeue (submitit requeues)."""
    if submitit_executor() != "slurm":
        return []
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    return [SLURMEnvironment(auto_requeue=False)] if SLURMEnvironment.detect() else []


def own_last_checkpoint(cfg: Any) -> Path:
    """Where this run writes ``last.ckpt``: a requeued job's own, written before it was stopped."""
    from omegaconf import OmegaConf

    folder = (
        OmegaConf.select(cfg, "callbacks.model_checkpoint.dirpath")
        or Path(cfg.paths.output_dir) / "checkpoints"
    )
    return Path(str(folder)) / "last.ckpt"


def launcher_options(name: str | None) -> set[str] | None:
    """The options of Hydra's submitit launcher ``name`` from the plugin's schema; None for another."""
    from dataclasses import fields

    from hydra_plugins.hydra_submitit_launcher import config

    schema = {"submitit_slurm": config.SlurmQueueConf, "submitit_local": config.LocalQueueConf}.get(str(name))
    return None if schema is None else {f.name for f in fields(schema)} - {"_target_"}


def check_launcher_overrides(argv: list[str]) -> None:
    """A ``hydra.launcher.<key>=`` override naming no option of the chosen submitit launcher: one
    line, before Hydra composes (whose own error says only that the key is not in the struct)."""
    chosen = next((a.split("=", 1)[1] for a in argv if a.split("=", 1)[0] == "hydra/launcher"), None)
    options = launcher_options(chosen)
    if not options:
        return
    for arg in argv:
        key = arg.split("=", 1)[0].lstrip("+")  # +key, ++key: Hydra's schema refuses new keys too
        if key.startswith("hydra.launcher.") and (name := key.split(".")[2]) not in options:
            slurm = "; an sbatch option it lacks goes in hydra.launcher.additional_parameters"
            raise ConfigError(
                f"hydra.launcher.{name}: hydra/launcher={chosen} has no such option "
                f"(its options: {', '.join(sorted(options))}){slurm if 'slurm' in str(chosen) else ''}"
            )


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_job_size(params: dict[str, Any], trainer: Any) -> None:
    """A submitit job's size checked before anything is sent: one task per device and node."""
    tasks, gpus, nodes = (params.get(k) for k in ("tasks_per_node", "gpus_per_node", "nodes"))
    devices, num_nodes = trainer.get("devices"), trainer.get("num_nodes")
    if not _count(tasks):
        raise ConfigError(
            f"hydra.launcher.tasks_per_node={tasks} (trainer.devices={devices}) cannot size a job: "
            "give trainer.devices=N, the processes of each node (one per GPU)"
        )
    if gpus is not None and not (_count(gpus) or gpus == 0):
        raise ConfigError(
            f"hydra.launcher.gpus_per_node={gpus}: expected a number of GPUs per node (trainer.devices=N), "
            "or null for a job on CPUs"
        )
    if not _count(nodes):
        raise ConfigError(
            f"hydra.launcher.nodes={nodes}: expected a positive number of nodes (trainer.num_nodes)"
        )
    for key, value, follows, wanted in (
        ("tasks_per_node", tasks, "trainer.devices", devices),
        ("nodes", nodes, "trainer.num_nodes", num_nodes),
    ):
        if _count(wanted) and value != wanted:
            raise ConfigError(
                f"hydra.launcher.{key}={value} but {follows}={wanted}: a job runs one task per device "
                f"(submitit starts DDP's processes, Lightning none); leave {key} to follow {follows}"
            )


# Hydra's submitit launchers, by the class their config names
SUBMITIT_LAUNCHERS = {
    "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher": "slurm",
    "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher": "local",
}


def check_submitit_launcher(config: Any) -> None:
    """Check a multirun's submitit launcher before any job is sent (for SLURM, ``sbatch --test-only``)."""
    import shutil
    import tempfile

    from omegaconf import OmegaConf

    kind = SUBMITIT_LAUNCHERS.get(str(OmegaConf.select(config, "hydra.launcher._target_")))
    if kind is None:
        return
    params = OmegaConf.to_container(config.hydra.launcher, resolve=True)
    params.pop("_target_", None)
    check_job_size(params, config.get("trainer") or {})
    if kind == "slurm" and not (shutil.which("sbatch") and shutil.which("srun")):
        raise ConfigError(
            "hydra/launcher=submitit_slurm: no sbatch here (SLURM's submit command): send the jobs from "
            "the cluster's login node, or run them here with hydra/launcher=submitit_local"
        )
    with tempfile.TemporaryDirectory(prefix="attnlab-submitit-") as scratch:
        executor = submitit_executor_for(kind, params, scratch)
        if kind == "slurm":
            sbatch_test_only(executor, Path(scratch))


def submitit_executor_for(kind: str, params: dict[str, Any], folder: str) -> Any:
    """submitit's executor for a launcher's options; a refused option is a ConfigError."""
    from dataclasses import fields

    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    params = {k: v for k, v in params.items() if k != "submitit_folder"}
    init = {f"{kind}_max_num_timeout": params.pop("max_num_timeout")} if "max_num_timeout" in params else {}
    generic = {f.name for f in fields(BaseQueueConf)}
    try:
        executor = submitit.AutoExecutor(folder=folder, cluster=kind, **init)
        executor.update_parameters(**{k if k in generic else f"{kind}_{k}": v for k, v in params.items()})
    except (AssertionError, NameError, TypeError, ValueError) as e:
        said = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"hydra/launcher=submitit_{kind}: submitit refuses the options: {said}") from None
    return executor


def sbatch_test_only(executor: Any, folder: Path) -> None:
    """sbatch's verdict on the script submitit would send, without submitting it (``--test-only``)."""
    import subprocess

    from submitit.slurm.slurm import _make_sbatch_string

    slurm = executor._executor
    script = folder / "check.sh"
    script.write_text(
        _make_sbatch_string(command=slurm._submitit_command_str, folder=folder, **slurm.parameters)
    )
    try:
        proc = subprocess.run(
            ["sbatch", "--test-only", str(script)], capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConfigError(f"hydra/launcher=submitit_slurm: sbatch --test-only did not answer ({e})") from None
    if proc.returncode != 0:
        lines = [line.strip() for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
        said = next((line for line in lines if "error" in line.lower()), lines[-1] if lines else "")
        raise ConfigError(
            f"hydra/launcher=submitit_slurm: sbatch refuses a job of these options: "
            f"{said or f'exit status {proc.returncode}'}"
        )
