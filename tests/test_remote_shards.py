"""Shards read from object storage (``data.source.path=s3://...``; ``gs://`` and ``https://`` too),
served here by a local S3-compatible server (moto's): the same bytes, batches, per-rank split and
resume as from disk, each shard's sha256 checked as it streams; a changed shard, a wrong scheme, a
missing bucket or folder, an unreachable endpoint: one line, exit status 2."""

from __future__ import annotations

import importlib.util
import json
import logging
import socket
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from attnlab.core.errors import DataError
from attnlab.data import MaskedLMDataModule, TranslationDataModule
from attnlab.data.remote import RemotePath
from attnlab.data.shards.tar import BadRecords, ShardRecords
from attnlab.data.shards.tar import TarShards as ImageShards
from attnlab.data.sources import Shards
from attnlab.data.text.shards import (
    MANIFEST,
    DocumentShards,
    PairShards,
    ShardDocuments,
    ShardWindows,
    TokenShards,
)
from attnlab.data.text.translation import read_parallel
from conftest import QUIET, read_metrics, run_main
from test_image_shards import VIT, key_stream, loader_order
from test_image_shards import shards as image_shards
from test_shard_safety import document_folder, image_folder, pair_folder, token_folder, zero_100_bytes
from test_shards import make as token_shards

BUCKET = "attnlab-test"


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on a free port, the environment pointing s3fs at it (as a user's
    AWS_ENDPOINT_URL and keys would), and ``upload(folder, prefix) -> s3:// URL``."""
    moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed")
    s3fs = pytest.importorskip("s3fs", reason="s3fs is not installed")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    try:
        server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"moto's S3 server cannot start here ({type(e).__name__}: {e})")
    endpoint = f"http://{host}:{port}"
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_MAX_ATTEMPTS": "1",  # an unreachable endpoint fails at once, not after retries
        "AWS_CONFIG_FILE": "/nonexistent",  # nothing of the machine's own AWS setup
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
    }
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        mp.delenv("AWS_PROFILE", raising=False)
        s3fs.S3FileSystem.clear_instance_cache()  # none made for another endpoint
        fs = s3fs.S3FileSystem()
        fs.mkdir(BUCKET)

        def upload(folder: Path, prefix: str) -> str:
            fs.put(f"{folder}/", f"{BUCKET}/{prefix}/", recursive=True)
            fs.invalidate_cache()
            return f"s3://{BUCKET}/{prefix}"

        yield SimpleNamespace(endpoint=endpoint, fs=fs, upload=upload)
        s3fs.S3FileSystem.clear_instance_cache()
    server.stop()


def windows(shards: TokenShards, n: int) -> list[torch.Tensor]:
    stream = ShardWindows(shards, max_len=8, batch_size=4, seed=3)
    return [stream.batch(i)[0] for i in range(n)]


# ---- the same bytes and batches as from disk ----------------------------------------------------


def test_token_document_and_pair_shards_read_from_s3_as_from_disk(s3, tmp_path):
    local = TokenShards(token_folder(tmp_path))
    remote = TokenShards(s3.upload(local.folder, "tokens"))
    assert isinstance(remote.splits["train"][0].path, RemotePath)
    for split in ("val", "test"):
        assert torch.equal(remote.read_split(split), local.read_split(split))
    assert all(torch.equal(a, b) for a, b in zip(windows(remote, 6), windows(local, 6), strict=True))
    assert remote.verified == {s.path for split in ("val", "test", "train") for s in remote.splits[split]}

    docs = DocumentShards(document_folder(tmp_path))
    remote_docs = DocumentShards(s3.upload(docs.folder, "docs"))
    assert remote_docs.read_split("val") == docs.read_split("val")
    assert list(ShardDocuments(remote_docs)) == list(ShardDocuments(docs))

    pairs = PairShards(pair_folder(tmp_path))
    remote_pairs = PairShards(s3.upload(pairs.folder, "pairs"))
    for lang in ("de", "en"):
        assert np.array_equal(remote_pairs.lengths(lang), pairs.lengths(lang))
        assert [remote_pairs.sentence(lang, i) for i in (0, 41, 99)] == [
            pairs.sentence(lang, i) for i in (0, 41, 99)
        ]
    assert read_parallel(*remote_pairs.text_files("test", "de", "en")) == read_parallel(
        *pairs.text_files("test", "de", "en")
    )

    # the data modules take the URL as data.source.path: the same first training batch either way
    for make_module, folder, url in (
        (
            lambda d: MaskedLMDataModule(Shards(d), max_len=16, max_tokens=64),
            docs.folder,
            remote_docs.folder,
        ),
        (
            lambda d: TranslationDataModule(Shards(d), max_len=32, max_tokens=128),
            pairs.folder,
            remote_pairs.folder,
        ),
    ):
        first = []
        for where in (str(folder), str(url)):
            dm = make_module(where)
            dm.setup("fit")
            first.append(next(iter(dm.train_dataloader())))
        assert first[0].keys() == first[1].keys()
        assert all(torch.equal(first[0][k], first[1][k]) for k in first[0] if torch.is_tensor(first[0][k]))


def test_tar_shards_stream_from_s3_as_from_disk_split_between_ranks_and_workers(s3, tmp_path, monkeypatch):
    local = image_shards(tmp_path, per_class=10, records=3)  # 16 training records in 6 shards
    remote = ImageShards(s3.upload(local.folder, "images"))
    assert remote.classes == local.classes and remote.count("train") == 16
    for rank in range(2):  # two ranks of two loader workers, across an epoch's end
        want = loader_order(key_stream(local, batch=2, lanes=2, rank=rank, world=2), 6, monkeypatch)
        stream = key_stream(remote, batch=2, lanes=2, rank=rank, world=2)
        assert loader_order(stream, 6, monkeypatch) == want
    resumed = key_stream(remote, batch=2, lanes=2)
    resumed.start = 5
    full = loader_order(key_stream(local, batch=2, lanes=2), 9, monkeypatch)
    assert loader_order(resumed, 4, monkeypatch) == full[5:]

    bad = BadRecords("error")
    val = ShardRecords(remote.splits["val"], lambda r, where: r, bad)
    want = ShardRecords(local.splits["val"], lambda r, where: r, bad)
    for i in range(len(want)):
        got = {k: v for k, v in val[i].items() if k != "__url__"}
        assert got == {k: v for k, v in want[i].items() if k != "__url__"}
        assert val[i]["__url__"].startswith(f"s3://{BUCKET}/images/val-")


def test_shards_read_over_https_as_from_disk(s3, tmp_path, monkeypatch):
    """A plain web server's URL (here the server's own, objects made public; ``https://`` takes
    the same path): ranged GETs, no credentials."""
    local = TokenShards(token_folder(tmp_path))
    images = image_shards(tmp_path, per_class=10, records=3)
    for folder, prefix in ((local.folder, "web/tokens"), (images.folder, "web/images")):
        s3.upload(folder, prefix)
    private = f"{s3.endpoint}/{BUCKET}/web/tokens"
    with pytest.raises(DataError, match=rf"^{private}/{MANIFEST}: cannot be read \(ClientResponseError: 403"):
        TokenShards(private)  # not public yet: the server's 403 said, not taken for a missing file
    for path in s3.fs.find(f"{BUCKET}/web"):
        s3.fs.chmod(path, acl="public-read")

    remote = TokenShards(f"{s3.endpoint}/{BUCKET}/web/tokens")
    assert torch.equal(remote.read_split("val"), local.read_split("val"))
    assert all(torch.equal(a, b) for a, b in zip(windows(remote, 4), windows(local, 4), strict=True))
    web = ImageShards(f"{s3.endpoint}/{BUCKET}/web/images")
    want = loader_order(key_stream(images, batch=2, lanes=2), 8, monkeypatch)
    assert loader_order(key_stream(web, batch=2, lanes=2), 8, monkeypatch) == want


# ---- training runs from the server, resumed mid-run ---------------------------------------------


def train(tmp: Path, every: int, *extra: str) -> Path:
    """A short tiny run validating and keeping a checkpoint ``every`` steps; returns its folder."""
    status, out = run_main(
        "train",
        [
            "task_name=remote",
            f"paths.root_dir={tmp}",
            f"trainer.val_check_interval={every}",
            "trainer.check_val_every_n_epoch=null",
            "callbacks.model_checkpoint.save_top_k=-1",
            "callbacks.model_checkpoint.monitor=step",
            "callbacks.model_checkpoint.mode=max",
            *extra,
        ],
    )
    assert status == 0, out[-3000:]
    return sorted((tmp / "logs" / "remote" / "runs").iterdir())[-1]


def assert_same_history(resumed: Path, full: Path, keys: tuple[str, ...]) -> None:
    want, got = read_metrics(full), read_metrics(resumed)
    for key in keys:
        assert [s for s, _ in got[key]] == [s for s, _ in want[key]], key
        assert [v for _, v in got[key]] == pytest.approx([v for _, v in want[key]], rel=1e-4), key


def test_a_gpt_trains_from_s3_token_shards_and_resumes_mid_run_exactly(s3, tmp_path):
    url = s3.upload(token_shards(tmp_path).folder, "gpt")
    args = [
        "experiment=gpt_pydoc_char",
        "data=token_shards",
        f"data.source.path={url}",  # read by a loader worker process (data.num_workers: 1)
        "model.net.depth=1",
        "model.net.n_head=2",
        "model.net.dim=32",
        "model.net.max_len=16",
        "data.batch_size=4",
        "data.val_batches=2",
        "trainer.max_steps=12",
        "trainer.limit_test_batches=2",
        "sample=null",
        *QUIET,
    ]
    full = train(tmp_path, 4, *args)
    (mid,) = (full / "checkpoints").glob("step_000004.ckpt")
    resumed = train(tmp_path, 4, *args, f"ckpt_path={mid}")
    assert_same_history(resumed, full, ("train/loss", "val/loss", "test/loss"))


def test_a_vit_trains_from_s3_tar_shards_and_resumes_mid_epoch_exactly(s3, tmp_path):
    url = s3.upload(image_shards(tmp_path, per_class=12, records=5).folder, "vit")  # 20 training images
    args = [
        *VIT,
        "data=image_shards",
        f"data.source.path={url}",
        "data.num_workers=2",  # two worker processes, each streaming its lane from the server
        "trainer.max_steps=8",
        "trainer.limit_test_batches=1",
    ]
    full = train(tmp_path, 3, *args)
    (mid,) = (full / "checkpoints").glob("step_000003.ckpt")  # epochs of 4 batches: mid-epoch
    resumed = train(tmp_path, 3, *args, f"ckpt_path={mid}")
    assert_same_history(resumed, full, ("train/loss", "val/loss", "test/acc"))


# ---- bad input ----------------------------------------------------------------------------------


def error_lines(args: list[str], tmp: Path) -> tuple[int, list[str], str]:
    status, out = run_main("train", [*args, f"paths.root_dir={tmp}", "trainer.max_steps=2", *QUIET])
    return status, [line for line in out.splitlines() if "error: " in line], out


def gpt(url: str) -> list[str]:
    return ["experiment=gpt_pydoc_char", "data=token_shards", f"data.source.path={url}", "model.net.depth=1"]


def test_a_shard_changed_on_the_server_is_one_line_and_exit_status_2(s3, tmp_path):
    folder = token_folder(tmp_path)
    zero_100_bytes(folder / "train_00001.bin")  # the size its manifest says, other bytes
    url = s3.upload(folder, "changed")
    status, lines, out = error_lines([*gpt(url), "data.max_len=16"], tmp_path)
    assert status == 2 and len(lines) == 1, out[-2000:]
    assert f"{url}/train_00001.bin: its sha256 differs from the manifest's" in lines[0]
    assert "Traceback" not in out

    shards = image_folder(tmp_path)
    zero_100_bytes(shards / "train-000001.tar")
    remote = ImageShards(s3.upload(shards, "changed_tar"))
    stream = key_stream(remote, batch=2)
    with pytest.raises(DataError, match=rf"{remote.folder}/train-000001.tar: its sha256 differs"):
        for _ in zip(stream, range(stream.batches_per_epoch()), strict=False):
            pass


def test_a_manifest_naming_anything_but_a_name_under_its_url_is_refused(s3, tmp_path):
    folder = token_folder(tmp_path)
    original = (folder / MANIFEST).read_text()
    for name in ("../tokens2/train_00000.bin", f"s3://{BUCKET}/x.bin", "/train_00000.bin", "a/./b"):
        manifest = json.loads(original)
        manifest["splits"]["train"][0]["file"] = name
        (folder / MANIFEST).write_text(json.dumps(manifest))
        url = s3.upload(folder, "outside")
        with pytest.raises(DataError) as e:
            TokenShards(url)
        assert str(e.value).startswith(f"{url}/{MANIFEST}: splits.train[0].file names {name!r}")
        assert "leads outside" in str(e.value) and "\n" not in str(e.value)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_wrong_url_a_missing_bucket_or_folder_or_an_unreachable_endpoint_is_one_line(
    s3, tmp_path, monkeypatch
):
    import s3fs

    cases = {
        "ftp://host/shards": "data.source.path=ftp://host/shards: ftp:// is not a storage shards are",
        "s3://": "data.source.path=s3://: names no bucket or host; give s3://<bucket or host>/<folder>",
        f"s3://{BUCKET}-missing/shards": "no such bucket (",
        f"s3://{BUCKET}/no/such/folder": f"s3://{BUCKET}/no/such/folder: no manifest.json; prepare it",
    }
    if importlib.util.find_spec("gcsfs") is None:
        cases["gs://bucket/shards"] = "reading gs:// URLs needs the gcsfs package, which is not installed"
    for url, want in cases.items():
        status, lines, out = error_lines(gpt(url), tmp_path)
        assert status == 2 and len(lines) == 1 and want in lines[0], out[-2000:]

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        status, lines, out = error_lines(gpt(f"s3://{BUCKET}/gpt"), tmp_path)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    assert status == 2 and len(lines) == 1, out[-2000:]
    assert f"s3://{BUCKET}/gpt/{MANIFEST}: cannot be read (EndpointConnectionError" in lines[0]
    assert "check the endpoint (AWS_ENDPOINT_URL)" in lines[0]
