"""Where a DataModule's examples come from (``data.source``, a ``_target_`` of its own): a built-in
set held in memory, files in a folder, or shards written by ``attnlab-prepare``. What the examples
become (tokenised or transformed, then batched) is the DataModule's pipeline; each source carries
only the options its kind uses."""

from __future__ import annotations

import inspect
from typing import Any, Literal

from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf, open_dict

from attnlab.core.specs import PositiveInt
from attnlab.data.remote import location

BadRecord = Literal["error", "skip"]  # a record that does not decode: stop, or warn, count, skip


class Source:
    """The base of the sources (``data.source._target_``); ``where`` names it in messages."""

    def __init__(self, where: str) -> None:
        self.where = where


class Builtin(Source):
    """A named set attnlab knows (``tinyshakespeare``, ``fashion_mnist``, ``multi30k``, ...):
    downloaded once, sha256-checked, into ``cache_dir/<name>``, or read from ``data_dir`` when
    set; ``url``/``sha256`` override where it is downloaded from (mirrors, tests). Sets that ship
    with Python or are generated (``pydoc``, ``synthetic``) need none of them."""

    def __init__(
        self,
        name: str,
        data_dir: str | None = None,
        cache_dir: str = "data",
        url: str | None = None,
        sha256: str | None = None,
    ) -> None:
        super().__init__(repr(name))
        self.name, self.data_dir, self.cache_dir = name, data_dir, cache_dir
        self.url, self.sha256 = url, sha256


class Generated(Source):
    """A set made in code (``synthetic``: a made-up language pair): ``train_size`` training
    examples, a tenth of that in each held-out split; what is fitted on it is cached in
    ``cache_dir``."""

    def __init__(self, name: str, train_size: int = 5000, cache_dir: str = "data") -> None:
        super().__init__(repr(name))
        self.name, self.train_size, self.cache_dir = name, train_size, cache_dir


class Files(Source):
    """Files by name in ``data_dir``; without it, files attnlab knows (SST-2's ``alps_train.tsv``,
    ``alps_dev.tsv``, ``dev.tsv``) downloaded once, sha256-checked, into ``cache_dir``."""

    def __init__(self, names: list[str], data_dir: str | None = None, cache_dir: str = "data") -> None:
        super().__init__(", ".join(names))
        self.names, self.data_dir, self.cache_dir = list(names), data_dir, cache_dir


class SplitFiles(Source):
    """One file per split (``val_file`` picks the checkpoint, ``test_file`` is scored once at the
    end) in ``data_dir``; without it, files attnlab knows (SST-2's) downloaded once,
    sha256-checked, into ``cache_dir``."""

    def __init__(
        self,
        train_file: str,
        val_file: str,
        test_file: str,
        data_dir: str | None = None,
        cache_dir: str = "data",
    ) -> None:
        super().__init__(data_dir or "the downloaded files")
        self.files = {"train": train_file, "val": val_file, "test": test_file}
        self.data_dir, self.cache_dir = data_dir, cache_dir


class Folder(Source):
    """An ImageFolder tree read as it is drawn: ``path/train/<class>/<image>`` (``val_size`` of
    them carved, seeded, to validate on) and, optionally, ``path/test/<class>/...``."""

    def __init__(self, path: str, val_size: PositiveInt = 1000, on_bad_record: BadRecord = "error") -> None:
        super().__init__(str(path))
        self.path, self.val_size, self.on_bad_record = path, val_size, on_bad_record


class Shards(Source):
    """A folder written by ``attnlab-prepare`` (local, or an ``s3://``, ``gs://`` or ``https://``
    URL read in ranges): training reads what it draws from the shards, validation and test are
    their held-out splits, and a tokenizer is the one they were made with."""

    def __init__(self, path: str) -> None:
        location(path, "data.source.path")  # a URL's scheme and package, checked here
        super().__init__(str(path))
        self.path = path


class StreamedShards(Shards):
    """Shards of image (or image-caption) records in webdataset's tar layout, streamed: each epoch
    every record once over all ranks and loader workers, shuffled within blocks of
    ``shuffle_batches`` batches (and the shards once per epoch)."""

    def __init__(
        self, path: str, on_bad_record: BadRecord = "error", shuffle_batches: PositiveInt = 4
    ) -> None:
        super().__init__(path)
        self.on_bad_record, self.shuffle_batches = on_bad_record, shuffle_batches


class CaptionShards(StreamedShards):
    """``StreamedShards`` of image-caption records; the tokenizer is fitted on the first
    ``fit_captions`` training captions."""

    def __init__(
        self,
        path: str,
        on_bad_record: BadRecord = "error",
        shuffle_batches: int = 16,  # what image-caption shards were always streamed with
        fit_captions: int = 100_000,
    ) -> None:
        super().__init__(path, on_bad_record, shuffle_batches)
        self.fit_captions = fit_captions


class Pairs(Source):
    """Image-caption pairs listed in a CSV file with a header (or JSONL), one row each, the
    ``image_key`` column a path relative to the file; ``test_file``: another such file (``None``:
    the test stage scores the validation split). Listed images that are missing or unreadable:
    ``on_bad_record``."""

    def __init__(
        self,
        path: str,
        test_file: str | None = None,
        image_key: str = "image",
        caption_key: str = "caption",
        on_bad_record: BadRecord = "error",
    ) -> None:
        super().__init__(str(path))
        self.path, self.test_file, self.on_bad_record = path, test_file, on_bad_record
        self.image_key, self.caption_key = image_key, caption_key


class Captions(Source):
    """A captions file as Flickr8k lays it out (``Flickr8k.token.txt``: ``name.jpg#0<TAB>caption``)
    or COCO's ``captions_*.json``; its images in ``images_dir`` (``None``: the file's folder)."""

    def __init__(self, path: str, images_dir: str | None = None) -> None:
        super().__init__(str(path))
        self.path, self.images_dir = path, images_dir


# ---- a run saved before data.source (issue 58): its flat keys named the source ----------------------

# the old keys that said where the examples came from, consumed into data.source
FLAT = ("corpus", "dataset", "source", "data_dir", "cache_dir", "url", "sha256", "shards_dir", "files")
FLAT += ("on_bad_record", "shuffle_batches", "fit_captions", "synthetic_size", "captions_file", "images_dir")
FLAT += ("pairs_file", "train_file", "val_file", "test_file", "image_key", "caption_key")
MIXUP = {"mixup_alpha": "mixup_alpha", "cutmix_alpha": "cutmix_alpha", "mixup_prob": "prob"}
MIXUP["mixup_switch_prob"] = "switch_prob"


def source_of(node: dict[str, Any], target: str) -> dict[str, Any]:
    """The ``data.source`` node a saved run's flat data keys describe."""
    kind = node.get("source") if isinstance(node.get("source"), str) else None
    keep = lambda *keys: {k: node[k] for k in keys if k in node}  # noqa: E731
    new = lambda cls, **keys: {"_target_": f"{__name__}.{cls}", **keys}  # noqa: E731
    if node.get("shards_dir") is not None or kind == "shards":
        if target.endswith("ImageFilesDataModule"):
            return new("StreamedShards", path=node["shards_dir"], **keep("on_bad_record", "shuffle_batches"))
        if target.endswith(("ImageTextDataModule", "CaptionsFolderDataModule")):
            return new("CaptionShards", path=node["shards_dir"], **keep("on_bad_record", "fit_captions"))
        return new("Shards", path=node["shards_dir"])
    if kind == "folder":
        return new("Folder", path=node["data_dir"], **keep("val_size", "on_bad_record"))
    if kind == "pairs":
        return new(
            "Pairs", path=node["pairs_file"], **keep("test_file", "image_key", "caption_key", "on_bad_record")
        )
    if "train_file" in node:
        files = keep("train_file", "val_file", "test_file", "data_dir", "cache_dir")
        return new("SplitFiles", **files)
    if "captions_file" in node:
        return new("Captions", path=node["captions_file"], **keep("images_dir"))
    if "files" in node:
        return new("Files", names=node["files"], **keep("data_dir", "cache_dir"))
    name = node.get("corpus", node.get("dataset", kind))
    if name == "synthetic":
        size = {"train_size": node["synthetic_size"]} if "synthetic_size" in node else {}
        return new("Generated", name=name, **size, **keep("cache_dir"))
    return new("Builtin", name=name, **keep("data_dir", "cache_dir", "url", "sha256"))


def translate_flat(data: DictConfig, where: str = "data") -> list[str]:
    """A saved run's ``data`` node from before issue 58 rewritten, in place: its source as a node
    (``data.corpus=pydoc -> data.source=Builtin(pydoc)``), its mixup keys as one; what was done,
    for the one notice. A node whose DataModule takes neither, or has them already, is left."""
    try:
        params = inspect.signature(get_class(str(data.get("_target_")))).parameters
    except Exception:  # not importable: left to whoever builds it
        return []
    node = OmegaConf.to_container(data, resolve=False)
    old = [k for k in FLAT if k in node and not isinstance(node[k], dict)] if "source" in params else []
    source = source_of(node, str(data._target_)) if old else {}
    old += [k for k in source if k in node and k not in {*params, *old, "_target_"}]  # a Folder's val_size
    mixup = [k for k in MIXUP if k in node] if "mixup" in params else []
    stats = [k for k in ("mean", "std") if k in node] if "normalize" in params else []
    with open_dict(data):
        for key in old + mixup + stats:
            del data[key]
        for key, keys, value in (
            ("source", old, source),
            ("mixup", mixup, {MIXUP[k]: node[k] for k in mixup}),
            ("normalize", stats, {k: node[k] for k in stats}),
        ):
            if keys:
                data[key] = value
    return [
        f"{where}.{{{','.join(keys)}}} -> {where}.{key}"
        for key, keys in (("source", old), ("mixup", mixup), ("normalize", stats))
        if keys
    ]
