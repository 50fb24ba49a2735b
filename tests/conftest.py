"""Shared helpers: run the entry points as a user would, on tiny configs, in a temporary directory."""

from __future__ import annotations

import contextlib
import csv
import importlib
import io
import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"

# pytest-xdist's workers (``-n``) share the cores: torch's threads, and those of the processes the
# tests start (CLIs, DDP ranks), split between them instead of each worker taking them all
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    import torch

    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // WORKERS))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# A GPT small enough to train 20 steps in about a second.
TINY = [
    "model.net.depth=1",
    "model.net.n_head=2",
    "model.net.dim=32",
    "model.net.max_len=16",
    "data.batch_size=4",
    "data.val_batches=2",
    "trainer.max_steps=20",
    "trainer.val_check_interval=10",
    "trainer.limit_test_batches=2",
    "sample.max_new_tokens=10",
    "extras.print_config=false",
    "~callbacks.rich_progress_bar",
    "~callbacks.model_summary",
]


# the console quiet and the log a CSV file: runs whose output tests read, not people
QUIET = [
    "extras.print_config=false",
    "~callbacks.rich_progress_bar",
    "~callbacks.model_summary",
    "trainer.enable_progress_bar=false",
    "logger=csv",
]


def blank_image(path: Path) -> Path:
    """A black 28x28 grayscale PNG: an image file for the image CLIs."""
    from PIL import Image

    Image.new("L", (28, 28)).save(path)
    return path


def tiny(*overrides: str) -> list[str]:
    """TINY with ``overrides`` replacing entries for the same keys."""
    keys = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    return [a for a in TINY if a.split("=", 1)[0].lstrip("+~") not in keys] + list(overrides)


def cli_env() -> dict[str, str]:
    """The environment of a new user: no W&B key, no WANDB_MODE."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["NETRC"] = os.devnull
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("HYDRA_FULL_ERROR", None)
    return env


def run_cli(
    entry: str, args: list[str], cwd: Path, timeout: float = 600, new_process: bool | None = None
) -> subprocess.CompletedProcess:
    """Run ``attnlab-<entry>`` with Hydra overrides in ``cwd``, with a new user's environment.

    In this process (the console script's own ``main()``: an interpreter start and its imports
    cost seconds a run here), unless the run starts processes of its own by re-running its command
    line (DDP's launcher), runs a sweep driver, or is called from another thread than the main one
    (a run here changes the working directory, the environment and ``sys.stdout`` of the whole
    process, which runs in parallel threads would share), or ``new_process`` says so: then as
    ``python -m attnlab.cli.<entry>``."""
    if new_process is None:
        new_process = (
            entry == "sweep"
            or threading.current_thread() is not threading.main_thread()
            or any(a.startswith(("trainer=ddp", "trainer=fsdp")) for a in args)
        )
    if new_process:
        return subprocess.run(
            [sys.executable, "-m", f"attnlab.cli.{entry}", *args],
            cwd=cwd,
            env=cli_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    here, environ, new_user = Path.cwd(), dict(os.environ), cli_env()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(new_user)
    try:
        status, out, err = _in_process(entry, args)
    finally:
        os.chdir(here)
        os.environ.clear()
        os.environ.update(environ)
    return subprocess.CompletedProcess([f"attnlab-{entry}", *args], status, out, err)


def popen_cli(entry: str, args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", f"attnlab.cli.{entry}", *args],
        cwd=cwd,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def run_main(module: str, argv: list[str]) -> tuple[int, str]:
    """``attnlab-<module> argv`` in this process (the console script's own ``main()``, without an
    interpreter start each): its exit status and everything it printed."""
    status, out, _ = _in_process(module, argv, separate=False)
    return status, out


def _in_process(module: str, argv: list[str], separate: bool = True) -> tuple[int, str, str]:
    """The exit status, stdout and stderr (or both in one, ``separate=False``) of a console
    script's ``main()`` run here; what it may change for its process is restored after."""
    import torch

    main = importlib.import_module(f"attnlab.cli.{module.replace('-', '_')}").main
    out = io.StringIO()
    err = io.StringIO() if separate else out
    saved_argv, environ = sys.argv, dict(os.environ)
    grad, threads = torch.is_grad_enabled(), torch.get_num_threads()
    loggers = saved_loggers()  # Hydra's logging configs replace handlers and disable loggers
    sys.argv = [f"attnlab-{module}", *argv]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main()
        status = 0
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(environ)
        torch.set_grad_enabled(grad)
        torch.set_num_threads(threads)
        restore_loggers(loggers)
    return status, out.getvalue(), "" if err is out else err.getvalue()


def saved_loggers() -> dict[logging.Logger, tuple]:
    every = [
        logging.getLogger(),
        *(lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)),
    ]
    return {lg: (lg.disabled, lg.level, list(lg.handlers), lg.propagate) for lg in every}


def restore_loggers(saved: dict[logging.Logger, tuple]) -> None:
    for lg in saved_loggers():
        lg.disabled, level, lg.handlers, lg.propagate = saved.get(lg, (False, logging.NOTSET, [], True))
        lg.setLevel(level)


def run_dirs(cwd: Path, task_name: str) -> list[Path]:
    return sorted((cwd / "logs" / task_name / "runs").glob("*"))


def read_metrics(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every metric of a run's CSV log as (step, value) pairs."""
    out: dict[str, list[tuple[int, float]]] = {}
    with open(run_dir / "csv" / "metrics.csv") as f:
        for row in csv.DictReader(f):
            for k, v in row.items():
                if k not in ("step", "epoch") and v not in ("", None):
                    out.setdefault(k, []).append((int(row["step"]), float(v)))
    return out


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


def assert_user_error(proc: subprocess.CompletedProcess, *needles: str, status: int = 2) -> None:
    """Exit status 2 (Hydra's own errors: 1), no traceback, and the needles in the output."""
    text = proc.stdout + proc.stderr
    assert proc.returncode == status, text[-2000:]
    assert "Traceback" not in text, text[-3000:]
    for n in needles:
        assert n in text, f"{n!r} not in:\n{text[-3000:]}"


def spec_refusal(target: str, **values: Any) -> str:
    """The one-line refusal of ``values`` for ``target`` (``attnlab.models.GPT``) at ``model.net``
    by its signature's spec, as the config check gives it before anything is built."""
    from omegaconf import OmegaConf

    from attnlab.core.config import check_types
    from attnlab.core.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        check_types(OmegaConf.create({"_target_": target, **values}), "model.net")
    return str(e.value)


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished tiny run of the default experiment; returns its output directory."""
    cwd = tmp_path_factory.mktemp("trained")
    proc = run_cli("train", [*TINY, "task_name=tiny"], cwd)
    assert_ok(proc)
    (run_dir,) = run_dirs(cwd, "tiny")
    return run_dir


@pytest.fixture(scope="session")
def positions_multirun(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real tiny ``attnlab-train -m seed=1,2,3 model.net.positions=learned,alibi`` (issue 59's
    comparison, shared by attnlab-compare's and attnlab-report's tests); returns its multirun folder."""
    cwd = tmp_path_factory.mktemp("positions")
    steps = tiny("trainer.max_steps=4", "trainer.val_check_interval=2", "data.val_batches=1")
    args = ["-m", "seed=1,2,3", "model.net.positions=learned,alibi", *steps, "logger=csv"]
    assert_ok(run_cli("train", [*args, f"paths.root_dir={cwd}"], cwd))
    (multirun,) = (cwd / "logs").glob("*/multiruns/*")
    return multirun


def needs_shared(name: str) -> Path:
    path = SHARED_DATA / name
    if not path.exists():
        pytest.skip(f"needs the shared dataset {path} (not present outside the team's machines)")
    return path


def write_idx(path: Path, array, gz: bool = True) -> Path:
    """An IDX file (gzipped when ``gz``) holding a uint8 numpy array."""
    import gzip
    import struct

    data = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def write_idx_dataset(
    folder: Path, n_train: int = 60, n_test: int = 20, classes: int = 10, seed: int = 0
) -> Path:
    """A tiny MNIST-like dataset: 28x28 images whose class is written in their brightness pattern."""
    import numpy as np

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = (np.arange(n) % classes).astype(np.uint8)
        images = rng.integers(0, 60, (n, 28, 28)).astype(np.uint8)
        for i, y in enumerate(labels):
            images[i, 2 * y : 2 * y + 6, 4:24] = 250  # a bright bar whose height gives the class
        write_idx(folder / f"{prefix}-images-idx3-ubyte.gz", images)
        write_idx(folder / f"{prefix}-labels-idx1-ubyte.gz", labels)
    return folder


def write_image_folder(
    root: Path,
    classes: tuple[str, ...] = ("cat", "dog"),
    per_class: int = 12,
    size: int = 16,
    mode: str = "RGB",
    test: bool = True,
) -> Path:
    """root/train/<class>/<i>.png (and root/test/...): images whose mean colour gives the class."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in ("train", "test") if test else ("train",):
        for c, name in enumerate(classes):
            (root / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                base = 40 + 150 * c / max(1, len(classes) - 1)
                px = np.clip(rng.normal(base, 20, (size, size, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(px).convert(mode).save(root / split / name / f"{i}.png")
    return root


def write_cifar(folder: Path, n: int = 4) -> Path:
    """CIFAR-10's python version in miniature: five training batches and a test batch of ``n``."""
    import pickle

    import numpy as np

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), "labels": list(range(n))}
        (folder / name).write_bytes(pickle.dumps(batch))
    names = ["airplane", "automobile", "bird", "cat"][:n]
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": names}))
    return folder


VISION_NETS = {
    "vit": ["model.net.dim=16", "model.net.depth=1", "model.net.n_head=2", "model.optim.compile=false"],
    "swin": ["model.net.dim=8", "model.net.depths=[1,1,1]", "model.net.n_head=[1,2,2]"],
    "convnet": ["model.net.widths=[4,8]"],
    "perceiver": [
        "model.net.n_latents=4",
        "model.net.dim=16",
        "model.net.depth=1",
        "model.net.n_head=2",
        "model.net.n_bands=2",
    ],
}


def vision_overrides(experiment: str, tmp: Path) -> list[str]:
    """Tiny nets on fake data (no download) for a vision experiment; DeiT's teacher is a timm
    ResNet from a weights file."""
    import timm
    import torch

    kind = next(k for k in ("swin", "convnet", "vit", "deit", "perceiver") if k in experiment)
    if "scenes" in experiment:  # scenes of 2 fake images each: 32 to train on, 8 each to evaluate
        data = write_idx_dataset(tmp / "idx")
        scenes = [
            "data.train_size=32",
            "data.val_size=8",
            "data.test_size=8",
            "data.items=[2,2]",
            "data.canvas=64",
            "data.batch_size=4",
        ]
        return [f"data.source.data_dir={data}", *scenes, *VISION_NETS[kind]]
    if "cifar" in experiment:
        data = write_cifar(tmp / "cifar" / "cifar-10-batches-py", n=4).parent
    else:
        data = write_idx_dataset(tmp / "idx")
    # batches of 4 for the 10 CIFAR training images: under 2 processes each gets 5, one batch
    batch = 4 if "cifar" in experiment else 8
    out = [
        f"data.source.data_dir={data}",
        f"data.batch_size={batch}",
        "data.source.val_size=10",
        "model.plot_images=0",
    ]
    out += VISION_NETS["vit" if kind == "deit" else kind]
    if "_finetune_" in experiment or "_lora_" in experiment:  # the pre-trained weights: a random
        # timm model of the tiny net at 112 pixels, not 224: a quarter of the tokens (ViT's
        # positions resampled to 7x7)
        out += [f"model.init_from={timm_folder(kind, tmp / 'timm')}", "data.img_size=112"]
    if kind == "deit" and "_finetune_" not in experiment:  # the fine-tuning recipe has no teacher
        weights = tmp / "teacher.pth"
        torch.save(timm.create_model("test_resnet", num_classes=10, in_chans=1).state_dict(), weights)
        out += [
            "model.distillation.teacher.run=null",
            "+model.distillation.teacher.timm_name=test_resnet",
            f"+model.distillation.teacher.weights={weights}",
        ]
    return out


def timm_folder(kind: str, folder: Path) -> Path:
    """A random timm model of the fine-tuning recipes' architecture (vit_tiny_patch16_224's,
    deit_tiny_distilled_patch16_224's or swin_tiny_patch4_window7_224's) cut to VISION_NETS' size,
    with ImageNet's 1,000 classes, saved as timm saves one (config.json + model.safetensors)."""
    import timm
    from timm.models import save_for_hf

    if kind == "swin":
        name, size = "swin_tiny_patch4_window7_224", dict(embed_dim=8, depths=(1, 1, 1), num_heads=(1, 2, 2))
    else:
        name = "deit_tiny_distilled_patch16_224" if kind == "deit" else "vit_tiny_patch16_224"
        size = dict(embed_dim=16, depth=1, num_heads=2)
    save_for_hf(timm.create_model(name, pretrained=False, **size), folder, safe_serialization=True)
    return folder


def write_pairs(folder: Path, n: int = 12, missing: int = 0, suffix: str = ".csv") -> Path:
    """An image-caption file (CSV or JSONL) of ``n`` small PNGs, the first ``missing`` absent."""
    import json

    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        name = f"img{i}.png"
        if i >= missing:
            Image.new("RGB", (20, 16), (20 * i, 100, 200 - 10 * i)).save(folder / name)
        rows.append((name, f"a picture number {i} with a long caption about many things"))
    path = folder / f"pairs{suffix}"
    if suffix == ".csv":
        path.write_text("image,caption\n" + "".join(f"{a},{b}\n" for a, b in rows))
    else:
        path.write_text("".join(json.dumps({"image": a, "caption": b}) + "\n" for a, b in rows))
    return path


def write_flickr8k(folder: Path, n: int = 10, per_image: int = 2, images: str = "images") -> Path:
    """Flickr8k's layout in miniature: ``n`` PNGs in ``folder/images`` and ``folder/Flickr8k.token.txt``
    (``name#k<TAB>caption``, ``per_image`` captions each)."""
    from PIL import Image

    (folder / images).mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        Image.new("RGB", (24, 20), (20 * i, 100, 200 - 10 * i)).save(folder / images / f"{i}.png")
        lines += [f"{i}.png#{k}\ta dog number {i} runs on grass {k} ." for k in range(per_image)]
    path = folder / "Flickr8k.token.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def write_coco(folder: Path, n: int = 10, images_dir: str = ".") -> Path:
    """COCO's captions in miniature: ``n`` JPEGs in ``folder/images_dir`` and
    ``folder/captions_train2017.json`` (two captions each)."""
    from PIL import Image

    (folder / images_dir).mkdir(parents=True, exist_ok=True)
    images, notes = [], []
    for i in range(n):
        Image.new("RGB", (20, 24), (10 * i, 50, 90)).save(folder / images_dir / f"{i:012d}.jpg")
        images.append({"id": 100 + i, "file_name": f"{i:012d}.jpg"})
        notes += [
            {"id": 2 * i + k, "image_id": 100 + i, "caption": f"A cat {i} on a mat {k}."} for k in range(2)
        ]
    path = folder / "captions_train2017.json"
    path.write_text(json.dumps({"images": images, "annotations": notes}))
    return path


CLIP_TINY = [
    "model.net.image.dim=16",
    "model.net.image.depth=1",
    "model.net.image.n_head=2",
    "model.net.text.dim=16",
    "model.net.text.depth=1",
    "model.net.text.n_head=2",
    "model.net.embed_dim=8",
    "model.plot_pairs=2",
    "data.batch_size=8",
    "data.vocab_size=300",
]


def clip_overrides(experiment: str, tmp: Path) -> list[str]:
    """Tiny CLIP towers on fake IDX files (generated captions) or a fake pairs file."""
    if experiment == "clip_pairs":
        data = [
            f"data.source.path={write_pairs(tmp / 'pairs', n=24)}",
            "data.img_size=16",
            "data.source.val_size=6",
            "data.num_workers=0",
        ]
    else:
        data = [f"data.source.data_dir={write_idx_dataset(tmp / 'idx')}", "data.source.val_size=10"]
    return [*CLIP_TINY, *data]


# Show, Attend and Tell at a tiny size, on scenes built from fake IDX files (no download)
SAT_TINY = [
    "model.net.enc_dim=16",
    "model.net.enc_depth=3",
    "model.net.dim=16",
    "model.net.hidden=32",
    "model.net.attn_dim=16",
    "model.beam_size=2",
    "model.max_len=16",
    "model.plot_images=1",
]


def captioning_overrides(experiment: str, tmp: Path) -> list[str]:
    """A tiny captioner on 48 training scenes and 12 each for validation and test, made of fake IDX
    images."""
    return [
        *SAT_TINY,
        f"data.source.data_dir={write_idx_dataset(tmp / 'idx')}",
        "data.train_size=48",
        "data.val_size=12",
        "data.test_size=12",
        "data.batch_size=8",
    ]


# The Flamingo recipe at a tiny size: the captioner's parts as their own experiments would make
# them (convnet_scenes, gpt_scene_captions), and the resampler and gated blocks
FLAMINGO_TINY = [
    "model.net.vision.widths=[4,8,8,8]",
    "model.net.lm.dim=32",
    "model.net.lm.depth=2",
    "model.net.lm.n_head=2",
    "model.net.lm.max_len=32",
    "model.net.n_head=2",
    "model.net.n_latents=4",
    "model.net.resampler_depth=1",
    "model.beam_size=2",
    "model.max_len=16",
    "model.plot_images=1",
]
FLAMINGO_RECIPE = ("convnet_scenes", "gpt_scene_captions", "flamingo_scenes")


def flamingo_overrides(experiment: str, tmp: Path, init_from: bool = False) -> list[str]:
    """The Flamingo recipe's experiments, tiny, on 48 training scenes and 12 each for validation
    and test made of fake IDX images: its convnet, its GPT (on their captions) and the captioner, whose
    frozen parts are random unless ``init_from`` (then the newest runs of the other two)."""
    scenes = [
        f"data.source.data_dir={write_idx_dataset(tmp / 'idx')}",
        "data.train_size=48",
        "data.val_size=12",
        "data.test_size=12",
    ]
    if experiment == "gpt_scene_captions":
        size = ["model.net.dim=32", "model.net.depth=2", "model.net.n_head=2", "model.net.max_len=32"]
        return [
            *(o.replace("data.", "data.captions.") for o in scenes),
            *size,
            "data.batch_size=4",
            "data.val_batches=2",
        ]
    scenes.append("data.batch_size=8")
    if experiment == "convnet_scenes":
        return [*scenes, "model.net.widths=[4,8,8,8]"]
    return [*scenes, *FLAMINGO_TINY, *([] if init_from else ["model.init_from=null"])]


OPEN_CLIP_TINY = {  # OpenAI CLIP's vocabulary and caption length, tiny towers
    "embed_dim": 32,
    "quick_gelu": True,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "patch_size": 8, "head_width": 32},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
}


def write_open_clip(folder: Path, tokenizer_files: str = "tokenizer.json") -> Any:
    """A random open_clip CLIP saved by open_clip's ``save_for_hf`` (what ``push_to_hf_hub``
    uploads) with OpenAI CLIP's tokenizer as transformers saves it (``tokenizer.json``), or as
    older folders hold it (``vocab.json`` + ``merges.txt``), built from open_clip's own BPE file."""
    import open_clip
    import torch
    from open_clip.push_to_hf_hub import save_for_hf
    from open_clip.tokenizer import SimpleTokenizer
    from transformers import CLIPTokenizer

    simple = SimpleTokenizer()
    names = {"<start_of_text>": "<|startoftext|>", "<end_of_text>": "<|endoftext|>"}
    vocab = {names.get(k, k): v for k, v in simple.encoder.items()}
    merges = sorted(simple.bpe_ranks, key=simple.bpe_ranks.get)
    torch.manual_seed(0)
    model = open_clip.CLIP(**OPEN_CLIP_TINY).eval()
    model.visual.image_mean, model.visual.image_std = (
        open_clip.OPENAI_DATASET_MEAN,
        open_clip.OPENAI_DATASET_STD,
    )
    save_for_hf(
        model, CLIPTokenizer(vocab=vocab, merges=merges), OPEN_CLIP_TINY, folder, safe_serialization=True
    )
    if tokenizer_files == "vocab.json + merges.txt":
        (folder / "tokenizer.json").unlink()
        (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
        lines = "".join(f"{a} {b}\n" for a, b in merges)
        (folder / "merges.txt").write_text("#version: 0.2\n" + lines, encoding="utf-8")
    return model


BERT_TINY = [
    "model.net.encoder.dim=16",
    "model.net.encoder.depth=1",
    "model.net.encoder.n_head=2",
    "model.net.encoder.mlp_ratio=2.0",
]
CONLL_FIXTURE = ROOT / "tests" / "fixtures" / "conll"


def write_sst2(folder: Path, n: int = 48) -> Path:
    """GLUE-format SST-2 lookalikes (alps_train.tsv, alps_dev.tsv, dev.tsv): each sentence's
    label is the sentiment of its adjective."""
    import random

    rng = random.Random(0)
    words = {1: ["good", "great", "superb", "moving"], 0: ["bad", "awful", "dull", "boring"]}
    nouns = ["film", "movie", "plot", "cast", "script", "ending"]
    folder.mkdir(parents=True, exist_ok=True)
    for name, size in (("alps_train.tsv", n), ("alps_dev.tsv", n // 4), ("dev.tsv", n // 4)):
        rows = ["sentence\tlabel"]
        for i in range(size):
            label = i % 2
            rows.append(
                f"the {rng.choice(nouns)} was {rng.choice(words[label])} and the "
                f"{rng.choice(nouns)} too \t{label}"
            )
        (folder / name).write_text("\n".join(rows) + "\n")
    return folder


def bert_overrides(experiment: str, tmp: Path) -> list[str]:
    """A one-block BERT on fake SST-2 files or the CoNLL fixture (no download, no pre-training run)."""
    data = CONLL_FIXTURE if "ner" in experiment else write_sst2(tmp / "sst2")
    out = [
        f"data.source.data_dir={data}",
        "data.vocab_size=120",
        "data.max_tokens=128",
        "model.plot_sentences=0",
        *BERT_TINY,
    ]
    if "pretrain" in experiment:  # 7 held-out documents each: shared out by 2 or 3 processes unevenly
        out += ["data.source.val_size=0.12", "data.source.test_size=0.12"]
    return out + (["model.init_from=null"] if "finetune" in experiment or "_lora_" in experiment else [])


def sentences(n: int = 300) -> list[str]:
    """Lines of tinyshakespeare and SST-2 where the shared data is here, else generated ones."""
    import random

    lines = []
    for path in (SHARED_DATA / "tinyshakespeare" / "input.txt", SHARED_DATA / "sst2_glue" / "dev.tsv"):
        if path.is_file():
            text = path.read_text(encoding="utf-8").splitlines()
            lines += [s.split("\t")[0] for s in text if s.strip()][1 : n // 2]
    rng = random.Random(0)
    words = "the a film was good bad Romeo's love; what light! through yonder window's 42 café-au-lait"
    while len(lines) < n:
        lines.append(" ".join(rng.choice(words.split()) for _ in range(rng.randint(1, 14))))
    return lines


def write_hf_gpt2(folder: Path, dim: int, depth: int, n_head: int, max_len: int) -> Path:
    """A random transformers GPT2LMHeadModel saved by ``save_pretrained``, with a byte-level BPE
    of GPT-2's kind (its ``<|endoftext|>`` too) trained on ``sentences()``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(sentences(), trainer=trainer)
    hf_tok = GPT2TokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    hf_tok.save_pretrained(folder)
    torch.manual_seed(0)
    config = GPT2Config(n_embd=dim, n_layer=depth, n_head=n_head, n_positions=max_len, vocab_size=len(hf_tok))
    GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


def write_hf_bert(
    folder: Path, dim: int, depth: int, n_head: int, max_len: int, mlp_ratio: float = 2.0
) -> Path:
    """A random transformers BertForSequenceClassification saved by ``save_pretrained``, with a
    WordPiece vocabulary whose specials are not at ids 0-4 (as BERT's: [UNK] 100, [CLS] 101, ...)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    specials = ["[PAD]", "[unused0]", "[unused1]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(sentences() + ["the film was good and the plot too"] * 3, trainer=trainer)
    hf_tok = BertTokenizerFast(tokenizer_object=tok)
    hf_tok.save_pretrained(folder)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(hf_tok),
        hidden_size=dim,
        num_hidden_layers=depth,
        num_attention_heads=n_head,
        intermediate_size=int(mlp_ratio * dim),
        max_position_embeddings=max_len,
        num_labels=2,
    )
    BertForSequenceClassification(config).save_pretrained(folder)
    return folder
