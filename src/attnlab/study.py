"""Where an ``attnlab-sweep`` keeps its Optuna study: ``<sweep dir>/optuna.db``.

Shared by the sweep driver (``attnlab.sweep``), its trials' pruning callback
(``attnlab.callbacks.TrialPruning``) and ``attnlab.compare``, which reads how each trial ended;
none of them imports another for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import optuna

STUDY = "sweep"  # the study's name inside optuna.db


def storage_url(sweep_dir: Path) -> str:
    return f"sqlite:///{(sweep_dir / 'optuna.db').resolve()}"


def trial_id(study: optuna.Study, number: int) -> int:
    """The storage's id of trial ``number`` (Optuna's ``Trial`` takes the id, not the number)."""
    return next(t._trial_id for t in study.get_trials(deepcopy=False) if t.number == number)


def load_trials(sweep_dir: Path) -> list[optuna.trial.FrozenTrial]:
    """The trials of the study in ``sweep_dir``; none where there is no ``optuna.db``."""
    if not (sweep_dir / "optuna.db").is_file():
        return []
    import optuna  # only where there is a sweep: attnlab-compare of plain runs does without

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(study_name=STUDY, storage=storage_url(sweep_dir)).get_trials(deepcopy=False)
