"""Optuna sweeps over Hydra-composed runs.

The study lives in SQLite inside the sweep directory (``optuna.db``), so a sweep that is stopped
resumes where it was and ``optuna-dashboard`` can read it; or in a storage many drivers share
(``sweep.storage``: PostgreSQL, or a journal file on a shared filesystem), each driver on its own
machine adding trials to one study until it has ``n_trials``. Every trial is its own
``attnlab-train`` process: a crash, an out-of-memory kill or DDP's relaunch of the command line
stays inside its trial, and the trial's ranks all run the same overrides. The trial reports its
validation metric to the study while it trains (``attnlab.experiments.pruning.TrialPruning``), so the
pruner can stop it early.

``sweep.n_jobs`` trials run at once, each on its own slice of the devices (``Slot``): GPUs by
``CUDA_VISIBLE_DEVICES``, CPU cores by affinity and ``OMP_NUM_THREADS``. Each runs in a thread of
the driver that waits on its process; the threads take turns to ask the study for a trial and
draw its values, so a seeded sampler draws the same values whatever ``n_jobs`` is.

Search spaces are written as for Hydra's Optuna sweeper, so its users' configs carry over:
``choice(a, b, ...)``, ``range(start, stop[, step])``, ``interval(low, high)``, and
``tag(log, interval(...))`` / ``tag(int, interval(...))``; a plain value is a fixed override.
"""

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
from attnlab.experiments.compare import load_run
from attnlab.experiments.study import STUDY, open_storage, storage_url, trial_id

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
    dotted (``model.optim.optimizer.lr: ...``) or nested (``+sweep.params.model.optim.optimizer.lr=...``)."""
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
    sweep_dir: Path | None,
    direction: str,
    sampler: optuna.samplers.BaseSampler | None = None,
    pruner: optuna.pruners.BasePruner | None = None,
    storage: optuna.storages.BaseStorage | None = None,
    study_name: str = STUDY,
) -> optuna.Study:
    """The study in ``<sweep_dir>/optuna.db``, or ``study_name`` in a shared ``storage``
    (``attnlab.experiments.study.open_storage``), created on first use and loaded after that."""
    if direction not in ("minimize", "maximize"):
        raise ConfigError(f"sweep.direction: expected minimize or maximize, got {direction!r}")
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
    """Record what the study searches on first use; refuse a driver that would add other trials
    to it (another search space, metric or direction under the same ``sweep.study_name``)."""
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
        keys = sorted(set(saved.get("params", {})) | set(mine["params"]))
        differ = [k for k in ("metric", "direction") if saved.get(k) != mine[k]]
        differ += [
            f"sweep.params.{k}" for k in keys if saved.get("params", {}).get(k) != mine["params"].get(k)
        ]
        raise ConfigError(
            f"sweep.study_name={study.study_name}: that study searches otherwise ({', '.join(differ)} "
            "differ); give another sweep.study_name, or the same search"
        )


@dataclass(frozen=True)
class Slot:
    """The devices of one worker's trials: ``env`` added to theirs (``CUDA_VISIBLE_DEVICES``,
    ``OMP_NUM_THREADS``), ``cores`` their CPU affinity. The default, nothing: a trial takes what
    the driver has (one trial at a time, as before ``sweep.n_jobs``)."""

    label: str = ""
    env: tuple[tuple[str, str], ...] = ()
    cores: tuple[int, ...] = ()


def cuda_device_count() -> int:
    import torch  # only to plan GPU slots: a config error ends before torch loads

    return torch.cuda.device_count()


def visible_gpus(accelerator: str) -> list[str]:
    """The GPUs a trial may use here, as ``CUDA_VISIBLE_DEVICES`` names them; none for a run on
    the CPU (``trainer.accelerator=cpu``, or ``auto`` without a GPU)."""
    if str(accelerator) not in ("auto", "gpu", "cuda"):
        return []
    count = cuda_device_count()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return [str(i) for i in range(count)]
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
    """One slot per trial run at once (``sweep.n_jobs``), each its own devices: on GPUs
    ``devices_per_trial`` of them (default: ``trainer.devices``), on a CPU as many cores (default:
    an even share), with one torch thread per core for each of the trial's processes. More than
    the devices here is a ``ConfigError``, as is a trial whose ``trainer.devices`` processes
    would not fit in its slot (a DDP trial stays inside its devices)."""
    if not is_int(n_jobs) or n_jobs < 1:
        raise ConfigError(f"sweep.n_jobs: expected a positive int (trials run at once), got {n_jobs!r}")
    if devices_per_trial is not None and (not is_int(devices_per_trial) or devices_per_trial < 1):
        raise ConfigError(
            f"sweep.devices_per_trial: expected a positive int or null, got {devices_per_trial!r}"
        )
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


def retried(trials: list[optuna.trial.FrozenTrial]) -> set[int]:
    """The trials failed as stale whose values were queued again (Optuna's
    ``RetryHeartbeatStaleTrialCallback`` writes the chain into the new trial's system attrs)."""
    return {n for t in trials for n in t.system_attrs.get("retry_history", [])}


def counted(trial: optuna.trial.FrozenTrial, again: set[int] | frozenset[int] = frozenset()) -> bool:
    """A trial that counts towards ``n_trials``: finished, and not cut short by a stopped sweep,
    nor a stale one run ``again``."""
    return trial.state in FINISHED and not trial.user_attrs.get("interrupted") and trial.number not in again


def tally(trials: list[optuna.trial.FrozenTrial]) -> tuple[list, list]:
    """The trials that count towards ``n_trials``, and those running (here or elsewhere)."""
    again = retried(trials)
    return [t for t in trials if counted(t, again)], [t for t in trials if t.state == TrialState.RUNNING]


def recover_interrupted(study: optuna.Study) -> list[int]:
    """Trials left running by a sweep that was killed: recorded as failed (``interrupted``) and
    their parameters queued to run again. Returns their numbers. Only for a study that one
    driver owns (its sweep folder's ``optuna.db``): a shared one finds them by their heartbeat."""
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
    overrides: list[str],
    params: dict[str, Any],
    run_dir: Path,
    storage: str,
    number: int,
    study_name: str = STUDY,
) -> list[str]:
    """The ``attnlab-train`` command of one trial: the sweep's overrides, the sampled values,
    its own run directory, and where to report for pruning."""
    sampled = [f"{k}={override_value(v)}" for k, v in params.items()]
    where = f"storage:{override_value(storage)},number:{number},study:{override_value(study_name)}"
    return [
        sys.executable,
        "-m",
        "attnlab.cli.train",
        *overrides,
        *sampled,
        f"hydra.run.dir={override_value(str(run_dir))}",
        f"sweep_trial={{{where}}}",
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


# Resolved here, not in the child: between fork and exec a child of a threaded driver must not
# load a library or take a lock (another thread may have held it at the fork).
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def child_setup(driver: int, cores: tuple[int, ...] = (), blocked: tuple[int, ...] = ()) -> None:
    """In a trial's process, before it starts: the kernel sends it SIGTERM when the sweep driver
    dies, however it dies (``kill -9`` included), so no trial trains on alone (Linux; elsewhere a
    no-op); it runs on its slot's ``cores`` (its DDP ranks inherit them); and the ``blocked``
    signals (a cluster's signal to the driver's job) do not end it before its driver acts."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG (the driver's thread waits for the trial)
        if os.getppid() != driver:  # the driver died before the request was in place
            os._exit(1)
    if cores:
        os.sched_setaffinity(0, cores)
    if blocked:
        signal.pthread_sigmask(signal.SIG_BLOCK, blocked)


def trial_environment(slot: Slot) -> tuple[dict[str, str], tuple[int, ...]]:
    """A trial's environment, and the signals it blocks. Where the driver is a job of a submitit
    array (``sweep.workers``), the trial is not that job: without submitit's variables and
    SLURM's task count, ``attnlab-train`` and Lightning run it as a plain process, its DDP ranks
    their own; and submitit's signal (USR2, before a time limit or a preemption), which SLURM
    sends to every process of the job, is the driver's to act on (it requeues itself; its trials
    end with it and run again once, as any dead driver's)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUBMITIT_") and k != "SLURM_NTASKS"}
    blocked: tuple[int, ...] = ()
    if "SUBMITIT_EXECUTOR" in os.environ:
        from submitit import JobEnvironment

        blocked = (getattr(signal, f"SIG{JobEnvironment.USR_SIG}"),)
    return env | dict(slot.env), blocked


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


class Turn:
    """A worker's turn to ask the study for a trial and draw its values: one worker of this
    driver at a time (``gate``), and one driver of a shared study at a time (``study_lock``), so
    that the count of trials before asking holds and a finite space (a grid) gives no values
    twice. Given back once, as soon as the values are drawn (or nothing is run)."""

    def __init__(self, gate: threading.Lock, study_lock: Any = None) -> None:
        gate.acquire()
        try:
            if study_lock is not None:
                study_lock.acquire()
        except BaseException:
            gate.release()
            raise
        self.gate, self.study_lock, self.held = gate, study_lock, True

    def release(self) -> None:
        if self.held:
            self.held = False
            try:
                if self.study_lock is not None:
                    self.study_lock.release()
            finally:
                self.gate.release()


class FileLock:
    """The lock of a study in a file (a journal, SQLite) that drivers share: Optuna's own for
    journal files on NFS (a symbolic link, broken after ``grace`` seconds if its holder died)."""

    def __init__(self, path: Path, grace: int = 30) -> None:
        target = path.with_name(path.name + ".ask")  # the lock's own, not the journal's (it appends)
        target.touch(exist_ok=True)  # the link's target must exist for its grace period to count
        self.lock = optuna.storages.journal.JournalFileSymlinkLock(str(target), grace_period=grace)

    def acquire(self) -> None:
        self.lock.acquire()

    def release(self) -> None:
        self.lock.release()


class AdvisoryLock:
    """The lock of a study on a PostgreSQL server: an advisory lock named by the study, held on a
    connection of its own (the server frees it if the holder dies)."""

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


def study_lock(url: str, storage: optuna.storages.BaseStorage, study_name: str) -> FileLock | AdvisoryLock:
    """The lock that drivers of the shared study at ``url`` (normalised) take turns on."""
    if url.startswith("journal:"):
        return FileLock(Path(url.removeprefix("journal:")))
    if url.startswith("sqlite:///"):
        return FileLock(Path(url.removeprefix("sqlite:///")))
    return AdvisoryLock(storage.engine, study_name)


class Driver:
    """Runs trials on ``slots`` (one worker thread each) until the study has ``n_trials``."""

    def __init__(
        self,
        study: optuna.Study,
        space: dict[str, BaseDistribution],
        overrides: list[str],
        sweep_dir: Path,
        metric: str,
        n_trials: int,
        echo: Callable[[str], Any] = print,
        slots: tuple[Slot, ...] | list[Slot] = (Slot(),),
        storage: str | None = None,
        study_name: str = STUDY,
        shared: bool = False,
        driver: str = "",
        poll: float = 5.0,
        lock: FileLock | AdvisoryLock | None = None,
    ) -> None:
        self.study, self.space, self.overrides, self.sweep_dir = study, space, overrides, sweep_dir
        self.metric, self.n_trials, self.echo, self.slots = metric, n_trials, echo, list(slots)
        self.storage = storage or storage_url(sweep_dir)  # where the trials report, for pruning
        self.study_name, self.shared, self.driver, self.poll = study_name, shared, driver, poll
        self.study_lock = lock  # a shared study's: its drivers take turns to ask
        self.host = socket.gethostname()
        self.gate = threading.Lock()  # one worker at a time asks and draws: the same draws for any n_jobs
        self.lock = threading.Lock()  # what follows, and the console
        self.mine: dict[int, subprocess.Popen | None] = {}  # this driver's running trials
        self.stopping = threading.Event()
        self.errors: list[BaseException] = []

    def run(self) -> None:
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
        """Until every worker has ended. Not ``Thread.join``: a Ctrl-C that interrupts it can
        leave the thread looking ended while it runs (CPython gh-90882)."""
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
                turn = Turn(self.gate, self.study_lock)
                try:
                    step = self.next_step()
                    if step == "stop":
                        return
                    if step == "wait":
                        turn.release()
                        self.stopping.wait(self.poll)
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
                    turn.release()
        except BaseException as e:  # a bug, or a storage that stopped answering: end the sweep
            with self.lock:
                self.errors.append(e)
            self.stop()
        finally:
            end.set()

    def next_step(self) -> str:
        """``run`` a trial; ``wait`` while the study's last trials run elsewhere (one may die
        there, be failed as stale and come back to be run here); ``stop`` when the study has
        ``n_trials`` finished, or its last ones run in this driver."""
        done, running = tally(self.study.get_trials(deepcopy=False))
        if len(done) >= self.n_trials:
            return "stop"
        if len(done) + len(running) < self.n_trials:
            return "run"
        with self.lock:
            elsewhere = [t for t in running if t.number not in self.mine]
        return "wait" if self.shared and elsewhere else "stop"

    def trial(self, slot: Slot, turn: Turn, trial: optuna.Trial) -> float:
        """Train the sampled (or queued) values in a process of their own on ``slot``; return
        ``metric`` at the end, or end as pruned, or fail with the run's error line."""
        try:
            params = {name: suggest(trial, name, dist) for name, dist in self.space.items()}
            with self.lock:
                self.mine[trial.number] = None
        finally:
            turn.release()
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
            "driver": self.driver,
        }
        first = self.study._storage.get_trial(trial._trial_id).system_attrs.get("failed_trial")
        attrs |= {"rerun_of": first} if first is not None else {}
        for key, value in attrs.items():
            if value not in ("", None):
                trial.set_user_attr(key, value)
        log_file = run_dir / "trial.log"
        cmd = trial_command(self.overrides, params, run_dir, self.storage, trial.number, self.study_name)
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
            trial.set_user_attr("interrupted", True)
            trial.set_user_attr("error", INTERRUPTED)
            self.study.enqueue_trial(params, user_attrs={"rerun_of": trial.number})
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
        # its rank among the finished trials, by finishing time: the same whichever thread prints first
        rank = sum(bool(d.datetime_complete and d.datetime_complete <= t.datetime_complete) for d in done)
        where = f" on {t.user_attrs['devices']}" if t.user_attrs.get("devices") else ""
        ran = f"trial {t.number}: {params}{where} ({seconds:.0f} s)"
        self.say(f"trial {rank}/{self.n_trials} done: {outcome} ({best_so_far(study)}); {ran}")


def run_sweep(
    study: optuna.Study,
    space: dict[str, BaseDistribution],
    overrides: list[str],
    sweep_dir: Path,
    metric: str,
    n_trials: int,
    echo: Callable[[str], Any] = print,
    **driver: Any,
) -> None:
    """Run trials until the study has ``n_trials`` finished (complete, pruned or failed);
    ``driver``: ``Driver``'s options (slots, a shared storage)."""
    if not driver.get("shared"):
        for number in recover_interrupted(study):
            echo(f"trial {number} was interrupted: its parameters are queued to run again")
    Driver(study, space, overrides, sweep_dir, metric, n_trials, echo, **driver).run()


def best_so_far(study: optuna.Study) -> str:
    """``best so far <value>, trial <number>`` among the complete trials (a resumed sweep's
    earlier ones included)."""
    if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        return "no complete trial yet"
    best = study.best_trial
    return f"best so far {best.value:.4f}, trial {best.number}"
