"""attnlab-sweep: search spaces in Hydra's sweeper syntax, the study in SQLite, resuming after a
kill without repeating finished trials, failed trials recorded, pruning, and clear errors."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from omegaconf import OmegaConf
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from attnlab.core.errors import ConfigError
from attnlab.experiments.sweep import (
    Driver,
    counted,
    open_study,
    recover_interrupted,
    search_space,
    trial_command,
)
from conftest import assert_ok, cli_env, run_cli, tiny


def test_search_spaces_read_hydras_optuna_sweeper_syntax():
    space, fixed = search_space(
        {
            "model.optim.optimizer.lr": "tag(log, interval(1e-4, 1e-2))",
            "model.net.dropout": "interval(0.0, 0.3)",
            "model.net.depth": "range(2, 8, 2)",
            "data.batch_size": "tag(int, interval(8, 64))",
            "model.net.attn_impl": "choice(sdpa, math)",
            "trainer.max_steps": 100,
        }
    )
    assert space["model.optim.optimizer.lr"] == FloatDistribution(1e-4, 1e-2, log=True)
    assert space["model.net.dropout"] == FloatDistribution(0.0, 0.3)
    assert space["model.net.depth"] == IntDistribution(2, 6, step=2)  # range's stop is excluded
    assert space["data.batch_size"] == IntDistribution(8, 64)
    assert space["model.net.attn_impl"] == CategoricalDistribution(["sdpa", "math"])
    assert fixed == ["trainer.max_steps=100"]
    with pytest.raises(ConfigError, match=r"sweep.params.model.net.depth: cannot parse"):
        search_space({"model.net.depth": "choice(2, 4"})
    with pytest.raises(ConfigError, match="sweep.params: nothing to search"):
        search_space({"trainer.max_steps": 100})


def test_a_trial_left_running_is_failed_as_interrupted_and_its_parameters_queued(tmp_path):
    space = {"lr": FloatDistribution(1e-4, 1e-2, log=True)}
    study = open_study(tmp_path, "minimize", optuna.samplers.RandomSampler(seed=0))
    done = study.ask(space)
    study.tell(done, 1.0)
    killed = study.ask(space)  # the sweep died during this one
    study = open_study(tmp_path, "minimize")  # a new process opens the same SQLite study
    assert recover_interrupted(study) == [killed.number]
    trials = study.get_trials()
    assert trials[killed.number].state == TrialState.FAIL and trials[killed.number].user_attrs["interrupted"]
    assert [counted(t) for t in trials] == [True, False, False]
    rerun = study.ask(space)
    assert rerun.params == killed.params and rerun.user_attrs == {"rerun_of": killed.number}


def test_trials_run_train_with_the_sampled_values_in_their_own_directory(tmp_path):
    cmd = trial_command(
        ["experiment=gpt_pydoc_char"],
        {"model.optim.optimizer.lr": 0.001, "model.net.bias": True, "data.name": "it's"},
        tmp_path / "3",
        "sqlite:////x/optuna.db",
        3,
    )
    assert cmd[:3] == [sys.executable, "-m", "attnlab.cli.train"]
    assert cmd[3:7] == [
        "experiment=gpt_pydoc_char",
        "model.optim.optimizer.lr=0.001",
        "model.net.bias=true",
        "data.name='it\\'s'",
    ]
    assert cmd[7] == f"hydra.run.dir='{tmp_path / '3'}'"
    assert cmd[8] == "sweep_trial={storage:'sqlite:////x/optuna.db',number:3,study:'sweep'}"


def test_sweep_errors_name_what_is_wrong(tmp_path):
    proc = run_cli("sweep", ["experiment=gpt_pydoc_char"], tmp_path)
    assert proc.returncode == 2 and "add hparams_search=<name>" in proc.stderr
    proc = run_cli("sweep", [f"resume={tmp_path / 'nowhere'}"], tmp_path)
    assert proc.returncode == 2 and "no sweep.yaml there" in proc.stderr
    proc = run_cli("sweep", ["hparams_search=gpt_optuna", "~sweep.params.model.nowhere"], tmp_path)
    assert proc.returncode == 2 and "Could not delete from config" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("+sweep.params.model.optim.optimizer.eps=interval(3e-3, 1e-4)", "`low <= high` must hold"),
        (
            "+sweep.params.model.optim.optimizer.eps=tag(log, interval(0, 1e-3))",
            "`low > 0` must hold for `log=True`",
        ),
        ("sweep.sampler._target_=optuna.samplers.FooSampler", "sweep.sampler: Error locating target"),
        ("+sweep.pruner.foo=1", "got an unexpected keyword argument 'foo'"),
        ("sweep.direction=up", "sweep.direction: expected minimize or maximize"),
        ("sweep.n_trials=abc", "sweep.n_trials: expected a positive int, got 'abc'"),
    ],
)
def test_an_invalid_sweep_is_refused_before_its_folder_is_written(override, needle, tmp_path):
    """So the same command, fixed, can run again (a written sweep.yaml would ask for resume=)."""
    from conftest import run_main

    status, out = run_main("sweep", ["hparams_search=gpt_optuna", f"sweep.dir={tmp_path / 's'}", override])
    assert status == 2 and needle in out and "Traceback" not in out, out[-2000:]
    assert out.count("error: ") == 1, out  # printed once
    assert not (tmp_path / "s").exists()


def test_each_finished_trial_says_the_best_so_far(tmp_path, monkeypatch):
    """The driver's line per trial, with trials that log preset values instead of training
    (the real sweep's lines are checked by the slow resume test)."""
    import attnlab.experiments.sweep as sweep_module

    values = {0.1: "2.0", 0.2: "1.5", 0.3: None, 0.4: "1.8"}  # None: the run fails

    def command(overrides, params, run_dir, storage, number, study_name):
        value = values[params["lr"]]
        log = f"step,val/loss\n1,{value}\n"
        code = (
            f"import pathlib; d = pathlib.Path({str(run_dir)!r}) / 'csv'; d.mkdir(); "
            f"(d / 'metrics.csv').write_text({log!r})"
            if value
            else "import sys; sys.exit('error: boom')"
        )
        return [sys.executable, "-c", code]

    monkeypatch.setattr(sweep_module, "trial_command", command)
    lines: list[str] = []
    space = {"lr": CategoricalDistribution([0.1, 0.2, 0.3, 0.4])}
    study = open_study(tmp_path, "minimize", optuna.samplers.BruteForceSampler())
    study.enqueue_trial({"lr": 0.1})  # in this order
    study.enqueue_trial({"lr": 0.2})
    study.enqueue_trial({"lr": 0.3})
    Driver(study, space, [], tmp_path, "val/loss", 4, echo=lines.append).run()
    assert [line.split("; ")[0] for line in lines] == [
        "trial 1/4 done: val/loss 2.0000 (best so far 2.0000, trial 0)",
        "trial 2/4 done: val/loss 1.5000 (best so far 1.5000, trial 1)",
        "trial 3/4 done: failed: exit status 1: error: boom (best so far 1.5000, trial 1)",
        "trial 4/4 done: val/loss 1.8000 (best so far 1.5000, trial 1)",
    ]
    assert lines[0].split("; ")[1].startswith("trial 0: lr=0.1 (")
    assert all(t.user_attrs["host"] and t.user_attrs["run_dir"] for t in study.trials)  # where each ran


@pytest.mark.slow
def test_killing_the_sweep_driver_ends_its_running_trial(tmp_path):
    sweep_dir = tmp_path / "sweep"
    args = [*SWEEP, f"sweep.dir={sweep_dir}", "trainer.max_steps=100000", "trainer.val_check_interval=100000"]
    driver = subprocess.Popen(
        [sys.executable, "-m", "attnlab.cli.sweep", *args],
        cwd=tmp_path,
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    log = sweep_dir / "0" / "trial.log"
    deadline = time.monotonic() + 300
    while not (log.exists() and "Instantiating model" in log.read_text(errors="replace")):
        assert driver.poll() is None and time.monotonic() < deadline
        time.sleep(0.5)
    trial = trial_pids(sweep_dir)
    assert len(trial) == 1
    driver.kill()  # SIGKILL: no handler of the driver's runs
    driver.wait()
    deadline = time.monotonic() + 60
    while trial_pids(sweep_dir):
        assert time.monotonic() < deadline, "the trial trains on without its sweep"
        time.sleep(0.5)


def trial_pids(sweep_dir: Path) -> list[int]:
    """The processes whose command line names ``sweep_dir`` as their run directory."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
            state = next(ln for ln in (proc / "status").read_text().splitlines() if ln.startswith("State:"))
        except (OSError, StopIteration):
            continue
        if f"hydra.run.dir='{sweep_dir}" in cmdline and "zombie" not in state:
            pids.append(int(proc.name))
    return pids


def test_search_spaces_given_on_the_command_line_need_no_quotes():
    from attnlab.cli.common import compose_train
    from attnlab.cli.sweep import quote_search_spaces

    args = quote_search_spaces(
        [
            "hparams_search=gpt_optuna",
            "~sweep.params",
            "+sweep.params.model.net.n_head=choice(4, 3)",
            "+sweep.params.model.optim.optimizer.lr='interval(1e-4, 1e-3)'",
        ]
    )
    space, _ = search_space(compose_train(args).sweep.params)  # Hydra left them to the driver
    assert space["model.net.n_head"] == CategoricalDistribution([4, 3])
    assert space["model.optim.optimizer.lr"] == FloatDistribution(1e-4, 1e-3)


# Six learning rates, each tried once in a seeded order: one is invalid (AdamW refuses it), the tiny
# ones fall behind the median and are pruned at their first validation.
SWEEP = [
    "hparams_search=gpt_optuna",
    "experiment=gpt_pydoc_char",
    *tiny("trainer.max_steps=20", "model.optim.scheduler.warmup_steps=5", "logger=csv", "test=false"),
    "sweep.n_trials=6",
    "~sweep.params",
    "+sweep.params.model.optim.optimizer.lr='choice(3e-3, 1e-3, 1e-6, 2e-6, -1.0, 5e-3)'",
    "sweep.sampler._target_=optuna.samplers.BruteForceSampler",
    "~sweep.sampler.n_startup_trials",
    "sweep.pruner.n_startup_trials=2",
    "sweep.pruner.n_warmup_steps=0",
]


@pytest.mark.slow
def test_a_killed_sweep_resumes_without_repeating_finished_trials(tmp_path):
    sweep_dir = tmp_path / "sweep"
    args = [*SWEEP, f"sweep.dir={sweep_dir}"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "attnlab.cli.sweep", *args],
        cwd=tmp_path,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    fourth = sweep_dir / "3" / "trial.log"
    deadline = time.monotonic() + 300
    while not (fourth.exists() and "Instantiating model" in fourth.read_text(errors="replace")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()[-3000:]
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and its trial, as a lost machine would
    proc.wait()
    finished = {n: (sweep_dir / str(n) / "trial.log").stat().st_mtime for n in range(3)}

    resumed = run_cli("sweep", [f"resume={sweep_dir}"], tmp_path)
    assert_ok(resumed)
    assert "trial 3 was interrupted" in resumed.stdout

    study = optuna.load_study(study_name="sweep", storage=f"sqlite:///{sweep_dir / 'optuna.db'}")
    trials = study.get_trials()
    done = [t for t in trials if counted(t)]
    assert len(done) == 6 and len(trials) == 7  # six finished + the interrupted one
    assert sorted(t.params["model.optim.optimizer.lr"] for t in done) == [-1.0, 1e-6, 2e-6, 1e-3, 3e-3, 5e-3]
    assert trials[3].user_attrs["interrupted"] and trials[4].user_attrs["rerun_of"] == 3  # queued first
    assert trials[4].params == trials[3].params
    for n, mtime in finished.items():  # finished trials were not run again
        assert (sweep_dir / str(n) / "trial.log").stat().st_mtime == mtime
    failed = [t for t in done if t.state == TrialState.FAIL]
    assert len(failed) == 1 and failed[0].params["model.optim.optimizer.lr"] == -1.0
    assert "Invalid learning rate" in failed[0].user_attrs["error"]
    assert any(t.state == TrialState.PRUNED for t in done)
    assert all(t.state == TrialState.COMPLETE for t in done if t.params["model.optim.optimizer.lr"] >= 1e-3)
    assert "best: trial" in resumed.stdout
    assert "trial 6/6 done: " in resumed.stdout and "(best so far " in resumed.stdout

    table = run_cli("compare", [str(sweep_dir), "--format", "csv", "--metrics", "val/loss_best"], tmp_path)
    assert_ok(table)
    header, *rows = table.stdout.strip().splitlines()
    assert header.startswith("model.optim.optimizer.lr,")
    assert len(rows) == 7  # every trial, the failed one too (it wrote no metrics)
    assert sum(",fail," in row for row in rows) == 1 and sum(",interrupted," in row for row in rows) == 1


# W&B sweeps need a server; the files are checked here: their shape, and that every value drawn
# from their spaces composes into the config key it names.
WANDB_SWEEPS = sorted((Path(__file__).resolve().parents[1] / "sweeps").glob("*.yaml"))
DISTRIBUTIONS = {"uniform", "log_uniform_values", "int_uniform", "categorical"}


def draws(spec: dict, rng) -> list:
    """Values a W&B agent could give one parameter."""
    if "value" in spec:
        return [spec["value"]]
    if "values" in spec:
        return list(spec["values"])
    dist = spec.get("distribution", "int_uniform" if isinstance(spec["min"], int) else "uniform")
    assert dist in DISTRIBUTIONS and spec["min"] < spec["max"], spec
    if dist == "int_uniform":
        return [spec["min"], spec["max"], rng.randint(spec["min"], spec["max"])]
    if dist == "log_uniform_values":
        return [spec["min"], spec["max"], math.exp(rng.uniform(math.log(spec["min"]), math.log(spec["max"])))]
    return [spec["min"], spec["max"], rng.uniform(spec["min"], spec["max"])]


@pytest.mark.parametrize("path", WANDB_SWEEPS, ids=lambda p: p.name)
def test_wandb_sweep_files_compose_for_values_drawn_from_their_spaces(path):
    import random

    from wandb.sdk.launch.sweeps.utils import load_sweep_config

    from attnlab.cli.common import compose_train

    sweep = load_sweep_config(str(path))
    assert sweep["method"] in ("grid", "random", "bayes")
    assert sweep["metric"]["goal"] in ("minimize", "maximize")
    if sweep["method"] == "grid":
        assert all("values" in s or "value" in s for s in sweep["parameters"].values())
    command = sweep["command"]
    assert command[-1] == "${args_no_hyphens}" and "attnlab-train" in command
    fixed = command[command.index("attnlab-train") + 1 : -1]
    assert fixed and all("=" in arg and not arg.startswith("-") for arg in fixed)

    rng = random.Random(0)
    space = {key: draws(spec, rng) for key, spec in sweep["parameters"].items()}
    for i in range(max(len(v) for v in space.values())):
        args = {key: values[i % len(values)] for key, values in space.items()}
        cfg = compose_train([*fixed, *(f"{k}={v}" for k, v in args.items())])  # as ${args_no_hyphens}
        for key, value in args.items():
            assert OmegaConf.select(cfg, key) == pytest.approx(value), key
        assert cfg.optimized_metric == sweep["metric"]["name"]


def test_tensorboard_hparams_tab_gets_each_runs_hyperparameters_and_final_metrics(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    args = tiny("logger=tensorboard", "model.optim.optimizer.lr=0.002", "task_name=tb")
    assert_ok(run_cli("train", args, tmp_path))
    (events,) = (tmp_path / "logs" / "tb" / "runs").glob("*/tensorboard")
    acc = EventAccumulator(str(events), size_guidance={"tensors": 0})
    acc.Reload()
    content = acc.PluginTagToContent("hparams")
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    metrics = {m.name.tag for m in experiment.metric_infos}
    assert {"test/loss", "val/loss_best"} <= metrics
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    assert start.session_start_info.hparams["model.optim.optimizer.lr"].number_value == 0.002
    assert start.session_start_info.hparams["model.net.dim"].number_value == 32
    logged = set(start.session_start_info.hparams)  # what was trained, not how it was logged
    assert "seed" in logged and not any(k.startswith(("callbacks.", "logger.", "paths.")) for k in logged)


@pytest.mark.parametrize("name", ["gpt_optuna", "translation_optuna", "vision_optuna", "bert_optuna"])
def test_hparams_search_configs_compose_and_their_seeded_samplers_repeat_a_sweep(name, tmp_path):
    from hydra.utils import instantiate

    from attnlab.cli.common import compose_train

    experiment = {
        "gpt_optuna": "gpt_pydoc_char",
        "translation_optuna": "nmt_transformer_multi30k",
        "vision_optuna": "vit_fashion_mnist",
        "bert_optuna": "bert_finetune_sst2",
    }[name]
    cfg = compose_train([f"hparams_search={name}", f"experiment={experiment}"])
    space, _ = search_space(cfg.sweep.params)
    for key in space:  # every searched key exists in the experiment's config
        assert OmegaConf.select(cfg, key) is not None, key
    sampled = []
    for run in range(2):
        study = open_study(tmp_path / str(run), cfg.sweep.direction, instantiate(cfg.sweep.sampler))
        for _ in range(6):
            study.tell(trial := study.ask(space), 1.0 / (1 + trial.number))
        sampled.append([t.params for t in study.trials])
    assert sampled[0] == sampled[1]


@pytest.mark.parametrize("multirun", [["-m"], []])
def test_train_with_a_search_space_refuses_and_names_the_sweep_command(multirun, tmp_path, monkeypatch):
    """lightning-hydra-template's habit, ``attnlab-train -m hparams_search=...``, trained one job
    and ignored the search; it is refused before anything is built, with the command to run."""
    from conftest import run_main

    monkeypatch.chdir(tmp_path)
    status, out = run_main(
        "train",
        [*multirun, "hparams_search=gpt_optuna", "experiment=gpt_pydoc_char", f"paths.root_dir={tmp_path}"],
    )
    assert status == 2, out[-2000:]
    assert "attnlab-sweep hparams_search=gpt_optuna experiment=gpt_pydoc_char" in out
    assert "Traceback" not in out and not list(tmp_path.rglob("*.ckpt"))


def test_sweep_help_prints_its_usage_and_examples():
    from conftest import run_main

    status, out = run_main("sweep", ["--help"])
    assert status == 0 and out.startswith("usage: attnlab-sweep"), out
    assert "attnlab-sweep hparams_search=gpt_optuna" in out and "error" not in out
