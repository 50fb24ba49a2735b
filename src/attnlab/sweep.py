"""Optuna sweeps over Hydra-composed runs.

The study lives in SQLite inside the sweep directory (``optuna.db``), so a sweep that is stopped
resumes where it was and ``optuna-dashboard`` can read it. Every trial is its own
``attnlab-train`` process: a crash, an out-of-memory kill or DDP's relaunch of the command line
stays inside its trial, and the trial's ranks all run the same overrides. The trial reports its
validation metric to the study while it trains (``attnlab.callbacks.TrialPruning``), so the
pruner can stop it early.

Search spaces are written as for Hydra's Optuna sweeper, so its users' configs carry over:
``choice(a, b, ...)``, ``range(start, stop[, step])``, ``interval(low, high)``, and
``tag(log, interval(...))`` / ``tag(int, interval(...))``; a plain value is a fixed override.
"""

from __future__ import annotations

import ctypes
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

import optuna
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.trial import TrialState

from attnlab.compare import load_run
from attnlab.errors import ConfigError
from attnlab.study import STUDY, storage_url, trial_id

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
INTERRUPTED = "interrupted: the sweep stopped during this trial; its values run again"


def distribution(key: str, value: Any) -> BaseDistribution | None:
    """The Optuna distribution of one ``key: <sweep expression>``; None for a fixed value."""
    try:
        override = OverridesParser.create().parse_override(f"{key}={value}")
    except Exception as e:
        raise ConfigError(f"sweep.params.{key}: cannot parse {value!r} ({e})") from None
    sweep = override.value()
    try:  # Optuna refuses empty or reversed bounds and log scales that reach 0
        if isinstance(sweep, ChoiceSweep):
            return CategoricalDistribution(sweep.list)
        if isinstance(sweep, RangeSweep):
            values = list(override.sweep_iterator())
            if not values:
                raise ConfigError(f"sweep.params.{key}: {value} is empty")
            if all(isinstance(v, int) for v in values):
                return IntDistribution(values[0], values[-1], step=int(sweep.step))
            return FloatDistribution(values[0], values[-1], step=sweep.step)
        if isinstance(sweep, IntervalSweep):
            log = "log" in sweep.tags
            if "int" in sweep.tags:
                return IntDistribution(int(sweep.start), int(sweep.end), log=log)
            return FloatDistribution(float(sweep.start), float(sweep.end), log=log)
    except ValueError as e:
        raise ConfigError(f"sweep.params.{key}: {value}: {str(e).splitlines()[0]}") from None
    return None


def search_space(params: Mapping[str, Any]) -> tuple[dict[str, BaseDistribution], list[str]]:
    """``sweep.params`` as Optuna distributions, and the plain values as fixed overrides. Keys are
    dotted (``model.optimizer.lr: ...``) or nested (``+sweep.params.model.optimizer.lr=...``)."""
    space, fixed = {}, []
    for key, value in flat(params).items():
        dist = distribution(key, value)
        if dist is None:
            fixed.append(f"{key}={value}")
        else:
            space[key] = dist
    if not space:
        raise ConfigError("sweep.params: nothing to search (expected choice/range/interval expressions)")
    return space, fixed


def flat(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in params.items():
        if isinstance(value, Mapping):
            out |= flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def open_study(
    sweep_dir: Path,
    direction: str,
    sampler: optuna.samplers.BaseSampler | None = None,
    pruner: optuna.pruners.BasePruner | None = None,
) -> optuna.Study:
    """The study in ``<sweep_dir>/optuna.db``, created on first use and loaded after that."""
    if direction not in ("minimize", "maximize"):
        raise ConfigError(f"sweep.direction: expected minimize or maximize, got {direction!r}")
    sweep_dir.mkdir(parents=True, exist_ok=True)
    return optuna.create_study(
        storage=storage_url(sweep_dir),
        study_name=STUDY,
        direction=direction,
        sampler=sampler,
        pruner=pruner,
        load_if_exists=True,
    )


def counted(trial: optuna.trial.FrozenTrial) -> bool:
    """A trial that counts towards ``n_trials``: finished, and not cut short by a stopped sweep."""
    return trial.state in FINISHED and not trial.user_attrs.get("interrupted")


def recover_interrupted(study: optuna.Study) -> list[int]:
    """Trials left running by a sweep that was killed: recorded as failed (``interrupted``) and
    their parameters queued to run again. Returns their numbers."""
    numbers = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        mark_interrupted(study, t.number, t.params)
        numbers.append(t.number)
    return numbers


def mark_interrupted(study: optuna.Study, number: int, params: dict[str, Any]) -> None:
    trial = optuna.trial.Trial(study, trial_id(study, number))
    trial.set_user_attr("interrupted", True)
    trial.set_user_attr("error", INTERRUPTED)
    study.tell(number, state=TrialState.FAIL)
    study.enqueue_trial(params, user_attrs={"rerun_of": number})


def override_value(value: Any) -> str:
    """A sampled value in Hydra's override grammar."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return repr(value)


def trial_command(
    overrides: list[str], params: dict[str, Any], run_dir: Path, storage: str, number: int
) -> list[str]:
    """The ``attnlab-train`` command of one trial: the sweep's overrides, the sampled values,
    its own run directory, and where to report for pruning."""
    sampled = [f"{k}={override_value(v)}" for k, v in params.items()]
    return [
        sys.executable,
        "-m",
        "attnlab.cli.train",
        *overrides,
        *sampled,
        f"hydra.run.dir={override_value(str(run_dir))}",
        f"sweep_trial={{storage:{override_value(storage)},number:{number}}}",
    ]


def error_line(log_file: Path) -> str:
    """The line of a failed trial's output that says why: ``error: ...`` or the exception's."""
    lines = [ln.strip() for ln in log_file.read_text(errors="replace").splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "error: " in ln:
            return ln[ln.index("error: ") :]
    for ln in reversed(lines):
        if "Error" in ln or "Exception" in ln:
            return ln
    return lines[-1] if lines else "no output"


def die_with_parent(driver: int) -> None:
    """In a trial's process, before it starts: the kernel sends it SIGTERM when the sweep driver
    dies, however it dies (``kill -9`` included), so no trial trains on alone (Linux; elsewhere a
    no-op). The resumed sweep runs its values again."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != driver:  # the driver died before the request was in place
            os._exit(1)


class TrialFailed(Exception):
    """A trial's run exited with an error or without a finite metric (recorded, the sweep goes on)."""


def suggest(trial: optuna.Trial, name: str, dist: BaseDistribution) -> Any:
    if isinstance(dist, CategoricalDistribution):
        return trial.suggest_categorical(name, dist.choices)
    if isinstance(dist, IntDistribution):
        return trial.suggest_int(name, dist.low, dist.high, step=dist.step, log=dist.log)
    return trial.suggest_float(name, dist.low, dist.high, step=dist.step, log=dist.log)


def objective(space: dict[str, BaseDistribution], overrides: list[str], sweep_dir: Path, metric: str):
    """Train the sampled (or queued) values in a process of their own; return ``metric`` at the
    end, or end as pruned, or fail with the run's error line."""

    def run(trial: optuna.Trial) -> float:
        params = {name: suggest(trial, name, dist) for name, dist in space.items()}
        run_dir = sweep_dir / str(trial.number)
        run_dir.mkdir(parents=True, exist_ok=True)
        log_file = run_dir / "trial.log"
        cmd = trial_command(overrides, params, run_dir, storage_url(sweep_dir), trial.number)
        try:
            with log_file.open("w") as out:
                rc = subprocess.run(
                    cmd,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    preexec_fn=partial(die_with_parent, os.getpid()),
                ).returncode
        except KeyboardInterrupt:  # Ctrl-C reaches the trial too: run these values again next time
            trial.set_user_attr("interrupted", True)
            trial.set_user_attr("error", INTERRUPTED)
            trial.study.enqueue_trial(params, user_attrs={"rerun_of": trial.number})
            raise
        if rc != 0:
            fail(trial, f"exit status {rc}: {error_line(log_file)}")
        if "pruned_at_step" in trial.study.get_trials(deepcopy=False)[trial.number].user_attrs:
            raise optuna.TrialPruned()
        value = load_run(run_dir).final(metric) if (run_dir / "csv" / "metrics.csv").is_file() else None
        if value is None or not math.isfinite(value):
            fail(trial, f"{metric} is {value} at the end of the run")
        return value

    return run


def fail(trial: optuna.Trial, error: str) -> None:
    trial.set_user_attr("error", error)
    raise TrialFailed(error)


def run_sweep(
    study: optuna.Study,
    space: dict[str, BaseDistribution],
    overrides: list[str],
    sweep_dir: Path,
    metric: str,
    n_trials: int,
    echo=print,
) -> None:
    """Run trials until ``n_trials`` have finished (complete, pruned or failed)."""
    for number in recover_interrupted(study):
        echo(f"trial {number} was interrupted: its parameters are queued to run again")
    run = objective(space, overrides, sweep_dir, metric)
    while (done := sum(counted(t) for t in study.get_trials(deepcopy=False))) < n_trials:
        start = time.monotonic()
        study.optimize(run, n_trials=1, catch=(TrialFailed,))
        t = study.get_trials(deepcopy=False)[-1]
        params = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in t.params.items())
        if t.state == TrialState.COMPLETE:
            outcome = f"{metric} {t.value:.4f}"
        elif t.state == TrialState.PRUNED:
            outcome = f"pruned at step {t.user_attrs.get('pruned_at_step')}"
        else:
            outcome = f"failed: {t.user_attrs.get('error')}"
        seconds = time.monotonic() - start
        so_far = best_so_far(study)
        ran = f"trial {t.number}: {params} ({seconds:.0f} s)"
        echo(f"trial {done + 1}/{n_trials} done: {outcome} ({so_far}); {ran}")


def best_so_far(study: optuna.Study) -> str:
    """``best so far <value>, trial <number>`` among the complete trials (a resumed sweep's
    earlier ones included)."""
    if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        return "no complete trial yet"
    best = study.best_trial
    return f"best so far {best.value:.4f}, trial {best.number}"
