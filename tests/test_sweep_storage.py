"""attnlab-sweep on a study that many drivers share: sweep.storage=postgresql://... (a real
PostgreSQL server from the pgserver package) and sweep.storage=journal:<file>. Drivers in separate
working folders attach to one study by name and share its n_trials; no values run twice; a driver
that dies mid-trial stops beating, and whoever asks next fails that trial and runs it again, once.
The trials are FAKE_TRIAL's stand-in processes (seconds); the slow tests kill a driver process
with SIGKILL, and run real attnlab-train trials."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import optuna
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from attnlab.cli.compare import compare, parse_args
from attnlab.core.errors import ConfigError
from attnlab.experiments.study import normalize_url, open_storage
from attnlab.experiments.sweep import Driver, Shared, check_same_search, open_study, study_lock, tally
from conftest import cli_env, run_main, tiny
from test_sweep_parallel import DRIVER, HELD_TRIAL, fake_trials

LR = "model.optim.optimizer.lr"
VALUES = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
SPACE = {LR: CategoricalDistribution(VALUES)}


@pytest.fixture(scope="module")
def postgres() -> str:
    """A PostgreSQL server for this module, from the pgserver package (a dev dependency)."""
    try:
        import pgserver
    except ImportError:
        pytest.skip("pgserver is not installed (a dev dependency): no PostgreSQL to test against")
    # not under pytest's tmp folder: as root, pgserver runs the server as a user of its own, who
    # must reach the data folder (pytest's are closed to others)
    data = Path(tempfile.mkdtemp(prefix="attnlab-pg-"))
    try:
        server = pgserver.get_server(data, cleanup_mode="stop")
    except Exception as e:  # no shared memory, a sandbox that forbids it...
        shutil.rmtree(data, ignore_errors=True)
        pytest.skip(f"pgserver's PostgreSQL cannot start here: {str(e).splitlines()[0] if str(e) else e!r}")
    yield server.get_uri()
    server.cleanup()
    shutil.rmtree(data, ignore_errors=True)


@pytest.fixture(params=["journal", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "journal":
        return f"journal:{tmp_path / 'study.log'}"
    return request.getfixturevalue("postgres")


def retry_once() -> optuna.storages.RetryHeartbeatStaleTrialCallback:
    return optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1)


def wait_for(condition, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        time.sleep(0.05)


def test_two_drivers_share_one_study_and_run_a_dead_drivers_trial_again_once(url, tmp_path, monkeypatch):
    fake_trials(monkeypatch)
    monkeypatch.setenv("FAKE_TRIAL_HOLD", str(tmp_path / "go"))
    name = f"study-{uuid.uuid4().hex[:8]}"
    # a driver that died during its trial: running, with one heartbeat long ago
    dead = open_study(None, "minimize", storage=open_storage(url, 1, 2), study_name=name)
    dead.set_metric_names(["val/loss_best"])  # as attnlab-sweep does
    dead.enqueue_trial({LR: 1.0})
    killed = dead.ask()
    killed.suggest_categorical(LR, VALUES)
    dead._storage.record_heartbeat(killed._trial_id)

    drivers = []
    for side in "ab":
        storage = open_storage(url, 1, 2, retry_once())
        study = open_study(None, "minimize", optuna.samplers.BruteForceSampler(), None, storage, name)
        lock = study_lock(normalize_url(url), storage, name)
        drivers.append(
            Driver(
                study, SPACE, [], tmp_path / side, "val/loss_best", 6, lambda line: None,
                shared=Shared(normalize_url(url), name, side, lock, poll=0.5),
            )
        )  # fmt: skip
    threads = [threading.Thread(target=d.run) for d in drivers]
    for t in threads:
        t.start()
    # each driver holds a trial of its own before any finishes: both run trials
    wait_for(lambda: len(list(tmp_path.glob("[ab]/*/started"))) == 2, "a trial in each driver")
    (tmp_path / "go").touch()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and not any(d.errors for d in drivers)

    trials = optuna.load_study(study_name=name, storage=open_storage(url)).get_trials()
    done, running = tally(trials)
    assert not running and len(done) == 6 and len(trials) == 7  # six + the dead driver's
    assert sorted(t.params[LR] for t in done) == VALUES  # none ran twice
    assert all(t.state == TrialState.COMPLETE for t in done)
    assert trials[killed.number].state == TrialState.FAIL
    (rerun,) = [t for t in trials if t.user_attrs.get("rerun_of") == killed.number]
    assert rerun.params == {LR: 1.0} and rerun in done
    # each trial ran in the folder of the driver that ran it, which says where it ran
    assert {Path(t.user_attrs["run_dir"]).parent.name for t in done} == {"a", "b"}
    assert all((Path(t.user_attrs["run_dir"]) / "probe.json").is_file() for t in done)
    assert {t.user_attrs["host"] for t in done} == {socket.gethostname()}
    # attnlab-compare of the study: every trial, where it ran
    table = compare(parse_args([url, "--study", name, "--format", "csv", "--no-group"])).strip().splitlines()
    assert table[0] == f"{LR},state,trial,host,runs,val/loss_best" and len(table) == 8
    assert table[1 + killed.number].startswith(f"1.0,interrupted,{killed.number},")
    assert sum(f",complete,{t.number},{socket.gethostname()},1," in "\n".join(table) for t in done) == 6


def test_drivers_started_by_the_command_attach_to_the_study_by_name(url, tmp_path, monkeypatch):
    """attnlab-sweep with sweep.storage: a second driver (another folder, a larger n_trials)
    attaches to the first's study and adds what is missing; a resumed driver finds the study
    done; attnlab-compare lists each folder's trials with their machine."""
    fake_trials(monkeypatch)
    name = f"cmd-{uuid.uuid4().hex[:8]}"
    outs = []
    for side, n_trials in (("a", 2), ("b", 3)):
        args = [
            a.replace("sweep.n_trials=6", f"sweep.n_trials={n_trials}")
            for a in sweep_args(url, name, tmp_path / side)
        ]
        status, out = run_main("sweep", args)
        assert status == 0, out[-3000:]
        outs.append(out)
    assert (
        f"study {name} in " in outs[0]
        and ": 0 finished, 0 running" in outs[0]
        and "trial 2/2 done" in outs[0]
    )
    assert ": 2 finished, 0 running" in outs[1] and "trial 3/3 done" in outs[1] and "trial 3/3" not in outs[0]
    assert all((tmp_path / side / "sweep" / "study.yaml").is_file() for side in "ab")
    status, out = run_main("sweep", [f"resume={tmp_path / 'a' / 'sweep'}"])
    assert status == 0 and ": 3 finished, 0 running" in out and "done:" not in out, out[-3000:]
    folders = [str(tmp_path / side / "sweep") for side in "ab"]
    table = (
        compare(parse_args([*folders, "--format", "csv", "--metrics", "val/loss_best"])).strip().splitlines()
    )
    assert table[0] == f"{LR},trial,host,runs,val/loss_best" and len(table) == 4  # all complete
    assert all(f",{n},{socket.gethostname()},1," in table[1 + n] for n in range(3))


def test_a_driver_with_another_search_is_refused_by_the_study(tmp_path):
    study = open_study(
        None, "minimize", storage=open_storage(f"journal:{tmp_path / 's.log'}"), study_name="x"
    )
    check_same_search(study, SPACE, "val/loss_best", "minimize")
    check_same_search(study, SPACE, "val/loss_best", "minimize")  # the same search attaches
    other = {LR: CategoricalDistribution([1.0, 2.0])}
    with pytest.raises(
        ConfigError, match=r"sweep.study_name=x: that study searches otherwise \(sweep.params."
    ):
        check_same_search(study, other, "val/loss_best", "minimize")
    with pytest.raises(ConfigError, match=r"\(metric, direction differ\)"):
        check_same_search(study, SPACE, "val/acc", "maximize")


def test_a_trial_reports_to_the_shared_study_by_name(url):
    """The trial's pruning callback (in attnlab-train) opens the storage the driver gave it."""
    from attnlab.experiments.pruning import TrialPruning

    name = f"report-{uuid.uuid4().hex[:8]}"
    study = open_study(None, "minimize", storage=open_storage(url), study_name=name)
    trial = study.ask(SPACE)
    callback = TrialPruning(normalize_url(url), trial.number, "val/loss", optuna.pruners.NopPruner(), name)
    callback.trial.report(0.5, step=10)
    assert study.get_trials()[trial.number].intermediate_values == {10: 0.5}


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("sweep.storage=mysql://me@db/optuna", "sweep.storage=mysql://me@db/optuna: expected postgresql://"),
        (
            "sweep.storage=journal:/nowhere/study.log",
            "sweep.storage=journal:/nowhere/study.log: no folder /nowhere",
        ),
        (
            "sweep.storage=postgresql://me:secret@127.0.0.1:1/optuna?connect_timeout=5",  # quoted for Hydra
            "sweep.storage=postgresql+psycopg2://me:***@127.0.0.1:1/optuna?connect_timeout=5: "
            "cannot open the study's database "
            '(connection to server at "127.0.0.1", port 1 failed: Connection refused',
        ),
        ("sweep.heartbeat_interval=0", "sweep.heartbeat_interval: expected a positive int, got 0"),
    ],
)
def test_a_storage_that_cannot_hold_the_study_is_refused_before_the_folder(override, needle, tmp_path):
    args = [
        "hparams_search=gpt_optuna",
        f"sweep.dir={tmp_path / 's'}",
        "sweep.storage=journal:x.log",
        override,
    ]
    status, out = run_main("sweep", args)
    assert status == 2 and needle in out and out.count("error: ") == 1, out[-2000:]
    assert "Traceback" not in out and "secret" not in out
    assert not (tmp_path / "s").exists()


def sweep_args(url: str, name: str, folder: Path) -> list[str]:
    return [
        "hparams_search=gpt_optuna",
        "trainer.accelerator=cpu",
        "sweep.n_trials=6",
        "~sweep.params",
        f"+sweep.params.{LR}=choice(1.0, 2.0, 3.0, 4.0, 5.0, 6.0)",
        "sweep.sampler._target_=optuna.samplers.BruteForceSampler",
        "~sweep.sampler.n_startup_trials",
        f"sweep.storage={url}",
        f"sweep.study_name={name}",
        "sweep.heartbeat_interval=1",
        "sweep.grace_period=3",
        f"sweep.dir={folder / 'sweep'}",
    ]


def test_a_driver_killed_mid_trial_leaves_it_to_the_other_to_run_again(url, tmp_path):
    """Two driver processes in their own folders; one is killed with SIGKILL during its second
    trial: its trial process ends with it, and the other driver runs that trial's values again,
    once, and completes the study."""
    name = f"kill-{uuid.uuid4().hex[:8]}"
    holds = tmp_path / "holds"  # trial k waits for holds/<k>
    holds.mkdir()
    env = cli_env() | {"FAKE_TRIAL_HOLD_DIR": str(holds)}
    drivers = {}
    for side in "ab":
        (tmp_path / side).mkdir()
        drivers[side] = subprocess.Popen(
            [sys.executable, "-c", DRIVER, HELD_TRIAL, *sweep_args(url, name, tmp_path / side)],
            cwd=tmp_path / side,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        first = 0 if side == "a" else 1
        wait_for(
            lambda s=side, n=first: (tmp_path / s / "sweep" / str(n) / "started").exists(), f"trial {first}"
        )
    (holds / "0").touch()  # a finishes trial 0 and starts trial 2
    wait_for(lambda: (tmp_path / "a" / "sweep" / "2" / "started").exists(), "trial 2")
    os.kill(drivers["a"].pid, signal.SIGKILL)
    drivers["a"].wait()
    for n in range(1, 12):
        (holds / str(n)).touch()
    out, _ = drivers["b"].communicate(timeout=180)
    assert drivers["b"].returncode == 0, out[-3000:]
    assert "trial 6/6 done" in out

    trials = optuna.load_study(study_name=name, storage=open_storage(url)).get_trials()
    done, running = tally(trials)
    assert not running and len(done) == 6 and len(trials) == 7
    assert sorted(t.params[LR] for t in done) == VALUES
    assert trials[2].state == TrialState.FAIL and not (tmp_path / "a" / "sweep" / "2" / "done").exists()
    (rerun,) = [t for t in trials if t.user_attrs.get("rerun_of") == 2]
    assert rerun.params == trials[2].params and Path(rerun.user_attrs["run_dir"]).parent.parent.name == "b"
    assert [t.number for t in done if Path(t.user_attrs["run_dir"]).parent.parent.name == "a"] == [0]


@pytest.mark.slow
def test_two_drivers_of_real_trials_on_postgresql(postgres, tmp_path):
    """The same with attnlab-train trials: two drivers on one PostgreSQL study, n_trials=4 in
    all, each trial reporting its validations to the study by name."""
    name = f"real-{uuid.uuid4().hex[:8]}"
    args = [
        "experiment=gpt_pydoc_char",
        *tiny("logger=csv", "test=false", "trainer.accelerator=cpu"),
        "+sweep.params.model.net.dropout=choice(0.0, 0.1)",
    ]
    procs = []
    for side in "ab":
        (tmp_path / side).mkdir()
        base = sweep_args(postgres, name, tmp_path / side)
        base[base.index("sweep.n_trials=6")] = "sweep.n_trials=4"
        base[base.index(f"+sweep.params.{LR}=choice(1.0, 2.0, 3.0, 4.0, 5.0, 6.0)")] = (
            f"+sweep.params.{LR}=choice(3e-3, 1e-3)"
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "attnlab.cli.sweep", *base, *args],
                cwd=tmp_path / side,
                env=cli_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
        if side == "a":
            wait_for(lambda: (tmp_path / "a" / "sweep" / "0").exists(), "driver a's first trial")
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-3000:]
    trials = optuna.load_study(study_name=name, storage=open_storage(postgres)).get_trials()
    done, _ = tally(trials)
    assert len(done) == 4 and len({tuple(sorted(t.params.items())) for t in done}) == 4
    assert all(t.state == TrialState.COMPLETE and t.intermediate_values for t in done)


def test_sweep_workers_go_out_as_a_job_array_attached_to_the_study(tmp_path, monkeypatch):
    """sweep.workers=2: two drivers sent as one submitit array (its debug cluster here: the jobs
    run in this process, one after the other), each in a folder of its own, on one study."""
    fake_trials(monkeypatch)
    name = f"workers-{uuid.uuid4().hex[:8]}"
    url = f"journal:{tmp_path / 'study.log'}"
    args = [a.replace("sweep.n_trials=6", "sweep.n_trials=3") for a in sweep_args(url, name, tmp_path)]
    status, out = run_main("sweep", [*args, "sweep.workers=2", "sweep.executor.cluster=debug"])
    assert status == 0, out[-3000:]
    assert "sent 2 sweep drivers (debug " in out and f"study {name} in {url}" in out
    assert "the workers ended: 3 trials finished in the study" in out
    workers = tmp_path / "sweep" / "workers"
    assert all((workers / str(i) / "study.yaml").is_file() for i in (0, 1))
    trials = optuna.load_study(study_name=name, storage=open_storage(url)).get_trials()
    assert len(trials) == 3 and {Path(t.user_attrs["run_dir"]).parent for t in trials} == {workers / "0"}


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["sweep.workers=2", "sweep.storage=null"], "sweep.workers: the workers need a study they all reach"),
        (["sweep.workers=0"], "sweep.workers: expected a positive int (drivers to send) or null, got 0"),
        (["sweep.workers=2", "sweep.executor.cluster=lsf"], "doesn't know any executor named lsf"),
        (["sweep.workers=2", "+sweep.resources.slurm_foo=1"], "sweep.executor, sweep.resources: "),
    ],
)
def test_workers_that_cannot_go_out_are_refused_before_the_folder(overrides, needle, tmp_path):
    args = [
        "hparams_search=gpt_optuna",
        f"sweep.dir={tmp_path / 's'}",
        f"sweep.storage=journal:{tmp_path / 'j'}",
    ]
    status, out = run_main("sweep", [*args, *overrides])
    assert status == 2 and needle in out and out.count("error: ") == 1, out[-2000:]
    assert not (tmp_path / "s").exists()


@pytest.mark.slow
def test_sweep_workers_of_real_trials_as_local_submitit_jobs(tmp_path):
    """sweep.workers=2 on submitit's local cluster: two driver processes, attnlab-train trials
    started by them run as plain processes (not as the submitit job), the study completes."""
    name = f"local-{uuid.uuid4().hex[:8]}"
    url = f"journal:{tmp_path / 'study.log'}"
    args = [
        a.replace("sweep.n_trials=6", "sweep.n_trials=2").replace(
            f"+sweep.params.{LR}=choice(1.0, 2.0, 3.0, 4.0, 5.0, 6.0)",
            f"+sweep.params.{LR}=choice(3e-3, 1e-3)",
        )
        for a in sweep_args(url, name, tmp_path)
    ]
    args += ["experiment=gpt_pydoc_char", *tiny("logger=csv", "test=false"), "sweep.workers=2"]
    proc = subprocess.run(
        [sys.executable, "-m", "attnlab.cli.sweep", *args, "sweep.executor.cluster=local"],
        cwd=tmp_path,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "the workers ended: 2 trials finished in the study" in proc.stdout
    trials = optuna.load_study(study_name=name, storage=open_storage(url)).get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2, [t.user_attrs.get("error") for t in trials]
    assert all(t.intermediate_values for t in trials)  # each reported to the study
