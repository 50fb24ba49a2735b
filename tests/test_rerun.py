"""A run's record (run.yaml: code, uv.lock and data hashes, seeds, machine, command line) and
attnlab-rerun, which trains it again from its folder and prints the two runs' metrics side by side."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, assert_ok, assert_user_error, read_metrics, run_cli, run_dirs, tiny

TEXT = "".join(f"The line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(300))
ARGS = ["data=shakespeare_char", "trainer.max_steps=6", "trainer.val_check_interval=3", "task_name=rerun"]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT trained on a text file of its own (data.source.data_dir)."""
    cwd = tmp_path_factory.mktemp("rerun")
    (cwd / "text").mkdir()
    (cwd / "text" / "input.txt").write_text(TEXT)
    assert_ok(run_cli("train", tiny(*ARGS, "logger=csv", "data.source.data_dir=text"), cwd))
    (run_dir,) = run_dirs(cwd, "rerun")
    return run_dir


def test_the_record_holds_the_code_data_seeds_machine_and_command(run: Path):
    record = yaml.safe_load((run / "run.yaml").read_text())
    git = ["git", "--no-optional-locks", "-C", str(ROOT)]
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    assert record["git"]["commit"] == head.stdout.strip()
    # others may edit the checkout meanwhile: the hash itself is checked on a repository of the test's
    assert record["git"]["diff_sha256"] is None or re.fullmatch("[0-9a-f]{64}", record["git"]["diff_sha256"])
    assert record["uv_lock_sha256"] == sha256((ROOT / "uv.lock").read_bytes())
    # a folder's hash: over its files' relative names and sha256
    listing = f"input.txt\0{sha256(TEXT.encode())}\n".encode()
    assert record["data"] == {"data.source.data_dir": sha256(listing)}
    assert record["seeds"] == {"seed": 1337, "data.seed": 1337, "ranks": [1337], "loader_workers": 0}
    assert record["machine"].items() <= yaml.safe_load((run / "machine.yaml").read_text()).items()
    assert record["overrides"] == yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text())
    assert "data.source.data_dir=text" in record["command"]
    assert record["ckpt_path"] is None  # trained from scratch
    assert datetime.fromisoformat(record["time"]).tzinfo is not None


def test_a_rerun_gives_the_same_metrics_in_a_new_folder(run: Path):
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    proc = run_cli("rerun", [str(run)], run.parents[3])
    assert_ok(proc)
    assert "sha256 of its data" not in proc.stdout  # the same data: no warning
    (new,) = (Path(m) for m in re.findall(r"^rerun of .+ in (.+):$", proc.stdout, flags=re.M))
    assert new != run and new.parent == run.parent
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before  # the original left alone
    old, again = read_metrics(run), read_metrics(new)
    assert round(again["test/loss"][-1][1], 4) == round(old["test/loss"][-1][1], 4)
    row = next(line.split() for line in proc.stdout.splitlines() if line.startswith("test/loss "))
    assert row[1] == row[2] == f"{old['test/loss'][-1][1]:.4f}"


def test_a_changed_data_file_is_one_warning_line(run: Path):
    data, runs = run.parents[3] / "text" / "input.txt", len(list(run.parent.iterdir()))
    data.write_text(TEXT + "one more line\n")
    try:
        proc = run_cli("rerun", [str(run), "--check"], run.parents[3])
    finally:
        data.write_text(TEXT)
    assert_ok(proc)
    warned = [line for line in proc.stdout.splitlines() if "data.source.data_dir" in line]
    assert len(warned) == 1 and warned[0].startswith("warning: data.source.data_dir (sha256 of its data)")
    assert len(list(run.parent.iterdir())) == runs  # --check trains nothing


def test_the_diff_hash_is_that_of_git_diff_head(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from attnlab.core import run_record

    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    (tmp_path / "a.txt").write_text("one\n")
    for args in (["init", "-q"], ["add", "a.txt"], ["commit", "-qm", "a"]):
        subprocess.run([*git, *args], check=True)
    monkeypatch.setattr(run_record, "ROOT", tmp_path.resolve())
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout
    assert run_record.git_state() == {"commit": head.strip(), "diff_sha256": None}
    (tmp_path / "a.txt").write_text("two\n")
    (tmp_path / "untracked.txt").write_text("not in the diff\n")
    diff = subprocess.run([*git, "diff", "HEAD", "--binary"], capture_output=True, check=True).stdout
    assert run_record.git_state()["diff_sha256"] == sha256(diff)
    (tmp_path / "sub").mkdir()  # attnlab installed inside someone else's repository
    monkeypatch.setattr(run_record, "ROOT", (tmp_path / "sub").resolve())
    assert run_record.git_state() == {"commit": "not a git checkout", "diff_sha256": None}


def test_big_data_is_hashed_again_only_when_one_of_its_files_changes(tmp_path: Path, monkeypatch):
    from attnlab.core import run_record

    monkeypatch.setattr(run_record, "BIG", 1)  # every folder is big
    monkeypatch.setattr(run_record, "HASH_CACHE", tmp_path / "sha256.json")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.bin").write_bytes(b"one")
    first = run_record.sha256_path(str(tmp_path / "d"))
    assert first == sha256(f"a.bin\0{sha256(b'one')}\n".encode())
    cache = json.loads((tmp_path / "sha256.json").read_text())
    assert list(cache.values()) == [first]
    (tmp_path / "sha256.json").write_text(json.dumps(dict.fromkeys(cache, "kept")))
    assert run_record.sha256_path(str(tmp_path / "d")) == "kept"  # same paths, sizes and mtimes
    (tmp_path / "d" / "a.bin").write_bytes(b"two!")
    assert run_record.sha256_path(str(tmp_path / "d")) == sha256(f"a.bin\0{sha256(b'two!')}\n".encode())


@pytest.mark.parametrize("where", ["empty", "missing"])
def test_a_folder_that_is_not_a_run_is_one_line(tmp_path: Path, where: str):
    folder = tmp_path / where
    if where == "empty":
        folder.mkdir()
    proc = run_cli("rerun", [str(folder)], tmp_path)
    assert_user_error(proc, f"error: {folder}: not a run folder")
    assert len(proc.stderr.strip().splitlines()) == 1
