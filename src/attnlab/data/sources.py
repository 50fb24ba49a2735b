"""Where a DataModule's examples come from (``data.source``). A split size is a field of a source
the DataModule carves; a source already split has none."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Literal

from annotated_types import Interval

from attnlab.core.errors import ConfigError
from attnlab.core.specs import PositiveInt
from attnlab.data.remote import location

BadRecord = Literal["error", "skip"]  # a record that does not decode: stop, or warn, count, skip
Share = Annotated[float, Interval(gt=0, lt=1)]
Size = PositiveInt | Share  # a split's size: a count, or a share of what is carved


class Source:
    """The base of the sources; ``where`` names it in messages."""

    def __init__(self, where: str) -> None:
        self.where = where

    def size(self, split: str) -> int | float:
        """The ``<split>_size`` the DataModule carves, refused in one line when unset."""
        value = getattr(self, f"{split}_size", None)
        if value is None:
            raise ConfigError(f"data.source.{split}_size: {self.where} has no {split} split: set its size")
        return value


class Builtin(Source):
    """A named set attnlab knows, downloaded once (sha256-checked) into ``cache_dir/<name>`` or read
    from ``data_dir``; ``val_size``/``test_size`` only for a split the set does not ship."""

    SHIPS = {
        "fashion_mnist": ("test",),
        "mnist": ("test",),
        "cifar10": ("test",),
        "multi30k": ("val", "test"),
    }

    def __init__(
        self,
        name: str,
        data_dir: str | None = None,
        cache_dir: str = "data",
        url: str | None = None,
        sha256: str | None = None,
        val_size: Size | None = None,
        test_size: Size | None = None,
    ) -> None:
        super().__init__(repr(name))
        self.name, self.data_dir, self.cache_dir = name, data_dir, cache_dir
        self.url, self.sha256, self.val_size, self.test_size = url, sha256, val_size, test_size
        for split in self.SHIPS.get(name, ()):
            if getattr(self, f"{split}_size") is not None:
                raise ConfigError(f"data.source.{split}_size: {name} ships its {split} split: leave it null")

    def one_of(self, names: Iterable[str]) -> Builtin:
        """This set, refused in one line unless one of ``names``."""
        if self.name not in names:
            expected = ", ".join(map(repr, names))
            raise ConfigError(f"data.source.name must be one of {expected}, got {self.name!r}")
        return self

    def carved(self) -> bool:
        """Whether a size is set (a DataModule that carves nothing refuses one)."""
        return self.val_size is not None or self.test_size is not None


class Generated(Source):
    """A set made in code (``synthetic``): ``train_size`` examples, a tenth of that in each
    held-out split; what is fitted on it is cached in ``cache_dir``."""

    def __init__(self, name: str, train_size: int = 5000, cache_dir: str = "data") -> None:
        super().__init__(repr(name))
        self.name, self.train_size, self.cache_dir = name, train_size, cache_dir


class Files(Source):
    """Files by name in ``data_dir`` (else SST-2's, downloaded into ``cache_dir``), carved into
    ``val_size`` and ``test_size`` shares."""

    def __init__(
        self,
        names: list[str],
        data_dir: str | None = None,
        cache_dir: str = "data",
        val_size: Share | None = None,
        test_size: Share | None = None,
    ) -> None:
        super().__init__(", ".join(names))
        self.names, self.data_dir, self.cache_dir = list(names), data_dir, cache_dir
        self.val_size, self.test_size = val_size, test_size


class SplitFiles(Source):
    """One file per split in ``data_dir`` (else SST-2's, downloaded into ``cache_dir``)."""

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
    """An ImageFolder tree: ``path/train/<class>/<image>`` (``val_size`` carved, seeded) and,
    optionally, ``path/test/<class>/...``."""

    def __init__(self, path: str, val_size: PositiveInt = 1000, on_bad_record: BadRecord = "error") -> None:
        super().__init__(str(path))
        self.path, self.val_size, self.on_bad_record = path, val_size, on_bad_record


class Shards(Source):
    """A folder written by ``attnlab-prepare`` (local or an ``s3://``, ``gs://``, ``https://`` URL),
    already split; a tokenizer is the one they were made with."""

    def __init__(self, path: str) -> None:
        location(path, "data.source.path")  # a URL's scheme and package, checked here
        super().__init__(str(path))
        self.path = path


class StreamedShards(Shards):
    """Image (or image-caption) tar shards, streamed: each epoch every record once over all ranks
    and workers, shuffled within blocks of ``shuffle_batches`` batches."""

    def __init__(
        self, path: str, on_bad_record: BadRecord = "error", shuffle_batches: PositiveInt = 4
    ) -> None:
        super().__init__(path)
        self.on_bad_record, self.shuffle_batches = on_bad_record, shuffle_batches


class CaptionShards(StreamedShards):
    """Image-caption ``StreamedShards``; the tokenizer is fitted on the first ``fit_captions``."""

    def __init__(
        self,
        path: str,
        on_bad_record: BadRecord = "error",
        shuffle_batches: int = 16,
        fit_captions: int = 100_000,
    ) -> None:
        super().__init__(path, on_bad_record, shuffle_batches)
        self.fit_captions = fit_captions


class Pairs(Source):
    """Image-caption rows of a CSV (with a header) or JSONL file, image paths relative to it;
    ``val_size`` carved (seeded); ``test_file``: another such file (None: test on val)."""

    def __init__(
        self,
        path: str,
        val_size: PositiveInt = 500,
        test_file: str | None = None,
        image_key: str = "image",
        caption_key: str = "caption",
        on_bad_record: BadRecord = "error",
    ) -> None:
        super().__init__(str(path))
        self.path, self.val_size, self.test_file = path, val_size, test_file
        self.on_bad_record, self.image_key, self.caption_key = on_bad_record, image_key, caption_key


class Captions(Source):
    """A Flickr8k token file (``name.jpg#0<TAB>caption``) or COCO ``captions_*.json``, its images in
    ``images_dir`` (None: the file's folder); ``val_size`` and ``test_size`` images carved."""

    def __init__(
        self,
        path: str,
        images_dir: str | None = None,
        val_size: PositiveInt = 500,
        test_size: PositiveInt = 500,
    ) -> None:
        super().__init__(str(path))
        self.path, self.images_dir, self.val_size, self.test_size = path, images_dir, val_size, test_size
