"""Where a sweep keeps its Optuna study: ``<sweep dir>/optuna.db``, or a storage drivers share
(``sweep.storage``: PostgreSQL, or a journal file); for the driver, pruning and compare."""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnlab.core.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Callable

    import optuna

STUDY = "sweep"  # the study's name inside optuna.db
SHARED = "study.yaml"  # in a driver's sweep folder whose study is elsewhere: where, and the driver's id
HEARTBEAT = "heartbeat"  # a trial's system attribute in a journal: when its driver last beat (epoch s)
URLS = "postgresql://USER@HOST/DB, journal:FILE or sqlite:///FILE"


def storage_url(sweep_dir: Path) -> str:
    return f"sqlite:///{(sweep_dir / 'optuna.db').resolve()}"


def shown(url: str) -> str:
    """``url`` without its password, for messages and tables."""
    if "://" in url and "@" in url.partition("://")[2].partition("/")[0]:
        from sqlalchemy.engine import make_url

        try:
            return make_url(url).render_as_string(hide_password=True)
        except Exception:  # not a URL SQLAlchemy reads: say it as given, but for what follows ':'
            return url.partition("://")[0] + "://***@" + url.partition("@")[2]
    return url


def normalize_url(url: str, key: str | None = "sweep.storage") -> str:
    """``url`` checked, a file's path absolute, PostgreSQL through the installed driver (psycopg2,
    where SQLAlchemy's default, psycopg 3, is not there)."""
    url = str(url)
    said = f"{key}={shown(url)}" if key else shown(url)  # how messages name it
    for prefix, what in (("journal:", "journal"), ("sqlite:///", "SQLite")):
        if url.startswith(prefix):
            path = Path(url.removeprefix(prefix)).expanduser()
            if not path.name:
                raise ConfigError(f"{said}: expected {prefix}<file>")
            if not path.parent.resolve().is_dir():
                raise ConfigError(f"{said}: no folder {path.parent} for the {what} file")
            return f"{prefix}{path.resolve()}"
    scheme = url.partition("://")[0] if "://" in url else ""
    if scheme == "postgresql":
        try:
            import psycopg  # noqa: F401  (SQLAlchemy's default driver, where it is installed)
        except ImportError:
            return "postgresql+psycopg2://" + url.partition("://")[2]
        return url
    if scheme.startswith("postgresql+"):
        return url
    raise ConfigError(f"{said}: expected {URLS}")


def is_study_url(text: str) -> bool:
    """Whether a command-line argument names a study's storage rather than a folder."""
    return text.startswith(("postgresql://", "postgresql+", "journal:", "sqlite:///"))


def open_storage(
    url: str,
    heartbeat_interval: int | None = None,
    grace_period: int | None = None,
    on_stale: Callable[[optuna.Study, optuna.trial.FrozenTrial], None] | None = None,
    key: str | None = "sweep.storage",
) -> optuna.storages.BaseStorage:
    """The Optuna storage at ``url``, connected (else one line); with ``heartbeat_interval``, a
    running trial silent for ``grace_period`` is failed and passed to ``on_stale``."""
    import optuna

    url = normalize_url(url, key)
    if url.startswith("journal:"):
        backend = optuna.storages.journal.JournalFileBackend(url.removeprefix("journal:"))
        if heartbeat_interval is None:
            return optuna.storages.JournalStorage(backend)
        return _heartbeat_journal()(backend, heartbeat_interval, grace_period, on_stale)
    connect: dict[str, Any] = {"timeout": 60} if url.startswith("sqlite") else {"connect_timeout": 10}
    try:
        return optuna.storages.RDBStorage(
            url,
            # a sweep holds its connections for hours: test each before use (servers drop idle ones)
            engine_kwargs={"pool_pre_ping": True, "connect_args": connect},
            heartbeat_interval=heartbeat_interval,
            grace_period=grace_period,
            heartbeat_stale_trial_callback=on_stale,
        )
    except Exception as e:  # SQLAlchemy's OperationalError, ArgumentError, a missing driver
        why = (str(e.__cause__ or e).strip().splitlines() or [type(e).__name__])[0]
        why = why.removeprefix("(psycopg2.OperationalError) ")
        said = f"{key}={shown(url)}" if key else shown(url)
        raise ConfigError(f"{said}: cannot open the study's database ({why})") from None


@functools.cache
def _heartbeat_journal() -> type:
    """Optuna's journal storage with the heartbeat its RDB storage has: a running trial whose last
    beat (or start, by the drivers' clocks) is older than the grace period is stale."""
    import optuna
    from optuna.storages._heartbeat import BaseHeartbeat  # the interface Optuna's RDB storage implements
    from optuna.trial import TrialState

    class HeartbeatJournal(optuna.storages.JournalStorage, BaseHeartbeat):
        def __init__(self, backend: Any, interval: int, grace: int | None, on_stale: Any) -> None:
            super().__init__(backend)
            self.heartbeat_interval, self.grace_period, self.on_stale = interval, grace, on_stale

        def record_heartbeat(self, trial_id: int) -> None:
            try:
                self.set_trial_system_attr(trial_id, HEARTBEAT, time.time())
            except optuna.exceptions.UpdateFinishedTrialError:  # failed as stale by another driver
                pass

        def _get_stale_trial_ids(self, study_id: int) -> list[int]:
            grace = self.grace_period or 2 * self.heartbeat_interval
            now = time.time()
            stale = []
            for t in self.get_all_trials(study_id, deepcopy=False, states=(TrialState.RUNNING,)):
                # a re-run inherits its original's beats: its own start counts as one
                started = t.datetime_start.timestamp() if t.datetime_start else 0.0
                if now - max(t.system_attrs.get(HEARTBEAT, 0.0), started) > grace:
                    stale.append(t._trial_id)
            return stale

        def get_heartbeat_interval(self) -> int | None:
            return self.heartbeat_interval

        def get_heartbeat_stale_trial_callback(self) -> Any:
            return self.on_stale

    return HeartbeatJournal


def trial_id(study: optuna.Study, number: int) -> int:
    """The storage's id of trial ``number`` (Optuna's ``Trial`` takes the id, not the number)."""
    return next(t._trial_id for t in study.get_trials(deepcopy=False) if t.number == number)


def rerun_numbers(trials: list[Any]) -> set[int]:
    """Trials failed as stale whose values were queued again (Optuna's retry callback)."""
    return {n for t in trials for n in t.system_attrs.get("retry_history", [])}


def load_trials(sweep_dir: Path) -> list[optuna.trial.FrozenTrial]:
    """The trials of ``sweep_dir``'s ``optuna.db``, or those its driver ran in a shared study."""
    shared = sweep_dir / SHARED
    if not (sweep_dir / "optuna.db").is_file() and not shared.is_file():
        return []
    import optuna  # only where there is a sweep: attnlab-compare of plain runs does without

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if (sweep_dir / "optuna.db").is_file():
        return optuna.load_study(study_name=STUDY, storage=storage_url(sweep_dir)).get_trials(deepcopy=False)
    from omegaconf import OmegaConf

    where = OmegaConf.load(shared)
    storage = open_storage(where.storage, key=None)
    trials = optuna.load_study(study_name=where.study_name, storage=storage).get_trials(deepcopy=False)
    return [t for t in trials if t.user_attrs.get("driver") == where.driver]
