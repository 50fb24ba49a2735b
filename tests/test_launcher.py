"""Hydra's submitit launcher (``hydra/launcher=submitit_slurm``, ``submitit_local``): each job of a
multirun one task per device, sized by the trainer; a job sent submitit's signal requeued and
resumed from its own last.ckpt, ending where an uninterrupted run ends; what SLURM, sbatch or
submitit would refuse, one line before anything is sent."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from attnlab.cli.common import compose_config
from attnlab.cli.train import trainer_rank_zero
from attnlab.core.distributed import check_job_tasks, cluster_plugins, export_local_ranks
from attnlab.core.errors import ConfigError
from attnlab.training.loggers import continue_history
from conftest import QUIET, assert_user_error, popen_cli, read_metrics, run_cli, tiny

needs_proc = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="finds a job's processes in /proc")
LOCAL = ["-m", "hydra/launcher=submitit_local"]
TORCH_ENV = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
)


def small(*overrides: str) -> list[str]:
    """The tiny GPT of tests/conftest.py, its console quiet and its log a CSV file."""
    return tiny(*overrides, "trainer.enable_progress_bar=false", "logger=csv")


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def job_processes(multirun: subprocess.Popen, job_dir: Path) -> list[int]:
    """The processes of one job of a ``submitit_local`` multirun (under each job's controller, one
    per task): those holding a file of ``job_dir`` open (their log)."""
    found = []
    for controller in children(multirun.pid):
        for task in children(controller):
            try:
                if any(
                    os.readlink(fd).startswith(f"{job_dir}{os.sep}")
                    for fd in Path(f"/proc/{task}/fd").iterdir()
                ):
                    found.append(task)
            except OSError:
                continue
    return found


def first_job_training(multirun: subprocess.Popen, sweeps: Path) -> Path:
    """The folder of the first job that logged training steps (its csv/metrics.csv is written)."""
    deadline = time.time() + 300
    while not (found := sorted(sweeps.glob("*/*/csv/metrics.csv"))):
        assert multirun.poll() is None and time.time() < deadline, "no job trained"
        time.sleep(0.02)
    return found[0].parent.parent


def interrupt(multirun: subprocess.Popen, job: Path) -> None:
    """Stop a job as SLURM preempts one: SIGTERM, then submitit's signal (USR2, which submitit also
    sends before a time limit) to each of its processes. Lightning's own SIGTERM handling would end
    the job at its next step, unrequeued; under submitit SIGTERM is ignored."""
    pids = job_processes(multirun, job)
    assert pids, f"no process of {job}"
    for sig in (signal.SIGTERM, signal.SIGUSR2):
        for pid in pids:
            os.kill(pid, sig)


def finish(multirun: subprocess.Popen) -> str:
    try:
        out, _ = multirun.communicate(timeout=600)
    finally:
        if multirun.poll() is None:
            multirun.kill()
    assert multirun.returncode == 0, out[-5000:]
    return out


def test_the_launcher_configs_size_each_job_by_the_trainer():
    cfg = compose_config(
        "train",
        [
            "hydra/launcher=submitit_slurm",
            "trainer=ddp",
            "trainer.devices=4",
            "trainer.num_nodes=2",
            "hydra.launcher.partition=gpu",
            "hydra.launcher.timeout_min=240",
            "hydra.launcher.account=lab",
        ],
        with_hydra=True,
    )
    slurm = cfg.hydra.launcher
    assert (slurm.tasks_per_node, slurm.gpus_per_node, slurm.nodes) == (4, 4, 2)
    assert (slurm.partition, slurm.timeout_min, slurm.account) == ("gpu", 240, "lab")
    assert slurm.max_num_timeout > 0  # a job that reaches its time limit is requeued
    assert slurm._target_.startswith("hydra_plugins.hydra_submitit_launcher.")  # Hydra's own launcher
    assert "submitit_checks" in cfg.hydra.callbacks
    local = compose_config("train", ["hydra/launcher=submitit_local", "trainer=ddp_cpu"], with_hydra=True)
    assert (local.hydra.launcher.tasks_per_node, local.hydra.launcher.nodes) == (2, 1)


@needs_proc
def test_a_local_multirun_requeues_an_interrupted_job_which_ends_as_if_never_stopped(tmp_path):
    """Two identical jobs at once; one is sent submitit's signal mid-training: it writes last.ckpt,
    exits, is started again by submitit, resumes from its own last.ckpt in its own folder, and its
    log and final metrics are the other's, row for row."""
    args = [*small("trainer.max_steps=100", "trainer.val_check_interval=25"), "task_name=req"]
    multirun = popen_cli("train", [*LOCAL, *args, "sample.max_new_tokens=10,11"], tmp_path)
    sweeps = tmp_path / "logs" / "req" / "multiruns"
    job = first_job_training(multirun, sweeps)
    interrupt(multirun, job)
    finish(multirun)

    (sweep,) = sweeps.iterdir()
    assert sorted(p.name for p in sweep.iterdir() if not p.name.startswith(".")) == [
        "0",
        "1",
        "multirun.yaml",
    ]
    assert sorted(p.name for p in (tmp_path / "logs" / "req").iterdir()) == ["multiruns"]
    other = sweep / ("1" if job.name == "0" else "0")
    log = (job / "req.log").read_text()
    step = int(re.search(r"last\.ckpt at step (\d+), then the job is requeued", log)[1])
    assert 0 < step < 100
    last = job / "checkpoints" / "last.ckpt"
    assert f"requeued: resuming from this job's own {last}" in log
    assert OmegaConf.load(job / "config.yaml").ckpt_path == str(last)
    assert OmegaConf.load(other / "config.yaml").ckpt_path is None
    want, got = read_metrics(other), read_metrics(job)
    assert got.keys() == want.keys() and want["val/loss"][-1][0] == 99
    for key in (k for k in want if not k.startswith("throughput/")):  # timings: another each run
        # every row once, with the values of the run that was never stopped
        assert [s for s, _ in got[key]] == [s for s, _ in want[key]], key
        assert [v for _, v in got[key]] == pytest.approx([v for _, v in want[key]], rel=1e-5, abs=1e-6), key


def test_a_job_resumed_in_its_own_folder_keeps_each_row_of_its_log_once(tmp_path):
    """Requeued from a checkpoint older than its log's last rows (SLURM's own requeue after a
    preemption, a signal that never came), the job logs those steps again: they leave the file,
    with a last line cut mid-write."""
    metrics = tmp_path / "metrics.csv"
    metrics.write_text("epoch,step,train/loss\n0,9,2.5\n0,19,2.1\n0,29,1.9\n0,39,1.")
    continue_history(metrics, 20, metrics)
    assert metrics.read_text().splitlines() == ["epoch,step,train/loss", "0,9,2.5", "0,19,2.1"]


@needs_proc
def test_ddp_inside_a_local_job_runs_one_task_per_device_and_requeues(tmp_path):
    """``trainer=ddp_cpu``: submitit starts the job's two processes (Lightning none, no relaunch of
    the command line), both in the job's folder; both take the signal at the same step."""
    args = [*small("trainer.max_steps=60", "trainer.val_check_interval=20"), "task_name=ddp"]
    multirun = popen_cli("train", [*LOCAL, *args, "trainer=ddp_cpu", "seed=5"], tmp_path)
    job = first_job_training(multirun, tmp_path / "logs" / "ddp" / "multiruns")
    interrupt(multirun, job)
    finish(multirun)

    assert sorted(p.name for p in job.parent.iterdir() if not p.name.startswith(".")) == [
        "0",
        "multirun.yaml",
    ]
    log = (job / "ddp.log").read_text()
    assert log.count("Instantiating model") == 4  # two ranks, twice (the job requeued)
    assert log.count("then the job is requeued") == 2  # each rank at the same step
    assert log.count("requeued: resuming from this job's own") == 2
    assert read_metrics(job)["val/loss"][-1][0] == 59


def test_a_local_jobs_tasks_get_torchs_ranks_and_a_slurm_job_lightnings_own(monkeypatch):
    for key in TORCH_ENV:  # restored after the test
        monkeypatch.setenv(key, "x")
        monkeypatch.delenv(key)
    job = {
        "NTASKS": "2",
        "GLOBALID": "1",
        "LOCALID": "1",
        "JOB_ID": "4242",
        "JOB_NUM_NODES": "1",
        "NODEID": "0",
    }
    for key, value in job.items():
        monkeypatch.setenv(f"SUBMITIT_LOCAL_{key}", value)
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "local")
    export_local_ranks()
    assert {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")} == {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
    }
    port = os.environ["MASTER_PORT"]
    monkeypatch.delenv("MASTER_PORT")
    export_local_ranks()
    assert os.environ["MASTER_PORT"] == port  # drawn from the job id: the same in every task
    assert not trainer_rank_zero()
    assert cluster_plugins() == []
    check_job_tasks({"devices": 2})
    with pytest.raises(ConfigError, match=r"trainer.devices=4 but this job runs 2 task\(s\) per node"):
        check_job_tasks({"devices": 4})  # swept per job: the array has the multirun's size

    from lightning.pytorch.plugins.environments import SLURMEnvironment

    for key in TORCH_ENV:
        monkeypatch.delenv(key, raising=False)
    for key, value in {
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_PROCID": "1",
        "SLURM_JOB_NAME": "req",
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    assert not trainer_rank_zero()  # srun's task 1, before Lightning has set anything
    (env,) = cluster_plugins()  # submitit's requeue is the one: Lightning's own is off
    assert isinstance(env, SLURMEnvironment) and not env.auto_requeue


@pytest.mark.parametrize(
    "args,needle",
    [
        (
            ["hydra/launcher=submitit_local", "hydra.launcher.foo=1"],
            "hydra.launcher.foo: hydra/launcher=submitit_local has no such option",
        ),
        (
            ["hydra/launcher=submitit_slurm", "+hydra.launcher.mail_user=me"],
            "hydra.launcher.mail_user: hydra/launcher=submitit_slurm has no such option",
        ),
        (
            ["hydra/launcher=submitit_slurm", "trainer=ddp"],
            "hydra.launcher.tasks_per_node=-1 (trainer.devices=-1) cannot size a job",
        ),
        (
            ["hydra/launcher=submitit_local", "trainer=ddp_cpu", "hydra.launcher.tasks_per_node=1"],
            "hydra.launcher.tasks_per_node=1 but trainer.devices=2: a job runs one task per device",
        ),
        (
            ["hydra/launcher=submitit_local", "trainer=ddp", "trainer.devices=1", "trainer.num_nodes=2"],
            "submitit refuses the options: LocalExecutor can use only one node",
        ),
        (["hydra/launcher=submitit_slurm"], "hydra/launcher=submitit_slurm: no sbatch here"),
    ],
    ids=[
        "unknown-option",
        "unknown-added-option",
        "every-gpu",
        "tasks-not-devices",
        "two-nodes-here",
        "no-sbatch",
    ],
)
def test_a_launcher_option_that_cannot_work_is_one_line_before_anything_is_sent(args, needle, tmp_path):
    if "no sbatch" in needle and shutil.which("sbatch"):
        pytest.skip("this machine has sbatch")
    proc = run_cli("train", ["-m", *args, *QUIET, "task_name=bad"], tmp_path)
    assert_user_error(proc, needle)
    assert proc.stderr.count("error:") == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not list((tmp_path / "logs").rglob("*"))  # no sweep folder, nothing sent


def test_sbatch_gets_one_task_per_device_and_its_refusal_is_one_line(tmp_path, monkeypatch):
    """A stand-in for SLURM's sbatch keeps the script submitit would send and refuses its partition,
    as sbatch --test-only does on a cluster: the refusal is sbatch's line, and nothing is sent."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "sbatch").write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do last="$a"; done\n'
        f'cp "$last" {tmp_path / "sent.sh"}\n'
        'echo "sbatch: error: invalid partition specified: nope" >&2\n'
        "exit 1\n"
    )
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    args = [
        "hydra/launcher=submitit_slurm",
        "trainer=ddp",
        "trainer.devices=2",
        "hydra.launcher.partition=nope",
    ]
    proc = run_cli("train", ["-m", *args, "hydra.launcher.timeout_min=90", *QUIET, "task_name=bad"], tmp_path)
    assert_user_error(
        proc, "sbatch refuses a job of these options: sbatch: error: invalid partition specified: nope"
    )
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not list((tmp_path / "logs").rglob("*"))
    script = (tmp_path / "sent.sh").read_text()
    for line in ("--ntasks-per-node=2", "--gpus-per-node=2", "--nodes=1", "--partition=nope", "--time=90"):
        assert f"#SBATCH {line}\n" in script, script
    assert "#SBATCH --signal=USR2@120\n" in script  # submitit's signal, before the time limit


def test_a_jobs_refused_config_is_its_one_line_in_the_multirun(tmp_path):
    """A job's own bad input (here its net's size) ends it as it ends a run; the multirun, which
    Hydra ends on the job's error, says the job's overrides and its line (Hydra's exit status 1)."""
    args = [*LOCAL, *small("model.net.dim=30", "model.net.n_head=4"), "task_name=bad"]
    proc = run_cli("train", args, tmp_path)
    assert_user_error(
        proc, "model.net.dim=30", "error: model.net.dim: must be divisible by n_head (4), got 30", status=1
    )
    (sweep,) = (tmp_path / "logs" / "bad" / "multiruns").iterdir()
    assert [p.name for p in sweep.iterdir() if not p.name.startswith(".")] == [
        "multirun.yaml"
    ]  # job folder gone
