"""usage: attnlab-sweep [OVERRIDE ...] | resume=SWEEP_DIR

An Optuna sweep over attnlab-train runs; every trial a run of its own, the study in
<sweep dir>/optuna.db, so a stopped sweep goes on where it was (finished trials stay).
The overrides compose as for attnlab-train; hparams_search=<name> (conf/hparams_search/) adds
the search: direction, n_trials, sampler, pruner and the space (sweep.params).
sweep.n_jobs=N runs N trials at once, each on its own GPUs or CPU cores (sweep.devices_per_trial);
sweep.storage=postgresql://... or journal:<file> puts the study where drivers on many machines
attach to it by name (sweep.study_name) and share its sweep.n_trials.

examples:
  attnlab-sweep hparams_search=gpt_optuna experiment=gpt_pydoc_char
  attnlab-sweep hparams_search=gpt_optuna sweep.n_trials=4 trainer.max_steps=500
  attnlab-sweep hparams_search=gpt_optuna sweep.n_jobs=4 sweep.devices_per_trial=2 trainer=ddp
  attnlab-sweep hparams_search=gpt_optuna sweep.storage=journal:/shared/gpt.log   # on each machine
  attnlab-sweep resume=logs/gpt_pydoc_char/sweeps/<time>
  attnlab-compare logs/gpt_pydoc_char/sweeps/<time>      # the trials side by side
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import uuid
import warnings
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import optuna
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from attnlab.cli.common import compose_config, compose_train, exit_on_user_error, quote_free_text
from attnlab.core.config import constructor_errors, refuse_renamed_overrides
from attnlab.core.errors import ConfigError
from attnlab.core.targets import check_targets
from attnlab.experiments.study import SHARED, normalize_url, open_storage, shown
from attnlab.experiments.sweep import (
    Driver,
    Shared,
    Slot,
    check_same_search,
    device_slots,
    open_study,
    override_value,
    positive,
    search_space,
    study_lock,
    tally,
)

SAVED = "sweep.yaml"  # the sweep's overrides, read back by resume=


def sweep_dir_of(cfg: DictConfig) -> Path:
    if cfg.sweep.get("dir"):
        return Path(cfg.sweep.dir)
    name = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    if cfg.sweep.get("storage"):  # drivers of one study start together, on machines sharing logs/
        name += f"_{socket.gethostname()}_{os.getpid()}"
    return Path(cfg.paths.log_dir) / cfg.task_name / "sweeps" / name


def quote_search_spaces(args: list[str]) -> list[str]:
    """``sweep.params.<key>=choice(...)`` and ``sweep.storage``'s URL quoted: Hydra would refuse a
    sweep expression outside ``--multirun`` (the driver parses it) and parse the URL."""
    keys = tuple({a.partition("=")[0] for a in args if a.lstrip("+").startswith("sweep.params.")})
    out = []
    for arg in quote_free_text(args, keys):
        # a database URL holds '=', '?', '@' (postgresql://me@/db?host=/run/pg), which Hydra would parse
        key, _, value = arg.partition("=")
        storage = key.lstrip("+") == "sweep.storage" and value != "null"
        out += quote_free_text([arg], (key,)) if storage else [arg]
    return out


@dataclass
class Plan:
    """What a sweep runs and where, every part checked before its folder is written."""

    space: dict
    fixed: list[str]
    sampler: optuna.samplers.BaseSampler | None
    pruner: optuna.pruners.BasePruner | None
    slots: list[Slot]
    study: optuna.Study | None = None  # the shared study (sweep.storage), attached
    shared: Shared | None = None  # where it is, and this driver's part in it


def start(args: list[str]) -> tuple[DictConfig, list[str], Path, Plan]:
    """Config, overrides, folder and plan of a new sweep (its folder written once the plan holds), or
    of the one ``resume=`` names."""
    if args and args[0].startswith("resume="):
        sweep_dir = Path(args[0].partition("=")[2])
        if len(args) > 1:
            raise ConfigError(f"resume= takes no other overrides: the sweep's are in {sweep_dir / SAVED}")
        if not (sweep_dir / SAVED).is_file():
            raise ConfigError(f"resume={sweep_dir}: no {SAVED} there (not a directory attnlab-sweep made)")
        overrides = list(OmegaConf.load(sweep_dir / SAVED).overrides)
        # the saved overrides are input, not code: each trial would build what they name
        check_targets(compose_config("train", overrides, with_hydra=True), str(sweep_dir / SAVED))
        cfg = compose_train(overrides)
        # the study where this driver first attached (its URL made absolute then)
        where = OmegaConf.load(sweep_dir / SHARED) if (sweep_dir / SHARED).is_file() else None
        return cfg, overrides, sweep_dir, plan(cfg, where)
    args = quote_search_spaces(args)
    cfg = compose_train(args)
    if not cfg.get("sweep"):
        raise ConfigError("no sweep settings: add hparams_search=<name> (one of conf/hparams_search/)")
    p = plan(cfg)  # a bad search space, device count or database stops here, before the folder is made
    sweep_dir = sweep_dir_of(cfg)
    if (sweep_dir / SAVED).exists():
        raise ConfigError(f"sweep.dir={sweep_dir} already holds a sweep: continue it with resume={sweep_dir}")
    sweep_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create({"overrides": args}), sweep_dir / SAVED)
    if p.study is not None:
        where = {"storage": p.shared.url, "study_name": p.shared.study_name, "driver": p.shared.driver}
        OmegaConf.save(OmegaConf.create(where), sweep_dir / SHARED)
    return cfg, args, sweep_dir, p


def plan(cfg: DictConfig, where: DictConfig | None = None) -> Plan:
    """The sweep's parts, its device slots, and a shared study attached (``where``: as first attached)."""
    s = cfg.sweep
    space, fixed, sampler, pruner = sweep_parts(s)
    trainer = cfg.get("trainer") or {}
    slots = device_slots(
        s.get("n_jobs", 1),
        s.get("devices_per_trial"),
        trainer.get("accelerator", "auto"),
        trainer.get("devices", 1),
    )
    url = where.storage if where else s.get("storage")
    if not url:
        check_workers(cfg, shared=False)
        return Plan(space, fixed, sampler, pruner, slots)
    url = normalize_url(url)
    name = str(where.study_name if where else s.get("study_name") or cfg.task_name)
    interval = positive("sweep.heartbeat_interval", s.get("heartbeat_interval", 60))
    grace = positive("sweep.grace_period", s.get("grace_period"), none=True)
    # a driver that dies mid-trial stops beating: whoever asks next fails that trial and runs its
    # values again, once (Optuna's heartbeat and retry callback)
    retry = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1)
    storage = open_storage(url, interval, grace, retry)
    if sampler is not None:  # drivers started by one command would draw the same values
        sampler.reseed_rng()
    study = open_study(None, s.direction, sampler, pruner, storage, name)
    check_same_search(study, space, cfg.optimized_metric, s.direction)
    check_workers(cfg, shared=True)
    driver = where.driver if where else uuid.uuid4().hex
    shared = Shared(url, name, driver, study_lock(url, storage, name), poll=min(interval, 10))
    return Plan(space, fixed, sampler, pruner, slots, study, shared)


def sweep_parts(
    s: DictConfig,
) -> tuple[dict, list[str], optuna.samplers.BaseSampler | None, optuna.pruners.BasePruner | None]:
    """The search space, fixed overrides, sampler and pruner of the ``sweep`` node, each checked."""
    if s.direction not in ("minimize", "maximize"):
        raise ConfigError(f"sweep.direction: expected minimize or maximize, got {s.direction!r}")
    positive("sweep.n_trials", s.n_trials)
    space, fixed = search_space(s.params)
    refuse_renamed_overrides([*(f"{key}=" for key in space), *fixed])  # else every trial fails on it
    parts = []
    for name in ("sampler", "pruner"):
        try:
            with constructor_errors(f"sweep.{name}"):
                parts.append(instantiate(s[name]) if s.get(name) else None)
        except InstantiationException as e:  # a _target_ that does not import, an unknown argument
            what = str(e).split(", set env var HYDRA_FULL_ERROR")[0].strip().splitlines()[0].rstrip(":")
            why = f": {str(e.__cause__).strip()}" if e.__cause__ else ""
            raise ConfigError(f"sweep.{name}: {what}{why}") from None
    return space, fixed, *parts


def sweep(args: list[str]) -> None:
    cfg, overrides, sweep_dir, p = start(args)
    s = cfg.sweep
    if s.get("workers"):
        send_workers(cfg, overrides, sweep_dir, p)
        return
    study = p.study or open_study(sweep_dir, s.direction, p.sampler, p.pruner)
    url = p.shared.url if p.shared else ""
    if p.study is None:
        check_same_search(study, p.space, cfg.optimized_metric, s.direction)
    study.set_metric_names([cfg.optimized_metric])  # named so in optuna-dashboard
    goal = f"{s.direction} {cfg.optimized_metric}"
    print(f"sweep {sweep_dir}: {s.n_trials} trials over {', '.join(p.space)}; {goal}")
    if p.study is not None:
        done, running = tally(study.get_trials(deepcopy=False))
        print(f"study {study.study_name} in {shown(url)}: {len(done)} finished, {len(running)} running")
    if p.slots[0].label:
        print(f"{len(p.slots)} at once, on {'; '.join(slot.label for slot in p.slots)}")
    trial_args = overrides + p.fixed
    if "wandb" in (cfg.get("logger") or {}):  # on W&B, the trials of one sweep form one group
        group = f"{cfg.task_name}-sweep-{study.study_name if p.study else sweep_dir.name}"
        trial_args.append(f"logger.wandb.group={override_value(group)}")
    Driver(
        study, p.space, trial_args, sweep_dir, cfg.optimized_metric, s.n_trials, print, p.slots, p.shared
    ).run()
    if any(t.value is not None for t in study.trials):
        best = study.best_trial
        print(f"best: trial {best.number}, {cfg.optimized_metric} {best.value:.4f}, {best.params}")
    if p.study is None:
        print(f"compare the trials: attnlab-compare {sweep_dir}")
        print(f"dashboard: optuna-dashboard sqlite:///{(sweep_dir / 'optuna.db').resolve()}")
    else:
        print(f"compare the trials: attnlab-compare {sweep_dir} (this driver's), or {shown(url)} (all)")
        target = url.removeprefix("journal:") if url.startswith("journal:") else shown(url)
        print(f"dashboard: optuna-dashboard {target}")


class DriverJob:
    """A driver of a job array (``sweep.workers``) in its own folder; requeued, it resumes there."""

    def __call__(self, args: list[str], sweep_dir: str) -> None:
        optuna.logging.set_verbosity(optuna.logging.ERROR)
        warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
        folder = Path(sweep_dir)
        sweep([f"resume={folder}"] if (folder / SAVED).is_file() else [*args, f"sweep.dir={folder}"])

    def checkpoint(self, args: list[str], sweep_dir: str) -> Any:
        import submitit

        return submitit.helpers.DelayedSubmission(self, args, sweep_dir)


def executor_of(cfg: DictConfig, folder: Path | str) -> Any:
    """The submitit executor of ``sweep.executor`` with ``sweep.resources``; what it refuses is one line."""
    import submitit

    s = cfg.sweep
    options = OmegaConf.to_container(s.get("executor") or {}, resolve=True)
    options.pop("folder", None)
    resources = OmegaConf.to_container(s.get("resources") or {}, resolve=True)
    try:
        executor = submitit.AutoExecutor(folder=folder, **options)
        parameters = {k: v for k, v in resources.items() if v is not None}
        executor.update_parameters(**{"name": f"{cfg.task_name}-sweep", **parameters})
    except (NameError, TypeError, ValueError) as e:
        raise ConfigError(f"sweep.executor, sweep.resources: {str(e).strip().splitlines()[0]}") from None
    return executor


def check_workers(cfg: DictConfig, shared: bool) -> None:
    """``sweep.workers``: a positive int, a shared study, and an executor submitit accepts."""
    workers = cfg.sweep.get("workers")
    if workers is None:
        return
    positive("sweep.workers", workers, what=" (drivers to send)", none=True)
    if not shared:
        raise ConfigError("sweep.workers: the workers need a study they all reach: set sweep.storage")
    with tempfile.TemporaryDirectory() as tmp:  # submitit makes its folder: not the sweep's yet
        executor_of(cfg, tmp)


def send_workers(cfg: DictConfig, overrides: list[str], sweep_dir: Path, p: Plan) -> None:
    """``sweep.workers`` drivers as one submitit job array, in ``<sweep dir>/workers/<i>``."""
    s = cfg.sweep
    folder = (s.get("executor") or {}).get("folder") or sweep_dir / ".submitit" / "%j"
    executor = executor_of(cfg, folder)
    # the workers run the same sweep, without sending workers of their own
    args = [a for a in overrides if not a.lstrip("+").startswith("sweep.workers=")] + ["sweep.workers=null"]
    folders = [str(sweep_dir / "workers" / str(i)) for i in range(s.workers)]
    jobs = executor.map_array(DriverJob(), [args] * s.workers, folders)
    array = jobs[0].job_id.split("_")[0]
    study = f"study {p.study.study_name} in {shown(p.shared.url)}"
    print(f"sent {len(jobs)} sweep drivers ({executor.cluster} {array}) to {study}")
    print(
        f"their folders: {sweep_dir / 'workers'}/<i>; their output: {str(folder).replace('%j', '<job id>')}"
    )
    print(f"follow the study: attnlab-compare {shown(p.shared.url)} --study {p.study.study_name}")
    if executor.cluster in ("local", "debug"):  # the jobs are this machine's processes: wait for them
        for job in jobs:
            job.result()
        done, _ = tally(p.study.get_trials(deepcopy=False))
        print(f"the workers ended: {len(done)} trials finished in the study")


def main() -> None:
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__, end="")
        return
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # one line per trial comes from the Driver
    # heartbeats and their retry callback are marked experimental by Optuna: said once, in the docs
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    with exit_on_user_error(console=True):
        sweep(sys.argv[1:])


if __name__ == "__main__":
    main()
