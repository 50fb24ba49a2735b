"""Comparing finished runs (``csv/metrics.csv`` and ``config.yaml``; an offline W&B run through
``wandb leet inspect --json``; a study's trials): metrics beside the hyperparameters that differ."""

from __future__ import annotations

import csv
import fnmatch
import functools
import json
import logging
import math
import re
import shutil
import statistics
import subprocess
import sys
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from attnlab.core.errors import ConfigError, DataError
from attnlab.experiments.study import (
    is_study_url,
    load_trials,
    normalize_url,
    open_storage,
    rerun_numbers,
    shown,
)

# config keys that say where or how a run was logged, not what was trained
IGNORED_PREFIXES = ("paths.", "hydra.", "logger.", "extras.", "callbacks.", "sweep_trial.", "sweep.dir")
IGNORED_PREFIXES += ("sweep.executor.", "sweep.resources.")
IGNORED_KEYS = {"ckpt_path", "tags", "train", "test", "trainer.devices", "trainer.accelerator"}
IGNORED_KEYS |= {"sweep.n_jobs", "sweep.devices_per_trial", "sweep.storage", "sweep.study_name"}
IGNORED_KEYS |= {"sweep.heartbeat_interval", "sweep.grace_period", "sweep.workers"}
IGNORED_KEYS |= {"data.data_dir", "data.cache_dir", "data.source.data_dir", "data.source.cache_dir"}
IGNORED_KEYS |= {"model.plot_dir", "model.net.plot_dir", "trainer.default_root_dir"}
SEED = "seed"
HOST = "host"  # the machine a sweep trial ran on: a column wherever trials are listed
# where `wandb leet inspect` cannot read an offline W&B run (an older wandb, a damaged file)
WANDB_UNREAD = "upload it with `wandb sync <dir>` and compare on W&B, or log with logger=csv too"


@dataclass
class Run:
    path: Path
    config: dict[str, Any]  # flattened: "model.optim.optimizer.lr" -> 0.001
    curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)

    def final(self, metric: str) -> float | None:
        points = self.curves.get(metric)
        return points[-1][1] if points else None

    def best(self, metric: str) -> float | None:
        points = self.curves.get(metric)
        if not points:
            return None
        values = [v for _, v in points]
        return min(values) if lower_is_better(metric) else max(values)


def lower_is_better(metric: str) -> bool:
    name = metric.rsplit("/", 1)[-1]
    return any(k in name for k in ("loss", "ppl", "perplexity", "error", "ms_per"))


def flatten(node: Any, prefix: str = "", sep: str = ".") -> dict[str, Any]:
    if isinstance(node, Mapping):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out |= flatten(v, f"{prefix}{k}{sep}", sep)
        return out
    if isinstance(node, list):
        return {prefix[: -len(sep)]: str(node)}
    return {prefix[: -len(sep)]: node}


def notice(message: str) -> None:
    """A line on stderr about input left out; the table goes on without it."""
    print(f"note: {message}", file=sys.stderr)


def read_curves(path: Path) -> dict[str, list[tuple[int, float]]]:
    """Every metric of a CSV log as (step, value) pairs; a last line without its newline (still
    being written, or cut) is left out with a notice, any other non-number is an error."""
    text = path.read_text(errors="replace")
    lines = text.splitlines()
    if lines and not text.endswith("\n"):
        notice(f"{path}:{len(lines)}: an incomplete last line (a run still writing, or cut): left out")
        lines = lines[:-1]
    curves: dict[str, list[tuple[int, float]]] = {}
    for n, row in enumerate(csv.DictReader(lines), start=2):
        try:
            step = int(float(row.get("step") or 0))
            for k, v in row.items():
                if k not in ("step", "epoch") and v not in ("", None):
                    curves.setdefault(k, []).append((step, float(v)))
        except (TypeError, ValueError):
            bad = {k: v for k, v in row.items() if v not in ("", None) and not _is_number(v)}
            raise DataError(f"{path}:{n}: not a number: {bad}") from None
    return curves


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def load_run(run_dir: Path) -> Run:
    config_file = run_dir / "config.yaml"
    if not config_file.is_file():
        config_file = run_dir / ".hydra" / "config.yaml"
    config = read_config(config_file, run_dir) if config_file.is_file() else {}
    derived = derived_keys(run_dir)
    config = {k: v for k, v in flatten(config).items() if k not in derived}
    return Run(run_dir, config, read_curves(run_dir / "csv" / "metrics.csv"))


def read_config(file: Path, run_dir: Path, resolve: bool = True, notify: bool = True) -> dict[str, Any]:
    """A run's saved config as a dict, in today's names (an old run: one notice line, ``notify``)."""
    from attnlab.core.legacy import read_saved

    legacy = logging.getLogger("attnlab.core.legacy")
    legacy.disabled = not notify
    try:
        config = OmegaConf.load(file)
        if not isinstance(config, DictConfig):
            raise DataError(f"{file}: not a config (a YAML mapping)")
        return OmegaConf.to_container(read_saved(config, str(run_dir)), resolve=resolve)
    except DataError:
        raise
    except Exception as e:  # YAML's and OmegaConf's parse errors have no common base
        raise DataError(f"{file}: not a readable config ({str(e).strip().splitlines()[0]})") from None
    finally:
        legacy.disabled = False


def derived_keys(run_dir: Path) -> set[str]:
    """Keys interpolated from another (``data.seed: ${seed}``) in Hydra's unresolved copy: not
    hyperparameters of their own (else no seeds would group); one set on the command line counts."""
    raw = run_dir / ".hydra" / "config.yaml"
    if not raw.is_file():
        return set()
    try:
        config = read_config(raw, run_dir, resolve=False, notify=False)
    except DataError as e:
        notice(f"{e}: its interpolated keys count as set")
        return set()
    return {k for k, v in flatten(config).items() if isinstance(v, str) and "${" in v}


def wandb_records(run_dir: Path) -> list[dict[str, Any]]:
    """The records of an offline W&B run's ``.wandb`` log (``wandb leet inspect --json``)."""
    beside = Path(sys.executable).with_name("wandb")  # the wandb of this environment first
    cli = str(beside) if beside.is_file() else shutil.which("wandb")
    if cli is None:
        raise DataError(
            f"{run_dir}: an offline W&B run without a CSV log, and no wandb command to read it; "
            + WANDB_UNREAD
        )
    proc = subprocess.run([cli, "leet", "inspect", "--json", str(run_dir)], capture_output=True, text=True)
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise DataError(f"{run_dir}: wandb leet inspect cannot read it ({why}); {WANDB_UNREAD}")
    try:
        return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        raise DataError(f"{run_dir}: wandb leet inspect printed no JSON ({e}); {WANDB_UNREAD}") from None


def load_wandb_run(run_dir: Path) -> Run:
    """Config and metric curves of an offline W&B run (step: Lightning's ``trainer/global_step``)."""
    config: dict[str, Any] = {}
    curves: dict[str, list[tuple[int, float]]] = {}
    for record in wandb_records(run_dir):
        kind = record.get("type")
        if kind in ("run", "config"):  # the config given at init, then updates (Lightning's hparams)
            config |= (record[kind].get("config", {}) if kind == "run" else record[kind]).get("update", {})
        elif kind == "history":
            row = flatten(record["history"].get("item", {}), sep="/")
            step = int(row.get("trainer/global_step", row.get("_step", 0)))
            for k, v in row.items():
                skipped = k.startswith("_") or k in ("epoch", "trainer/global_step")
                if not skipped and type(v) in (int, float):  # JSON's numbers; not bool
                    curves.setdefault(k, []).append((step, float(v)))
    for key in ("machine", "_wandb"):
        config.pop(key, None)
    return Run(run_dir, flatten(config), curves)


def _read_elsewhere(wandb_dir: Path) -> bool:
    """An offline W&B run inside a run with its CSV log, or a sweep's trial (read from there)."""
    return any(
        (p / "csv" / "metrics.csv").is_file() or bool(sweep_trials(p.parent)) for p in wandb_dir.parents[:3]
    )


def find_runs(paths: Iterable[Path]) -> list[Run]:
    """Every run under ``paths`` (each a run directory, or a folder holding runs), in path order."""
    runs, missing = [], []
    for path in paths:
        if not path.exists():
            missing.append(str(path))
            continue
        logs = [path / "csv" / "metrics.csv"] if (path / "csv" / "metrics.csv").is_file() else []
        logs = logs or sorted(path.rglob("csv/metrics.csv"))
        runs += [load_run(log.parent.parent) for log in logs]
        offline = sorted(path.glob("run-*.wandb")) or sorted(path.rglob("offline-run-*/run-*.wandb"))
        runs += [load_wandb_run(f.parent) for f in offline if not _read_elsewhere(f.parent)]
    if missing:
        raise DataError(f"no such run or sweep directory: {', '.join(missing)}")
    runs = without_copies(without_empty(runs))
    runs += [t for path in paths if path.exists() for t in unlogged_trials(path, runs)]
    for run in runs:
        run.config |= sweep_columns(run.path.parent).get(run.path.name, {})
    if not runs:
        raise DataError(f"no runs (csv/metrics.csv) under {', '.join(map(str, paths))}")
    return runs


def without_empty(runs: list[Run]) -> list[Run]:
    """Runs that logged no metric yet left out with a notice, but for sweep trials."""
    kept = []
    for run in runs:
        if run.curves or sweep_trials(run.path.parent):
            kept.append(run)
        else:
            notice(f"{run.path}: no metrics logged yet: left out")
    return kept


def without_copies(runs: list[Run]) -> list[Run]:
    """Of runs with the same config, seed and all (copies), the one that logged the most steps, the
    others left out with a notice; sweep trials are kept (a sampler may draw values twice)."""
    by_config: dict[str, list[Run]] = {}
    for run in runs:
        if sweep_trials(run.path.parent):
            by_config[str(run.path)] = [run]
            continue
        key = repr(sorted((k, repr(v)) for k, v in run.config.items() if is_hyperparameter(k)))
        by_config.setdefault(key, []).append(run)
    kept = []
    for same in by_config.values():
        if len(same) == 1 or not same[0].config:
            kept += same
            continue
        longest = max(same, key=lambda r: sum(len(points) for points in r.curves.values()))
        for run in same:
            if run is not longest:
                notice(f"{run.path}: the same config as {longest.path}, seed included (a copy?): left out")
        kept.append(longest)
    return sorted(kept, key=lambda r: runs.index(r))


def unlogged_trials(sweep_dir: Path, runs: list[Run]) -> list[Run]:
    """Trials of a sweep directory that ended before writing a log: a row each with their values."""
    logged = {r.path.resolve() for r in runs}
    # the trials share everything but the sampled values: a logged sibling gives the rest
    sibling = next((r.config for r in runs if r.path.parent.resolve() == sweep_dir.resolve()), {})
    return [
        Run(sweep_dir / str(t.number), {**sibling, **t.params})
        for t in sweep_trials(sweep_dir)
        if (sweep_dir / str(t.number)).resolve() not in logged
    ]


def trial_columns(t: Any, again: set[int], host: str | None = None) -> dict[str, Any]:
    """A trial's columns: its number, how it ended (complete, pruned, fail, running, or interrupted:
    its sweep stopped, or its driver died, failed as stale with a ``host`` and no error, or run
    ``again``) and the machine it ran on (else ``host``)."""
    stale = t.state.name == "FAIL" and HOST in t.user_attrs and "error" not in t.user_attrs
    interrupted = stale or t.user_attrs.get("interrupted") or t.number in again
    state = "interrupted" if interrupted else t.state.name.lower()
    host = t.user_attrs.get(HOST, host)
    return {"trial": t.number, "state": state} | ({HOST: host} if host else {})


@functools.cache
def sweep_columns(sweep_dir: Path) -> dict[str, dict[str, Any]]:
    """Trial number -> its columns, in a sweep directory's study; empty for any other folder."""
    trials = sweep_trials(sweep_dir)
    again = rerun_numbers(trials)
    return {str(t.number): trial_columns(t, again) for t in trials}


@functools.cache
def sweep_trials(sweep_dir: Path) -> list[Any]:
    """The trials of a sweep directory's study, read once; none elsewhere, or unreachable (said)."""
    try:
        return load_trials(sweep_dir)
    except ConfigError as e:
        notice(f"{sweep_dir}: {e}: its trials are listed without how they ended")
        return []


def study_runs(url: str, study_name: str | None = None) -> tuple[list[Run], list[str]]:
    """A run per trial of the study (or every study) at ``url``, with its machine: its run folder's
    logs where reachable, else what the study holds; and the studies' metric names."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = normalize_url(url, key=None)
    file = url.removeprefix("journal:").removeprefix("sqlite:///")
    if file != url and not Path(file).is_file():
        raise DataError(f"{shown(url)}: no such file")
    storage = open_storage(url, key=None)
    names = optuna.study.get_all_study_names(storage)
    if study_name is not None and study_name not in names:
        raise ConfigError(f"--study {study_name}: no such study in {shown(url)} (it has: {', '.join(names)})")
    runs: list[Run] = []
    metrics: list[str] = []
    for name in [study_name] if study_name else names:
        study = optuna.load_study(study_name=name, storage=storage)
        metric = (study.metric_names or ["value"])[0]
        metrics += [metric] if metric not in metrics else []
        trials = [t for t in study.get_trials(deepcopy=False) if t.state.name != "WAITING"]
        again = rerun_numbers(trials)
        logged = {t.number: Path(t.user_attrs["run_dir"]) for t in trials if "run_dir" in t.user_attrs}
        logged = {n: load_run(d) for n, d in logged.items() if (d / "csv" / "metrics.csv").is_file()}
        sibling = next(iter(logged.values())).config if logged else {}  # what unreached trials share
        for t in trials:
            run = logged.get(t.number) or Run(
                Path(t.user_attrs.get("run_dir", f"{name}/{t.number}")),
                {**sibling, **t.params},
                {metric: [(0, t.value)]} if t.value is not None else {},
            )
            run.config |= {"study": name} if len(names) > 1 and not study_name else {}
            run.config |= trial_columns(t, again, host="-")
            runs.append(run)
    return runs, metrics


def find_sources(sources: Iterable[str], study_name: str | None = None) -> tuple[list[Run], list[str]]:
    """The runs of the folders and study URLs given, and the metric names the studies optimised."""
    sources = [str(s) for s in sources]
    urls = [s for s in sources if is_study_url(s)]
    paths = [Path(s) for s in sources if not is_study_url(s)]
    runs = find_runs(paths) if paths else []
    metrics: list[str] = []
    for url in urls:
        found, names = study_runs(url, study_name)
        runs += found
        metrics += [m for m in names if m not in metrics]
    if urls and not runs:
        raise DataError(f"no trials in {', '.join(map(shown, urls))}")
    return runs, metrics


def is_hyperparameter(key: str) -> bool:
    """A flattened config key that says what was trained, not where or how it was logged."""
    return not key.startswith(IGNORED_PREFIXES) and key not in IGNORED_KEYS


def varying_keys(runs: list[Run]) -> list[str]:
    """Hyperparameters whose values differ between the runs, and last the machine of sweep trials."""
    keys = sorted({k for r in runs for k in r.config} - {HOST})
    varying = [k for k in keys if is_hyperparameter(k) and len({repr(r.config.get(k)) for r in runs}) > 1]
    return varying + ([HOST] if any(HOST in r.config for r in runs) else [])


def default_metrics(runs: list[Run]) -> list[str]:
    """The test metrics (``eval/test/...`` too), else the validation ones, but bests and per-class."""
    names = logged_metrics(runs)
    test = [m for m in names if m.startswith(("test/", "eval/test/")) and "/acc_class/" not in m]
    return test or [m for m in names if m.startswith("val/") and not m.endswith("_best")]


@dataclass
class Row:
    label: dict[str, Any]  # the varying hyperparameters
    runs: list[Run]
    values: dict[str, list[float]]  # per metric, one value per run

    def mean(self, metric: str) -> float:
        vals = self.values.get(metric) or []
        return statistics.fmean(vals) if vals else math.nan


def rows(runs: list[Run], metrics: list[str], group_seeds: bool = True, best: bool = False) -> list[Row]:
    """One row per run, or per setting (varying keys but the seed) with its runs' values."""
    keys = varying_keys(runs)
    label_keys = [k for k in keys if not (group_seeds and k == SEED)]
    out: dict[tuple, Row] = {}
    for i, run in enumerate(runs):
        label = {k: run.config.get(k) for k in label_keys}
        key = tuple(repr(v) for v in label.values()) if group_seeds else (i,)
        row = out.setdefault(key, Row(label, [], {}))
        row.runs.append(run)
        for m in metrics:
            v = run.best(m) if best else run.final(m)
            if v is not None:
                row.values.setdefault(m, []).append(v)
    return list(out.values())


def short(value: Any, width: int = 32) -> str:
    """A value for a legend: long ones (paths) keep their start and end."""
    text = str(value)
    return text if len(text) <= width else f"{text[: width // 2 - 1]}…{text[-(width // 2) :]}"


def _series(groups: dict[str, list[dict[float, float]]]) -> dict[str, list[tuple[float, float, float]]]:
    """Per label, the points every run of it has: (x, mean, std over the runs)."""
    series = {}
    for label, curves in groups.items():
        xs = sorted(set.intersection(*(set(c) for c in curves)))  # logged by every seed
        values = [[c[x] for c in curves] for x in xs]
        if len(curves) > 1:
            label = f"{label} ({len(curves)} seeds)"
        series[label] = [
            (x, statistics.fmean(v), statistics.stdev(v) if len(v) > 1 else 0.0)
            for x, v in zip(xs, values, strict=True)
        ]
    return series


def _label(run: Run, keys: list[str]) -> str:
    return ", ".join(f"{k.rsplit('.', 1)[-1]}={short(run.config.get(k))}" for k in keys) or run.path.name


def _save(fig: Any, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def plot(runs: list[Run], metric: str, out: Path, x: str | None = None, group_seeds: bool = True) -> Path:
    """``metric`` of every run against the step, labelled by what varies, seeds as mean ± std; with
    ``x``, each run's last value against config key ``x``, or (``x="*"``) against the number a ``*``
    in ``metric`` stands for (``eval/test/ppl_x*``): a line per setting, log2 x axis."""
    from attnlab.training.plots import curves_figure

    pattern = re.compile(re.escape(metric).replace(r"\*", r"([0-9.]+)") + "$") if x == "*" else None
    varying = [k for k in varying_keys(runs) if k != x and not (group_seeds and k == SEED)]
    groups: dict[str, dict[str, dict[float, float]]] = {}
    for run in runs:
        points: dict[float, float] = {}
        if x is None:
            points = dict(run.curves.get(metric, []))
        elif pattern is not None:
            for name in run.curves:
                if (m := pattern.match(name)) and (v := run.final(name)) is not None:
                    points[float(m.group(1))] = v
        elif metric in run.curves and _is_number(run.config.get(x)):
            points[float(run.config[x])] = run.final(metric)
        if points:
            # against x, runs of one setting that differ by seed average; runs at different x join one line
            line = repr(run.config.get(SEED)) if x else str(run.path)
            groups.setdefault(_label(run, varying), {}).setdefault(line, {}).update(points)
    if not groups and x is None:
        raise DataError(f"--plot {metric}: no run logged it")
    if not groups:
        what = f"a metric named like {metric}" if x == "*" else f"{metric} with a number at {x}"
        raise DataError(f"--plot {metric} --x {x}: no run logged {what}")
    series = _series({label: list(lines.values()) for label, lines in groups.items()})
    if x is None:
        return _save(curves_figure(series, metric), out)
    xlabel = metric.split("*")[0].rsplit("/", 1)[-1].rstrip("_") if x == "*" else x
    return _save(curves_figure(series, metric.replace("*", ""), xlabel=xlabel, logx=True), out)


# ---- statistics over the seeds of each row (scipy and sacreBLEU do the maths) ---------------------


@dataclass
class Stats:
    """What ``comparison`` adds to each row's mean ± std: ``attnlab-compare``'s flags."""

    baseline: str | None = None  # a row's label as printed ("model.net.positions=learned"), or "2"
    ci: str | None = "t"  # Student's t, "bootstrap", or None: no intervals
    level: float = 0.95
    test: str = "welch"  # Welch's t-test, or "mwu" (Mann-Whitney U)
    alpha: float = 0.05


def confidence_interval(values: list[float], level: float = 0.95, method: str = "t") -> list[float] | None:
    """The interval of the mean of ``values``: Student's t, or a BCa bootstrap (seeded: stable output)."""
    import numpy as np
    from scipy import stats

    if len(values) < 2:
        return None
    if method == "bootstrap":
        ci = stats.bootstrap((values,), np.mean, confidence_level=level, rng=0).confidence_interval
    else:
        ci = stats.ttest_1samp(values, 0.0).confidence_interval(level)
    return [float(ci.low), float(ci.high)]


def seeds_needed(d: float, alpha: float = 0.05, power: float = 0.8) -> int | None:
    """Seeds per group for a two-sided two-sample t-test at ``alpha`` to detect an effect of
    Cohen's ``d`` with ``power`` (the noncentral t's power); None for no effect."""
    from scipy import stats

    def short_of(n: int) -> float:
        df, crit = 2 * n - 2, stats.t.ppf(1 - alpha / 2, 2 * n - 2)
        nc = abs(d) * math.sqrt(n / 2)
        reach = stats.nct.sf(crit, df, nc) + stats.nct.cdf(-crit, df, nc)
        if math.isnan(reach):  # the nct fails far out (large nc): the normal is exact enough there
            reach = stats.norm.sf(crit - nc) + stats.norm.cdf(-crit - nc)
        return reach - power

    if not d or math.isnan(d):
        return None
    if math.isinf(d):  # seeds that all agree, and a difference
        return 2
    hi = 2
    while short_of(hi) < 0:
        hi *= 2
    lo = max(2, hi // 2)  # the first n with enough power lies in (lo, hi] (or is 2)
    if short_of(lo) >= 0:
        return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if short_of(mid) >= 0 else (mid, hi)
    return hi


def versus(values: list[float], base: list[float], stats: Stats) -> dict[str, Any]:
    """``values`` against the baseline's: the test's p-value, the difference of the means with its
    Welch-Satterthwaite interval, and the seeds needed to detect it (Cohen's d, the pooled std)."""
    from scipy import stats as st

    if not values or not base:
        return {}
    out: dict[str, Any] = {"diff": statistics.fmean(values) - statistics.fmean(base)}
    if min(len(values), len(base)) < 2:
        return out
    welch = st.ttest_ind(values, base, equal_var=False)
    p = st.mannwhitneyu(values, base).pvalue if stats.test == "mwu" else welch.pvalue
    ci = welch.confidence_interval(stats.level)
    n, m = len(values), len(base)
    pooled = math.sqrt(
        ((n - 1) * statistics.variance(values) + (m - 1) * statistics.variance(base)) / (n + m - 2)
    )
    d = out["diff"] / pooled if pooled else math.inf
    return out | {"p": p, "diff_ci": [ci.low, ci.high], "seeds_needed": seeds_needed(d, stats.alpha)}


def paired_bleu(hyps: list[str], base_hyps: list[str], refs: list[str]) -> float:
    """sacreBLEU's paired bootstrap p-value of ``hyps`` against the baseline's."""
    from sacrebleu.metrics import BLEU
    from sacrebleu.significance import PairedTest

    test = PairedTest([("baseline", base_hyps), ("row", hyps)], {"BLEU": BLEU()}, [refs], test_type="bs")
    return test()[1]["BLEU"][1].p_value


def translations(row: Row) -> tuple[list[str], list[str]] | None:
    """The test translations and references of the row's first run that saved both."""
    for run in row.runs:
        hyps, refs = (run.path / f"test_{name}.txt" for name in ("translations", "references"))
        if hyps.is_file() and refs.is_file():
            return hyps.read_text("utf-8").splitlines(), refs.read_text("utf-8").splitlines()
    return None


def row_label(row: Row) -> str:
    return ", ".join(f"{k}={v}" for k, v in row.label.items())


def baseline_row(table_rows: list[Row], name: str) -> Row:
    """The row ``--baseline`` names: its 1-based index, or its ``key=value`` pairs (keys in full
    or their last part)."""
    if name.isdigit() and 1 <= int(name) <= len(table_rows):
        return table_rows[int(name) - 1]
    wanted = {part.strip() for part in name.split(",")}
    found = [
        r
        for r in table_rows
        if wanted <= {f"{key}={v}" for k, v in r.label.items() for key in (k, k.rsplit(".", 1)[-1])}
    ]
    if len(found) != 1:
        labels = "; ".join(f"{i}: {row_label(r)}" for i, r in enumerate(table_rows, 1))
        raise ConfigError(f"--baseline: {name!r} names {len(found)} rows, expected one of ({labels})")
    return found[0]


def cell(row: Row, base: Row | None, metric: str, stats: Stats) -> dict[str, Any]:
    """A row's statistics for one metric, against ``base`` where given."""
    values = row.values.get(metric, [])
    out: dict[str, Any] = dict.fromkeys(("p", "diff", "diff_ci", "seeds_needed", "mark", "bleu_p"))
    out |= {"n": len(values), "values": values, "mean": statistics.fmean(values) if values else None}
    out |= {"std": statistics.stdev(values) if len(values) > 1 else None}
    out["ci"] = confidence_interval(values, stats.level, stats.ci) if stats.ci else None
    if base is None or base is row:
        return out
    out |= versus(values, base.values.get(metric, []), stats)
    if "bleu" in metric and (mine := translations(row)) and (theirs := translations(base)):
        out["bleu_p"] = paired_bleu(mine[0], theirs[0], theirs[1])
    p = out["p"] if out["p"] is not None else out["bleu_p"]
    if p is not None and p < stats.alpha and out["diff"]:
        # attention health has no better side: its rows only differ
        better = (out["diff"] < 0) == lower_is_better(metric)
        out["mark"] = "differs" if metric.startswith("attn/") else "better" if better else "worse"
    return out


def plain(value: Any) -> Any:
    """JSON's own types: numpy's numbers as floats, NaN and infinities as None."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, bool | int | str) or value is None:
        return value
    return float(value) if math.isfinite(value) else None


def comparison(table_rows: list[Row], metrics: list[str], stats: Stats | None = None) -> dict[str, Any]:
    """The table of ``attnlab-compare --format json``: every row's statistics per metric."""
    stats = stats or Stats()
    base = baseline_row(table_rows, stats.baseline) if stats.baseline else None
    with warnings.catch_warnings():  # seeds with equal values: scipy warns, the interval is null
        warnings.simplefilter("ignore")
        out_rows = [
            {
                "label": row_label(row),
                "config": row.label,
                "runs": [str(r.path) for r in row.runs],
                "metrics": {m: cell(row, base, m, stats) for m in metrics},
            }
            for row in table_rows
        ]
    head = {"metrics": metrics, "keys": list(table_rows[0].label) if table_rows else []}
    settings = {k: v for k, v in vars(stats).items() if k != "baseline"}
    return plain(head | {"baseline": row_label(base) if base else None} | settings | {"rows": out_rows})


def logged_metrics(runs: list[Run]) -> list[str]:
    return sorted({m for r in runs for m in r.curves})


def choose_metrics(runs: list[Run], names: list[str] | None, study_metrics: list[str]) -> list[str]:
    """``names`` as given: a logged name, a glob (``attn/entropy/*``), or a prefix standing for the
    names under it; by default the test metrics and what the studies optimised."""
    logged = logged_metrics(runs)
    names = names or default_metrics(runs) + [m for m in study_metrics if m in logged]
    out: list[str] = []
    for name in names:
        found = [name] if name in logged else fnmatch.filter(logged, name)
        found = found or [m for m in logged if m.startswith(name.rstrip("/") + "/")]
        if not found:
            raise ConfigError(f"--metrics {name}: no run logged it (logged: {', '.join(logged)})")
        out += [m for m in found if m not in out]
    return out
