"""Tar shards in open_clip's webdataset layout (``key.jpg`` + ``key.cls`` or ``key.txt``), written
byte-reproducibly; training streams them (``ShardStream``), evaluation reads records at their
offsets (``ShardRecords``)."""

from __future__ import annotations

import itertools
import logging
import os
import tarfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from attnlab.core.errors import DataError
from attnlab.data import sampling
from attnlab.data.remote import RemotePath, read_ranges
from attnlab.data.sampling import example_seed
from attnlab.data.shards.folder import SPLITS, Hashed, Location, Shard, ShardFolder, check_file
from attnlab.data.shards.writer import ShardWriter, check_count, check_free, publish, start_partial

log = logging.getLogger(__name__)

Record = dict[str, Any]  # webdataset's sample: {"__key__": ..., "jpg": bytes, "cls": bytes, ...}
Item = tuple[Path, dict[str, bytes] | DataError]  # a record's fields, or why they cannot be read
# Every tar header the same whatever the machine, user and time (webdataset's TarWriter stamps the
# time of writing and its own user names): the same records write the same bytes.
TAR_HEADER = {"user": "", "group": "", "mode": 0o444, "mtime": 0}


# ---- writing ------------------------------------------------------------------------------------


def write_tar_shards(
    splits: dict[str, Iterable[Item]],
    out_dir: str | os.PathLike,
    meta: dict[str, Any],
    check: Callable[[dict[str, bytes], Path], None],
    shard_records: int = 10_000,
    on_bad_record: str = "error",
) -> dict[str, Any]:
    """Each split's ``(source file, {field: bytes})`` items as tar shards in ``out_dir`` with a
    manifest (``meta`` + the shards), returned."""
    check_count("shard_records", shard_records)
    out = Path(out_dir)
    check_free(out)
    partial = start_partial(out)
    entries: dict[str, list[dict[str, Any]]] = {s: [] for s in SPLITS}
    skipped: list[str] = []
    for split, items in splits.items():
        good = _readable(items, check, on_bad_record, skipped)
        key = sum(e["count"] for shards in entries.values() for e in shards)  # keys go on across splits
        entries[split] = _write_split(partial, split, good, shard_records, key)
    return publish(partial, out, {"version": 1, **meta, "splits": entries, "skipped": skipped})


def _readable(items: Iterable[Item], check: Callable, on_bad_record: str, skipped: list[str]) -> Iterator:
    for path, fields in items:
        try:
            if isinstance(fields, DataError):
                raise fields
            check(fields, path)
        except DataError as e:
            if on_bad_record == "error":
                raise DataError(f"{e}; set --on-bad-record skip to leave such images out") from None
            log.warning("%s: skipped", e)
            skipped.append(str(path))
            continue
        yield fields


def _write_split(partial: Path, split: str, records: Iterator, shard_records: int, key: int) -> list[dict]:
    """The records as ``<split>-<k>.tar`` files; keys go on from ``key`` (the records before)."""
    import webdataset as wds

    writer = ShardWriter(
        partial, split, ["tar"], "{split}-{k:06d}", lambda p: wds.TarWriter(str(p), **TAR_HEADER)
    )
    try:
        for k, fields in enumerate(records, key):
            if not writer.files or writer.shards[-1]["count"] == shard_records:
                writer.open(count=0)
            writer.files["tar"].write({"__key__": f"{k:09d}", **fields})
            writer.shards[-1]["count"] += 1
        writer.close()
    finally:  # on an error: a writer left open would be flushed into its closed file at exit
        for f in writer.files.values():
            f.close()
    for shard in writer.shards:
        shard["bytes"] = (partial / shard["file"]).stat().st_size
    return writer.shards


# ---- reading ------------------------------------------------------------------------------------


class TarShards(ShardFolder):
    """A folder of tar shards (of ``kind``; ``None``: images or image_text), each checked for
    presence and size here, its sha256 as first read."""

    def __init__(self, folder: str | os.PathLike | RemotePath, kind: str | None = None) -> None:
        super().__init__(folder, *([kind] if kind else ["images", "image_text"]))
        self.splits: dict[str, list[Shard]] = {s: [] for s in SPLITS}
        with self.reading():
            for s in SPLITS:
                for e, paths, sha256 in self.shards(s):
                    check_file(paths[""], int(e["bytes"]))
                    self.splits[s].append(Shard(paths[""], int(e["count"]), sha256[""]))

    @property
    def classes(self) -> list[str] | None:
        return self.manifest.get("classes")

    def count(self, split: str) -> int:
        return sum(s.count for s in self.splits[split])


class BadRecords:
    """A record that cannot be read: ``error`` raises one line naming it; ``skip`` logs that line
    and counts it (per process)."""

    def __init__(self, policy: str) -> None:
        self.policy, self.skipped = policy, 0

    def __call__(self, message: str) -> None:
        if self.policy == "error":
            raise DataError(f"{message}; set data.source.on_bad_record=skip to leave such records out")
        self.skipped += 1
        log.warning("%s: skipped (%d so far in this process)", message, self.skipped)

    def decoded(self, decode: Callable[..., Any], record: Record, *seed: int | None) -> Any:
        """``decode(record, where, *seed)``, or ``None`` for a record that does not decode."""
        try:
            return decode(record, f"{record['__url__']}: record {record['__key__']}", *seed)
        except DataError as e:
            self(str(e))
            return None


def read_shard(
    shard: Shard, skip: int, bad: BadRecords, stop: int | None = None, verified: set[Location] | None = None
) -> Iterator[Record]:
    """A shard's records after the first ``skip`` (read past) up to the ``stop``-th; a shard that breaks
    off or holds fewer than its manifest says is reported (``bad``) once. With ``verified``, a shard
    not in it is hashed as it is read (to its end) and a sha256 not the manifest's is a ``DataError``."""
    from webdataset.tariterators import group_by_keys, tar_file_expander

    seen, last, error, stopped = 0, None, None, False

    def handler(exn: Exception) -> bool:
        nonlocal error
        error = exn
        return False  # a tar stream cannot be picked up after a broken record: stop this shard

    check = verified is not None and shard.path not in verified
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
            f.finish(shard.path, shard.sha256)
            verified.add(shard.path)
    if stopped:
        return
    if error is not None or seen < shard.count:
        where = f"after record {last}" if last else "at its start"
        why = f"({type(error).__name__}: {error.args[0] if error.args else ''})" if error else ""
        bad(f"{shard.path}: broken off {where}, {seen} of {shard.count} records read {why}".rstrip())


class ShardStream(IterableDataset):
    """Endless training batches from tar shards, each epoch every record at most once over all ranks
    and workers, resumable at any batch.

    Epoch ``e`` is the shards in an order seeded by ``(seed, e)``, cut into ``world * lanes`` contiguous
    spans of ``per_lane`` batches (the remainder left out); rank ``r``'s lane ``l`` reads span
    ``r * lanes + l`` in order. A rank's batch ``k`` is batch ``k // lanes`` of lane ``k % lanes``, so
    worker ``w`` draws ``start + w, start + w + lanes, ...`` of one lane and a resumed run (``start``)
    reads what the uninterrupted one would. Records are shuffled within blocks of ``shuffle_batches``
    batches; ``decode(record, where, seed)`` makes an item, ``collate`` a batch; bad records shrink it."""

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
        self.verified: set[Location] = set()  # shards this process (worker) has hashed
        self.records = sum(s.count for s in shards)
        self.per_lane = self.records // (batch_size * self.world * self.lanes)
        self.start = 0

    def batches_per_epoch(self) -> int:
        """Batches of one epoch on this rank (not ``__len__``: to Lightning the stream is endless)."""
        return self.per_lane * self.lanes

    def span(self, epoch: int, lo: int, hi: int) -> Iterator[tuple[int, Record]]:
        """Records ``lo..hi - 1`` of ``epoch``'s order (shards shuffled by ``(seed, epoch)``), numbered."""
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**63)
        offset = 0
        for shard in (self.shards[i] for i in torch.randperm(len(self.shards), generator=g).tolist()):
            if offset + shard.count > lo and offset < hi:
                skip = max(0, lo - offset)
                records = read_shard(shard, skip, self.bad, hi - offset, self.verified)
                yield from enumerate(records, offset + skip)
            offset += shard.count
            if offset >= hi:
                return

    def lane_batches(self, lane: int, start: int) -> Iterator[Any]:
        """Lane ``lane``'s batches from its ``start``-th on, epoch after epoch."""
        b, block, slot = self.batch_size, self.shuffle_batches, self.rank * self.lanes + lane
        begin = slot * self.per_lane * b  # the span's first record
        epoch, j = divmod(start, self.per_lane)
        while True:
            opening = (j // block) * block  # the shuffle block holding batch j
            records = self.span(epoch, begin + opening * b, begin + self.per_lane * b)  # read on
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
                block_seed = ((self.seed * 1_000_003 + epoch) * 1_000_003 + slot) * 1_000_003 + first
                g = torch.Generator().manual_seed(block_seed % 2**63)
                order = (begin + first * b + torch.randperm((last - first) * b, generator=g)).tolist()
                for jj in range(max(j, first), last):
                    indices = order[(jj - first) * b : (jj - first + 1) * b]
                    yield self._batch(got, indices, epoch, f"batch {jj} of epoch {epoch}")
            epoch, j = epoch + 1, 0

    def _batch(self, records: dict[int, Record], indices: list[int], epoch: int, where: str) -> Any:
        # a record not read: its shard broke off before it (already reported)
        seeded = [(records[i], example_seed(self.seed, (epoch, i))) for i in indices if i in records]
        items = [x for r, s in seeded if (x := self.bad.decoded(self.decode, r, s)) is not None]
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


def stream_loader(dm: Any, shards: list[Shard], decode: Callable, collate: Callable) -> DataLoader:
    """The training loader of a DataModule (``dm``: its batch size, workers, seed, ``source``'s
    shuffling and bad-record policy) streaming ``shards`` from the batches it had consumed."""
    args = (dm.batch_size, decode, collate, dm.seed, dm.num_workers, *dm.rank_world())
    stream = ShardStream(shards, *args, dm.source.shuffle_batches, dm.source.on_bad_record)
    stream.start = dm.train_batches_consumed
    return dm.loader(stream)  # batches made in the workers


class ShardRecords(Dataset):
    """A split's records by index, read at their tar offsets (one pass over the headers): map-style,
    for ``DataModule.eval_loader``'s exact sharing between ranks."""

    def __init__(self, shards: list[Shard], decode: Callable[[Record, str], Any], bad: BadRecords) -> None:
        self.decode, self.bad = decode, bad
        self.index: list[tuple[Location, str, dict[str, tuple[int, int]]]] = []
        for shard in shards:
            self.index += self._scan(shard)

    def _scan(self, shard: Shard) -> list[tuple[Location, str, dict[str, tuple[int, int]]]]:
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
            f.finish(shard.path, shard.sha256)  # a changed shard says so before how it broke
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
        return self.bad.decoded(self.decode, self.record(i))
