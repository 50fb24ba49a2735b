"""Images of any size and count: ImageFolder trees decoded lazily (``data=image_folder``), tar
shards in webdataset's layout (``attnlab-prepare --mode images|pairs``, ``data=image_shards``,
``data=image_text_shards``) streamed once per epoch over ranks and workers, resumable at any batch;
exact evaluation; bad input named in one line, skipped and counted or refused."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from attnlab.core.errors import DataError
from attnlab.data.shards.folder import MANIFEST
from attnlab.data.shards.tar import ShardStream
from attnlab.data.shards.tar import TarShards as ImageShards
from attnlab.data.sources import StreamedShards
from attnlab.data.vision.shards import prepare_images
from conftest import (
    QUIET,
    VISION_NETS,
    assert_ok,
    assert_user_error,
    read_metrics,
    run_cli,
    run_dirs,
    write_pairs,
)

VIT = [
    "experiment=vit_fashion_mnist",
    "data.img_size=16",
    "data.batch_size=4",
    "model.net.patch_size=4",
    *VISION_NETS["vit"],
    "model.plot_images=2",
    "trainer.log_every_n_steps=1",
    *QUIET,
]


def vit(*overrides: str) -> list[str]:
    """VIT with ``overrides`` replacing entries for the same keys (Hydra takes the first of two)."""
    keys = {o.split("=", 1)[0] for o in overrides}
    return [a for a in VIT if a.split("=", 1)[0] not in keys] + list(overrides)


def mixed_folder(root: Path, per_class: int = 10, test: int = 3) -> Path:
    """root/train/<class>/<i>.jpg|png of sides 10-40 (mixed), the class in the mean colour."""
    rng = np.random.default_rng(0)
    for split, n in (("train", per_class), ("test", test)):
        for c, name in enumerate(("cat", "dog")):
            (root / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                h, w = rng.integers(10, 40, 2)
                px = np.clip(rng.normal(50 + 150 * c, 20, (h, w, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(px).save(root / split / name / f"{i}.{'jpg' if i % 2 else 'png'}")
    return root


def shards(tmp: Path, per_class: int = 10, records: int = 3, **kw) -> ImageShards:
    prepare_images(
        mixed_folder(tmp / "pets", per_class), tmp / "shards", val_size=4, shard_records=records, **kw
    )
    return ImageShards(tmp / "shards")


def key_stream(s: ImageShards, batch: int, lanes: int = 1, rank: int = 0, world: int = 1) -> ShardStream:
    """A stream whose items are the records' keys (what was read, nothing decoded)."""
    return ShardStream(
        s.splits["train"], batch, lambda r, where, seed: int(r["__key__"]), list, 7, lanes, rank, world
    )


def loader_order(stream: ShardStream, n: int, monkeypatch) -> list[list[int]]:
    """The first ``n`` batches of a loader with ``stream.lanes`` workers: round-robin over them."""
    per_worker = []
    for worker in range(stream.lanes):
        info = type("Info", (), {"id": worker, "num_workers": stream.lanes})()
        monkeypatch.setattr("attnlab.data.sampling.get_worker_info", lambda i=info: i)
        it = iter(stream)
        per_worker.append([next(it) for _ in range(-(-n // stream.lanes))])
    return [per_worker[k % stream.lanes][k // stream.lanes] for k in range(n)]


# ---- the lazy folder ----------------------------------------------------------------------------


def test_a_vit_trains_on_a_folder_of_mixed_sizes_decoded_lazily(tmp_path):
    data = mixed_folder(tmp_path / "pets")
    args = [*VIT, "data=image_folder", f"data.source.path={data}", "data.source.val_size=4"]
    args.append("data.num_workers=2")
    aug = ["data.auto_augment=rand-m9-mstd0.5", "data.mixup.mixup_alpha=0.2", "data.mixup.cutmix_alpha=1.0"]
    proc = run_cli(
        "train",
        [*args, *aug, "trainer.max_steps=4", "trainer.val_check_interval=2", "task_name=pets"],
        tmp_path,
    )
    assert_ok(proc)
    (run,) = run_dirs(tmp_path, "pets")
    metrics = read_metrics(run)
    assert len(metrics["train/loss"]) == 4 and "test/acc" in metrics
    proc = run_cli("predict", ["ckpt_path=last", f"image={data / 'test' / 'dog' / '1.jpg'}"], tmp_path)
    assert_ok(proc)
    assert "dog" in proc.stdout


# ---- tar shards: layout, epochs, resuming ------------------------------------------------------


def test_shards_hold_open_clip_s_layout_and_a_manifest(tmp_path):
    s = shards(tmp_path)
    manifest = json.loads((s.folder / MANIFEST).read_text())
    assert manifest["classes"] == ["cat", "dog"] and manifest["kind"] == "images"
    assert [s.count(x) for x in ("train", "val", "test")] == [16, 4, 6]
    with tarfile.open(s.splits["train"][0].path) as tar:
        names = tar.getnames()
    assert names[:2] == ["000000000.cls", "000000000.png"] or names[:2] == ["000000000.cls", "000000000.jpg"]
    assert all(len(e["sha256"]) == 64 for e in manifest["splits"]["train"])


def test_two_ranks_of_two_workers_read_each_record_of_an_epoch_once(tmp_path, monkeypatch):
    s = shards(tmp_path, per_class=10, records=3)  # 16 training records in 6 shards of <= 3
    seen = []
    for rank in range(2):
        stream = key_stream(s, batch=2, lanes=2, rank=rank, world=2)
        assert stream.batches_per_epoch() == 4  # 16 records / (2 ranks x 2 per batch)
        seen += [k for batch in loader_order(stream, 4, monkeypatch) for k in batch]
    assert sorted(seen) == list(range(16))  # the whole epoch (keys 0-15: train is written first), none twice
    # the next epoch: the same records again, in another order
    stream = key_stream(s, batch=2, lanes=2, rank=0, world=2)
    both = loader_order(stream, 8, monkeypatch)
    assert both[:4] != both[4:]


def test_a_resumed_stream_gives_the_next_batches_exactly(tmp_path, monkeypatch):
    s = shards(tmp_path, per_class=10, records=3)
    stream = key_stream(s, batch=2, lanes=2)
    full = loader_order(stream, 14, monkeypatch)  # across an epoch's end (8 batches an epoch)
    for start in (3, 5, 8):
        stream = key_stream(s, batch=2, lanes=2)
        stream.start = start
        digest = lambda batches: hashlib.sha256(repr(batches).encode()).hexdigest()  # noqa: E731
        assert digest(loader_order(stream, 14 - start, monkeypatch)) == digest(full[start:]), start


@pytest.mark.slow  # two short runs each
@pytest.mark.parametrize("source", ["image_shards", "image_folder"])
def test_a_run_resumed_mid_epoch_continues_with_the_same_batches(tmp_path, source):
    from conftest import run_main

    if source == "image_shards":
        shards(tmp_path, per_class=12, records=5)
        data = [f"data.source.path={tmp_path / 'shards'}"]
    else:
        data = [f"data.source.path={mixed_folder(tmp_path / 'pets', 12)}", "data.source.val_size=4"]

    def train(*extra: str) -> Path:
        status, out = run_main(
            "train",
            [
                *VIT,
                f"data={source}",
                *data,
                "data.num_workers=2",
                "data.auto_augment=rand-m9-mstd0.5",
                "task_name=resume",
                f"paths.root_dir={tmp_path}",
                "model.optim.compile=false",
                "trainer.max_steps=8",
                "trainer.val_check_interval=3",
                "callbacks.model_checkpoint.save_top_k=-1",
                "callbacks.model_checkpoint.monitor=step",
                "callbacks.model_checkpoint.mode=max",
                *extra,
            ],
        )
        assert status == 0, out[-3000:]
        return sorted((tmp_path / "logs" / "resume" / "runs").iterdir())[-1]

    full = train()
    (mid,) = (full / "checkpoints").glob("step_000003.ckpt")  # 20 or 16 images, batches of 4: mid-epoch
    resumed = train(f"ckpt_path={mid}")
    want, got = read_metrics(full)["train/loss"], read_metrics(resumed)["train/loss"]
    assert [s for s, _ in got] == [s for s, _ in want] and len(want) == 8  # the run's whole history
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-4)


def test_validation_and_test_count_every_record_once_on_any_number_of_ranks(tmp_path, monkeypatch):
    from attnlab.data import ImageFilesDataModule

    shards(tmp_path, per_class=10)
    dm = ImageFilesDataModule(StreamedShards(str(tmp_path / "shards")), img_size=8, batch_size=4)
    dm.setup("fit")
    assert len(dm.splits["test"]) == 6
    seen = []
    for rank in range(4):  # 6 records, 4 ranks: no padding copies
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.distributed, "get_rank", lambda r=rank: r)
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 4)
        seen += [tuple(image.flatten().tolist()) for x, _ in dm.test_dataloader() for image in x]
    want = [tuple(dm.splits["test"][i][0].flatten().tolist()) for i in range(6)]
    assert sorted(seen) == sorted(want)


# ---- bad input -----------------------------------------------------------------------------------


def test_an_image_that_does_not_decode_is_named_then_refused_or_skipped(tmp_path):
    data = mixed_folder(tmp_path / "pets")
    bad = data / "train" / "cat" / "3.jpg"
    bad.write_bytes(b"not a jpeg")
    with pytest.raises(DataError, match=r"3.jpg: not a readable image .*--on-bad-record skip"):
        prepare_images(data, tmp_path / "out", val_size=2)
    manifest = prepare_images(data, tmp_path / "out", val_size=2, on_bad_record="skip")
    assert manifest["skipped"] == [str(bad)]

    args = vit(
        "data=image_folder",
        f"data.source.path={data}",
        "data.source.val_size=2",
        "data.num_workers=0",
        "data.batch_size=6",  # 18 training images: all of them in 3 steps
        "trainer.max_steps=3",
        "trainer.val_check_interval=3",
        "test=false",
    )
    proc = run_cli("train", args, tmp_path)
    assert_user_error(proc, "3.jpg: not a readable image", "data.source.on_bad_record=skip")
    proc = run_cli("train", [*args, "data.source.on_bad_record=skip"], tmp_path)
    assert_ok(proc)
    out = proc.stdout + proc.stderr
    assert "3.jpg: not a readable image" in out and "skipped (1 so far" in out


def corrupt_record(shard: Path) -> str:
    """Overwrite the image bytes of a shard's second record in place (its size unchanged)."""
    with tarfile.open(shard) as tar:
        member = [m for m in tar.getmembers() if not m.name.endswith(".cls")][1]
    data = bytearray(shard.read_bytes())
    data[member.offset_data : member.offset_data + member.size] = b"\0" * member.size
    shard.write_bytes(bytes(data))
    return member.name.split(".")[0]


def test_a_corrupt_record_and_an_empty_shard_are_named_then_refused_or_skipped(tmp_path, monkeypatch):
    s = shards(tmp_path, per_class=10, records=3)
    first, second = s.splits["train"][:2]
    key = corrupt_record(first.path)
    empty = io.BytesIO()
    tarfile.open(fileobj=empty, mode="w").close()
    second.path.write_bytes(empty.getvalue())
    manifest = json.loads((s.folder / MANIFEST).read_text())
    manifest["splits"]["train"][1]["bytes"] = len(empty.getvalue())
    for entry, shard in zip(manifest["splits"]["train"], (first, second), strict=False):
        entry["sha256"] = hashlib.sha256(shard.path.read_bytes()).hexdigest()  # written so
    (s.folder / MANIFEST).write_text(json.dumps(manifest))

    from attnlab.data import ImageFilesDataModule

    def epoch(policy: str) -> list:
        dm = ImageFilesDataModule(
            StreamedShards(str(s.folder), on_bad_record=policy), img_size=8, batch_size=2
        )
        dm.setup("fit")
        it = iter(dm.train_dataloader())
        return [next(it) for _ in range(dm.train_dataloader().dataset.batches_per_epoch())]

    with pytest.raises(
        DataError,
        match=rf"(000000.tar: record {key}: not a readable image|000001.tar: broken off at its start)",
    ):
        epoch("error")
    batches = epoch("skip")
    assert sum(len(y) for _, y in batches) == 16 - 1 - 3  # the bad record and the empty shard's 3

    first.path.write_bytes(first.path.read_bytes()[:-1024])  # truncated: refused before training
    with pytest.raises(DataError, match=r"train-000000.tar: \d+ bytes, but the manifest says \d+; truncated"):
        ImageShards(s.folder)


def test_an_interrupted_write_leaves_nothing_half_written(tmp_path, monkeypatch):
    import attnlab.data.vision.shards as shards_module

    data = mixed_folder(tmp_path / "pets")

    original = shards_module.image_items

    def items(files, values, field):  # killed after 5 images
        for n, item in enumerate(original(files, values, field)):
            if n == 5:
                raise KeyboardInterrupt
            yield item

    monkeypatch.setattr(shards_module, "image_items", items)
    with pytest.raises(KeyboardInterrupt):
        prepare_images(data, tmp_path / "out", val_size=2, shard_records=2)
    assert not (tmp_path / "out").exists() and (tmp_path / "out.partial").is_dir()
    monkeypatch.setattr(shards_module, "image_items", original)
    prepare_images(data, tmp_path / "out", val_size=2, shard_records=2)
    assert not (tmp_path / "out.partial").exists() and ImageShards(tmp_path / "out").count("train") == 18


def test_the_prepare_command_reports_and_refuses_in_one_line(tmp_path):
    mixed_folder(tmp_path / "pets")
    proc = run_cli(
        "prepare", ["--mode", "images", "pets", "--out", "shards/pets", "--val-size", "4"], tmp_path
    )
    assert_ok(proc)
    assert "16 train / 4 val / 6 test records" in proc.stdout
    again = run_cli("prepare", ["--mode", "images", "pets", "--out", "shards/pets"], tmp_path)
    assert again.returncode == 2 and again.stderr.strip().splitlines() == [
        "error: shards/pets: already holds prepared shards; choose another folder or remove it"
    ]


# ---- CLIP ----------------------------------------------------------------------------------------


def test_clip_trains_from_image_caption_shards(tmp_path):
    from conftest import CLIP_TINY

    pairs = write_pairs(tmp_path / "pairs", n=40)
    proc = run_cli(
        "prepare",
        ["--mode", "pairs", str(pairs), "--out", "shards/cap", "--val-size", "8", "--shard-records", "10"],
        tmp_path,
    )
    assert_ok(proc)
    args = [
        "experiment=clip_pairs",
        "data=image_text_shards",
        "data.source.path=shards/cap",
        "data.img_size=16",
        "data.num_workers=2",
        *CLIP_TINY,
        "trainer.max_steps=24",
        "trainer.val_check_interval=8",
        "trainer.log_every_n_steps=1",
        "task_name=clip",
        *QUIET,
    ]
    assert_ok(run_cli("train", args, tmp_path))
    (run,) = run_dirs(tmp_path, "clip")
    losses = [v for _, v in read_metrics(run)["train/loss"]]
    assert np.mean(losses[-4:]) < np.mean(losses[:4]), losses
