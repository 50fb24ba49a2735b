"""attnlab-sweep with sweep.n_jobs: trials run at once, each on its own devices (GPUs by
CUDA_VISIBLE_DEVICES, CPU cores by affinity and OMP_NUM_THREADS), the same seeded grid giving the
same trials, and more trials at once than devices refused. The trials here are a stand-in process
(``FAKE_TRIAL``) that records where it ran and writes a metric, so that the driver's side is
tested in seconds; the slow test runs real ``attnlab-train`` trials."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

import optuna
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

import attnlab.experiments.sweep as sweep_module
from attnlab.core.errors import ConfigError
from attnlab.experiments.sweep import Driver, Slot, device_slots, open_study, usable_cores
from conftest import assert_ok, cli_env, run_cli, run_main, tiny

# A trial's stand-in: the command line of attnlab-train, read back; it records where it ran
# (probe.json), waits where the test asks it to, and logs the sampled learning rate as its metric.
FAKE_TRIAL = r"""
import json, os, subprocess, sys, time
from pathlib import Path

args = sys.argv[1:]
run_dir = Path(next(a for a in args if a.startswith("hydra.run.dir=")).split("=", 1)[1].strip("'"))
lr = float(next(a for a in args if a.startswith("model.optim.optimizer.lr=")).split("=", 1)[1])
(run_dir / "started").write_text(str(time.time()))
start = time.time()


def wait_for(path):
    while not path.exists():
        if time.time() - start > 120:
            sys.exit(f"error: waited 120 s for {path}")
        time.sleep(0.05)


if os.environ.get("FAKE_TRIAL_PAIRS"):  # trials 2k and 2k+1 wait for each other: both run at once
    wait_for(run_dir.parent / str(int(run_dir.name) ^ 1) / "started")
if os.environ.get("FAKE_TRIAL_HOLD"):  # a file the test writes
    wait_for(Path(os.environ["FAKE_TRIAL_HOLD"]))
probe = {
    "affinity": sorted(os.sched_getaffinity(0)),
    "omp": os.environ.get("OMP_NUM_THREADS"),
    "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "args": args,
}
if os.environ.get("FAKE_TRIAL_RANK"):  # a process of the trial's own, as DDP's rank 1
    code = "import os; print(sorted(os.sched_getaffinity(0)), os.environ.get('OMP_NUM_THREADS'))"
    probe["rank"] = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout
(run_dir / "probe.json").write_text(json.dumps(probe))
(run_dir / "config.yaml").write_text(f"model:\n  optim:\n    optimizer:\n      lr: {lr}\n")
(run_dir / "csv").mkdir()
(run_dir / "csv" / "metrics.csv").write_text(f"step,val/loss_best\n1,{lr}\n")
"""

# FAKE_TRIAL that waits for holds/<its number> first, and says it ended
HELD_TRIAL = (
    FAKE_TRIAL.replace(
        'if os.environ.get("FAKE_TRIAL_PAIRS"):',
        'wait_for(Path(os.environ["FAKE_TRIAL_HOLD_DIR"]) / run_dir.name)\n'
        'if os.environ.get("FAKE_TRIAL_PAIRS"):',
    )
    + '\n(run_dir / "done").touch()\n'
)


# A driver process whose trials are FAKE_TRIAL (attnlab-sweep's own main, trial_command replaced)
DRIVER = r"""
import sys
import attnlab.experiments.sweep as sweep

real, fake = sweep.trial_command, sys.argv[1]
sweep.trial_command = lambda *a, **k: [sys.executable, "-c", fake, *real(*a, **k)[3:]]
sys.argv = ["attnlab-sweep", *sys.argv[2:]]
from attnlab.cli.sweep import main

main()
"""


SPACE = {"model.optim.optimizer.lr": CategoricalDistribution([1.0, 2.0, 3.0, 4.0])}


def fake_trials(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each trial of a ``Driver`` runs FAKE_TRIAL with attnlab-train's arguments."""
    real = sweep_module.trial_command
    monkeypatch.setattr(
        sweep_module, "trial_command", lambda *a, **k: [sys.executable, "-c", FAKE_TRIAL, *real(*a, **k)[3:]]
    )


def probes(sweep_dir: Path) -> dict[int, dict]:
    return {int(p.parent.name): json.loads(p.read_text()) for p in sweep_dir.glob("*/probe.json")}


@pytest.mark.skipif(len(usable_cores()) < 2, reason="two trials at once need two CPU cores")
def test_n_jobs_runs_trials_at_once_on_their_own_cores_and_the_same_grid(tmp_path, monkeypatch):
    fake_trials(monkeypatch)
    grid = {k: d.choices for k, d in SPACE.items()}
    ran = {}
    for n_jobs in (1, 2):
        if n_jobs == 2:
            monkeypatch.setenv("FAKE_TRIAL_PAIRS", "1")  # would wait forever (120 s) one at a time
        sweep_dir = tmp_path / f"jobs{n_jobs}"
        study = open_study(sweep_dir, "minimize", optuna.samplers.GridSampler(grid, seed=7))
        lines: list[str] = []
        slots = device_slots(n_jobs, None, "cpu", 1)
        Driver(study, SPACE, [], sweep_dir, "val/loss_best", 4, lines.append, slots=slots).run()
        trials = study.get_trials()
        assert [t.state for t in trials] == [TrialState.COMPLETE] * 4, [t.user_attrs for t in trials]
        assert sorted(line.partition(" done: val/loss_best ")[0] for line in lines) == [
            f"trial {k}/4" for k in range(1, 5)
        ]
        ran[n_jobs] = {t.number: t.params["model.optim.optimizer.lr"] for t in trials}
    # the gate draws the values of one trial at a time, in the order of the trials
    assert ran[1] == ran[2] and sorted(ran[1].values()) == [1.0, 2.0, 3.0, 4.0]

    seen = probes(tmp_path / "jobs2")
    per = len(usable_cores()) // 2
    for pair in ((0, 1), (2, 3)):  # ran at once (they waited for each other), on cores of their own
        a, b = (set(seen[n]["affinity"]) for n in pair)
        assert len(a) == len(b) == per and not a & b
    assert all(p["omp"] == str(per) for p in seen.values())
    assert "on cores " in lines[0]


def test_trials_finishing_together_get_distinct_numbers(tmp_path):
    """Optuna stamps a trial's end before it stores the trial: under load, the trial stamped later
    can be stored and reported first, before the earlier-stamped one is seen; both keep a number."""
    study = optuna.create_study()
    lines: list[str] = []
    driver = Driver(study, SPACE, [], tmp_path, "val/loss", 2, lines.append)
    now = datetime.now()
    for seconds in (1, 0):  # the later-stamped trial reported first
        trial = optuna.trial.create_trial(value=1.0)
        trial.datetime_complete = now + timedelta(seconds=seconds)
        study.add_trial(trial)
        driver.report(study, study.trials[-1])
    assert [line.partition(" done: ")[0] for line in lines] == ["trial 1/2", "trial 2/2"]


def test_slots_split_the_visible_gpus_and_refuse_more_trials_than_devices(monkeypatch):
    monkeypatch.setattr(sweep_module, "cuda_device_count", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7")
    slots = device_slots(2, 2, "gpu", "auto")
    assert [dict(s.env) for s in slots] == [{"CUDA_VISIBLE_DEVICES": "3,5"}, {"CUDA_VISIBLE_DEVICES": "6,7"}]
    assert [s.cores for s in slots] == [(), ()] and slots[0].label == "GPU 3,5"
    # a DDP trial of trainer.devices GPUs gets that many by default
    assert [dict(s.env)["CUDA_VISIBLE_DEVICES"] for s in device_slots(2, None, "auto", 2)] == ["3,5", "6,7"]
    assert device_slots(1, None, "gpu", 1) == [Slot()]  # one at a time: all it has, as before
    with pytest.raises(
        ConfigError, match=r"sweep.n_jobs=3 x sweep.devices_per_trial=2 needs 6 GPUs; 4 visible"
    ):
        device_slots(3, 2, "gpu", 1)
    with pytest.raises(ConfigError, match=r"trainer.devices=2: more GPUs than a trial has"):
        device_slots(4, 1, "gpu", 2)
    with pytest.raises(ConfigError, match=r"sweep.n_jobs: expected a positive int .* got 0"):
        device_slots(0, None, "gpu", 1)
    with pytest.raises(ConfigError, match=r"sweep.devices_per_trial: expected a positive int or null"):
        device_slots(2, 0, "gpu", 1)
    cores = len(usable_cores())
    with pytest.raises(
        ConfigError, match=rf"sweep.n_jobs={cores + 1} needs .* CPU cores; this process may use"
    ):
        device_slots(cores + 1, None, "cpu", 1)
    with pytest.raises(ConfigError, match=r"trainer.devices=2: a trial's 2 processes need 2 CPU cores"):
        device_slots(cores, None, "cpu", 2)


@pytest.mark.skipif(len(usable_cores()) < 2, reason="a trial of two processes needs two CPU cores")
def test_a_ddp_trials_processes_stay_inside_its_cores(tmp_path, monkeypatch):
    """trainer=ddp_cpu with sweep.devices_per_trial=2: the trial and the process it starts (as
    Lightning starts rank 1) run on the trial's 2 cores, one torch thread each."""
    fake_trials(monkeypatch)
    monkeypatch.setenv("FAKE_TRIAL_RANK", "1")
    (slot,) = device_slots(1, 2, "cpu", 2)
    study = open_study(tmp_path, "minimize", optuna.samplers.GridSampler({"model.optim.optimizer.lr": [1.0]}))
    space = {"model.optim.optimizer.lr": CategoricalDistribution([1.0])}
    Driver(study, space, [], tmp_path, "val/loss_best", 1, lambda line: None, slots=[slot]).run()
    probe = probes(tmp_path)[0]
    assert probe["affinity"] == list(slot.cores) and len(slot.cores) == 2 and probe["omp"] == "1"
    assert probe["rank"].strip() == f"{list(slot.cores)} 1"


@pytest.mark.slow
@pytest.mark.skipif(len(usable_cores()) < 2, reason="two trials at once need two CPU cores")
def test_a_sweep_of_real_trials_with_n_jobs_2(tmp_path):
    """attnlab-sweep ... sweep.n_jobs=2 end to end: two attnlab-train trials at once, each on its
    core with one thread, reporting to the study (pruning) and finishing."""
    sweep_dir = tmp_path / "sweep"
    args = [
        "hparams_search=gpt_optuna",
        "experiment=gpt_pydoc_char",
        *tiny("logger=csv", "test=false", "trainer.accelerator=cpu"),
        "sweep.n_trials=2",
        "sweep.n_jobs=2",
        "~sweep.params",
        "+sweep.params.model.optim.optimizer.lr='choice(3e-3, 1e-3)'",
        "sweep.sampler._target_=optuna.samplers.BruteForceSampler",
        "~sweep.sampler.n_startup_trials",
        f"sweep.dir={sweep_dir}",
    ]
    proc = run_cli("sweep", args, tmp_path)
    assert_ok(proc)
    assert "2 at once, on cores " in proc.stdout and "trial 2/2 done: val/loss_best" in proc.stdout
    study = optuna.load_study(study_name="sweep", storage=f"sqlite:///{sweep_dir / 'optuna.db'}")
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2
    assert {t.user_attrs["devices"] for t in trials} == {s.label for s in device_slots(2, None, "cpu", 1)}
    assert all(t.intermediate_values for t in trials)  # each reported its validations
    # their run times overlap
    assert max(t.datetime_start for t in trials) < min(t.datetime_complete for t in trials)


@pytest.mark.skipif(len(usable_cores()) < 2, reason="two trials at once need two CPU cores")
def test_ctrl_c_during_two_trials_queues_both_and_resume_runs_them(tmp_path, monkeypatch):
    """Ctrl-C (SIGINT to the terminal's process group) while two trials run: both are recorded
    as interrupted and their values queued; resume= runs them and completes the sweep."""
    holds = tmp_path / "holds"  # trial k waits for holds/<k>
    holds.mkdir()
    sweep_dir = tmp_path / "sweep"
    args = [
        "hparams_search=gpt_optuna",
        "trainer.accelerator=cpu",
        "sweep.n_trials=3",
        "sweep.n_jobs=2",
        "~sweep.params",
        "+sweep.params.model.optim.optimizer.lr=choice(1.0, 2.0, 3.0)",
        "sweep.sampler._target_=optuna.samplers.BruteForceSampler",
        "~sweep.sampler.n_startup_trials",
        f"sweep.dir={sweep_dir}",
    ]
    env = cli_env() | {"FAKE_TRIAL_HOLD_DIR": str(holds)}
    cmd = [sys.executable, "-c", DRIVER, HELD_TRIAL]
    # as from a terminal: Ctrl-C's default action, whatever this process inherited (a process that
    # starts with SIGINT ignored, as a background job does, keeps ignoring it)
    driver = subprocess.Popen(
        [*cmd, *args],
        env=env,
        cwd=tmp_path,
        start_new_session=True,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    while not all((sweep_dir / str(n) / "started").exists() for n in (0, 1)):
        assert driver.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(driver.pid, signal.SIGINT)
    assert driver.wait(timeout=60) != 0
    study = optuna.load_study(study_name="sweep", storage=f"sqlite:///{sweep_dir / 'optuna.db'}")
    trials = study.get_trials()
    assert [t.state for t in trials[:2]] == [TrialState.FAIL] * 2
    assert all(t.user_attrs["interrupted"] for t in trials[:2])
    queued = sorted(t.user_attrs["rerun_of"] for t in trials if t.state == TrialState.WAITING)
    assert queued == [0, 1]

    fake_trials(monkeypatch)  # resumed here, without holds
    status, out = run_main("sweep", [f"resume={sweep_dir}"])
    assert status == 0 and "trial 0 was interrupted" not in out, out[-3000:]  # already recorded
    done = [t for t in study.get_trials() if t.state == TrialState.COMPLETE]
    assert sorted(t.params["model.optim.optimizer.lr"] for t in done) == [1.0, 2.0, 3.0]
    assert sorted(t.user_attrs.get("rerun_of", -1) for t in done)[1:] == [0, 1]


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["sweep.n_jobs=0"], "sweep.n_jobs: expected a positive int (trials run at once), got 0"),
        (["sweep.n_jobs=512"], "sweep.n_jobs=512 needs 512 CPU cores; this process may use"),
        (
            ["sweep.n_jobs=2", "sweep.devices_per_trial=512"],
            "x sweep.devices_per_trial=512 needs 1024 CPU cores",
        ),
        (["sweep.devices_per_trial=-1"], "sweep.devices_per_trial: expected a positive int or null, got -1"),
        (
            ["trainer=ddp_cpu", "sweep.devices_per_trial=1"],
            "trainer.devices=2: a trial's 2 processes need 2 CPU",
        ),
    ],
)
def test_more_trials_at_once_than_devices_is_refused_before_the_folder(overrides, needle, tmp_path):
    args = ["hparams_search=gpt_optuna", f"sweep.dir={tmp_path / 's'}", *overrides, "trainer.accelerator=cpu"]
    status, out = run_main("sweep", args)
    assert status == 2 and needle in out and out.count("error: ") == 1, out[-2000:]
    assert "Traceback" not in out and not (tmp_path / "s").exists()


def test_a_trial_of_a_driver_sent_as_a_submitit_job_is_not_that_job(monkeypatch):
    """Under sweep.workers the driver is a submitit job: its trials get neither submitit's
    variables nor SLURM's task count (attnlab-train and Lightning would take them for the job and
    its tasks), and they block the job's signal, which is the driver's to act on."""
    from attnlab.experiments.sweep import trial_environment

    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    monkeypatch.setenv("SUBMITIT_FOLDER", "/x")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    env, blocked = trial_environment(Slot("GPU 1", (("CUDA_VISIBLE_DEVICES", "1"),)))
    assert not {"SUBMITIT_EXECUTOR", "SUBMITIT_FOLDER", "SLURM_NTASKS"} & set(env)
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and blocked == (signal.SIGUSR2,)
    monkeypatch.delenv("SUBMITIT_EXECUTOR")
    assert trial_environment(Slot())[1] == ()
