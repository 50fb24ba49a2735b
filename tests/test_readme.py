"""Every command in the README and the docs runs: each ``uv run attnlab-...`` line of their code
blocks, in a fast form.

The lines are read from README.md and docs/*.md (so a new or changed line is tested as written);
each is run
in this process (``run_main``, the console script's own ``main()``) in a temporary directory:

- ``attnlab-train``: the experiment's tiny overrides (``tiny_overrides`` of test_debug_matrix: fake
  data, no download; a tiny net), then the README's own overrides (a size preset it chooses, such as
  ``model/net=swin_tiny``, replaces the tiny net), then the limits of ``debug=fdr`` (one training,
  validation and test batch). A ``data.data_dir`` under ``../shared/data`` (or ``...``) is replaced by
  the fake data; a relative one (``my_images``) and the other files a line names (``shoe.png``,
  ``captions.csv``, ``sentences.de``, ...) are written where the line expects them.
- the inference CLIs and ``ckpt_path=last``: in a workspace where a short run (2 steps, which
  leaves checkpoints) of the matching experiment was trained first, once per module.
- placeholders are made concrete from what is on disk: ``logs/.../last.ckpt`` and ``ckpt_path=...``
  name the newest checkpoint of the run the line needs, ``<time>`` the newest sweep or multirun.

Which lines run otherwise, and why, is said at ``test_readme_command``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from attnlab.data.multimodal.image_text import prepare_image_text
from attnlab.data.text.corpora import python_docs
from attnlab.data.text.shards import prepare, prepare_documents, prepare_pairs
from attnlab.data.text.translation import synthetic_pairs
from attnlab.data.vision import shards as image_shards
from conftest import (
    FLAMINGO_RECIPE,
    QUIET,
    ROOT,
    blank_image,
    run_cli,
    run_main,
    write_coco,
    write_flickr8k,
    write_hf_bert,
    write_hf_gpt2,
    write_image_folder,
    write_open_clip,
    write_pairs,
)
from test_debug_matrix import GPT_TINY, tiny_overrides

README = ROOT / "README.md"
# the pages whose commands run; tables are checked in these and in the results page too
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
MARKDOWN = [*PAGES, ROOT / "benchmarks" / "RESULTS.md"]
DEFAULT_EXPERIMENT = "gpt_pydoc_char"

# debug=fdr's limits without its config group (which would also set task_name=debug and the logger)
FDR = ["trainer.fast_dev_run=true", "trainer.val_check_interval=1", "sample.max_new_tokens=10"]
# a short real run: fast_dev_run writes no checkpoint and no CSV log, which later commands read
SHORT = [
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=1",
    "trainer.limit_test_batches=1",
    "trainer.num_sanity_val_steps=0",
    "sample.max_new_tokens=10",
]
# the debug configs keep their own mode (overfit_batches, profiler, anomaly detection), over 4 steps
DEBUG_CAP = ["trainer.max_steps=4", "trainer.val_check_interval=2"]
SWEEP_FAST = [*SHORT, "sweep.n_trials=1", "test=false"]

# the checkpoint each inference CLI needs: a run of this experiment is trained first; `eval` tests
# the checkpoint of the lines above it (their experiment)
ENTRY_EXPERIMENT = {
    "generate": "gpt_shakespeare_char",
    "translate": "nmt_transformer_multi30k",
    "predict": "vit_fashion_mnist",
    "fill-mask": "bert_pretrain_sst2",
    "classify": "bert_finetune_sst2",
    "zeroshot": "clip_fashion_mnist",
    "caption": "sat_scenes",
    "compare": DEFAULT_EXPERIMENT,  # <task> in the compare lines: the learning-rate multirun's
}
# experiments that read another run (DeiT's teacher, BERT's pre-training) and the tiny override
# that replaces it (left out where the line runs beside that run)
PREREQUISITE = {
    "deit_fashion_mnist": ("convnet_fashion_mnist", "model.distillation.teacher"),
    "bert_finetune_sst2": ("bert_pretrain_sst2", "model.init_from"),
}
# experiments that start from another library's weights (a hub name, offline here): a random model
# of that family, saved by transformers at the tiny overrides' sizes, stands in for the hub's
PRETRAINED = {
    "gpt2_finetune_shakespeare": lambda d: write_hf_gpt2(d, dim=32, depth=1, n_head=2, max_len=16),
    "gpt2_lora_shakespeare": lambda d: write_hf_gpt2(d, dim=32, depth=1, n_head=2, max_len=16),
    "bert_hf_finetune_sst2": lambda d: write_hf_bert(d, dim=16, depth=1, n_head=2, max_len=512),
}


@dataclass(frozen=True)
class Command:
    page: str  # README.md, docs/sweeps.md, ...
    lineno: int
    text: str
    entry: str  # train, eval, fill-mask, ...
    args: tuple[str, ...]  # as a shell passes them
    experiment: str  # what it trains, or the run whose checkpoint it reads

    @property
    def id(self) -> str:
        short = re.sub(r"[^\w.=/@,+~-]+", "_", " ".join(self.args))[:50]
        page = "" if self.page == "README.md" else f"{Path(self.page).stem}:"
        return f"{page}L{self.lineno}-{self.entry}-{short}".rstrip("-")

    @property
    def where(self) -> str:
        return f"{self.page}:{self.lineno}"

    def value(self, key: str) -> str | None:
        return next((a.partition("=")[2] for a in self.args if a.partition("=")[0] == key), None)


def readme_commands(text: str | None = None, page: str = "README.md") -> list[Command]:
    """The ``uv run attnlab-...`` lines of the fenced code blocks of every page (of ``text``
    when given; a trailing ``\\`` continues a line; a ``# comment`` ends one)."""
    if text is None:
        return [c for p in PAGES for c in readme_commands(p.read_text(), str(p.relative_to(ROOT)))]
    lines = text.splitlines()
    commands: list[Command] = []
    fenced, previous, i = False, None, 0
    while i < len(lines):
        line, lineno = lines[i], i + 1
        i += 1
        if line.lstrip().startswith("```"):
            fenced, previous = not fenced, None
            continue
        if not (fenced and line.startswith("uv run attnlab-")):
            continue
        while line.rstrip().endswith("\\") and i < len(lines):
            line, i = line.rstrip()[:-1] + " " + lines[i].strip(), i + 1
        words = shlex.split(line, comments=True)
        entry, args = words[2].removeprefix("attnlab-"), tuple(words[3:])
        if entry in ("train", "sweep"):
            experiment = next((a.partition("=")[2] for a in args if a.startswith("experiment=")), None)
            experiment = experiment or (previous if entry == "sweep" else None) or DEFAULT_EXPERIMENT
        elif entry == "eval":
            experiment = previous or DEFAULT_EXPERIMENT
        else:
            experiment = ENTRY_EXPERIMENT.get(entry, previous or DEFAULT_EXPERIMENT)
        commands.append(Command(page, lineno, line.split("#")[0].strip(), entry, args, experiment))
        previous = experiment
    return commands


COMMANDS = readme_commands()


def test_the_readme_commands_are_found():
    """A README reformat must not leave this file testing nothing."""
    assert len(COMMANDS) >= 40, [c.text for c in COMMANDS]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert {f"attnlab-{c.entry}" for c in COMMANDS} <= set(scripts)
    assert {c.entry for c in COMMANDS} >= {"train", "eval", "generate", "sweep", "compare"}
    assert not [c.text for c in COMMANDS if any(a.endswith("\\") for a in c.args)]  # continuations joined


def test_the_parser_reads_blocks_comments_quotes_and_continuations():
    text = "\n".join(
        [
            "uv run attnlab-train outside=a-block",
            "```bash",
            "# a comment",
            'uv run attnlab-generate ckpt_path=last prompt="ROMEO:"   # a comment with=equals',
            "uv run attnlab-sweep experiment=x a=1 \\",
            "  '+b=choice(1, 2)'",
            "uv run attnlab-eval ckpt_path=last",
            "```",
        ]
    )
    gen, sweep, ev = readme_commands(text)
    assert (gen.lineno, gen.entry, gen.args) == (4, "generate", ("ckpt_path=last", "prompt=ROMEO:"))
    assert sweep.args == ("experiment=x", "a=1", "+b=choice(1, 2)") and sweep.experiment == "x"
    assert ev.experiment == "x"  # eval tests the checkpoint of the line above


# ---- fake data and input files ------------------------------------------------------------------


def write_shakespeare(folder: Path) -> Path:
    """An ``input.txt`` with tinyshakespeare's shape: speakers' names in capitals, lines of verse."""
    folder.mkdir(parents=True, exist_ok=True)
    speakers = ["ROMEO", "JULIET", "MERCUTIO", "First Citizen"]
    verse = [
        "But soft, what light through yonder window breaks?",
        "It is the east, and Juliet is the sun.",
        "A plague on both your houses!",
        "We are accounted poor citizens, the patricians good.",
    ]
    text = "".join(f"{speakers[i % 4]}:\n{verse[i % 4]}\n{verse[(i + 1) % 4]}\n\n" for i in range(150))
    (folder / "input.txt").write_text(text)
    return folder


def tiny_for(experiment: str, data: Path, args: tuple[str, ...] = ()) -> list[str]:
    """The experiment's tiny overrides, with fake data written under ``data``; GPT's shakespeare
    data a fake input.txt instead of Python's docs (the README's lines choose that corpus)."""
    if any(a == "data=captions_folder" for a in args):  # the scenes' data overrides make no sense there
        keep = [o for o in tiny_overrides(experiment, data) if not o.startswith("data.")]
        sizes = ["data.source.val_size=2", "data.source.test_size=2"]
        return [*keep, *sizes, "data.img_size=16", "data.batch_size=4"]
    if not experiment.startswith("gpt_") or experiment in FLAMINGO_RECIPE:
        return tiny_overrides(experiment, data)
    if experiment == "gpt_shakespeare_char" or any(a.startswith("data=shakespeare") for a in args):
        # the recipe's block of 64 kept: the README's data.test_stride=32 is within it
        keep = [o for o in GPT_TINY if not o.startswith(("data/source=", "model.net.max_len="))]
        return [*keep, f"data.source.data_dir={write_shakespeare(data)}"]
    return list(GPT_TINY)


def key_of(override: str) -> str:
    return override.partition("=")[0].lstrip("+~")


def without_replaced(
    tiny: list[str], args: list[str] | tuple[str, ...], experiment: str, beside_prerequisite: bool = False
) -> list[str]:
    """The tiny overrides less those the README's line sets itself: the same key, or a key inside a
    config group it chooses (``model/net=swin_tiny`` replaces every ``model.net.*``)."""
    packages = []
    for a in args:
        k = key_of(a)
        if "/" in k:
            group, _, package = k.partition("@")
            packages.append(package or group.replace("/", "."))
    if beside_prerequisite:  # the teacher / pre-trained encoder is the run trained before
        packages.append(PREREQUISITE[experiment][1])
    keys = {key_of(a) for a in args}
    if "data.source.path" in keys:  # a folder or shards of the line's own: no built-in set's files
        shards = any(a.startswith(("data=", "data/source=")) and "shards" in a for a in args)  # already split
        drop = (
            "data.source.data_dir",
            *(("data.source.val_size", "data.source.test_size", "data.vocab_size") if shards else ()),
        )
        tiny = [o for o in tiny if key_of(o) not in drop]
    packages = [p for p in packages if p != "data.source"]  # data/source=mnist keeps the fake files
    return [
        o
        for o in tiny
        if key_of(o) not in keys
        and not any(key_of(o) == p or key_of(o).startswith(p + ".") for p in packages)
    ]


def write_inputs(args: tuple[str, ...], cwd: Path) -> None:
    """The files a line names, where it names them (relative to where it runs)."""
    writers = {
        "shoe.png": lambda p: blank_image(p),
        "scene.png": lambda p: blank_image(p),
        "sentences.de": lambda p: p.write_text("Zwei Männer spielen Fußball.\nEin Hund läuft im Park.\n"),
        "sentences.txt": lambda p: p.write_text("a gripping , funny film .\nthe plot was dull .\n"),
        "prompts.txt": lambda p: p.write_text("a photo of a {}.\na blurry picture of a {}.\n"),
        "my_images": lambda p: write_image_folder(p),
        "photos": lambda p: (p.mkdir(), blank_image(p / "a.png"), blank_image(p / "b.png")),
        "captions.csv": lambda p: write_pairs(p.parent, n=24).rename(p),
        "Flickr8k.token.txt": lambda p: write_flickr8k(p.parent, images="Flicker8k_Dataset"),
        "captions_train2017.json": lambda p: write_coco(p.parent, images_dir="train2017"),
        # twice the docs: byte-level BPE leaves training tokens after the default held-out splits
        "corpus.txt": lambda p: p.write_text(python_docs() * 2),
        "documents.txt": lambda p: p.write_text(python_docs()[:100_000]),  # paragraphs: documents
        "pairs.tsv": lambda p: write_tsv(p),
        "corpus/train": lambda p: write_aligned(p),
    }
    for a in args:
        name = a.partition("=")[2] or a  # key=file, or a file given by position
        if name in writers and not (cwd / name).exists():
            writers[name](cwd / name)
    shards = next((a.partition("=")[2] for a in args if a.startswith("data.source.path=shards")), None)
    if shards and not (cwd / shards).exists():  # what attnlab-prepare would have written there
        data = next((a.partition("=")[2] for a in args if a.startswith("data=")), "token_shards")
        if data == "image_shards":
            image_shards.prepare_images(write_image_folder(cwd / "shard_images"), cwd / shards, val_size=4)
        elif data in ("image_text_shards", "captions_folder"):
            prepare_image_text(write_pairs(cwd / "shard_pairs", n=24), cwd / shards, val_size=6)
        elif data == "bert_shards":
            writers["documents.txt"](cwd / "documents.txt")
            docs = [str(cwd / "documents.txt")]
            prepare_documents(docs, cwd / shards, vocab_size=500, val_docs=8, test_docs=8, progress=False)
        elif data == "translation_shards":
            writers["pairs.tsv"](cwd / "pairs.tsv")
            pairs = [str(cwd / "pairs.tsv")]
            prepare_pairs(
                pairs, cwd / shards, "de", "en", vocab_size=120, val_pairs=8, test_pairs=8, progress=False
            )
        else:
            (cwd / "corpus.txt").write_text(python_docs())
            prepare(
                [str(cwd / "corpus.txt")], cwd / shards, val_tokens=5000, test_tokens=5000, progress=False
            )


def write_tsv(path: Path) -> None:
    """A parallel corpus as ``de<TAB>en`` lines."""
    path.write_text("".join(f"{a}\t{b}\n" for a, b in zip(*synthetic_pairs(400, 0), strict=True)))


def write_aligned(prefix: Path) -> None:
    """Two line-aligned files ``<prefix>.de`` and ``<prefix>.en``."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    for lang, lines in zip(("de", "en"), synthetic_pairs(400, 0), strict=True):
        Path(f"{prefix}.{lang}").write_text("\n".join(lines) + "\n")


def concrete(cmd: Command, cwd: Path) -> list[str]:
    """The line's arguments, runnable here: shared data left to the tiny overrides' fake data, and
    placeholders (``...``, ``<time>``, ``<task>``) replaced by the newest match on disk."""
    out = []
    for a in cmd.args:
        key, eq, value = a.partition("=")
        if key in SHARED_DATA_KEYS and (value == "..." or value.startswith("../shared/data/")):
            continue
        if key == "model.init_from" and cmd.experiment in PRETRAINED:
            folder = cwd / f"hf_{cmd.experiment}"
            if not folder.exists():
                PRETRAINED[cmd.experiment](folder)
            out.append(f"{key}={folder}")
            continue
        if key == "init_from" and cmd.entry == "zeroshot":  # an open_clip folder from the hub
            folder = cwd / "open_clip_tiny"
            if not folder.exists():
                write_open_clip(folder)
            out.append(f"{key}={folder}")
            continue
        if key == "model.init_from" and cmd.experiment in FROM_HUB and not (cwd / value).exists():
            continue  # a model downloaded from the hub (`hf download` above it): the tiny random one
        if value == "..." and key == "ckpt_path":
            value = "logs/.../last.ckpt"
        if not eq:
            key, value = "", a
        if "..." in value or re.search(r"<\w+>", value):
            task = PREREQUISITE[cmd.experiment][0] if key == "model.init_from" else cmd.experiment
            pattern = (
                value.replace("logs/...", f"logs/{task}/**").replace("<task>", task).replace("<time>", "*")
            )
            found = sorted(cwd.glob(pattern), key=lambda p: p.stat().st_mtime)
            assert found, f"{cmd.text}: nothing matches {pattern} in {cwd}"
            value = str(found[-1].relative_to(cwd))
        out.append(f"{key}={value}" if key else value)
    return out


# where a line names the shared data (replaced by the tiny overrides' fake data), before and after
# the data source became a node of its own (data.source)
SHARED_DATA_KEYS = (
    "data.data_dir",
    "data.captions.data_dir",
    "data.source.data_dir",
    "data.captions.source.data_dir",
)
# the recipes that start from a model on the Hugging Face hub: the tiny overrides' random one here
FROM_HUB = ("vit_finetune_cifar10", "deit_finetune_cifar10", "swin_finetune_cifar10")


# ---- running ------------------------------------------------------------------------------------


def run_in(cwd: Path, entry: str, argv: list[str]) -> tuple[int, str]:
    with contextlib.chdir(cwd):
        return run_main(entry, argv)


def check(status: int, out: str, what: str) -> None:
    assert status == 0, f"{what}\nexit {status}\n{out[-5000:]}"


class Workspaces:
    """One directory per experiment, holding a short run of it (and of its prerequisite first):
    the checkpoints that ``ckpt_path=last`` and the inference CLIs read. Each is trained once per
    module, when a line first needs it."""

    def __init__(self, factory: pytest.TempPathFactory):
        self.factory, self.dirs = factory, {}

    def train(self, experiment: str, cwd: Path, beside_prerequisite: bool = False) -> None:
        tiny = tiny_for(experiment, self.factory.mktemp("data"))
        if beside_prerequisite:
            tiny = without_replaced(tiny, (), experiment, beside_prerequisite=True)
        argv = [*QUIET, f"experiment={experiment}", *tiny, *SHORT]
        check(*run_in(cwd, "train", argv), f"the short run of {experiment} in {cwd}")

    def __call__(self, experiment: str) -> Path:
        if experiment not in self.dirs:
            cwd = self.factory.mktemp(experiment)
            if experiment in PREREQUISITE:
                self.train(PREREQUISITE[experiment][0], cwd)
            self.train(experiment, cwd, beside_prerequisite=experiment in PREREQUISITE)
            self.dirs[experiment] = cwd
        return self.dirs[experiment]

    def compare(self) -> Path:
        """A learning-rate multirun of the default experiment beside the ViT's and DeiT's runs."""
        if "compare" not in self.dirs:
            cwd = self.factory.mktemp("compare")
            argv = [
                "-m",
                "model.optim.optimizer.lr=1e-3,3e-3",
                *QUIET,
                *tiny_for(DEFAULT_EXPERIMENT, cwd),
                *SHORT,
            ]
            check(*run_in(cwd, "train", argv), "the multirun compared")
            for experiment in ("vit_fashion_mnist", "deit_fashion_mnist"):
                (cwd / "logs" / experiment).symlink_to(self(experiment) / "logs" / experiment)
            self.dirs["compare"] = cwd
        return self.dirs["compare"]

    def sweep(self, cmd: Command) -> tuple[int, str, Path]:
        """A sweep line's result and directory: run once per module, as ``resume=`` reads it too."""
        if cmd.where not in self.dirs:
            cwd = self.factory.mktemp(f"sweep{cmd.lineno}")
            args = concrete(cmd, cwd)
            tiny = without_replaced(tiny_for(cmd.experiment, cwd / "data", cmd.args), args, cmd.experiment)
            self.dirs[cmd.where] = (*run_in(cwd, "sweep", [*QUIET, *tiny, *args, *SWEEP_FAST]), cwd)
        return self.dirs[cmd.where]


@pytest.fixture(scope="module")
def workspaces(tmp_path_factory: pytest.TempPathFactory) -> Workspaces:
    return Workspaces(tmp_path_factory)


def train_argv(cmd: Command, args: list[str], data: Path, beside_prerequisite: bool) -> list[str]:
    """The fast form of a training line: tiny, then the line's own overrides, then the limits."""
    tiny = without_replaced(
        tiny_for(cmd.experiment, data, cmd.args), args, cmd.experiment, beside_prerequisite
    )
    flags = [a for a in args if a.startswith("-")]
    overrides = [a for a in args if not a.startswith("-")]
    if cmd.value("ckpt_path"):  # resuming the workspace's 2-step run: one more step
        fast = [*SHORT, "trainer.max_steps=3"]
    elif cmd.value("debug"):
        fast = DEBUG_CAP
    elif flags:  # a multirun: short real runs (fast_dev_run leaves no CSV log to compare)
        fast = SHORT
    else:
        fast = FDR
    if int(cmd.value("data.img_size") or 0) >= 128:  # a net at its real size (swin_tiny at 224): 2 images
        fast = [*fast, "data.batch_size=2"]
    return [*flags, *QUIET, *tiny, *overrides, *fast]


def is_slow(cmd: Command) -> bool:
    """Lines that start processes: ``trainer=ddp_cpu`` (two ranks; tests/test_distributed.py and
    tests/test_scaleout.py run it by default), the docs' sweeps (a process per trial; ``resume=``
    needs the sweep above it). The README's sweep and its resume stay: one real trial."""
    return cmd.value("trainer") in ("ddp_cpu", "ddp") or (cmd.entry == "sweep" and cmd.page != "README.md")


PARAMS = [pytest.param(c, id=c.id, marks=[pytest.mark.slow] if is_slow(c) else []) for c in COMMANDS]


@pytest.mark.parametrize("cmd", PARAMS)
def test_readme_command(cmd: Command, workspaces: Workspaces, tmp_path: Path, tmp_path_factory):
    """Each README line, in its fast form:

    - train: in a fresh directory, or beside the run it reads (``ckpt_path=``: the run it resumes,
      for one step more; DeiT: its convnet teacher's; BERT fine-tuning: its pre-training run's);
    - ``trainer=gpu`` / ``trainer=ddp`` without a GPU: the config is composed and checked (every
      value against its constructor), then the test skips, saying so; with a GPU they run;
    - ``trainer=ddp_cpu`` (and ``ddp``): in a new process (Lightning starts the other ranks by running
      the command line again, which this process's ``sys.argv`` is not);
    - sweeps: one trial of 2 steps (a trial is an ``attnlab-train`` process, so this is the slowest
      form that still runs a trial); ``resume=`` resumes the sweep of the line above it, whose one
      trial is done: it reads the saved sweep, runs nothing more and reports the best trial;
    - compare: on a learning-rate multirun of 2-step runs and the ViT's and DeiT's runs.
    """
    import torch

    if cmd.entry == "train":
        if cmd.value("trainer") in ("gpu", "ddp") and not torch.cuda.is_available():
            compose_and_check(cmd, tmp_path)
            pytest.skip(f"{cmd.text}: needs a GPU; its config was composed and checked")
        beside = cmd.experiment in PREREQUISITE and cmd.value(PREREQUISITE[cmd.experiment][1]) != "null"
        cwd = workspaces(cmd.experiment) if cmd.value("ckpt_path") or beside else tmp_path
        write_inputs(cmd.args, cwd)
        argv = train_argv(cmd, concrete(cmd, cwd), tmp_path_factory.mktemp("data"), beside)
        if cmd.value("trainer") in ("ddp_cpu", "ddp"):
            proc = run_cli("train", argv, cwd)
            status, out = proc.returncode, proc.stdout + proc.stderr
        else:
            status, out = run_in(cwd, "train", argv)
        assert "downloading http" not in out, out[-3000:]  # the fake data, never the network
    elif cmd.entry == "sweep" and cmd.value("resume"):  # the sweep above, whatever order tests run in
        above = next(
            c
            for c in reversed(COMMANDS)
            if c.entry == "sweep" and c.page == cmd.page and c.lineno < cmd.lineno
        )
        cwd = workspaces.sweep(above)[2]
        status, out = run_in(cwd, "sweep", concrete(cmd, cwd))
    elif cmd.entry == "sweep" and (why := sweep_needs(cmd)):
        compose_sweep(cmd)
        pytest.skip(f"{cmd.text}: {why}; its config was composed and checked")
    elif cmd.entry == "sweep":
        status, out, cwd = workspaces.sweep(cmd)
        assert "failed:" not in out, out[-3000:]  # its trial trained (a failed trial does not fail a sweep)
    elif cmd.entry == "prepare":  # reads the files it names, needs no run
        write_inputs(cmd.args, tmp_path)
        cwd = tmp_path
        images = any(f"--mode {m}" in " ".join(cmd.args) for m in ("images", "pairs"))
        tiny = ["--val-size", "4"] if images else []  # of 24 images
        status, out = run_in(cwd, "prepare", [*cmd.args, *tiny])
    elif cmd.entry == "compare" and any(a.startswith("postgresql") for a in cmd.args):
        pytest.skip(f"{cmd.text}: needs the PostgreSQL server it names (tests/test_compare.py reads studies)")
    elif cmd.entry in ("compare", "report"):  # the report: on the same runs
        cwd = workspaces.compare()
        status, out = run_in(cwd, cmd.entry, concrete(cmd, cwd))
    else:
        cwd = workspaces(cmd.experiment)
        write_inputs(cmd.args, cwd)
        status, out = run_in(cwd, cmd.entry, concrete(cmd, cwd))
    check(status, out, f"{cmd.where}: {cmd.text}")
    if cmd.entry == "sweep":
        assert "best: trial 0" in out, out[-3000:]
    for a in cmd.args:  # what the line writes is there
        key, _, value = a.partition("=")
        if key == "output":
            assert (cwd / value).is_file(), out[-3000:]
    if "--out" in cmd.args:
        assert (cwd / cmd.args[cmd.args.index("--out") + 1]).exists(), out[-3000:]  # a file or a folder


def sweep_needs(cmd: Command) -> str | None:
    """What a sweep line needs that this machine lacks: GPUs, more cores than it has, a database
    server or a shared filesystem it names (tests/test_sweep_parallel.py and
    tests/test_sweep_storage.py run those paths on a real PostgreSQL server and a journal file)."""
    import torch

    storage = cmd.value("sweep.storage") or ""
    if storage.startswith("postgresql"):
        return "needs the PostgreSQL server it names"
    if storage.startswith("journal:/"):
        return "needs the shared filesystem it names"
    on_cpu = not torch.cuda.is_available() or cmd.value("trainer.accelerator") == "cpu"
    devices = int(cmd.value("sweep.n_jobs") or 1) * int(cmd.value("sweep.devices_per_trial") or 1)
    if on_cpu and (cmd.value("trainer") in ("gpu", "ddp") or devices > len(os.sched_getaffinity(0))):
        return f"needs {devices} GPUs"
    return None


def compose_sweep(cmd: Command) -> None:
    """A sweep line's config, composed as ``attnlab-sweep`` would, its sweep settings checked."""
    from attnlab.cli.common import compose_train
    from attnlab.cli.sweep import quote_search_spaces, sweep_parts

    cfg = compose_train(quote_search_spaces(list(cmd.args)))
    sweep_parts(cfg.sweep)


def compose_and_check(cmd: Command, tmp: Path) -> None:
    """A GPU line's config, composed as ``attnlab-train`` would and checked against its constructors."""
    from attnlab.cli.common import config_dir
    from attnlab.core.config import check_config, resolve

    tiny = without_replaced(tiny_for(cmd.experiment, tmp / "data", cmd.args), cmd.args, cmd.experiment)
    overrides = [*QUIET, *tiny, *cmd.args, f"paths.output_dir={tmp / 'run'}"]
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    resolve(cfg)
    check_config(cfg)
    assert cfg.trainer.accelerator == "gpu", cfg.trainer


def table_cells(line: str) -> list[str]:
    """The cells of a Markdown table row: split at every ``|`` not escaped as ``\\|`` (GitHub
    splits at a bare ``|`` inside a code span too)."""
    return re.split(r"(?<!\\)\|", line.strip().strip("|"))


@pytest.mark.parametrize("page", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_table_row_has_the_header_s_columns(page: Path):
    """A row with a cell too many or too few renders broken (its cells shift or vanish)."""
    tables, current = [], []
    for n, line in enumerate(page.read_text().splitlines(), start=1):
        if line.lstrip().startswith("|"):
            current.append((n, line))
        elif current:
            tables.append(current)
            current = []
    tables += [current] if current else []
    name = page.relative_to(ROOT)
    for table in tables:
        (head_n, head), *rows = table
        width = len(table_cells(head))
        assert set(rows[0][1].replace("|", "").strip()) <= set("-: "), f"{name}:{head_n}: no separator row"
        bad = [(n, len(table_cells(row))) for n, row in rows if len(table_cells(row)) != width]
        assert not bad, f"{name}:{head_n}: {width} columns, but rows {bad}"


def test_the_pages_link_to_files_that_exist():
    """The README's contents and the docs' links survive files moving."""
    for page in MARKDOWN:
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith("http"):
                assert (page.parent / target).exists(), f"{page.relative_to(ROOT)}: {target}"
    assert sum(len(re.findall(r"^\|", p.read_text(), re.M)) > 0 for p in MARKDOWN) >= 5
