"""Prepared shards are taken only as prepared: every file a manifest names stays in its folder,
each shard's sha256 is checked once as it is first read, token ids are checked against the
vocabulary before they reach an embedding, and image shards are written byte-reproducibly (and
their writer closed and their inputs named when something goes wrong)."""

from __future__ import annotations

import gc
import hashlib
import json
import shutil
import tarfile
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import attnlab.data.shards.folder as token_module
from attnlab.core.errors import DataError
from attnlab.data.multimodal.image_text import prepare_image_text as prepare_image_pairs
from attnlab.data.shards.tar import BadRecords, ShardRecords, ShardStream
from attnlab.data.shards.tar import TarShards as ImageShards
from attnlab.data.sources import StreamedShards
from attnlab.data.text.shards import (
    MANIFEST,
    DocumentShards,
    PairShards,
    ShardDocuments,
    ShardSide,
    ShardWindows,
    TokenShards,
    prepare,
    prepare_documents,
    prepare_pairs,
)
from attnlab.data.text.translation import synthetic_pairs
from attnlab.data.vision.shards import prepare_images, write_shards
from conftest import QUIET, run_main, write_pairs

WORDS = "the a film cast plot dog ran quickly over slow red house tree was good bad and".split()


# ---- tiny prepared folders of each kind ------------------------------------------------------------


def token_folder(tmp: Path) -> Path:
    (tmp / "gpt.txt").write_text("".join(f"line {i}: the quick brown fox\n" for i in range(120)))
    options = {"val_tokens": 300, "test_tokens": 300, "shard_tokens": 1000, "progress": False}
    prepare([str(tmp / "gpt.txt")], tmp / "tokens", **options)
    return tmp / "tokens"


def document_folder(tmp: Path) -> Path:
    rng = np.random.default_rng(0)
    docs = ["\n".join(" ".join(rng.choice(WORDS, 6)) + " ." for _ in range(3)) for _ in range(40)]
    (tmp / "docs.txt").write_text("\n\n".join(docs) + "\n")
    options = {"vocab_size": 80, "val_docs": 4, "test_docs": 4, "shard_tokens": 300, "progress": False}
    prepare_documents([str(tmp / "docs.txt")], tmp / "docs", **options)
    return tmp / "docs"


def pair_folder(tmp: Path) -> Path:
    de, en = synthetic_pairs(120, 0)
    (tmp / "c.tsv").write_text("".join(f"{a}\t{b}\n" for a, b in zip(de, en, strict=True)))
    options = {"vocab_size": 100, "val_pairs": 10, "test_pairs": 10, "shard_tokens": 500, "progress": False}
    prepare_pairs([str(tmp / "c.tsv")], tmp / "pairs", "de", "en", **options)
    return tmp / "pairs"


def image_tree(root: Path, per_class: int = 4) -> Path:
    for c, name in enumerate(("cat", "dog")):
        (root / "train" / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            px = np.full((8, 8, 3), 40 * i + 100 * c, dtype=np.uint8)
            Image.fromarray(px).save(root / "train" / name / f"{i}.png")
    return root


def image_folder(tmp: Path) -> Path:
    prepare_images(image_tree(tmp / "pets"), tmp / "images", val_size=2, shard_records=3)
    return tmp / "images"


# kind -> (build, open, the manifest key naming a training shard's file(s), its first file's suffix)
KINDS: dict[str, tuple[Callable[[Path], Path], Callable[[Path], object], str, str]] = {
    "tokens": (token_folder, TokenShards, "file", ""),
    "documents": (document_folder, DocumentShards, "name", ".tokens"),
    "pairs": (pair_folder, PairShards, "name", ".de.tokens"),
    "images": (image_folder, ImageShards, "file", ""),
}


def edit_manifest(folder: Path, change: Callable[[dict], None]) -> None:
    manifest = json.loads((folder / MANIFEST).read_text())
    change(manifest)
    (folder / MANIFEST).write_text(json.dumps(manifest))


def rehash(folder: Path, split: str = "train", part: str | None = None) -> None:
    """Record the first shard's (part's) present sha256 in the manifest: a shard changed together
    with its manifest, so that only the check of its content can catch it."""

    def change(m: dict) -> None:
        entry = m["splits"][split][0]
        if part is None:
            entry["sha256"] = hashlib.sha256((folder / entry["file"]).read_bytes()).hexdigest()
        else:
            path = folder / f"{entry['name']}.{part}"
            entry["sha256"][part] = hashlib.sha256(path.read_bytes()).hexdigest()

    edit_manifest(folder, change)


# ---- every path inside the folder ---------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_manifest_naming_a_file_outside_its_folder_is_refused_in_one_line(tmp_path, kind):
    build, open_, key, suffix = KINDS[kind]
    folder = build(tmp_path)
    original = (folder / MANIFEST).read_text()
    first = json.loads(original)["splits"]["train"][0][key]
    outside = tmp_path / "outside"
    outside.mkdir()
    for name in ("/etc/passwd", "../../x", f"../outside/{first}"):
        edit_manifest(folder, lambda m, n=name: m["splits"]["train"][0].update({key: n}))
        with pytest.raises(DataError) as e:
            open_(folder)
        message = str(e.value)
        assert "\n" not in message and message.startswith(f"{folder / MANIFEST}: splits.train[0].{key} names")
        assert "leads outside" in message and name in message
        (folder / MANIFEST).write_text(original)

    # a link in the folder to a file of the right size and sha256 elsewhere: refused all the same
    shard = folder / f"{first}{suffix}"
    shutil.move(shard, outside / shard.name)
    shard.symlink_to(outside / shard.name)
    with pytest.raises(
        DataError, match=rf"splits.train\[0\].{key} names '{shard.name}', which leads outside"
    ):
        open_(folder)
    shard.unlink()
    shard.symlink_to(Path(shard.name + ".here"))  # a link that stays inside is fine
    shutil.move(outside / shard.name, folder / (shard.name + ".here"))
    open_(folder)


# ---- sha256, checked once as a shard is first read --------------------------------------------


def zero_100_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 100] = bytes(100)
    path.write_bytes(bytes(data))


def test_token_shards_of_another_sha256_are_refused_as_first_read_and_each_is_hashed_once(
    tmp_path, monkeypatch
):
    folder = token_folder(tmp_path)
    shards = TokenShards(folder)
    calls: list[Path] = []
    real = token_module.verify_file
    monkeypatch.setattr(token_module, "verify_file", lambda p, *a: calls.append(p) or real(p, *a))
    assert len(shards.read_split("val")) == 300
    windows = ShardWindows(shards, max_len=8, batch_size=4, seed=0)
    for index in range(20):
        windows.batch(index)
    shards.read_split("val")
    every = [s.path for split in ("val", "train") for s in shards.splits[split]]
    assert sorted(calls) == sorted(every)  # each shard hashed once, in the read that needed it

    edit_manifest(folder, lambda m: m["splits"]["val"][0].update(sha256="0" * 64))
    with pytest.raises(DataError, match=r"val_00000.bin: its sha256 differs from the manifest's"):
        TokenShards(folder).read_split("val")
    train = folder / "train_00001.bin"
    zero_100_bytes(train)
    shards = TokenShards(folder)  # the size is right: opening the folder passes
    with pytest.raises(DataError, match=r"train_00001.bin: its sha256 differs from the manifest's; corrupt"):
        ShardWindows(shards, max_len=8, batch_size=4, seed=0)


def test_document_and_pair_shards_of_another_sha256_are_refused_as_first_read(tmp_path):
    docs = document_folder(tmp_path)
    shards = DocumentShards(docs)
    zero_100_bytes(shards.splits["train"][0].path("tokens"))
    with pytest.raises(DataError, match=r"train_00000.tokens: its sha256 differs from the manifest's"):
        ShardDocuments(DocumentShards(docs))
    edit_manifest(docs, lambda m: m["splits"]["val"][0]["sha256"].update(documents="0" * 64))
    with pytest.raises(DataError, match=r"val_00000.documents: its sha256 differs"):
        DocumentShards(docs).read_split("val")

    pairs = pair_folder(tmp_path)
    zero_100_bytes(pairs / "train_00000.en.tokens")
    shards = PairShards(pairs)
    assert len(shards.lengths("en")) == 100  # offsets intact
    ShardSide(shards, "de", np.arange(10))  # the German side too
    with pytest.raises(DataError, match=r"train_00000.en.tokens: its sha256 differs"):
        ShardSide(shards, "en", np.arange(10))
    edit_manifest(pairs, lambda m: m["splits"]["test"]["sha256"].update(de="0" * 64))
    with pytest.raises(DataError, match=r"test.de: its sha256 differs"):
        PairShards(pairs).text_files("test", "de", "en")


def test_image_shards_are_hashed_as_streamed_and_refused_at_the_end_of_a_changed_one(tmp_path):
    folder = image_folder(tmp_path)
    shards = ImageShards(folder)
    train = shards.splits["train"]

    def epoch(lanes: int = 1) -> ShardStream:
        stream = ShardStream(train, 2, lambda r, where, seed: r["__key__"], list, 7, lanes)
        it = iter(stream)
        for _ in range(stream.batches_per_epoch()):
            next(it)
        return stream

    assert epoch().verified == {s.path for s in train}  # one epoch read (and hashed) every shard
    bad = BadRecords("error")
    ShardRecords(shards.splits["val"], lambda r, where: r, bad)

    zero_100_bytes(train[1].path)  # image bytes or a header: either way the sha256 differs
    with pytest.raises(DataError, match=rf"{train[1].path.name}: its sha256 differs from the manifest's"):
        epoch()
    edit_manifest(folder, lambda m: m["splits"]["val"][0].update(sha256="0" * 64))
    with pytest.raises(DataError, match=r"val-000000.tar: its sha256 differs"):
        ShardRecords(ImageShards(folder).splits["val"], lambda r, where: r, bad)


def test_a_run_on_changed_token_shards_stops_in_one_line_before_training(tmp_path):
    folder = token_folder(tmp_path)
    vocab = TokenShards(folder).vocab_size
    args = [
        "experiment=gpt_pydoc_char",
        "data=token_shards",
        f"data.source.path={folder}",
        "data.max_len=16",
        "model.net.depth=1",
        f"paths.root_dir={tmp_path}",
        "trainer.max_steps=2",
        *QUIET,
    ]
    zero_100_bytes(folder / "train_00001.bin")
    status, out = run_main("train", args)
    lines = [line for line in out.splitlines() if "error: " in line]
    assert status == 2 and len(lines) == 1 and "train_00001.bin: its sha256 differs" in lines[0], out[-2000:]
    assert "Traceback" not in out

    ids = np.fromfile(folder / "train_00001.bin", dtype=np.uint16)
    ids[:] = np.fromfile(folder / "train_00000.bin", dtype=np.uint16)[: len(ids)]
    ids[5] = vocab + 3  # an id past the embedding table, the manifest's sha256 made to agree
    ids.tofile(folder / "train_00001.bin")
    rehash_file(folder, "train", 1)
    status, out = run_main("train", args)
    want = f"train_00001.bin: token id {vocab + 3} is outside the vocabulary of {vocab} (ids 0..{vocab - 1})"
    assert status == 2 and want in out and "IndexError" not in out, out[-2000:]


def rehash_file(folder: Path, split: str, i: int) -> None:
    def change(m: dict) -> None:
        entry = m["splits"][split][i]
        entry["sha256"] = hashlib.sha256((folder / entry["file"]).read_bytes()).hexdigest()

    edit_manifest(folder, change)


# ---- token ids against the vocabulary -----------------------------------------------------------


def test_a_token_id_outside_the_vocabulary_is_named_before_it_reaches_an_embedding(tmp_path):
    folder = token_folder(tmp_path)
    vocab = TokenShards(folder).vocab_size
    ids = np.fromfile(folder / "val_00000.bin", dtype=np.uint16)
    ids[7] = vocab
    ids.tofile(folder / "val_00000.bin")
    rehash(folder, "val")
    with pytest.raises(
        DataError, match=rf"val_00000.bin: token id {vocab} is outside the vocabulary of {vocab}"
    ):
        TokenShards(folder).read_split("val")

    docs = document_folder(tmp_path)
    shards = DocumentShards(docs)
    path = shards.splits["train"][0].path("tokens")
    ids = np.fromfile(path, dtype=shards.dtype)
    ids[0] = 60_000
    ids.tofile(path)
    rehash(docs, part="tokens")
    with pytest.raises(DataError, match=r"train_00000.tokens: token id 60000 is outside the vocabulary of"):
        ShardDocuments(DocumentShards(docs))

    pairs = pair_folder(tmp_path)
    ids = np.fromfile(pairs / "train_00000.de.tokens", dtype=np.uint16)
    ids[-1] = 65_535
    ids.tofile(pairs / "train_00000.de.tokens")
    rehash(pairs, part="de.tokens")
    with pytest.raises(DataError, match=r"train_00000.de.tokens: token id 65535 is outside the vocabulary"):
        ShardSide(PairShards(pairs), "de", np.arange(5))

    edit_manifest(folder, lambda m: m.update(dtype="int64"))  # negative ids could pass a max
    with pytest.raises(DataError, match=r"not a readable manifest \(ValueError: dtype 'int64', not uint16"):
        TokenShards(folder)


# ---- one container: its manifest names the kind, those written before still read ------------------


def test_each_kind_is_named_in_its_manifest_and_a_folder_of_another_is_refused_in_one_line(tmp_path):
    folders = {kind: build(tmp_path) for kind, (build, _, _, _) in KINDS.items()}
    for kind, folder in folders.items():
        assert json.loads((folder / MANIFEST).read_text())["kind"] == kind
    with pytest.raises(
        DataError, match=r"holds image shards \(attnlab-prepare --mode images\), not pair shards"
    ):
        PairShards(folders["images"])
    with pytest.raises(DataError, match=r"holds document shards \(attnlab-prepare --mode bert\), not image"):
        ImageShards(folders["documents"])

    # manifests written before: token shards named no kind, image shards their label's field
    edit_manifest(folders["tokens"], lambda m: m.pop("kind"))
    assert TokenShards(folders["tokens"]).kind == "tokens"
    edit_manifest(folders["images"], lambda m: m.update(kind="cls"))
    assert ImageShards(folders["images"]).kind == "images"
    edit_manifest(folders["images"], lambda m: m.update(kind="txt"))
    assert ImageShards(folders["images"]).kind == "image_text"


def test_the_container_imports_no_modality():
    import ast

    import attnlab.data.shards as container

    for path in Path(container.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            bad = [
                n
                for n in names
                if n.startswith(("attnlab.data.text", "attnlab.data.vision", "attnlab.data.multimodal"))
            ]
            assert not bad, (path.name, bad)


# ---- image shards: reproducible, and their writer's errors ----------------------------------------


def test_the_same_image_tree_prepares_to_the_same_bytes(tmp_path):
    tree = image_tree(tmp_path / "pets")
    prepare_images(tree, tmp_path / "one", val_size=2, shard_records=3)
    prepare_images(tree, tmp_path / "two", val_size=2, shard_records=3)
    one, two = ((tmp_path / d / MANIFEST).read_bytes() for d in ("one", "two"))
    assert one == two and hashlib.sha256(one).hexdigest() == hashlib.sha256(two).hexdigest()
    with tarfile.open(tmp_path / "one" / "train-000000.tar") as tar:
        headers = {(m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) for m in tar.getmembers()}
    assert headers == {(0, 0, 0, "", "", 0o444)}  # nothing of the machine, the user or the time

    pairs = write_pairs(tmp_path / "cap", n=6)
    prepare_image_pairs(pairs, tmp_path / "cap1", val_size=2)
    prepare_image_pairs(pairs, tmp_path / "cap2", val_size=2)
    assert (tmp_path / "cap1" / MANIFEST).read_bytes() == (tmp_path / "cap2" / MANIFEST).read_bytes()


def test_the_image_writer_names_missing_files_and_folders_and_closes_its_tar_on_an_error(tmp_path):
    pairs = write_pairs(tmp_path / "cap", n=6, missing=1)
    with pytest.raises(
        DataError, match=r"img0.png: no such file \(listed, but missing\); set --on-bad-record"
    ):
        prepare_image_pairs(pairs, tmp_path / "out", val_size=1)
    manifest = prepare_image_pairs(pairs, tmp_path / "out", val_size=1, on_bad_record="skip")
    assert manifest["skipped"] == [str(tmp_path / "cap" / "img0.png")]
    (tmp_path / "cap" / "img0.png").mkdir()  # a folder where an image is listed
    with pytest.raises(DataError, match=r"img0.png: a folder, not an image file"):
        prepare_image_pairs(pairs, tmp_path / "out2", val_size=1)

    tree = image_tree(tmp_path / "pets")
    (tree / "train" / "cat" / "x.png").mkdir()  # a folder named like an image: not one
    assert prepare_images(tree, tmp_path / "out3", val_size=2)["splits"]["train"][0]["count"] == 6

    good = tree / "train" / "cat" / "0.png"
    items = [
        (good, {"png": good.read_bytes(), "cls": b"0"}),
        (good, {"png": b"text, not a png", "cls": b"0"}),
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            write_shards({"train": iter(items)}, tmp_path / "out4", {"kind": "cls"})
        except DataError as e:
            assert "not a readable image" in str(e)
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], [str(w) for w in caught]


def test_a_class_index_that_is_no_integer_says_what_it_holds(tmp_path):
    from attnlab.data import ImageFilesDataModule

    png = (image_tree(tmp_path / "pets") / "train" / "cat" / "0.png").read_bytes()
    record = lambda cls: (Path("0.png"), {"png": png, "cls": cls})  # noqa: E731
    meta = {"kind": "cls", "classes": ["cat", "dog"]}
    write_shards({"train": [record(b"0"), record(b"1")], "val": [record(b"cat")]}, tmp_path / "s", meta)
    dm = ImageFilesDataModule(StreamedShards(str(tmp_path / "s")), img_size=8, batch_size=2)
    with pytest.raises(DataError, match=r"val-000000.tar: record 000000002: .cls holds 'cat', not a class"):
        dm.setup("fit")  # the validation images are read for their mean and std
