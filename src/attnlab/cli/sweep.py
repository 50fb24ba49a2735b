"""``attnlab-sweep``: an Optuna sweep over ``attnlab-train`` runs, resumable.

    attnlab-sweep hparams_search=gpt_optuna experiment=gpt_pydoc_char      # a new sweep
    attnlab-sweep resume=logs/gpt_pydoc_char/sweeps/<time>                 # go on after a stop

The overrides compose exactly as for ``attnlab-train``; ``hparams_search/<name>`` adds the
``sweep`` block (direction, n_trials, sampler, pruner, params). See ``attnlab.sweep``.
"""

from __future__ import annotations

import sys
from datetime import datetime
from pathlib import Path

import optuna
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from attnlab.cli.common import compose_config, compose_train, exit_on_user_error, quote_free_text
from attnlab.errors import ConfigError
from attnlab.sweep import open_study, override_value, run_sweep, search_space
from attnlab.utils.checks import is_int
from attnlab.utils.config import constructor_errors, refuse_renamed_overrides
from attnlab.utils.targets import check_targets

SAVED = "sweep.yaml"  # the sweep's overrides, read back by resume=


def sweep_dir_of(cfg: DictConfig) -> Path:
    if cfg.sweep.get("dir"):
        return Path(cfg.sweep.dir)
    return Path(cfg.paths.log_dir) / cfg.task_name / "sweeps" / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


def quote_search_spaces(args: list[str]) -> list[str]:
    """``sweep.params.<key>=choice(...)`` as a string: unquoted, Hydra reads a sweep expression
    and refuses it outside ``--multirun``; the driver parses it itself (``search_space``)."""
    keys = tuple({a.partition("=")[0] for a in args if a.lstrip("+").startswith("sweep.params.")})
    return quote_free_text(args, keys)


def start(args: list[str]) -> tuple[DictConfig, list[str], Path]:
    """The config, overrides and directory of the sweep to run: a new one, or the one ``resume=``
    names."""
    if args and args[0].startswith("resume="):
        sweep_dir = Path(args[0].partition("=")[2])
        if len(args) > 1:
            raise ConfigError(f"resume= takes no other overrides: the sweep's are in {sweep_dir / SAVED}")
        if not (sweep_dir / SAVED).is_file():
            raise ConfigError(f"resume={sweep_dir}: no {SAVED} there (not a directory attnlab-sweep made)")
        overrides = list(OmegaConf.load(sweep_dir / SAVED).overrides)
        # the saved overrides are input, not code: each trial would build what they name
        check_targets(compose_config("train", overrides, with_hydra=True), str(sweep_dir / SAVED))
        return compose_train(overrides), overrides, sweep_dir
    args = quote_search_spaces(args)
    cfg = compose_train(args)
    if not cfg.get("sweep"):
        raise ConfigError("no sweep settings: add hparams_search=<name> (one of conf/hparams_search/)")
    sweep_parts(cfg.sweep)  # a bad search space, sampler or pruner stops here, before the folder is made
    sweep_dir = sweep_dir_of(cfg)
    if (sweep_dir / SAVED).exists():
        raise ConfigError(f"sweep.dir={sweep_dir} already holds a sweep: continue it with resume={sweep_dir}")
    sweep_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create({"overrides": args}), sweep_dir / SAVED)
    return cfg, args, sweep_dir


def sweep_parts(
    s: DictConfig,
) -> tuple[dict, list[str], optuna.samplers.BaseSampler | None, optuna.pruners.BasePruner | None]:
    """The search space, fixed overrides, sampler and pruner of the ``sweep`` node, each checked."""
    if s.direction not in ("minimize", "maximize"):
        raise ConfigError(f"sweep.direction: expected minimize or maximize, got {s.direction!r}")
    if not is_int(s.n_trials) or s.n_trials < 1:
        raise ConfigError(f"sweep.n_trials: expected a positive int, got {s.n_trials!r}")
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
    cfg, overrides, sweep_dir = start(args)
    s = cfg.sweep
    space, fixed, sampler, pruner = sweep_parts(s)
    study = open_study(sweep_dir, s.direction, sampler, pruner)
    study.set_metric_names([cfg.optimized_metric])  # named so in optuna-dashboard
    goal = f"{s.direction} {cfg.optimized_metric}"
    print(f"sweep {sweep_dir}: {s.n_trials} trials over {', '.join(space)}; {goal}")
    if "wandb" in (cfg.get("logger") or {}):  # on W&B, the trials of one sweep form one group
        fixed.append(f"logger.wandb.group={override_value(f'{cfg.task_name}-sweep-{sweep_dir.name}')}")
    run_sweep(study, space, overrides + fixed, sweep_dir, cfg.optimized_metric, s.n_trials)
    if any(t.value is not None for t in study.trials):
        best = study.best_trial
        print(f"best: trial {best.number}, {cfg.optimized_metric} {best.value:.4f}, {best.params}")
    print(f"compare the trials: attnlab-compare {sweep_dir}")
    print(f"dashboard: optuna-dashboard sqlite:///{(sweep_dir / 'optuna.db').resolve()}")


USAGE = """usage: attnlab-sweep [OVERRIDE ...] | resume=SWEEP_DIR

An Optuna sweep over attnlab-train runs; every trial a run of its own, the study in
<sweep dir>/optuna.db, so a stopped sweep goes on where it was (finished trials stay).
The overrides compose as for attnlab-train; hparams_search=<name> (conf/hparams_search/) adds
the search: direction, n_trials, sampler, pruner and the space (sweep.params).

examples:
  attnlab-sweep hparams_search=gpt_optuna experiment=gpt_pydoc_char
  attnlab-sweep hparams_search=gpt_optuna sweep.n_trials=4 trainer.max_steps=500
  attnlab-sweep resume=logs/gpt_pydoc_char/sweeps/<time>
  attnlab-compare logs/gpt_pydoc_char/sweeps/<time>      # the trials side by side
"""


def main() -> None:
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(USAGE, end="")
        return
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # one line per trial comes from run_sweep
    with exit_on_user_error(console=True):
        sweep(sys.argv[1:])


if __name__ == "__main__":
    main()
