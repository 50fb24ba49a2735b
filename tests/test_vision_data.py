"""Image data: the IDX reader, MNIST-style and CIFAR-10 files, ImageFolder trees, the DataModule."""

from __future__ import annotations

import functools
import gzip
import hashlib
import http.server
import pickle
import threading

import numpy as np
import pytest
import torch

from attnlab.core.errors import ConfigError, DataError
from attnlab.data import ImageClassificationDataModule, ScenesDataModule
from attnlab.data.sources import Builtin
from attnlab.data.vision import datasets
from attnlab.data.vision.classification import random_crop_flip
from attnlab.data.vision.datasets import (
    load_cifar10,
    load_idx_dataset,
    read_idx,
    read_image,
    scan_image_folder,
)
from conftest import needs_shared, write_cifar, write_idx, write_idx_dataset, write_image_folder


def test_idx_reader_against_a_hand_made_file(tmp_path):
    # magic 0x00000803 (uint8, 3 dims), dims 2 x 2 x 3, then 12 values
    raw = bytes([0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 2, 0, 0, 0, 3, *range(12)])
    (tmp_path / "a.idx").write_bytes(raw)
    (tmp_path / "a.idx.gz").write_bytes(gzip.compress(raw))
    expected = torch.arange(12, dtype=torch.uint8).view(2, 2, 3)
    assert torch.equal(read_idx(tmp_path / "a.idx"), expected)
    assert torch.equal(read_idx(tmp_path / "a.idx.gz", ndim=3), expected)
    # big-endian int32 labels
    raw = bytes([0, 0, 0x0C, 1, 0, 0, 0, 2, 0, 0, 1, 0, 0xFF, 0xFF, 0xFF, 0xFE])
    (tmp_path / "b.idx").write_bytes(raw)
    assert read_idx(tmp_path / "b.idx").tolist() == [256, -2]


def test_corrupt_idx_files_are_data_errors_naming_the_file(tmp_path):
    good = write_idx(tmp_path / "good.idx", np.zeros((3, 4, 4), np.uint8), gz=False).read_bytes()
    cases = {
        "magic.idx": b"\x08\x03" + good[2:],  # wrong magic number
        "truncated.idx": good[:-5],
        "header.idx": good[:9],
        "notgzip.gz": good,  # named .gz but not gzipped
        "cutgzip.gz": gzip.compress(good)[:-10],
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(DataError, match=name):
            read_idx(tmp_path / name)
    with pytest.raises(DataError, match="of 3 dimensions.*expected 1"):
        read_idx(tmp_path / "good.idx", ndim=1)


def test_idx_dataset_offline_from_data_dir(tmp_path):
    folder = write_idx_dataset(tmp_path / "fm")
    splits = load_idx_dataset("fashion_mnist", str(folder), str(tmp_path / "cache"))
    assert splits.train_images.shape == (60, 1, 28, 28) and splits.train_images.dtype == torch.uint8
    assert splits.test_labels.tolist()[:3] == [0, 1, 2] and splits.classes[0] == "T-shirt/top"
    (folder / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte.gz"):
        load_idx_dataset("fashion_mnist", str(folder), str(tmp_path / "cache"))


@pytest.fixture
def idx_server(tmp_path):
    root = write_idx_dataset(tmp_path / "www")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield root, f"http://127.0.0.1:{httpd.server_port}/"
    httpd.shutdown()
    httpd.server_close()


def test_idx_download_checks_sha256(idx_server, tmp_path, monkeypatch):
    root, url = idx_server
    files = {
        f: hashlib.sha256((root / f).read_bytes()).hexdigest()
        for f in datasets.IDX_DATASETS["mnist"]["files"]
    }
    monkeypatch.setitem(datasets.IDX_DATASETS["mnist"], "files", files)
    splits = load_idx_dataset("mnist", None, str(tmp_path / "cache"), url=url)
    assert (
        len(splits.train_labels) == 60
        and (tmp_path / "cache" / "mnist" / "t10k-images-idx3-ubyte.gz").is_file()
    )
    files = {**files, "t10k-images-idx3-ubyte.gz": "0" * 64}
    monkeypatch.setitem(datasets.IDX_DATASETS["mnist"], "files", files)
    with pytest.raises(DataError, match="checksum mismatch"):
        load_idx_dataset("mnist", None, str(tmp_path / "cache2"), url=url)


def test_cifar10_reader_on_a_tiny_fixture_in_its_format(tmp_path):
    folder = write_cifar(tmp_path / "cifar-10-batches-py")
    splits = load_cifar10(str(tmp_path), str(tmp_path / "cache"))
    assert splits.train_images.shape == (20, 3, 32, 32) and splits.test_images.shape == (4, 3, 32, 32)
    batch = pickle.loads((folder / "data_batch_1").read_bytes())
    assert torch.equal(
        splits.train_images[1].flatten(), torch.from_numpy(batch["data"][1])
    )  # R, then G, then B
    assert splits.classes[:2] == ["airplane", "automobile"]


def test_cifar10_batches_cannot_run_code(tmp_path):
    folder = write_cifar(tmp_path / "cifar-10-batches-py")

    class Exploit:
        def __reduce__(self):
            return (print, ("pwned",))

    (folder / "test_batch").write_bytes(pickle.dumps({"data": Exploit(), "labels": []}))
    with pytest.raises(DataError, match="test_batch: not a CIFAR-10 batch"):
        load_cifar10(str(tmp_path), str(tmp_path / "cache"))


def test_image_folder(tmp_path):
    root = write_image_folder(tmp_path / "imgs", classes=("a", "b", "c"), per_class=3)
    (root / "train" / "a" / "notes.txt").write_text("not an image")  # skipped: not an image suffix
    found, classes = scan_image_folder(str(root))
    files, labels = found["train"]
    assert classes == ["a", "b", "c"] and torch.stack([read_image(f) for f in files]).shape == (9, 3, 16, 16)
    assert labels == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    (root / "train" / "b" / "bad.png").write_text("not a png")
    with pytest.raises(DataError, match="bad.png: not a readable image"):
        read_image(root / "train" / "b" / "bad.png")
    with pytest.raises(DataError, match="no train/ folder"):
        scan_image_folder(str(tmp_path))


def test_read_image_converts_channels(tmp_path):
    root = write_image_folder(tmp_path / "imgs", per_class=1, test=False)
    path = next((root / "train" / "cat").glob("*.png"))
    assert read_image(path).shape == (3, 16, 16) and read_image(path, 1).shape == (1, 16, 16)


def test_datamodule_split_normalisation_and_mixup(tmp_path):
    folder = write_idx_dataset(tmp_path / "fm")
    kwargs = dict(source=Builtin("fashion_mnist", str(folder), val_size=10), batch_size=8, seed=3)
    mixup = {"mixup_alpha": 0.8, "cutmix_alpha": 1.0}
    dm = ImageClassificationDataModule(**kwargs, mixup=mixup, random_erasing=0.5)
    dm.setup("fit")
    assert len(dm.splits["train"]) == 50 and len(dm.splits["val"]) == 10 and len(dm.splits["test"]) == 20
    assert dm.model_kwargs() == {"num_classes": 10, "img_size": 28, "in_chans": 1}
    again = ImageClassificationDataModule(**kwargs)
    again.setup("fit")
    assert torch.equal(again.splits["val"].labels, dm.splits["val"].labels)  # seeded split
    images, labels = next(iter(dm.train_dataloader()))
    assert images.dtype == torch.uint8 and images.shape == (8, 1, 28, 28)
    x, y = dm.on_after_batch_transfer((images, labels), 0)  # no trainer: evaluation path
    assert y.shape == (8,) and abs(float(dm.normalize(dm.splits["train"].images).mean())) < 0.05

    class Training:
        training = True

    dm.trainer = Training()
    x, y = dm.on_after_batch_transfer((images, labels), 0)
    assert x.shape == (8, 1, 28, 28) and y.shape == (8, 10)  # mixed label distributions
    torch.testing.assert_close(y.sum(1), torch.ones(8))


def test_batch_crop_and_flip_are_per_image_shifts_and_mirrors():
    torch.manual_seed(0)
    images = torch.randint(1, 256, (32, 2, 6, 6), dtype=torch.uint8)
    out = random_crop_flip(images, 2, 0.5)
    padded = torch.nn.functional.pad(images, (2,) * 4)
    seen = set()
    for b in range(32):
        crops = {(y, x, 0): padded[b, :, y : y + 6, x : x + 6] for y in range(5) for x in range(5)}
        crops |= {(y, x, 1): c.flip(-1) for (y, x, _), c in crops.items()}
        match = [k for k, c in crops.items() if torch.equal(out[b], c)]
        assert match, b  # every image is its own shifted (and maybe mirrored) copy
        seen.add(match[0])
    assert len(seen) > 10 and {f for _, _, f in seen} == {0, 1}  # drawn per image
    assert torch.equal(random_crop_flip(images, 0, 1.0), images.flip(-1))


def test_datamodule_resizes_once_and_keeps_checkpoint_statistics(tmp_path):
    folder = write_idx_dataset(tmp_path / "fm")
    dm = ImageClassificationDataModule(
        Builtin("mnist", str(folder), val_size=10),
        img_size=32,
        crop_padding=2,
        rand_augment="rand-m9-mstd0.5-inc1",
    )
    dm.load_artifacts({"mean": [0.5], "std": [0.25]})
    dm.setup("fit")
    assert dm.splits["train"].images.shape[-2:] == (32, 32) and dm.artifacts()["mean"] == [0.5]
    assert dm.splits["train"][0][0].shape == (1, 32, 32)  # crop + RandAugment keep the shape


def test_datamodule_bad_values_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="data.source.name must be one of"):
        ImageClassificationDataModule(Builtin("imagenet"))
    with pytest.raises(ConfigError, match="data.batch_size must be even"):
        ImageClassificationDataModule(batch_size=7, mixup={"mixup_alpha": 0.2})
    with pytest.raises(ConfigError, match="data.rand_augment='nonsense'"):
        dm = ImageClassificationDataModule(
            Builtin("mnist", str(write_idx_dataset(tmp_path / "m")), val_size=5), rand_augment="nonsense"
        )
        dm.setup("fit")
    with pytest.raises(ConfigError, match=r"data.source.val_size \(60\) must be smaller than the 60"):
        ImageClassificationDataModule(Builtin("mnist", str(tmp_path / "m"), val_size=60)).setup("fit")


def test_split_sizes_belong_to_the_source_that_is_carved():
    """A size only where the DataModule carves the source: one it ships, or none set, is one line."""
    with pytest.raises(ConfigError, match="data.source.test_size: mnist ships its test split"):
        Builtin("mnist", val_size=5, test_size=5)
    with pytest.raises(ConfigError, match="data.source.val_size: 'mnist' has no val split: set its size"):
        ImageClassificationDataModule(Builtin("mnist"))
    with pytest.raises(ConfigError, match="data.source.val_size: scenes are drawn from halves"):
        ScenesDataModule(Builtin("mnist", val_size=5))


def test_real_fashion_mnist_files_decode():
    folder = needs_shared("fashion_mnist")
    splits = load_idx_dataset("fashion_mnist", str(folder), "data")
    assert splits.train_images.shape == (60000, 1, 28, 28) and splits.test_images.shape == (10000, 1, 28, 28)
    assert torch.bincount(splits.train_labels).tolist() == [6000] * 10
    assert abs(splits.train_images.float().div(255).mean().item() - 0.2860) < 1e-3


def test_image_data_modules_take_no_split_size_and_at_most_12_arguments():
    """Split sizes are their sources' (a shards source has none), so none is unused in one mode."""
    import inspect

    from attnlab.data import CaptionsFolderDataModule, ImageFilesDataModule, ImageTextDataModule

    for cls in (
        ImageClassificationDataModule,
        ImageFilesDataModule,
        ImageTextDataModule,
        CaptionsFolderDataModule,
    ):
        params = inspect.signature(cls).parameters
        assert not {"val_size", "test_size"} & set(params) and len(params) <= 12, cls.__name__


def test_an_image_folder_validates_on_images_it_does_not_train_on(tmp_path):
    """The validation images are carved out of train/: none of them is also a training image."""
    from attnlab.data import ImageFilesDataModule
    from attnlab.data.sources import Folder

    dm = ImageFilesDataModule(Folder(str(write_image_folder(tmp_path / "f")), val_size=4), img_size=16)
    dm.setup("fit")
    train, val = set(dm.splits["train"].images), set(dm.splits["val"].images)
    assert len(train) == 20 and len(val) == 4 and not train & val
