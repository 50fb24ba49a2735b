"""Images in tar shards, open_clip's webdataset layout: ``key.jpg`` (or ``.png``) with ``key.cls``
(a class index) for classification, or with ``key.txt`` (a caption) for CLIP; a ``manifest.json``
lists each split's shards with their record counts, sizes and sha256, and the class names.

Written once (``attnlab-prepare --mode images|pairs``); training streams the shards in order, each loader
worker of each rank reading one contiguous part of every epoch (``ShardStream``); validation and
test read records by their offsets in the tar (``ShardRecords``), a map-style split that
``DataModule.eval_loader`` shares out exactly. The tar files are read through ``webdataset``'s
tar iterators, so any shard open_clip or img2dataset writes in this layout reads here too.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import logging
import os
import shutil
import tarfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import DataLoader, Dataset, IterableDataset

from attnlab.core.errors import ConfigError, DataError
from attnlab.data import sampling
from attnlab.data.remote import RemotePath, file_size, location, read_ranges
from attnlab.data.sampling import example_seed
from attnlab.data.text.shards import SHA256_DIFFERS, file_sha256, manifest_file, manifest_text
from attnlab.data.vision.datasets import unreadable_image

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
SPLITS = ("train", "val", "test")
IMAGE_EXTS = ("jpg", "png", "jpeg", "webp")
ON_BAD_RECORD = ("error", "skip")

Record = dict[str, Any]  # webdataset's sample: {"__key__": ..., "jpg": bytes, "cls": bytes, ...}
Item = tuple[Path, dict[str, bytes] | DataError]  # an image file's record, or why it cannot be read

# Every tar header the same whatever the machine, user and time (webdataset's TarWriter stamps the
# time of writing and its own user names): the same tree prepares to the same bytes.
TAR_HEADER = {"user": "", "group": "", "mode": 0o444, "mtime": 0}


# ---- writing ------------------------------------------------------------------------------------


def image_ext(path: Path) -> str:
    ext = path.suffix.lower().lstrip(".")
    return "jpg" if ext == "jpeg" else ext


def check_image(data: bytes, where: str) -> None:
    """Raise ``DataError`` naming ``where`` unless ``data`` decodes as an image."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise unreadable_image(where, e) from None


def check_out(out_dir: str | os.PathLike) -> Path:
    """``out_dir`` if shards can be written there: it must not exist or be empty."""
    out = Path(out_dir)
    if (out / MANIFEST).exists():
        raise DataError(f"{out}: already holds prepared shards; choose another folder or remove it")
    if out.exists() and any(out.iterdir()):
        raise DataError(f"{out}: exists and is not empty; choose another folder")
    return out


def write_shards(
    splits: dict[str, Iterable[Item]],
    out_dir: str | os.PathLike,
    meta: dict[str, Any],
    shard_records: int = 10_000,
    on_bad_record: str = "error",
) -> dict[str, Any]:
    """Write each split's ``(image file, {ext: bytes})`` items into tar shards of at most
    ``shard_records`` records in ``out_dir``, with a manifest (``meta`` plus the shards); return it.
    The tar headers are fixed (``TAR_HEADER``), so the same items give the same bytes.

    Images that cannot be read (an item's ``DataError``) or do not decode are refused, or skipped
    and counted with ``on_bad_record=skip``.
    Everything goes into ``<out_dir>.partial``, moved into place with its manifest at the end: an
    interrupted write leaves no half-written shard where a reader would take it for whole."""
    import webdataset as wds

    if on_bad_record not in ON_BAD_RECORD:
        raise ConfigError(f"on_bad_record must be 'error' or 'skip', got {on_bad_record!r}")
    if not isinstance(shard_records, int) or shard_records < 1:
        raise ConfigError(f"shard_records must be a positive integer, got {shard_records!r}")
    out = check_out(out_dir)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    entries: dict[str, list[dict[str, Any]]] = {s: [] for s in SPLITS}
    skipped: list[str] = []
    key = 0
    for split, items in splits.items():
        writer, shard = None, None
        try:
            for path, fields in items:
                try:
                    if isinstance(fields, DataError):
                        raise fields
                    check_image(fields[image_ext(path)], str(path))
                except DataError as e:
                    if on_bad_record == "error":
                        raise DataError(f"{e}; set --on-bad-record skip to leave such images out") from None
                    log.warning("%s: skipped", e)
                    skipped.append(str(path))
                    continue
                if writer is None or shard["count"] == shard_records:
                    if writer is not None:
                        writer.close()
                    shard = {"file": f"{split}-{len(entries[split]):06d}.tar", "count": 0}
                    entries[split].append(shard)
                    writer = wds.TarWriter(str(partial / shard["file"]), **TAR_HEADER)
                writer.write({"__key__": f"{key:09d}", **fields})
                shard["count"] += 1
                key += 1
        finally:  # on an error too: a writer left open is flushed into its closed file at exit
            if writer is not None:
                writer.close()
        for shard in entries[split]:
            shard["bytes"] = (partial / shard["file"]).stat().st_size
            shard["sha256"] = file_sha256(partial / shard["file"])
    manifest = {"version": 1, **meta, "splits": entries, "skipped": skipped}
    (partial / MANIFEST).write_text(json.dumps(manifest, indent=1))
    if out.exists():
        out.rmdir()  # empty, checked above
    os.replace(partial, out)
    return manifest


def read_image_file(path: Path) -> bytes | DataError:
    """The bytes of a listed image file, or the one line that says why there are none (returned,
    not raised: the writer refuses it or, with ``on_bad_record=skip``, goes on without it)."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return DataError(f"{path}: no such file (listed, but missing)")
    except IsADirectoryError:
        return DataError(f"{path}: a folder, not an image file")
    except OSError as e:
        return DataError(f"{path}: cannot be read ({e.strerror or e})")


def image_folder_items(files: list[Path], labels: list[int]) -> Iterator[Item]:
    for path, label in zip(files, labels, strict=True):
        data = read_image_file(path)
        yield (
            path,
            data if isinstance(data, DataError) else {image_ext(path): data, "cls": str(label).encode()},
        )


def caption_items(files: list[Path], captions: list[str]) -> Iterator[Item]:
    for path, text in zip(files, captions, strict=True):
        data = read_image_file(path)
        yield path, data if isinstance(data, DataError) else {image_ext(path): data, "txt": text.encode()}


# ---- reading ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shard:
    path: Path | RemotePath
    count: int
    sha256: str | None = None  # None: not checked (a shard no manifest lists)


class ImageShards:
    """A prepared folder (local, or at an ``s3://``, ``gs://`` or ``https://`` URL): its manifest
    (kind, classes) and each split's shards, checked for presence and size here, inside the folder;
    their sha256 as they are first read (``read_shard``, ``ShardRecords``)."""

    def __init__(self, folder: str | os.PathLike | RemotePath) -> None:
        self.folder = location(folder)
        path = self.folder / MANIFEST
        try:
            self.manifest = json.loads(manifest_text(self.folder, "attnlab-prepare --mode images|pairs"))
            self.kind: str = self.manifest["kind"]
            entries = self.manifest["splits"]
            self.splits = {
                s: [
                    Shard(
                        manifest_file(self.folder, e["file"], f"splits.{s}[{i}].file"),
                        int(e["count"]),
                        str(e["sha256"]),
                    )
                    for i, e in enumerate(entries.get(s, []))
                ]
                for s in SPLITS
            }
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise DataError(f"{path}: not a readable manifest ({type(e).__name__}: {e})") from None
        for split in SPLITS:
            for shard, entry in zip(self.splits[split], entries.get(split, []), strict=True):
                size = file_size(shard.path)
                if size is None:
                    raise DataError(f"{shard.path}: a shard the manifest lists is missing")
                if size != entry["bytes"]:
                    raise DataError(
                        f"{shard.path}: {size} bytes, but the manifest says {entry['bytes']}; "
                        "truncated or replaced?"
                    )

    @property
    def classes(self) -> list[str] | None:
        return self.manifest.get("classes")

    def count(self, split: str) -> int:
        return sum(s.count for s in self.splits[split])


def image_bytes(record: Record) -> bytes | None:
    return next((record[e] for e in IMAGE_EXTS if e in record), None)


class BadRecords:
    """What to do with a record that cannot be read: ``error`` raises one line naming the shard and
    the record; ``skip`` logs that line and counts it (per process)."""

    def __init__(self, policy: str) -> None:
        if policy not in ON_BAD_RECORD:
            raise ConfigError(f"data.on_bad_record must be 'error' or 'skip', got {policy!r}")
        self.policy, self.skipped = policy, 0

    def __call__(self, message: str) -> None:
        if self.policy == "error":
            raise DataError(f"{message}; set data.on_bad_record=skip to leave such records out")
        self.skipped += 1
        log.warning("%s: skipped (%d so far in this process)", message, self.skipped)


class Hashed:
    """A file read through, its bytes hashed as they pass: a shard's sha256 from the read that
    training makes anyway, not a second pass over it."""

    def __init__(self, f: io.BufferedReader | Any) -> None:
        self.f, self.h = f, hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.h.update(data)
        return data

    def finish(self, shard: Shard) -> None:
        """Hash the rest of the file; ``DataError`` unless it is the manifest's sha256."""
        while self.read(1 << 22):
            pass
        if self.h.hexdigest() != shard.sha256:
            raise DataError(f"{shard.path}: {SHA256_DIFFERS}")

    def __str__(self) -> str:  # webdataset names the stream in its errors
        return str(self.f)


def read_shard(
    shard: Shard,
    skip: int,
    bad: BadRecords,
    stop: int | None = None,
    verified: set[Path | RemotePath] | None = None,
) -> Iterator[Record]:
    """The records of one shard after the first ``skip`` (read past, not decoded) up to the
    ``stop``-th, through webdataset's tar iterators (a remote shard streamed, read ahead). A shard
    that breaks off or holds fewer records than its manifest says is reported (``bad``) once,
    naming the last record read.

    With ``verified`` (the shards this process has checked), a shard not in it is hashed as it
    is read (read to its end past ``stop``, unparsed) and a sha256 other than the manifest's
    raises ``DataError`` whatever ``bad`` says: the shard changed since it was written."""
    from webdataset.tariterators import group_by_keys, tar_file_expander

    seen, last, error, stopped = 0, None, None, False

    def handler(exn: Exception) -> bool:
        nonlocal error
        error = exn
        return False  # a tar stream cannot be picked up after a broken record: stop this shard

    check = verified is not None and shard.sha256 is not None and shard.path not in verified
    with shard.path.open("rb") as raw:
        f = Hashed(raw) if check else raw
        files = tar_file_expander([{"url": str(shard.path), "stream": f}], handler=handler)
        for record in group_by_keys(files, handler=handler):
            seen += 1
            last = record["__key__"]
            if stop is not None and seen > stop:
                stopped = True
                break
            if seen > skip:
                yield record
        if check:
            f.finish(shard)
            verified.add(shard.path)
    if stopped:
        return
    if error is not None or seen < shard.count:
        where = f"after record {last}" if last else "at its start"
        why = f"({type(error).__name__}: {error.args[0] if error.args else ''})" if error else ""
        bad(f"{shard.path}: broken off {where}, {seen} of {shard.count} records read {why}".rstrip())


def decode_image(data: bytes | None, where: str, mode: str | None) -> Image.Image:
    """Image bytes -> a PIL image in ``mode`` ("L" or "RGB"; ``None``: as stored); ``DataError``
    naming ``where``."""
    if data is None:
        raise DataError(f"{where}: no image (expected a .jpg, .png, .jpeg or .webp file)")
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            return im.convert(mode) if mode else im.copy()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise unreadable_image(where, e) from None


class ShardStream(IterableDataset):
    """Endless training batches from tar shards, each epoch every record at most once over all
    ranks and workers, resumable at any batch.

    Epoch ``e`` is the shards in an order seeded by ``(seed, e)``, their records in order. It is
    cut into ``world * lanes`` contiguous spans of ``per_lane`` batches; rank ``r``'s lane ``l``
    reads span ``r * lanes + l`` from start to end, sequentially (the remainder, fewer records than
    one batch per span, is left out of that epoch). A rank's batch ``k`` is batch ``k // lanes`` of
    lane ``k % lanes``: loader worker ``w`` draws batches ``start + w, start + w + lanes, ...``
    (the loader takes them round-robin), all of one lane, so a resumed run (``start``: the batches
    its checkpoint had consumed) reads exactly the batches the uninterrupted run would have. Records
    are shuffled within blocks of ``shuffle_batches`` batches of a lane (seeded per block).

    ``decode(record, where, seed)`` turns a record into an item (``DataError`` if it cannot), its
    random draws seeded by ``seed`` (of the run, the epoch and the record's place); ``collate``
    a list of items into a batch. Bad records leave their batch smaller (``bad`` says or stops).
    """

    def __init__(
        self,
        shards: list[Shard],
        batch_size: int,
        decode: Callable[[Record, str], Any],
        collate: Callable[[list[Any]], Any],
        seed: int,
        lanes: int = 1,
        rank: int = 0,
        world: int = 1,
        shuffle_batches: int = 16,
        on_bad_record: str = "error",
    ) -> None:
        self.shards, self.batch_size, self.decode, self.collate = shards, batch_size, decode, collate
        self.seed, self.lanes, self.rank, self.world = seed, max(1, lanes), rank, world
        self.shuffle_batches, self.bad = shuffle_batches, BadRecords(on_bad_record)
        self.verified: set[Path | RemotePath] = set()  # shards this process (worker) has hashed
        self.records = sum(s.count for s in shards)
        self.per_lane = self.records // (batch_size * self.world * self.lanes)
        self.start = 0

    def batches_per_epoch(self) -> int:
        """Batches of one epoch on this rank. (Not ``__len__``: to Lightning the stream is endless,
        as ``ShardWindows`` is; were it an epoch long, Lightning would start the stream anew each
        epoch, and the workers' copies with it.)"""
        return self.per_lane * self.lanes

    def epoch_order(self, epoch: int) -> list[Shard]:
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**63)
        return [self.shards[i] for i in torch.randperm(len(self.shards), generator=g).tolist()]

    def span(self, epoch: int, lane: int, first: int, last: int) -> Iterator[Record]:
        """Records ``first..last - 1`` of lane ``lane``'s span of ``epoch``."""
        begin = (self.rank * self.lanes + lane) * self.per_lane * self.batch_size
        lo, hi = begin + first, begin + last
        offset = 0
        for shard in self.epoch_order(epoch):
            if offset + shard.count > lo and offset < hi:
                skip = max(0, lo - offset)
                records = read_shard(shard, skip, self.bad, hi - offset, self.verified)
                yield from enumerate(records, offset + skip)
            offset += shard.count
            if offset >= hi:
                return

    def lane_batches(self, lane: int, start: int) -> Iterator[Any]:
        """Lane ``lane``'s batches from its ``start``-th on, epoch after epoch."""
        b, block = self.batch_size, self.shuffle_batches
        begin = (self.rank * self.lanes + lane) * self.per_lane * b  # the span's first record
        epoch, j = divmod(start, self.per_lane)
        while True:
            opening = (j // block) * block  # the shuffle block holding batch j
            records = self.span(epoch, lane, opening * b, self.per_lane * b)  # read on, sequentially
            pending: tuple[int, Record] | None = None
            for first in range(opening, self.per_lane, block):
                last = min(first + block, self.per_lane)
                got: dict[int, Record] = {}
                for i, record in itertools.chain([pending] if pending else [], records):
                    if i >= begin + last * b:
                        pending = (i, record)
                        break
                    got[i] = record
                else:
                    pending = None
                slot = self.rank * self.lanes + lane
                block_seed = ((self.seed * 1_000_003 + epoch) * 1_000_003 + slot) * 1_000_003 + first
                g = torch.Generator().manual_seed(block_seed % 2**63)
                order = (begin + first * b + torch.randperm((last - first) * b, generator=g)).tolist()
                for jj in range(max(j, first), last):
                    indices = order[(jj - first) * b : (jj - first + 1) * b]
                    yield self._batch(got, indices, epoch, f"batch {jj} of epoch {epoch}")
            epoch, j = epoch + 1, 0

    def _batch(self, records: dict[int, Record], indices: list[int], epoch: int, where: str) -> Any:
        items = []
        for i in indices:
            record = records.get(i)
            if record is None:
                continue  # its shard broke off before it (already reported)
            try:
                where_ = f"{record['__url__']}: record {record['__key__']}"
                items.append(self.decode(record, where_, example_seed(self.seed, (epoch, i))))
            except DataError as e:
                self.bad(str(e))
        if not items:
            raise DataError(f"no readable record in {where} of the training shards")
        return self.collate(items)

    def __iter__(self) -> Iterator[Any]:
        if not self.per_lane:
            raise DataError(
                f"the training shards hold {self.records} records, fewer than one batch of "
                f"{self.batch_size} for each of {self.world} ranks x {self.lanes} loader workers"
            )
        info = sampling.get_worker_info()
        worker = info.id if info else 0
        k = self.start + worker  # this worker's first batch of the rank's stream
        yield from self.lane_batches(k % self.lanes, k // self.lanes)


def stream_loader(stream: ShardStream, num_workers: int, seed: int) -> DataLoader:
    """A loader of a stream's batches (made in the workers: ``batch_size=None``)."""
    return DataLoader(
        stream,
        batch_size=None,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        generator=torch.Generator().manual_seed(seed),
    )


class ShardRecords(Dataset):
    """A split's records by index, read at their offsets in the tar files (validation and test:
    a map-style split, for ``DataModule.eval_loader``'s exact sharing between ranks). The offsets
    come from one pass over the tar headers."""

    def __init__(self, shards: list[Shard], decode: Callable[[Record, str], Any], bad: BadRecords) -> None:
        self.decode, self.bad = decode, bad
        self.index: list[tuple[Path | RemotePath, str, dict[str, tuple[int, int]]]] = []
        for shard in shards:
            self.index += self._scan(shard)

    def _scan(self, shard: Shard) -> list[tuple[Path | RemotePath, str, dict[str, tuple[int, int]]]]:
        """The records' offsets, read as a stream (the data read past, not sought over) so that the
        same pass hashes the shard: ``DataError`` unless its sha256 is the manifest's."""
        out: dict[str, dict[str, tuple[int, int]]] = {}
        broken = None
        with shard.path.open("rb") as raw:
            f = Hashed(raw)
            try:
                with tarfile.open(fileobj=f, mode="r|") as tar:
                    for member in tar:
                        if member.isreg() and "." in member.name:
                            key, ext = member.name.split(".", 1)
                            out.setdefault(key, {})[ext.lower()] = (member.offset_data, member.size)
            except (tarfile.TarError, OSError) as e:
                broken = e
            if shard.sha256 is not None:  # a changed shard says so before how it broke
                f.finish(shard)
        if broken is not None:
            self.bad(
                f"{shard.path}: not a readable tar file ({broken}), {len(out)} of {shard.count} records found"
            )
        if len(out) < shard.count:
            self.bad(f"{shard.path}: {len(out)} of {shard.count} records found")
        return [(shard.path, key, fields) for key, fields in out.items()]

    def __len__(self) -> int:
        return len(self.index)

    def record(self, i: int) -> Record:
        path, key, fields = self.index[i]
        record: Record = {"__key__": key, "__url__": str(path)}
        record.update(zip(fields, read_ranges(path, list(fields.values())), strict=True))
        return record

    def __getitem__(self, i: int) -> Any:
        """The decoded record, or ``None`` for one that is skipped (collate leaves it out)."""
        record = self.record(i)
        try:
            return self.decode(record, f"{record['__url__']}: record {record['__key__']}")
        except DataError as e:
            self.bad(str(e))
            return None


# ---- preparing ----------------------------------------------------------------------------------


def prepare_images(
    folder: str | os.PathLike,
    out_dir: str | os.PathLike,
    val_size: int = 1000,
    shard_records: int = 10_000,
    on_bad_record: str = "error",
    seed: int = 1337,
) -> dict[str, Any]:
    """An ImageFolder tree (``folder/train/<class>/<image>``, optional ``folder/test/...``) into
    classification shards: ``val_size`` training images carved out (seeded) as the val split."""
    from attnlab.data.vision.datasets import scan_image_folder
    from attnlab.data.vision.files import carve

    check_out(out_dir)
    found, classes = scan_image_folder(str(folder))
    if val_size >= len(found["train"][0]):
        raise ConfigError(
            f"--val-size ({val_size}) must be smaller than the {len(found['train'][0])} training images"
        )
    files = {**carve(*found["train"], val_size, seed), **{k: v for k, v in found.items() if k == "test"}}
    splits = {s: image_folder_items(*files[s]) for s in SPLITS if s in files}
    meta = {"kind": "cls", "classes": classes, "source": str(folder)}
    return write_shards(splits, out_dir, meta, shard_records, on_bad_record)


def prepare_pairs(
    pairs_file: str | os.PathLike,
    out_dir: str | os.PathLike,
    val_size: int = 1000,
    test_file: str | os.PathLike | None = None,
    image_key: str = "image",
    caption_key: str = "caption",
    shard_records: int = 10_000,
    on_bad_record: str = "error",
    seed: int = 1337,
) -> dict[str, Any]:
    """Image-caption rows (CSV with a header, or JSONL; image paths relative to the file) into
    CLIP shards (``key.jpg`` + ``key.txt``): ``val_size`` rows carved out (seeded) as the val split,
    ``test_file``'s rows (if any) the test split."""
    from attnlab.data.multimodal.image_text import read_pairs

    def rows(path: Path) -> tuple[list[Path], list[str]]:
        found = read_pairs(path, image_key, caption_key)
        return [path.parent / image for image, _, _ in found], [text for _, text, _ in found]

    check_out(out_dir)
    files, texts = rows(Path(pairs_file))
    if val_size >= len(files):
        raise ConfigError(
            f"--val-size ({val_size}) must be smaller than the {len(files)} rows of {pairs_file}"
        )
    order = torch.randperm(len(files), generator=torch.Generator().manual_seed(seed)).tolist()
    pick = lambda idx: caption_items([files[i] for i in idx], [texts[i] for i in idx])  # noqa: E731
    splits = {"train": pick(order[val_size:]), "val": pick(order[:val_size])}
    if test_file is not None:
        splits["test"] = caption_items(*rows(Path(test_file)))
    meta = {"kind": "txt", "source": str(pairs_file)}
    return write_shards(splits, out_dir, meta, shard_records, on_bad_record)
