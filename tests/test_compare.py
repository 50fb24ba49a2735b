"""attnlab-compare: varying hyperparameters found, seeds grouped as mean ± std, sorting,
filtering, formats, the curve plot, clear errors, and the statistics on a real multirun (their
maths on fixed values: tests/test_compare_stats.py)."""

from __future__ import annotations

import csv
import io
import json
import shutil
import statistics
from pathlib import Path

import numpy as np
import pytest
import yaml
from scipy import stats

from attnlab.cli.compare import compare, main, parse_args
from attnlab.experiments.compare import Run, find_runs, plot, seeds_needed


def write_run(root: Path, name: str, lr: float, seed: int, losses: list[float], acc: float) -> Path:
    run = root / name
    (run / "csv").mkdir(parents=True)
    config = {
        "seed": seed,
        "task_name": "gpt",
        "paths": {"output_dir": str(run)},
        "model": {"optimizer": {"lr": lr, "betas": [0.9, 0.99]}},
        "trainer": {"max_steps": 30},
    }
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    rows = ["epoch,step,val/loss,test/acc"]
    rows += [f"0,{10 * (i + 1)},{loss}," for i, loss in enumerate(losses)]
    rows.append(f"0,{10 * len(losses)},,{acc}")
    (run / "csv" / "metrics.csv").write_text("\n".join(rows) + "\n")
    return run


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    root = tmp_path / "multiruns" / "2026-11-25"
    n = 0
    for lr, base in ((0.001, 2.0), (0.01, 1.0)):
        for seed in (1, 2, 3):
            losses = [base + 1, base + seed / 10, base + 0.5]
            write_run(root, str(n), lr, seed, losses, acc=base / 10 + seed / 100)
            n += 1
    return root


def test_seeds_group_into_mean_and_std_per_setting(sweep):
    out = compare(parse_args([str(sweep), "--format", "csv", "--metrics", "test/acc,val/loss"]))
    header, *body = [line.split(",") for line in out.strip().splitlines()]
    assert header == ["model.optimizer.lr", "runs", "test/acc", "val/loss"]  # the seed is grouped away
    assert [row[:2] for row in body] == [["0.001", "3"], ["0.01", "3"]]
    accs = [0.2 + s / 100 for s in (1, 2, 3)]
    assert body[0][2] == f"{statistics.fmean(accs):.4g} ± {statistics.stdev(accs):.2g}"
    best = compare(parse_args([str(sweep), "--format", "csv", "--metrics", "val/loss", "--best"]))
    assert best.strip().splitlines()[1].startswith("0.001,3,2.2 ± 0.1")  # min of each run's curve


def test_one_row_per_run_sorting_and_filtering(sweep):
    out = compare(parse_args([str(sweep), "--no-group", "--format", "md", "--sort", "test/acc"]))
    lines = out.strip().splitlines()
    assert lines[0] == "| model.optimizer.lr | seed | runs | test/acc |" and len(lines) == 2 + 6
    assert lines[2].startswith("| 0.001 | 3 |")  # the highest accuracy first
    only = compare(parse_args([str(sweep), "--where", "model.optimizer.lr=0.01", "--format", "csv"]))
    assert [line.split(",")[0] for line in only.strip().splitlines()] == ["runs", "3"]  # nothing varies
    table = compare(parse_args([str(sweep)]))
    assert "model.optimizer.lr" in table and "0.22 ± 0.01" in table


def test_plot_overlays_every_run(sweep, tmp_path, monkeypatch):
    import attnlab.training.plots

    figures, draw = [], attnlab.training.plots.curves_figure

    def kept(*args, **kwargs):  # the figure compare draws, kept to be looked at
        figures.append(draw(*args, **kwargs))
        return figures[-1]

    monkeypatch.setattr(attnlab.training.plots, "curves_figure", kept)
    out = tmp_path / "loss.png"
    compare(parse_args([str(sweep), "--no-group", "--plot", "val/loss", "--out", str(out)]))
    assert out.read_bytes()[:4] == b"\x89PNG"
    (fig,) = figures
    (ax,) = fig.axes
    # one line per run, each the run's own curve, named in the legend by what varies
    expected = {
        f"lr={lr}, seed={seed}": [base + 1, base + seed / 10, base + 0.5]
        for lr, base in ((0.001, 2.0), (0.01, 1.0))
        for seed in (1, 2, 3)
    }
    lines = ax.get_lines()
    assert {line.get_label(): list(line.get_ydata()) for line in lines} == expected and len(lines) == 6
    assert all(list(line.get_xdata()) == [10, 20, 30] for line in lines)
    assert sorted(t.get_text() for t in ax.get_legend().get_texts()) == sorted(expected)
    attnlab.training.plots.plt.close(fig)


def test_bad_paths_filters_and_metrics_are_clear_errors(sweep, tmp_path, capsys, caplog):
    def said() -> str:  # one line on stderr; under pytest the log record goes to its handler
        text = caplog.text + capsys.readouterr().err
        caplog.clear()
        return text

    for argv, needle in (
        ([str(tmp_path / "nope")], "no such run or sweep directory"),
        ([str(tmp_path / "multiruns"), "--where", "lr"], "--where 'lr': expected KEY=VALUE"),
        ([str(sweep), "--where", "seed=9"], "no run matches"),
        ([str(sweep), "--plot", "val/bleu"], "--plot val/bleu: no run logged it"),
    ):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and needle in said(), argv
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        main([str(tmp_path / "empty")])
    assert "no runs (csv/metrics.csv) under" in said()


def test_an_offline_wandb_run_is_read_from_its_csv_log_or_through_wandbs_cli(tmp_path, capsys):
    """A real attnlab-train run logging to W&B (offline: no key): read from the CSV log beside
    it; its W&B run folder alone (a run of a tool that logged to W&B only) is read through
    ``wandb leet inspect --json``, with the same config and curves; a damaged one is one line."""
    from conftest import TINY, assert_ok, run_cli, run_dirs

    assert_ok(run_cli("train", [*TINY, "task_name=wb", "logger=wandb", "test=false"], tmp_path))
    (run_dir,) = run_dirs(tmp_path, "wb")
    (offline,) = run_dir.rglob("offline-run-*")
    args = ["--format", "csv", "--metrics", "val/loss,val/loss_best", "--no-group"]
    status, from_csv, err = compare_main([str(run_dir), *args], capsys)
    assert status == 0 and len(from_csv.strip().splitlines()) == 2, err

    alone = tmp_path / "wandb-only"
    alone.mkdir()
    offline.rename(alone / offline.name)  # as a run of another tool, with no CSV log
    status, from_wandb, err = compare_main([str(alone), *args], capsys)
    assert status == 0, err
    assert from_wandb.strip().splitlines()[1] == from_csv.strip().splitlines()[1]  # the same final values
    (wandb_run,) = find_runs([alone])
    (csv_run,) = find_runs([run_dir])
    assert wandb_run.curves["val/loss"] == csv_run.curves["val/loss"]  # every point, at its step
    assert wandb_run.config["model.optim.optimizer.lr"] == csv_run.config["model.optim.optimizer.lr"]

    damaged = tmp_path / "damaged" / "offline-run-20260101_000000-x"
    damaged.mkdir(parents=True)
    (damaged / "run-x.wandb").write_bytes(b"not a W&B log")
    status, out, err = compare_main([str(damaged.parent)], capsys)
    assert status == 2 and out == "" and err.count("\n") == 1, err
    assert "wandb leet inspect cannot read it" in err and "wandb sync" in err, err


def test_a_sweep_trial_killed_before_its_csv_log_is_one_row_from_the_study(tmp_path, monkeypatch):
    import optuna
    import wandb

    from attnlab.experiments.sweep import open_study

    sweep_dir = tmp_path / "sweep"
    study = open_study(sweep_dir, "minimize")
    space = {"model.optimizer.lr": optuna.distributions.FloatDistribution(1e-4, 1.0)}
    finished, killed = study.ask(space), study.ask(space)
    write_run(sweep_dir, "0", finished.params["model.optimizer.lr"], 1, [2.0, 1.5], acc=0.5)
    study.tell(finished, 1.5)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb.init(dir=sweep_dir / "1", project="p").finish()  # killed early: W&B started, no CSV yet
    study.tell(killed, state=optuna.trial.TrialState.FAIL)
    out = compare(parse_args([str(sweep_dir), "--format", "csv", "--metrics", "test/acc"]))
    header, *rows = out.strip().splitlines()
    # the W&B run inside trial 1 is not a run of its own: no row of empty values, and it does not
    # make every config key look as if it varied
    assert header == "model.optimizer.lr,state,trial,runs,test/acc"
    assert len(rows) == 2 and rows[1].endswith(",fail,1,1,-")


# ---- half-written or damaged logs: named, or left out with a notice -------------------------------


def compare_main(args: list[str], capsys) -> tuple[int, str, str]:
    try:
        main(args)
        status = 0
    except SystemExit as e:
        status = e.code
    out = capsys.readouterr()
    return status, out.out, out.err


def test_a_last_line_cut_inside_a_number_is_left_out_with_a_notice(sweep, capsys):
    log = sweep / "0" / "csv" / "metrics.csv"
    log.write_text(log.read_text() + "0,40,4.5")  # the run was writing 4.5312 when it was read
    status, out, err = compare_main([str(sweep / "0"), "--format", "csv", "--metrics", "val/loss"], capsys)
    assert status == 0 and out.strip().splitlines()[1].endswith(",2.5")  # the last whole value
    assert f"{log}:6: an incomplete last line" in err


def test_an_unparsable_value_or_config_names_the_file(sweep, capsys):
    log = sweep / "0" / "csv" / "metrics.csv"
    log.write_text(log.read_text().replace("0,20,", "0,20,2.1x", 1))
    status, _, err = compare_main([str(sweep)], capsys)
    assert status == 2 and f"{log}:3: not a number: {{'val/loss': '2.1x" in err and "Traceback" not in err
    (sweep / "1" / "config.yaml").write_text("seed: [1,\n")
    status, _, err = compare_main([str(sweep / "1")], capsys)
    assert status == 2 and f"{sweep / '1' / 'config.yaml'}: not a readable config" in err
    assert err.count("error: ") == 1  # printed once


def test_a_run_without_metrics_and_a_copy_of_a_run_are_left_out(sweep, capsys):
    import shutil

    empty = write_run(sweep, "6", 0.1, 1, [], 0.0)
    (empty / "csv" / "metrics.csv").write_text("epoch,step,val/loss,test/acc\n")  # header only
    copy = sweep.parent / "copy_of_0"
    shutil.copytree(sweep / "0", copy)
    log = copy / "csv" / "metrics.csv"
    log.write_text("\n".join(log.read_text().splitlines()[:2]) + "\n")  # a partial copy
    args = [str(sweep), str(copy), "--format", "csv", "--metrics", "test/acc"]
    status, out, err = compare_main(args, capsys)
    assert status == 0, err
    assert [row.split(",")[:2] for row in out.strip().splitlines()[1:]] == [["0.001", "3"], ["0.01", "3"]]
    assert f"{empty}: no metrics logged yet: left out" in err
    assert f"{copy}: the same config as {sweep / '0'}, seed included (a copy?): left out" in err


def test_an_unknown_sort_or_metric_is_refused(sweep, capsys):
    status, _, err = compare_main([str(sweep), "--sort", "val/acc"], capsys)
    assert status == 2 and "--sort val/acc: no run logged it (logged: test/acc, val/loss)" in err
    status, _, err = compare_main([str(sweep), "--metrics", "test/bleu"], capsys)
    assert status == 2 and "--metrics test/bleu: no run logged it" in err


def test_seeds_of_a_real_multirun_group_as_mean_and_std_and_plot_as_bands(
    positions_multirun, tmp_path, monkeypatch
):
    """``attnlab-train -m seed=1,2,3 model.net.positions=learned,alibi``: every data config takes
    ``seed: ${seed}``, so the saved (resolved) configs differ in ``data.seed`` too; derived keys
    follow the key they come from, and the three seeds of each setting make one row and one band."""
    import attnlab.training.plots

    multirun = positions_multirun
    table = compare(parse_args([str(multirun), "--format", "csv", "--metrics", "val/loss"]))
    lines = table.strip().splitlines()
    assert lines[0].startswith("model.net.positions,runs"), table  # no data.seed column
    assert sorted(line.split(",")[:2] for line in lines[1:]) == [["alibi", "3"], ["learned", "3"]]
    figures, draw = [], attnlab.training.plots.curves_figure
    monkeypatch.setattr(
        attnlab.training.plots, "curves_figure", lambda *a: figures.append(draw(*a)) or figures[-1]
    )
    compare(parse_args([str(multirun), "--plot", "val/loss", "--out", str(tmp_path / "loss.png")]))
    (ax,) = figures[0].axes
    labels = ["positions=alibi (3 seeds)", "positions=learned (3 seeds)"]
    assert sorted(line.get_label() for line in ax.get_lines()) == labels
    assert len(ax.collections) == 2  # a band around each mean
    assert sorted(t.get_text() for t in ax.get_legend().get_texts()) == labels
    attnlab.training.plots.plt.close(figures[0])


def test_a_real_multirun_prints_intervals_p_values_and_seeds_needed(positions_multirun, capsys):
    """The bar of issue 59: ``attnlab-train -m seed=1,2,3 model.net.positions=learned,alibi``
    compared against ``--baseline``, every figure equal to scipy's on the runs' own metrics.csv."""
    from conftest import read_metrics

    multirun = positions_multirun
    values: dict[str, list[float]] = {"learned": [], "alibi": []}
    for run in sorted(p.parent.parent for p in multirun.rglob("csv/metrics.csv")):
        positions = yaml.safe_load((run / "config.yaml").read_text())["model"]["net"]["positions"]
        values[positions].append(read_metrics(run)["test/loss"][-1][1])
    args = [str(multirun), "--metrics", "test/loss", "--baseline", "model.net.positions=learned"]
    main([*args, "--format", "json"])
    table = json.loads(capsys.readouterr().out)
    assert table["baseline"] == "model.net.positions=learned"
    rows = {r["config"]["model.net.positions"]: r["metrics"]["test/loss"] for r in table["rows"]}
    for name, got in rows.items():
        vals = values[name]
        assert got["n"] == 3 and got["mean"] == pytest.approx(statistics.fmean(vals))
        ci = stats.t.interval(0.95, 2, np.mean(vals), stats.sem(vals))
        assert got["ci"] == pytest.approx(ci)
    welch = stats.ttest_ind(values["alibi"], values["learned"], equal_var=False)
    assert rows["alibi"]["p"] == pytest.approx(welch.pvalue)
    assert rows["alibi"]["diff_ci"] == pytest.approx(list(welch.confidence_interval(0.95)))
    pooled = np.sqrt((np.var(values["alibi"], ddof=1) + np.var(values["learned"], ddof=1)) / 2)
    assert rows["alibi"]["seeds_needed"] == seeds_needed(rows["alibi"]["diff"] / pooled)
    assert rows["learned"]["p"] is None  # the baseline itself

    main([*args, "--format", "csv"])  # what a user reads: the same figures, rounded
    header, *body = capsys.readouterr().out.splitlines()
    assert "test/loss (95% CI),Δ test/loss,p test/loss,seeds test/loss" in header
    alibi = next(line for line in body if line.startswith("alibi"))
    assert f"{welch.pvalue:.3g}" in alibi and f"[{rows['alibi']['ci'][0]:.3g}, " in alibi
    assert alibi.endswith(f",{rows['alibi']['seeds_needed'] or '-'}")


def test_runs_of_different_families_line_up_on_the_shared_names(tmp_path, monkeypatch):
    """A GPT and a ViT name width and depth alike (``model.net.dim``, ``model.net.depth``), so one
    table compares them: one row per run, both runs' values in the same two columns."""
    from conftest import QUIET, run_main, tiny, vision_overrides

    monkeypatch.chdir(tmp_path)
    common = [
        "test=false",
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        f"paths.root_dir={tmp_path}",
    ]
    gpt = tiny("model.net.dim=32", "model.net.depth=2", "logger=csv")
    vit = ["experiment=vit_fashion_mnist", *vision_overrides("vit_fashion_mnist", tmp_path), *QUIET]
    for args in (gpt, vit):
        status, out = run_main("train", [*args, *common])
        assert status == 0, out[-3000:]
    table = compare(parse_args([str(tmp_path / "logs"), "--format", "csv", "--metrics", "val/loss"]))
    header, *body = csv.reader(io.StringIO(table))  # values such as betas=[0.9, 0.99] are quoted
    assert {"model.net.dim", "model.net.depth"} <= set(header), header
    dim, depth = header.index("model.net.dim"), header.index("model.net.depth")
    assert sorted((row[dim], row[depth]) for row in body) == [("16", "1"), ("32", "2")]  # ViT, GPT


def test_the_table_follows_the_terminal_width(sweep, monkeypatch):
    widest = {}
    for columns in (40, 200):
        monkeypatch.setenv("COLUMNS", str(columns))
        widest[columns] = max(len(line) for line in compare(parse_args([str(sweep)])).splitlines())
    assert widest[40] <= 40 < widest[200]


# ---- an attnlab-sweep study shared by many machines: every trial with the machine it ran on -------


def shared_study(url: str, reached: Path) -> None:
    """A study as drivers on two machines leave it: trial 0 ran here (its folder is ``reached``),
    1 elsewhere, 2 elsewhere until its driver died (failed as stale, run again as 3, here)."""
    import optuna

    from attnlab.experiments.study import open_storage
    from attnlab.experiments.sweep import open_study

    study = open_study(None, "minimize", storage=open_storage(url), study_name="gpt")
    study.set_metric_names(["val/loss_best"])
    space = {"model.optimizer.lr": optuna.distributions.CategoricalDistribution([0.1, 0.2, 0.3])}
    where = [("alpha", reached), ("beta", Path("/elsewhere/1")), ("beta", Path("/elsewhere/2"))]
    for (host, run_dir), value, lr in zip(where, (0.5, 0.7, None), (0.1, 0.2, 0.3), strict=True):
        study.enqueue_trial({"model.optimizer.lr": lr})
        trial = study.ask(space)
        trial.set_user_attr("host", host)
        trial.set_user_attr("run_dir", str(run_dir))
        study.tell(trial, value, state=None if value else optuna.trial.TrialState.FAIL)
    stale = study.trials[2]
    study.add_trial(
        optuna.trial.create_trial(
            params=stale.params,
            distributions=stale.distributions,
            value=0.6,
            user_attrs={"host": "alpha", "run_dir": "/gone/3", "rerun_of": 2},
            system_attrs={"failed_trial": 2, "retry_history": [2]},
        )
    )
    (reached / "csv").mkdir(parents=True)
    (reached / "config.yaml").write_text(yaml.safe_dump({"model": {"optimizer": {"lr": 0.1}}, "seed": 1}))
    (reached / "csv" / "metrics.csv").write_text("step,val/loss_best\n10,0.9\n20,0.5\n")


@pytest.mark.parametrize("kind", ["journal", "sqlite"])
def test_a_study_url_lists_every_trial_with_the_machine_it_ran_on(kind, tmp_path):
    url = f"journal:{tmp_path / 'gpt.log'}" if kind == "journal" else f"sqlite:///{tmp_path / 'optuna.db'}"
    shared_study(url, tmp_path / "alpha" / "0")
    out = compare(parse_args([url, "--format", "csv", "--no-group"]))
    header, *rows = out.strip().splitlines()
    assert header == "model.optimizer.lr,state,trial,host,runs,val/loss_best"
    assert rows[0].endswith(",complete,0,alpha,1,0.5")  # from its run folder's log, reached here
    assert rows[1].endswith(",complete,1,beta,1,0.7")  # from the study: its folder is elsewhere
    assert rows[2].endswith(",interrupted,2,beta,1,-") and rows[3].endswith(",complete,3,alpha,1,0.6")
    # with a folder of runs beside it
    other = write_run(tmp_path / "runs", "x", 0.3, 1, [1.0], acc=0.5)
    assert len(compare(parse_args([url, str(other), "--format", "csv"])).strip().splitlines()) == 6


def test_a_study_url_that_cannot_be_read_is_one_line(tmp_path, capsys):
    url = f"journal:{tmp_path / 'gpt.log'}"
    shared_study(url, tmp_path / "alpha" / "0")
    for args, needle in [
        ([url, "--study", "bert"], "--study bert: no such study in journal:"),
        ([f"journal:{tmp_path / 'none.log'}"], f"journal:{tmp_path / 'none.log'}: no such file"),
        (
            ["postgresql://me:pw@127.0.0.1:1/optuna"],
            "postgresql+psycopg2://me:***@127.0.0.1:1/optuna: cannot open",
        ),
    ]:
        status, out, err = compare_main(args, capsys)
        assert status == 2 and needle in err and err.count("\n") == 1, err


def test_a_run_saved_before_the_redesign_compares_under_todays_names(tmp_path, caplog):
    """The fixture's old keys (``model.optimizer``, ``data.block_size``) read as today's, beside a
    run saved now: one column for what differs, one notice line for the old run (not one more
    for its ``.hydra`` copy)."""
    from omegaconf import OmegaConf

    from attnlab.core.legacy import read_saved
    from conftest import ROOT

    old, new = tmp_path / "old", tmp_path / "new"
    shutil.copytree(ROOT / "tests" / "fixtures" / "run_before_redesign", old)
    for name in ("config.yaml", ".hydra/config.yaml"):  # as a run saved now would have them
        config = read_saved(OmegaConf.load(old / name), "fixture")
        config.model.optim.optimizer.lr = 0.003
        (new / name).parent.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(config, new / name)
    for run, loss in ((old, 4.6), (new, 4.5)):
        (run / "csv").mkdir(exist_ok=True)
        (run / "csv" / "metrics.csv").write_text(f"epoch,step,val/loss\n0,4,{loss}\n")
    caplog.clear()
    table = compare(parse_args([str(old), str(new), "--format", "csv"]))
    assert table.splitlines() == ["model.optim.optimizer.lr,runs,val/loss", "0.001,1,4.6", "0.003,1,4.5"]
    (notice,) = [r.getMessage() for r in caplog.records if "older attnlab" in r.getMessage()]
    assert "data.block_size -> data.max_len" in notice


def test_plot_against_a_key_without_grouping_draws_a_line_per_run_setting_and_seed(tmp_path, monkeypatch):
    """--x with --no-group: a line per setting and seed through its runs' x values (it was empty)."""
    import attnlab.training.plots

    drawn = []
    monkeypatch.setattr(attnlab.training.plots, "curves_figure", lambda series, *a, **k: drawn.append(series))
    monkeypatch.setattr("attnlab.experiments.compare._save", lambda fig, out: out)
    runs = [
        Run(
            tmp_path / f"{seed}_{length}",
            {"seed": seed, "max_len": length},
            {"val/loss": [(9, seed + length)]},
        )
        for seed in (1, 2)
        for length in (32, 64)
    ]
    plot(runs, "val/loss", tmp_path / "p.png", "max_len", group_seeds=False)
    assert drawn == [
        {"seed=1": [(32.0, 33.0, 0.0), (64.0, 65.0, 0.0)], "seed=2": [(32.0, 34.0, 0.0), (64.0, 66.0, 0.0)]}
    ]
