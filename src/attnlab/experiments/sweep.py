"""Optuna sweeps over ``attnlab-train`` runs: a trial per process (on its slot of the devices,
``Slot``), the study in ``<sweep dir>/optuna.db`` or a storage many drivers share, pruning from
inside the trial (``TrialPruning``); search spaces in Hydra's Optuna sweeper syntax."""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
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
    distribution_to_json,
)
from optuna.trial import TrialState

from attnlab.core.errors import ConfigError
from attnlab.core.specs import is_int
from attnlab.experiments.compare import flatten, load_run
from attnlab.experiments.study import STUDY, open_storage, rerun_numbers, storage_url, trial_id

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
INTERRUPTED = "interrupted: the sweep stopped during this trial; its values run again"


def positive(key: str, value: Any, what: str = "", none: bool = False) -> Any:
    """``value`` if a positive int (or null, ``none``), else one line naming ``key``."""
    if (value is None and none) or (is_int(value) and value > 0):
        return value
    raise ConfigError(f"{key}: expected a positive int{what}{' or null' if none else ''}, got {value!r}")


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
    """``sweep.params`` (dotted or nested keys) as Optuna distributions, plain values as overrides."""
    space, fixed = {}, []
    for key, value in flatten(params).items():
        dist = distribution(key, value)
        if dist is None:
            fixed.append(f"{key}={value}")
        else:
            space[key] = dist
    if not space:
        raise ConfigError("sweep.params: nothing to search (expected choice/range/interval expressions)")
    return space, fixed


def open_study(
    sweep_dir: Path | None,
    direction: str,
    sampler: optuna.samplers.BaseSampler | None = None,
    pruner: optuna.pruners.BasePruner | None = None,
    storage: optuna.storages.BaseStorage | None = None,
    study_name: str = STUDY,
) -> optuna.Study:
    """The study in ``<sweep_dir>/optuna.db``, or ``study_name`` in a shared ``storage``; created once."""
    if storage is None:
        sweep_dir.mkdir(parents=True, exist_ok=True)
        storage = open_storage(storage_url(sweep_dir))
    return optuna.create_study(
        storage=storage,
        study_name=study_name,
        direction=direction,
        sampler=sampler,
        pruner=pruner,
        load_if_exists=True,
    )


def check_same_search(
    study: optuna.Study, space: dict[str, BaseDistribution], metric: str, direction: str
) -> None:
    """Record what the study searches on first use; refuse a driver that searches otherwise."""
    mine = {
        "metric": metric,
        "direction": direction,
        "params": {k: distribution_to_json(d) for k, d in sorted(space.items())},
    }
    saved = study.user_attrs.get("attnlab_sweep")
    if saved is None:
        study.set_user_attr("attnlab_sweep", mine)
        return
    if saved != mine:
        old, new = flatten(saved), flatten(mine)  # "params.<key>": a distribution's JSON
        differ = [k for k in dict.fromkeys([*new, *sorted(old)]) if old.get(k) != new.get(k)]
        differ = [f"sweep.{k}" if k.startswith("params.") else k for k in differ]
        raise ConfigError(
            f"sweep.study_name={study.study_name}: that study searches otherwise ({', '.join(differ)} "
            "differ); give another sweep.study_name, or the same search"
        )


@dataclass(frozen=True)
class Slot:
    """One worker's devices: ``env`` for its trials and ``cores`` their affinity (default: the driver's)."""

    label: str = ""
    env: tuple[tuple[str, str], ...] = ()
    cores: tuple[int, ...] = ()


def cuda_device_count() -> int:
    import torch  # only to plan GPU slots: a config error ends before torch loads

    return torch.cuda.device_count()


def visible_gpus(accelerator: str) -> list[str]:
    """The GPUs a trial may use, as ``CUDA_VISIBLE_DEVICES`` names them; none on the CPU."""
    if str(accelerator) not in ("auto", "gpu", "cuda"):
        return []
    count = cuda_device_count()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(count))))
    return [d.strip() for d in listed.split(",") if d.strip()][:count]


def usable_cores() -> list[int]:
    """The CPU cores this process may run on (a cluster job's share, not the machine's)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def span(ids: list[int]) -> str:
    """``0-3,6``: core numbers as ranges."""
    parts: list[str] = []
    for i in ids:
        if parts and i == int(parts[-1].split("-")[-1]) + 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{i}"
        else:
            parts.append(str(i))
    return ",".join(parts)


def device_slots(n_jobs: Any, devices_per_trial: Any, accelerator: str, trainer_devices: Any) -> list[Slot]:
    """A slot per trial run at once (``sweep.n_jobs``): ``devices_per_trial`` GPUs (default:
    ``trainer.devices``) or CPU cores (default: an even share); what does not fit is refused."""
    positive("sweep.n_jobs", n_jobs, " (trials run at once)")
    positive("sweep.devices_per_trial", devices_per_trial, none=True)
    if n_jobs == 1 and devices_per_trial is None:
        return [Slot()]
    ranks = trainer_devices if is_int(trainer_devices) and trainer_devices > 0 else 1
    if gpus := visible_gpus(accelerator):
        per = devices_per_trial or ranks
        if n_jobs * per > len(gpus):
            raise ConfigError(
                f"sweep.n_jobs={n_jobs} x sweep.devices_per_trial={per} needs {n_jobs * per} GPUs; "
                f"{len(gpus)} visible: lower sweep.n_jobs"
            )
        if ranks > per:
            raise ConfigError(
                f"trainer.devices={ranks}: more GPUs than a trial has (sweep.devices_per_trial={per})"
            )
        slices = [gpus[k * per : (k + 1) * per] for k in range(n_jobs)]
        return [Slot(f"GPU {','.join(s)}", (("CUDA_VISIBLE_DEVICES", ",".join(s)),)) for s in slices]
    cores = usable_cores()
    per = devices_per_trial or len(cores) // n_jobs
    if per < 1 or n_jobs * per > len(cores):
        asked = f"sweep.n_jobs={n_jobs}" + (f" x sweep.devices_per_trial={per}" if devices_per_trial else "")
        raise ConfigError(
            f"{asked} needs {n_jobs * max(per, 1)} CPU cores; this process may use {len(cores)}: "
            "lower sweep.n_jobs"
        )
    if ranks > per:
        raise ConfigError(
            f"trainer.devices={ranks}: a trial's {ranks} processes need {ranks} CPU cores, it has {per} "
            f"({'sweep.devices_per_trial' if devices_per_trial else f'{len(cores)} cores / sweep.n_jobs'}): "
            "lower sweep.n_jobs or raise sweep.devices_per_trial"
        )
    threads = str(max(1, per // ranks))  # torch's threads per process: one per core, the cores split
    slices = [tuple(cores[k * per : (k + 1) * per]) for k in range(n_jobs)]
    return [Slot(f"cores {span(list(s))}", (("OMP_NUM_THREADS", threads),), s) for s in slices]


def counted(trial: optuna.trial.FrozenTrial, again: set[int] | frozenset[int] = frozenset()) -> bool:
    """A trial that counts towards ``n_trials``: finished, not interrupted, nor run ``again``."""
    return trial.state in FINISHED and not trial.user_attrs.get("interrupted") and trial.number not in again


def tally(trials: list[optuna.trial.FrozenTrial]) -> tuple[list, list]:
    """The trials that count towards ``n_trials``, and those running (here or elsewhere)."""
    again = rerun_numbers(trials)
    return [t for t in trials if counted(t, again)], [t for t in trials if t.state == TrialState.RUNNING]


def recover_interrupted(study: optuna.Study) -> list[int]:
    """The numbers of trials a killed sweep left running, failed as interrupted and queued again."""
    numbers = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        requeue(study, optuna.trial.Trial(study, trial_id(study, t.number)), t.params)
        study.tell(t.number, state=TrialState.FAIL)
        numbers.append(t.number)
    return numbers


def requeue(study: optuna.Study, trial: optuna.Trial, params: dict[str, Any]) -> None:
    """``trial`` marked interrupted, its values queued to run again."""
    trial.set_user_attr("interrupted", True)
    trial.set_user_attr("error", INTERRUPTED)
    study.enqueue_trial(params, user_attrs={"rerun_of": trial.number})


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
    overrides: list[str],
    params: dict[str, Any],
    run_dir: Path,
    storage: str,
    number: int,
    study_name: str = STUDY,
) -> list[str]:
    """A trial's ``attnlab-train`` command: overrides, sampled values, run folder, where to report."""
    sampled = [f"{k}={override_value(v)}" for k, v in params.items()]
    where = f"storage:{override_value(storage)},number:{number},study:{override_value(study_name)}"
    run = [f"hydra.run.dir={override_value(str(run_dir))}", f"sweep_trial={{{where}}}"]
    return [sys.executable, "-m", "attnlab.cli.train", *overrides, *sampled, *run]


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


# Resolved here, not in the child: between fork and exec a child of a threaded driver must not
# load a library or take a lock (another thread may have held it at the fork).
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def child_setup(driver: int, cores: tuple[int, ...] = (), blocked: tuple[int, ...] = ()) -> None:
    """In a trial's process before it starts: SIGTERM when the driver dies however it dies (Linux),
    its slot's ``cores``, and the job's signals ``blocked`` (the driver acts on them)."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG (the driver's thread waits for the trial)
        if os.getppid() != driver:  # the driver died before the request was in place
            os._exit(1)
    if cores:
        os.sched_setaffinity(0, cores)
    if blocked:
        signal.pthread_sigmask(signal.SIG_BLOCK, blocked)


def trial_environment(slot: Slot) -> tuple[dict[str, str], tuple[int, ...]]:
    """A trial's environment and blocked signals: a submitit driver's trial is a plain process
    (no submitit variables, no SLURM task count), and submitit's signal is the driver's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUBMITIT_") and k != "SLURM_NTASKS"}
    if "SUBMITIT_EXECUTOR" not in os.environ:
        return env | dict(slot.env), ()
    from submitit import JobEnvironment

    return env | dict(slot.env), (getattr(signal, f"SIG{JobEnvironment.USR_SIG}"),)


class TrialFailed(Exception):
    """A trial's run exited with an error or without a finite metric (recorded, the sweep goes on)."""


class Interrupted(Exception):
    """The driver was stopped during the trial: recorded, its values queued to run again."""


def suggest(trial: optuna.Trial, name: str, dist: BaseDistribution) -> Any:
    if isinstance(dist, CategoricalDistribution):
        return trial.suggest_categorical(name, dist.choices)
    if isinstance(dist, IntDistribution):
        return trial.suggest_int(name, dist.low, dist.high, step=dist.step, log=dist.log)
    return trial.suggest_float(name, dist.low, dist.high, step=dist.step, log=dist.log)


def fail(trial: optuna.Trial, error: str) -> None:
    trial.set_user_attr("error", error)
    raise TrialFailed(error)


def take_turn(gate: threading.Lock, study_lock: Any = None) -> ExitStack:
    """A worker's turn to ask for a trial and draw its values: one worker (``gate``) of one driver
    (``study_lock``) at a time, so counts hold and a grid gives no values twice; ``close()`` ends it."""
    with ExitStack() as turn:
        turn.enter_context(gate)
        if study_lock is not None:
            study_lock.acquire()
            turn.callback(study_lock.release)
        return turn.pop_all()


class AdvisoryLock:
    """A PostgreSQL study's lock: an advisory lock on a connection of its own."""

    def __init__(self, engine: Any, study_name: str) -> None:
        digest = hashlib.sha256(f"attnlab-sweep:{study_name}".encode()).digest()
        self.engine, self.key, self.conn = engine, int.from_bytes(digest[:8], "big", signed=True), None

    def acquire(self) -> None:
        from sqlalchemy import text

        self.conn = self.engine.connect()
        self.conn.execute(text("SELECT pg_advisory_lock(:key)"), {"key": self.key})

    def release(self) -> None:
        from sqlalchemy import text

        conn, self.conn = self.conn, None
        try:
            conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": self.key})
        finally:
            conn.close()


def study_lock(url: str, storage: optuna.storages.BaseStorage, study_name: str) -> Any:
    """The lock that drivers of the shared study at ``url`` (normalised) take turns on: a study
    file's is Optuna's lock for journals on NFS (a symlink, broken after 30 s)."""
    if not url.startswith(("journal:", "sqlite:///")):
        return AdvisoryLock(storage.engine, study_name)
    path = Path(url.removeprefix("journal:").removeprefix("sqlite:///"))
    target = path.with_name(path.name + ".ask")  # the lock's own, not the journal's (it appends)
    target.touch(exist_ok=True)  # the link's target must exist for its grace period to count
    return optuna.storages.journal.JournalFileSymlinkLock(str(target), grace_period=30)


@dataclass(frozen=True)
class Shared:
    """A study many drivers share: ``url`` normalised, ``driver`` this one's id (a trial's user attr),
    ``lock`` what they take turns on to ask, ``poll`` seconds between looks while trials run elsewhere."""

    url: str
    study_name: str
    driver: str
    lock: Any = None
    poll: float = 5.0


@dataclass(eq=False)
class Driver:
    """Runs trials on ``slots`` (one worker thread each) until the study has ``n_trials``."""

    study: optuna.Study
    space: dict[str, BaseDistribution]
    overrides: list[str]
    sweep_dir: Path
    metric: str
    n_trials: int
    echo: Callable[[str], Any] = print
    slots: tuple[Slot, ...] | list[Slot] = (Slot(),)
    shared: Shared | None = None  # None: the study in ``<sweep_dir>/optuna.db``, this driver's own

    def __post_init__(self) -> None:
        self.where = self.shared or Shared(storage_url(self.sweep_dir), STUDY, "")  # where trials report
        self.host = socket.gethostname()
        self.gate = threading.Lock()  # one worker at a time asks and draws: the same draws for any n_jobs
        self.lock = threading.Lock()  # what follows, and the console
        self.mine: dict[int, subprocess.Popen | None] = {}  # this driver's running trials
        self.stopping = threading.Event()
        self.errors: list[BaseException] = []
        self.ranks: set[int] = set()  # those this driver's reports gave

    def run(self) -> None:
        if not self.shared:  # a study this driver owns: the trials a killed sweep left running
            for number in recover_interrupted(self.study):
                self.echo(f"trial {number} was interrupted: its parameters are queued to run again")
        ends = [threading.Event() for _ in self.slots]
        for slot, end in zip(self.slots, ends, strict=True):
            threading.Thread(target=self.work, args=(slot, end), daemon=True).start()
        try:
            self.wait(ends)
        except KeyboardInterrupt:  # Ctrl-C: each running trial is recorded and queued again
            self.stop()
            self.wait(ends)
            raise
        if self.errors:
            raise self.errors[0]

    @staticmethod
    def wait(ends: list[threading.Event]) -> None:
        """Until every worker has ended (not ``Thread.join``: CPython gh-90882)."""
        while pending := [e for e in ends if not e.is_set()]:
            pending[0].wait(timeout=0.2)

    def stop(self) -> None:
        with self.lock:
            self.stopping.set()
            procs = [p for p in self.mine.values() if p is not None]
        for p in procs:
            if p.poll() is None:
                p.terminate()

    def say(self, line: str) -> None:
        with self.lock:
            self.echo(line)

    def work(self, slot: Slot, end: threading.Event) -> None:
        try:
            while not self.stopping.is_set():
                turn = take_turn(self.gate, self.where.lock)
                try:
                    step = self.next_step()
                    if step == "stop":
                        return
                    if step == "wait":
                        turn.close()
                        self.stopping.wait(self.where.poll)
                        with warnings.catch_warnings():  # as Optuna's own call is (experimental)
                            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                            optuna.storages.fail_stale_trials(self.study)  # then queued: run here
                        continue
                    self.study.optimize(
                        partial(self.trial, slot, turn),
                        n_trials=1,
                        catch=(TrialFailed, Interrupted),
                        callbacks=[self.report],
                    )
                except optuna.exceptions.UpdateFinishedTrialError as e:
                    # failed as stale by another driver while it still ran (a grace period too short)
                    self.say(f"note: {str(e).splitlines()[0]}")
                finally:
                    turn.close()
        except BaseException as e:  # a bug, or a storage that stopped answering: end the sweep
            with self.lock:
                self.errors.append(e)
            self.stop()
        finally:
            end.set()

    def next_step(self) -> str:
        """``run`` a trial; ``wait`` while the last trials run elsewhere (one may come back as
        stale); ``stop`` at ``n_trials``, or when the last run here."""
        done, running = tally(self.study.get_trials(deepcopy=False))
        if len(done) >= self.n_trials:
            return "stop"
        if len(done) + len(running) < self.n_trials:
            return "run"
        with self.lock:
            elsewhere = [t for t in running if t.number not in self.mine]
        return "wait" if self.shared and elsewhere else "stop"

    def trial(self, slot: Slot, turn: ExitStack, trial: optuna.Trial) -> float:
        """Train the drawn values on ``slot``: ``metric`` at the end, pruned, or failed."""
        try:
            params = {name: suggest(trial, name, dist) for name, dist in self.space.items()}
            with self.lock:
                self.mine[trial.number] = None
        finally:
            turn.close()
        try:
            return self.train(slot, trial, params)
        finally:
            with self.lock:
                self.mine.pop(trial.number, None)

    def train(self, slot: Slot, trial: optuna.Trial, params: dict[str, Any]) -> float:
        run_dir = self.sweep_dir / str(trial.number)
        run_dir.mkdir(parents=True, exist_ok=True)
        # where it ran, for attnlab-compare of a study that many machines share
        attrs = {
            "host": self.host,
            "run_dir": str(run_dir.resolve()),
            "devices": slot.label,
            "driver": self.where.driver,
        }
        first = self.study._storage.get_trial(trial._trial_id).system_attrs.get("failed_trial")
        attrs |= {"rerun_of": first} if first is not None else {}
        for key, value in attrs.items():
            if value not in ("", None):
                trial.set_user_attr(key, value)
        log_file = run_dir / "trial.log"
        cmd = trial_command(
            self.overrides, params, run_dir, self.where.url, trial.number, self.where.study_name
        )
        env, blocked = trial_environment(slot)
        with log_file.open("w") as out:
            proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=partial(child_setup, os.getpid(), slot.cores, blocked),
            )
            with self.lock:
                self.mine[trial.number] = proc
                stopped = self.stopping.is_set()
            if stopped:
                proc.terminate()
            rc = proc.wait()
        # Ctrl-C reaches the trial too (its process group), a moment before the driver notes it
        if rc != 0 and (self.stopping.is_set() or self.stopping.wait(0.5)):
            requeue(self.study, trial, params)
            raise Interrupted(INTERRUPTED)
        if rc != 0:
            fail(trial, f"exit status {rc}: {error_line(log_file)}")
        if "pruned_at_step" in self.study._storage.get_trial(trial._trial_id).user_attrs:
            raise optuna.TrialPruned()
        value = load_run(run_dir).final(self.metric) if (run_dir / "csv" / "metrics.csv").is_file() else None
        if value is None or not math.isfinite(value):
            fail(trial, f"{self.metric} is {value} at the end of the run")
        return value

    def report(self, study: optuna.Study, t: optuna.trial.FrozenTrial) -> None:
        """One line per finished trial: how it ended, the best so far, its values."""
        if t.user_attrs.get("interrupted"):
            self.say(f"trial {t.number} was interrupted: its parameters are queued to run again")
            return
        params = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in t.params.items())
        if t.state == TrialState.COMPLETE:
            outcome = f"{self.metric} {t.value:.4f}"
        elif t.state == TrialState.PRUNED:
            outcome = f"pruned at step {t.user_attrs.get('pruned_at_step')}"
        else:
            outcome = f"failed: {t.user_attrs.get('error')}"
        seconds = t.duration.total_seconds() if t.duration else 0.0
        done, _ = tally(study.get_trials(deepcopy=False))
        where = f" on {t.user_attrs['devices']}" if t.user_attrs.get("devices") else ""
        ran = f"trial {t.number}: {params}{where} ({seconds:.0f} s)"
        best = best_so_far(study)
        with self.lock:
            # its rank among the finished trials by finishing time, whichever thread prints first; the
            # time is stamped before the trial is stored, so a trial stored after a later-stamped one
            # was reported (under load) finds its rank given: it takes the next free one
            rank = sum(bool(d.datetime_complete and d.datetime_complete <= t.datetime_complete) for d in done)
            while rank in self.ranks:
                rank += 1
            self.ranks.add(rank)
            self.echo(f"trial {rank}/{self.n_trials} done: {outcome} ({best}); {ran}")


def best_so_far(study: optuna.Study) -> str:
    """``best so far <value>, trial <number>`` among the complete trials."""
    if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        return "no complete trial yet"
    best = study.best_trial
    return f"best so far {best.value:.4f}, trial {best.number}"
