"""What a run records to be re-run from its folder (``run.yaml``): the code (git commit, a hash of
the uncommitted diff, ``uv.lock``), the data's hashes, every seed, the machine and the command.
No torch here: ``attnlab-rerun`` compares a record with today's checkout before anything loads."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from datetime import UTC, datetime
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

import attnlab

ROOT = Path(attnlab.__file__).resolve().parents[2]  # the checkout attnlab is imported from (src layout)
NOT_GIT = "not a git checkout"
PATH_KEYS = ("data_dir", "path", "test_file", "images_dir")  # data.* keys that name files or folders
MODULE_CORPORA = {"pydoc": "pydoc_data.topics"}  # corpora that ship as Python modules (data.text.corpora)
BIG = 64 << 20  # data this large is hashed again only when a file of it changes (sha256_path)
HASH_CACHE = Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "attnlab" / "sha256.json"


def run_record(
    cfg: DictConfig, overrides: list[str], world_size: int, machine: dict, ckpt_path: str | None
) -> dict[str, Any]:
    """The record of a run about to train with ``cfg`` on ``world_size`` processes."""
    seeds: dict[str, Any] = {
        k: v for k, v in flat(OmegaConf.to_container(cfg, resolve=True)) if k.endswith("seed")
    }
    seed = cfg.get("seed")
    # ResumableRandomness reseeds process r with seed + r when there are several
    seeds["ranks"] = [seed + r if seed is not None and world_size > 1 else seed for r in range(world_size)]
    seeds["loader_workers"] = cfg.data.get("num_workers", 0)
    return {
        "time": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": list(sys.argv),
        "overrides": list(overrides),
        "ckpt_path": str(ckpt_path) if ckpt_path else None,
        **code_state(),
        "data": data_hashes(cfg.data),
        "seeds": seeds,
        "machine": machine,
    }


def flat(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if not isinstance(tree, dict):
        return [(prefix, tree)]
    return [kv for k, v in tree.items() for kv in flat(v, f"{prefix}.{k}" if prefix else str(k))]


def code_state() -> dict[str, Any]:
    """The git commit of attnlab's checkout, the sha256 of ``git diff HEAD`` and of ``uv.lock`` (or null)."""
    lock = ROOT / "uv.lock"
    return {"git": git_state(), "uv_lock_sha256": sha256_file(lock) if lock.is_file() else None}


def git_state() -> dict[str, str | None]:
    def git(*args: str) -> bytes:
        # --no-optional-locks: reading never rewrites the index another git command may be using
        return subprocess.run(
            ["git", "--no-optional-locks", "-C", str(ROOT), *args], capture_output=True, check=True
        ).stdout

    try:
        top, commit = git("rev-parse", "--show-toplevel", "HEAD").decode().split()
        diff = git("diff", "HEAD", "--binary")
    except (OSError, subprocess.CalledProcessError, ValueError):
        return {"commit": NOT_GIT, "diff_sha256": None}
    if Path(top).resolve() != ROOT:  # attnlab installed inside someone else's repository
        return {"commit": NOT_GIT, "diff_sha256": None}
    return {"commit": commit, "diff_sha256": hashlib.sha256(diff).hexdigest() if diff else None}


def data_hashes(node: DictConfig, prefix: str = "data") -> dict[str, str]:
    """The sha256 of what each key of ``data`` that names data holds: a file's; a folder's over its
    files (a prepared folder: its ``manifest.json``, which holds its shards' sha256)."""
    out: dict[str, str] = {}
    for key in node:
        value = node[key]
        name = f"{prefix}.{key}"
        if isinstance(value, DictConfig):
            out |= data_hashes(value, name)
        elif key in PATH_KEYS and isinstance(value, str):
            out[name] = sha256_path(value)
    if str(node.get("_target_", "")).endswith(".Builtin") and node.get("data_dir") is None:
        module = MODULE_CORPORA.get(node.name)
        where = find_spec(module).origin if module else Path(node.cache_dir) / node.name
        out[f"{prefix}.name"] = sha256_path(str(where))
    return out


def sha256_path(where: str) -> str:
    """A file's sha256; a folder's over its files' names and sha256 (a prepared folder: its
    manifest's). Data of BIG bytes or more: kept by its files' paths, sizes and mtimes, and hashed
    again only when one of them changes."""
    if "://" in where:
        return "remote: not hashed"
    path = Path(where).expanduser().resolve()
    if (path / "manifest.json").is_file():
        path = path / "manifest.json"
    if not path.exists():
        return "missing"
    files = (
        [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file() and p.name[0] != ".")
    )
    stats = [p.stat() for p in files]
    key = sha256_text(
        "".join(f"{p}:{s.st_size}:{s.st_mtime_ns}\n" for p, s in zip(files, stats, strict=True))
    )
    big = sum(s.st_size for s in stats) >= BIG
    cache = json.loads(HASH_CACHE.read_text()) if big and HASH_CACHE.is_file() else {}
    if key in cache:
        return cache[key]
    if path.is_file():
        digest = sha256_file(path)
    else:
        digest = sha256_text("".join(f"{p.relative_to(path)}\0{sha256_file(p)}\n" for p in files))
    if big:  # written whole, then renamed: runs started together never read half of it
        HASH_CACHE.parent.mkdir(parents=True, exist_ok=True)
        tmp = HASH_CACHE.with_name(f".{HASH_CACHE.name}.{os.getpid()}")
        tmp.write_text(json.dumps({**cache, key: digest}))
        tmp.replace(HASH_CACHE)
    return digest


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def differences(record: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """One line for each fact of the record about the code and the data that is not so now."""
    facts = {
        "git commit": (record["git"]["commit"], now["git"]["commit"]),
        "uncommitted diff (sha256)": (record["git"]["diff_sha256"], now["git"]["diff_sha256"]),
        "uv.lock (sha256)": (record["uv_lock_sha256"], now["uv_lock_sha256"]),
    }
    for key in record["data"] | now["data"]:
        facts[f"{key} (sha256 of its data)"] = (record["data"].get(key), now["data"].get(key))
    return [f"{what}: the run's {short(a)}, now {short(b)}" for what, (a, b) in facts.items() if a != b]


def short(value: str | None) -> str:
    return "none" if value is None else value[:12] if len(value) in (40, 64) else value
