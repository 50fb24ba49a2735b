"""The entry points as a user runs them: the main job, resume, generate, eval and bad input."""

import csv
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from conftest import (
    TINY,
    assert_ok,
    assert_user_error,
    cli_env,
    needs_shared,
    popen_cli,
    read_metrics,
    run_cli,
    run_dirs,
    tiny,
)


def wandb_summary(run_dir: Path) -> dict:
    (wandb_run,) = (run_dir / "wandb").glob("offline-run-*")
    return inspect_wandb(wandb_run)


def inspect_wandb(wandb_run: Path) -> dict:
    """The summary and config of an offline W&B run folder."""
    exe = Path(sys.executable).parent / "wandb"
    out = subprocess.run(
        [str(exe), "leet", "inspect", "--summary", "--json", str(wandb_run)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    return json.loads(out)


def test_tiny_run_leaves_checkpoints_csv_and_offline_wandb_run(trained: Path):
    metrics = read_metrics(trained)
    losses = [v for _, v in metrics["val/loss"]]
    assert losses[-1] < losses[0]  # it learned something in 20 steps
    assert {"train/loss", "val/ppl", "val/loss_best", "test/loss", "test/ppl"} <= set(metrics)
    assert (trained / "checkpoints" / "last.ckpt").is_file()
    assert list((trained / "checkpoints").glob("step_*.ckpt"))
    assert (trained / "config.yaml").is_file() and (trained / ".hydra" / "config.yaml").is_file()
    summary = wandb_summary(trained)
    assert summary["summary"]["test/loss"] == pytest.approx(metrics["test/loss"][-1][1], rel=1e-5)
    assert summary["config"]["model"]["net"]["dim"] == 32


def test_checkpoint_loads_with_weights_only_and_carries_the_run(trained: Path):
    ckpt = torch.load(trained / "checkpoints" / "last.ckpt", weights_only=True)
    meta = ckpt["attnlab"]
    assert "depth: 1" in meta["config"] and json.loads(meta["artifacts"]["tokenizer"])["kind"] == "char"
    assert meta["machine"]["cpu"]
    assert meta["wandb_run_id"] in next((trained / "wandb").glob("offline-run-*")).name


def test_last_checkpoint_holds_the_last_step_when_the_best_is_older(tmp_path: Path):
    """last.ckpt follows every validation and the end of training, not only a new best: here the
    best (the highest val/loss) is the first validation's, at step 10 of 25."""
    overrides = ["task_name=tiny", "callbacks.model_checkpoint.mode=max", "trainer.max_steps=25"]
    assert_ok(run_cli("train", tiny(*overrides), tmp_path))
    (run,) = run_dirs(tmp_path, "tiny")
    best = [p.name for p in (run / "checkpoints").glob("step_*.ckpt")]
    assert best == ["step_000010.ckpt"]
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 25


def test_generate_from_checkpoint(trained: Path):
    ckpt = trained / "checkpoints" / "last.ckpt"
    args = [f"ckpt_path={ckpt}", "prompt=The", "max_new_tokens=30", "seed=1", "top_k=10"]
    a, b = run_cli("generate", args, trained), run_cli("generate", [*args, "use_cache=false"], trained)
    assert_ok(a)
    assert a.stdout.startswith("The") and len(a.stdout.rstrip("\n")) >= 30
    assert a.stdout == b.stdout


def read_csv_log(run_dir: Path) -> tuple[list[str], list[dict[str, str]]]:
    with open(run_dir / "csv" / "metrics.csv", newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        return list(reader.fieldnames or []), rows


def test_eval_reproduces_the_test_metric_and_logs_into_the_run(trained: Path, tmp_path: Path):
    run = tmp_path / "run"  # a copy: the session's run stays as its training left it
    shutil.copytree(trained, run)
    columns, rows = read_csv_log(run)
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    run_id, step = ckpt["attnlab"]["wandb_run_id"], ckpt["global_step"]
    proc = run_cli(
        "eval", [f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}", "trainer.limit_test_batches=2"], tmp_path
    )
    assert_ok(proc)
    (out,) = run_dirs(tmp_path, "eval")
    got = json.loads((out / "metrics.json").read_text())["test/loss"]
    best = read_metrics(trained)["test/loss"][-1][1]  # tested on the best checkpoint (= last here)
    assert got == pytest.approx(best, rel=1e-4)

    # the run's CSV log: its columns and rows as they were, and one row more, at the checkpoint's step
    new_columns, new_rows = read_csv_log(run)
    assert set(columns) < set(new_columns) and "eval/test/loss" in new_columns
    assert [{k: r[k] for k in columns} for r in new_rows[: len(rows)]] == rows
    (added,) = new_rows[len(rows) :]
    assert int(added["step"]) == step and float(added["eval/test/loss"]) == pytest.approx(got, rel=1e-6)
    assert all(added[k] == "" for k in columns if k != "step")  # the run's own test/loss untouched
    assert read_metrics(run)["test/loss"] == read_metrics(trained)["test/loss"]

    # W&B: the run's own id, continued (offline here: a second folder of the same run)
    folders = sorted((run / "wandb").glob("offline-run-*"))
    assert len(folders) == 2 and {p.name.rsplit("-", 1)[1] for p in folders} == {run_id}
    assert inspect_wandb(folders[-1])["summary"]["eval/test/loss"] == pytest.approx(got, rel=1e-6)

    # log_to_run=false: the run's logs are left alone
    before = (run / "csv" / "metrics.csv").read_text()
    args = [
        f"ckpt_path={run / 'checkpoints' / 'last.ckpt'}",
        "trainer.limit_test_batches=1",
        "log_to_run=false",
    ]
    assert_ok(run_cli("eval", args, tmp_path))
    assert (run / "csv" / "metrics.csv").read_text() == before
    assert len(list((run / "wandb").glob("offline-run-*"))) == 2


def test_resume_after_kill_9_matches_an_uninterrupted_run(tmp_path: Path):
    args = tiny("trainer.max_steps=400", "trainer.val_check_interval=50")
    full = run_cli("train", [*args, "task_name=full"], tmp_path)
    assert_ok(full)

    proc = popen_cli("train", [*args, "task_name=killed"], tmp_path)
    deadline = time.time() + 120
    while not list((tmp_path / "logs/killed/runs").glob("*/checkpoints/last.ckpt")):
        assert proc.poll() is None and time.time() < deadline, "run ended before its first checkpoint"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    (killed,) = run_dirs(tmp_path, "killed")
    killed_step = torch.load(killed / "checkpoints/last.ckpt", weights_only=True)["global_step"]
    assert 0 < killed_step < 400

    resumed = run_cli("train", [*args, "task_name=killed", "ckpt_path=last"], tmp_path)
    assert_ok(resumed)
    _, resumed_dir = run_dirs(tmp_path, "killed")
    want, got = read_metrics(run_dirs(tmp_path, "full")[0]), read_metrics(resumed_dir)
    for key in ("val/loss", "val/loss_best", "test/loss"):
        assert got[key][-1][1] == pytest.approx(want[key][-1][1], rel=1e-5, abs=1e-6), key
    assert got["val/loss"][-1][0] == want["val/loss"][-1][0] == 399  # same final step
    for key in ("train/loss", "val/loss"):  # the resumed run's CSV holds the whole history, once
        assert [s for s, _ in got[key]] == [s for s, _ in want[key]], key
        assert [v for _, v in got[key]] == pytest.approx([v for _, v in want[key]], rel=1e-5, abs=1e-6), key
    # the W&B run continues under the same id
    ids = {p.name.rsplit("-", 1)[1] for p in tmp_path.glob("logs/killed/runs/*/wandb/offline-run-*")}
    assert len(ids) == 1


def test_default_main_job_composes_and_prints_a_sample(trained: Path):
    log = next(trained.glob("*.log")).read_text()
    assert "sample:" in log and "final:" in log and "test/loss" in log


# ---- bad input: one readable message, non-zero exit, nothing lost -------------------------------


@pytest.mark.parametrize(
    "override,needles",
    [
        (["model=nope"], ["model", "nope"]),
        (
            ["model.net.dim=30", "model.net.n_head=4"],
            ["model.net.dim: must be divisible by n_head (4), got 30"],
        ),
        # data.max_len follows model.net.max_len: the key the user set is named (the model comes first)
        (["model.net.max_len=0"], ["model.net.max_len=0: must be greater than 0 (attnlab.models.GPT)"]),
        (["data.tokenizer=words"], ["data.tokenizer", "'char' or 'bpe'"]),
        (["data/source=tinyshakespeare", "data.source.data_dir=nowhere"], ["data.source.data_dir=nowhere"]),
        (["ckpt_path=last"], ["ckpt_path=last", "no checkpoint"]),
    ],
    ids=["unknown-group-option", "dim-not-divisible", "max-len", "tokenizer", "data-dir", "no-last"],
)
def test_bad_config_is_one_clear_error(tmp_path, override, needles):
    proc = run_cli("train", tiny(*override), tmp_path)
    assert_user_error(proc, *needles, status=1 if override == ["model=nope"] else 2)


def test_empty_data_file(tmp_path):
    (tmp_path / "input.txt").write_text("")
    proc = run_cli(
        "train", [*TINY, "data/source=tinyshakespeare", f"data.source.data_dir={tmp_path}"], tmp_path
    )
    assert_user_error(proc, "input.txt", "empty")


def test_corrupt_checkpoint_is_named_and_left_alone(trained: Path, tmp_path: Path):
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes((trained / "checkpoints" / "last.ckpt").read_bytes()[:5000])
    for entry, args in [
        ("generate", [f"ckpt_path={bad}"]),
        ("train", [*TINY, f"ckpt_path={bad}"]),
        ("eval", [f"ckpt_path={bad}"]),
    ]:
        assert_user_error(run_cli(entry, args, tmp_path), str(bad), "corrupt")
    assert bad.stat().st_size == 5000


def test_mismatched_checkpoint_names_the_difference(trained: Path, tmp_path: Path):
    ckpt = trained / "checkpoints" / "last.ckpt"
    before = ckpt.read_bytes()
    proc = run_cli("train", tiny("model.net.dim=64", f"ckpt_path={ckpt}"), tmp_path)
    assert_user_error(proc, "does not match the configured model", "(64,)")
    assert ckpt.read_bytes() == before
    assert len(list((trained / "csv").glob("*"))) >= 1  # the original logs are still there


def test_prompt_outside_the_vocabulary(trained: Path):
    proc = run_cli("generate", [f"ckpt_path={trained / 'checkpoints/last.ckpt'}", "prompt='日本'"], trained)
    assert_user_error(proc, "outside the model's vocabulary", "日")


@pytest.mark.parametrize("override,needle", [("top_p=1.5", "top_p"), ("temperature=-1", "temperature")])
def test_bad_sampling_options(trained: Path, override, needle):
    proc = run_cli("generate", [f"ckpt_path={trained / 'checkpoints/last.ckpt'}", override], trained)
    assert_user_error(proc, needle)


# ---- slower paths -------------------------------------------------------------------------------


@pytest.mark.slow
def test_shakespeare_bpe_run(tmp_path):
    data_dir = needs_shared("tinyshakespeare")
    proc = run_cli(
        "train",
        [
            *TINY,
            "data=shakespeare_bpe",
            f"data.source.data_dir={data_dir}",
            "data.vocab_size=512",
            "task_name=bpe",
        ],
        tmp_path,
    )
    assert_ok(proc)
    (run_dir,) = run_dirs(tmp_path, "bpe")
    ckpt = torch.load(run_dir / "checkpoints/last.ckpt", weights_only=True)
    assert ckpt["state_dict"]["net.embed.tokens.weight"].shape[0] == 512


@pytest.mark.slow
def test_debug_config_from_the_command_line(tmp_path):
    """One debug config through the entry point; tests/test_debug_matrix.py runs every debug config
    with every experiment in-process."""
    proc = run_cli("train", [*tiny(), "debug=fdr"], tmp_path)
    assert_ok(proc)
    assert "fast_dev_run" in proc.stdout + proc.stderr


def test_multirun_gives_each_job_its_own_run_and_logs_to_csv_wandb_and_tensorboard(tmp_path):
    overrides = ["-m", *tiny("task_name=sweep", "logger=many"), "model.optim.optimizer.lr=1e-3,3e-3"]
    proc = run_cli("train", overrides, tmp_path)
    assert_ok(proc)
    jobs = sorted((tmp_path / "logs/sweep/multiruns").glob("*/[0-9]"))
    assert len(jobs) == 2
    wandb_ids = {next((j / "wandb").glob("offline-run-*")).name for j in jobs}
    assert len(wandb_ids) == 2 and all(read_metrics(j)["test/loss"] for j in jobs)
    assert all(list(j.glob("tensorboard/**/events.out.tfevents.*")) for j in jobs)
    # W&B: each job named by its overrides, the jobs grouped as one multirun
    wandb = [OmegaConf.load(j / "config.yaml").logger.wandb for j in jobs]
    assert [w.name.split()[-1] for w in wandb] == [
        "model.optim.optimizer.lr=0.001",
        "model.optim.optimizer.lr=0.003",
    ]
    assert all(w.name.startswith("sweep model.net.depth=1") for w in wandb)
    assert wandb[0].group == wandb[1].group == f"sweep multirun {jobs[0].parent.name}"


def test_ckpt_path_last_takes_the_newest_run_the_cli_can_serve(tmp_path, monkeypatch):
    """A GPT run, then a newer ViT run: ``attnlab-generate ckpt_path=last`` takes the GPT run
    (the newest language model), ``attnlab-predict`` the ViT run, and each says which it took."""
    from conftest import QUIET, blank_image, run_main, vision_overrides

    monkeypatch.chdir(tmp_path)
    common = [
        "test=false",
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        f"paths.root_dir={tmp_path}",
    ]
    assert run_main("train", [*TINY, "logger=csv", *common])[0] == 0  # TINY is quiet already
    vision = ["experiment=vit_fashion_mnist", *vision_overrides("vit_fashion_mnist", tmp_path)]
    assert run_main("train", [*vision, *QUIET, *common])[0] == 0
    (gpt,) = (tmp_path / "logs").glob("gpt_*/runs/*")
    (vit,) = (tmp_path / "logs").glob("vit_*/runs/*")
    status, out = run_main("generate", ["ckpt_path=last", "max_new_tokens=5", f"paths.root_dir={tmp_path}"])
    assert status == 0 and f"ckpt_path=last -> {gpt}" in out and "LanguageModelTask run" in out, out[-2000:]
    image = blank_image(tmp_path / "one.png")
    status, out = run_main("predict", ["ckpt_path=last", f"image={image}", f"paths.root_dir={tmp_path}"])
    assert status == 0 and f"ckpt_path=last -> {vit}" in out, out[-2000:]
    status, out = run_main("translate", ["ckpt_path=last", "text=hallo", f"paths.root_dir={tmp_path}"])
    assert status == 2 and "no run of a TranslationTask under" in out, out[-2000:]


SCRIPTS = sorted(
    name.removeprefix("attnlab-")
    for name in __import__("tomllib").loads((Path(__file__).parents[1] / "pyproject.toml").read_text())[
        "project"
    ]["scripts"]
)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_console_script_answers_help_with_its_usage_and_examples(script):
    from conftest import run_main

    status, out = run_main(script, ["--help"])
    assert status == 0, out[-2000:]
    assert f"usage: attnlab-{script}" in out and f"attnlab-{script} " in out.split("usage:", 1)[1], out[:2000]
    assert "example" in out.lower() and "error" not in out.lower()[:200], out[:2000]


def test_early_stopping_ends_a_run_that_stops_improving(tmp_path, monkeypatch):
    """``callbacks=early_stopping`` (lightning-hydra-template's): with an improvement of 10 asked
    for, the run stops after patience + 1 validations instead of running to max_steps."""
    from conftest import run_main

    monkeypatch.chdir(tmp_path)
    argv = [
        *tiny("trainer.max_steps=40", "trainer.val_check_interval=5"),
        "callbacks=early_stopping",
        "callbacks.early_stopping.patience=1",
        "callbacks.early_stopping.min_delta=10",
        "logger=csv",
        "test=false",
        f"paths.root_dir={tmp_path}",
    ]
    status, out = run_main(
        "train", [a for a in argv if not a.startswith("~callbacks.") or argv.count(a) == 1]
    )
    assert status == 0, out[-2000:]
    (run,) = run_dirs(tmp_path, "gpt_pydoc_char")
    steps = [s for s, _ in read_metrics(run)["val/loss"]]
    assert steps == [4, 9], steps  # stopped at the second validation, not at step 40


@pytest.mark.parametrize(
    ("script", "args"),
    [
        ("generate", []),
        ("predict", ["image={image}"]),
        ("translate", ["text=hallo"]),
        ("zeroshot", ["image={image}", "labels=a,b"]),
        ("fill-mask", ["text=the [MASK] ."]),
        ("classify", ["text=a film"]),
    ],
)
def test_inference_device_is_checked_before_the_checkpoint_is_read(script, args, tmp_path):
    """``device=`` (cpu, cuda, cuda:N, auto) of every inference CLI: a wrong one is one line."""
    from conftest import blank_image, run_main

    image = blank_image(tmp_path / "one.png")
    argv = ["ckpt_path=last", f"paths.root_dir={tmp_path}", *(a.format(image=image) for a in args)]
    status, out = run_main(script, [*argv, "device=tpu"])
    assert status == 2 and "device must be cpu, cuda, cuda:N or auto, got 'tpu'" in out, out[-2000:]
    if not torch.cuda.is_available():
        status, out = run_main(script, [*argv, "device=cuda"])
        assert status == 2 and "device=cuda: no CUDA GPU here" in out, out[-2000:]
    status, out = run_main(script, [*argv, "device=auto"])  # past the device: no run to read
    assert status == 2 and "error: ckpt_path=last: no checkpoint matches" in out, out[-2000:]


# ---- start-up: --help and a config error end before torch and Lightning load -----------------------

HEAVY = ("torch", "lightning", "timm", "transformers")
CLI_MODULES = sorted(
    p.stem
    for p in (Path(__file__).parents[1] / "src" / "attnlab" / "cli").glob("*.py")
    if p.stem != "__init__"
)


def test_no_cli_module_imports_torch_or_lightning():
    """Every ``attnlab.cli`` module (the console scripts' and what they share) imports without
    torch, Lightning, timm or transformers: each script's --help and config check run first."""
    probe = (
        "import importlib, sys\n"
        f"for name in {CLI_MODULES!r}:\n"
        "    importlib.import_module(f'attnlab.cli.{name}')\n"
        f"    heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "    if heavy:\n"
        "        print(f'attnlab.cli.{name} imports {heavy}'); break\n"
        "else:\n"
        "    print('light')\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "light", out


@pytest.mark.parametrize(
    ("script", "args", "needle"),
    [
        ("train", ["trainer.max_steps=abc"], "trainer.max_steps='abc': must be a valid integer"),
        (  # a nested net's value, named by its full key
            "train",
            ["experiment=clip_fashion_mnist", "model.net.image.dim=0"],
            "error: model.net.image.dim=0: must be greater than 0 (attnlab.models.VisionTransformer)",
        ),
        ("generate", ["ckpt_path=last"], "ckpt_path=last: no checkpoint matches"),
        ("eval", ["ckpt_path=nowhere.ckpt"], "ckpt_path=nowhere.ckpt: no such file"),
        (
            "sweep",
            ["hparams_search=gpt_optuna", "sweep.n_trials=abc"],
            "sweep.n_trials: expected a positive int",
        ),
    ],
)
def test_a_config_error_ends_before_torch_loads(script, args, needle, tmp_path):
    probe = (
        "import sys\n"
        f"sys.argv = ['attnlab-{script}', *{args!r}, 'paths.root_dir={tmp_path}']\n"
        f"from attnlab.cli.{script} import main\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as e:\n"
        "    print('exit', e.code, [m for m in ('torch', 'lightning') if m in sys.modules])\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=cli_env()
    )
    assert needle in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert "exit 2 []" in proc.stdout, proc.stdout + proc.stderr


def test_the_sharded_checkpoint_marker_is_lightnings():
    """``attnlab.core.run_paths`` restates Lightning's file name to stay torch-free."""
    from lightning.fabric.utilities.load import _METADATA_FILENAME

    from attnlab.core.run_paths import SHARDED_METADATA

    assert SHARDED_METADATA == _METADATA_FILENAME
