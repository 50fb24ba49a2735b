"""What the entry points share: composing a config, one-line input errors, loading a run.
No torch at module level: ``--help`` and a config error end before it loads (tests/test_cli.py)."""

from __future__ import annotations

import argparse
import difflib
import logging
import re
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from attnlab.core.errors import AttnlabError, ConfigError, DataError
from attnlab.core.specs import is_int

if TYPE_CHECKING:
    import lightning as L
    import torch
    from torch import nn

    from attnlab.inference.runs import TrainedRun

log = logging.getLogger("attnlab")


def config_dir() -> str:
    """``conf/`` of a source checkout, or the copy packaged inside an installed wheel."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parents[2] / "conf", here.parent / "conf"):
        if (candidate / "train.yaml").is_file():
            return str(candidate)
    raise RuntimeError(f"attnlab: no conf/ directory found near {here}")


def arg_parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    """An argparse entry point's parser, its module docstring (with examples) as the description."""
    return argparse.ArgumentParser(
        prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def aligned(lines: Sequence[Sequence[str]]) -> str:
    """Rows of cells as left-aligned text columns."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines
    )


def compose_config(name: str, overrides: list[str], with_hydra: bool = False) -> DictConfig:
    """``conf/<name>.yaml`` with ``overrides``; an override Hydra refuses is a one-line ``ConfigError``."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        try:
            return compose(config_name=name, overrides=overrides, return_hydra_config=with_hydra)
        except HydraException as e:
            raise ConfigError(str(e).splitlines()[0]) from None


def compose_train(overrides: list[str]) -> DictConfig:
    """The config ``attnlab-train`` composes; a hyper-parameter under its old name is one line."""
    from attnlab.core.config import refuse_renamed_overrides

    refuse_renamed_overrides(overrides)
    return compose_config("train", overrides)


def refuse_unknown_keys(name: str, overrides: list[str]) -> None:
    """An override of a key the config does not have is one line (Hydra's is five): a key under a
    null node (``model.lora.r=8``) says to give the node whole; another names the keys that end
    the same way (``data.val_size`` -> ``data.source.val_size``). A multirun's sweeps are Hydra's."""
    if {"-m", "--multirun"} & set(overrides):
        return
    plain = [o for o in overrides if not o.startswith("-")]
    try:
        compose_config(name, plain)
    except ConfigError as e:
        cause = e.__context__
        while cause is not None and "not in struct" not in str(cause):
            cause = cause.__cause__ or cause.__context__
        if not getattr(cause, "full_key", None):
            return
        key = cause.full_key
        parent, _, last = key.rpartition(".")
        cfg = compose_config(name, [o for o in plain if not o.lstrip("+~").startswith(f"{key}=")])
        if parent and OmegaConf.select(cfg, parent) is None:
            raise ConfigError(
                f"{key}: {parent} is null here; give it whole: '{parent}={{{last}: ...}}'"
            ) from None
        keys = list(_keys(OmegaConf.to_container(cfg)))
        near = [k for k in keys if k.endswith(f".{last}")] or difflib.get_close_matches(key, keys, n=2)
        hint = f"did you mean {' or '.join(near)}?" if near else f"a new key takes a leading +: +{key}=..."
        raise ConfigError(f"{key}: not a key of this config ({hint})") from None


def _keys(tree: Any, prefix: str = "") -> Iterator[str]:
    for k, v in tree.items():
        path = f"{prefix}{k}"
        yield path
        if isinstance(v, dict):
            yield from _keys(v, f"{path}.")


def user_error(e: BaseException) -> AttnlabError | None:
    """The AttnlabError behind ``e`` (Hydra wraps constructors' errors; a constructor's
    ``ValueError`` is named by its node's key: ``refusal``), if any."""
    from attnlab.core.config import refusal

    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, AttnlabError):
            return unwrap_worker_error(e)
        if isinstance(e, InstantiationException) and (err := refusal(e)) is not None:
            return err
        if isinstance(e, MissingMandatoryValue):  # a ``???`` in the config that nobody set
            return ConfigError(f"{e.full_key} is required: give {e.full_key}=... on the command line")
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def unwrap_worker_error(err: AttnlabError) -> AttnlabError:
    """``err`` as raised, where torch re-raised it from a loader worker around the worker's
    traceback ("Caught DataError in DataLoader worker ..."), whose last line carries it."""
    text = str(err)
    if not text.startswith(f"Caught {type(err).__name__} ") or "\nOriginal Traceback" not in text:
        return err
    prefix = f"{type(err).__module__}.{type(err).__qualname__}: "
    for line in reversed(text.splitlines()):
        if line.startswith(prefix):
            return type(err)(line.removeprefix(prefix))
    return err


def own_run_folder(cfg: DictConfig) -> Path | None:
    """The run folder Hydra made for this command, for ``exit_on_user_error`` to discard; ``None``
    outside ``paths.log_dir`` (``hydra.run.dir=.``: the user's folder, never removed)."""
    try:
        out, logs = Path(cfg.paths.output_dir).resolve(), Path(cfg.paths.log_dir).resolve()
    except OmegaConfBaseException:  # an interpolation error: the command reports it
        return None
    return out if out != logs and out.is_relative_to(logs) else None


# what a refused run leaves that records only how it was asked for: Hydra's copy of the config,
# attnlab-train's config.yaml, machine.yaml and run.yaml (with its log, ``*.log``)
RUN_RECORDS = (".hydra", "config.yaml", "machine.yaml", "run.yaml")


@contextmanager
def exit_on_user_error(discard: Path | None = None, console: bool = False) -> Iterator[None]:
    """Input errors as one ``error: ...`` line (``console``: on stderr, else logged) and exit
    status 2; bugs raise. ``discard``: this command's run folder, removed if it holds only records."""
    try:
        yield
    except Exception as e:
        err = user_error(e)
        if err is None:
            raise
        if console or log.disabled or not log.hasHandlers():  # not logging's last resort: a second copy
            print(f"error: {err}", file=sys.stderr)
        else:
            log.error("error: %s", err)
        if discard is not None and discard.is_dir() and all(map(run_record, discard.iterdir())):
            shutil.rmtree(discard)
        sys.exit(2)


def run_record(path: Path) -> bool:
    """Whether ``path`` in a refused run's folder only records how it was asked for (or is a
    logger's folder holding at most ``hparams.yaml``)."""
    if path.name in RUN_RECORDS or (path.suffix == ".log" and path.is_file()):
        return True
    return (
        path.is_dir()
        and not path.is_symlink()
        and all(p.name == "hparams.yaml" for p in path.rglob("*") if p.is_file() or p.is_symlink())
    )


def quote_free_text(argv: list[str], keys: tuple[str, ...]) -> list[str]:
    """Free-text overrides (``text=Zwei Männer ...``, quotes stripped by the shell) quoted for
    Hydra's grammar; a value already quoted is left alone."""
    out = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key in keys and not (len(value) >= 2 and value[0] == value[-1] and value[0] in "'\""):
            # Hydra's quoted strings: backslashes are escaped only before a quote or at the end
            value = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, value)
            value = value.replace("'", "\\'").replace("${", "\\${")
            arg = f"{key}='{value}'"
        out.append(arg)
    return out


def read_sentences(cfg: DictConfig) -> list[str]:
    """The sentences of ``text="..."`` or ``input=<file>`` (every line kept: one output line each)."""
    if (cfg.text is None) == (cfg.input is None):
        raise ConfigError('give exactly one of text="..." or input=<file with one sentence per line>')
    if cfg.text is not None:
        if not str(cfg.text).strip():
            raise ConfigError(f"text={str(cfg.text)!r} is empty; give a sentence")
        return [str(cfg.text)]
    from attnlab.data.text.formats import read_lines  # attnlab.data loads torch

    path = Path(str(cfg.input))
    lines = read_lines(path, "input")
    if not any(line.strip() for line in lines):
        raise DataError(f"input={path} is empty; expected one sentence per line")
    return lines


def write_lines(path: Path, lines: list[str]) -> None:
    """One line each, written whole or not at all (through a temporary file)."""
    tmp = path.with_name(f".{path.name}.part")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        tmp.replace(path)
    except OSError as e:
        with suppress(OSError):
            tmp.unlink()
        raise DataError(f"output={path}: cannot write it ({e.strerror or e})") from e


def resolve_checkpoint(cfg: DictConfig, task: str | None = None) -> None:
    """``cfg.ckpt_path`` as the file it names (``last``: the newest run, of ``task`` if given)."""
    from attnlab.core.run_paths import LAST_OF_ANY_RUN, resolve_ckpt_path

    tasks = (task,) if task else ()
    path = resolve_ckpt_path(str(cfg.ckpt_path), Path(cfg.paths.log_dir), LAST_OF_ANY_RUN, tasks)
    cfg.ckpt_path = str(path)


def build_trainer(cfg: DictConfig, **kwargs: Any) -> L.Trainer:
    """The ``trainer`` node instantiated, ``precision: auto`` resolved for this machine."""
    from attnlab.core.config import instantiate_trainer
    from attnlab.core.hardware import resolve_precision

    with open_dict(cfg):
        cfg.trainer.precision = resolve_precision(cfg.trainer.accelerator, cfg.trainer.precision)
    return instantiate_trainer(cfg.trainer, **kwargs)


def check_device(value: Any) -> None:
    """``device=``: ``cpu``, ``cuda``, ``cuda:N`` or ``auto``; a GPU where there is none is one line
    (torch loads only when a GPU is asked for)."""
    value = str(value)
    if value != "auto" and not re.fullmatch(r"cpu|cuda(:\d+)?", value):
        raise ConfigError(f"device must be cpu, cuda, cuda:N or auto, got {value!r}")
    if value.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"device={value}: no CUDA GPU here (device=cpu, or auto)")


@contextmanager
def trained_net(
    cfg: DictConfig, task: str, need: str
) -> Iterator[tuple[TrainedRun, nn.Module, torch.device]]:
    """The run ``ckpt_path`` names (of ``task``, else ``need`` is the refusal) and its net on
    ``device=``, under ``torch.no_grad``; device and path checked before torch loads."""
    check_device(cfg.device)
    resolve_checkpoint(cfg, task)
    import torch

    import attnlab.training
    from attnlab.inference.runs import TrainedRun

    with torch.no_grad():
        device = inference_device(cfg.device)
        run = TrainedRun.for_cli(cfg, getattr(attnlab.training, task), need=need)
        yield run, run.net().to(device), device


def inference_device(value: Any) -> torch.device:
    """The ``torch.device`` of ``device=``, checked by ``check_device``."""
    import torch

    if str(value) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(str(value))


@contextmanager
def progress(total: int, description: str, show: bool = True) -> Iterator[Callable[[int], None]]:
    """A progress bar over ``total`` items on stderr (stdout keeps the outputs); yields ``advance(n)``."""
    if not show:
        yield lambda n: None
        return
    import rich.progress as rp
    from rich.console import Console

    columns = (rp.BarColumn(), rp.MofNCompleteColumn(), rp.TimeElapsedColumn(), rp.TimeRemainingColumn())
    with rp.Progress(
        rp.TextColumn("{task.description}"), *columns, console=Console(stderr=True), redirect_stdout=False
    ) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)


def image_batches(
    cfg: DictConfig, artifacts: dict[str, Any], device: Any, description: str
) -> Iterator[tuple[list[Path], torch.Tensor]]:
    """The images ``image=`` names (a file, or a folder's, with a progress bar) in batches: their
    paths and uint8 images (B, C, H, W) on ``device``, in the run's channels and size."""
    import torch

    from attnlab.inference.classification import image_files, load_image

    folder = Path(str(cfg.image)).expanduser()
    files = image_files(folder)
    with progress(len(files), description, show=folder.is_dir()) as advance:
        for start in range(0, len(files), cfg.batch_size):
            chunk = files[start : start + cfg.batch_size]
            yield chunk, torch.stack([load_image(f, artifacts) for f in chunk]).to(device)
            advance(len(chunk))


def positive_option(cfg: DictConfig, key: str, default: Any = None) -> int:
    """``cfg[key]`` (null: ``default``, the run's own), which must be a positive integer."""
    value = default if cfg[key] is None else cfg[key]
    if not is_int(value) or value < 1:
        raise ConfigError(f"{key} must be a positive integer, got {value!r}")
    return value


def print_or_write(cfg: DictConfig, lines: Callable[[], list[str]], what: str) -> None:
    """The ``lines`` printed, or written to ``output=`` (checked before they are made)."""
    path = None if cfg.output is None else Path(str(cfg.output))
    if path is not None and path.exists() and not cfg.overwrite:
        raise DataError(f"output={path} exists (set overwrite=true to replace it)")
    out = lines()
    if path is None:
        print("\n".join(out))
    else:
        write_lines(path, out)
        print(f"{len(out)} {what} written to {path}", file=sys.stderr)


def print_top(name: Any, top: list[tuple[str, float]]) -> None:
    print(f"{name}: " + ", ".join(f"{label} {p:.3f}" for label, p in top))


def inference_main(
    name: str, free_text: tuple[str, ...], body: Callable[[DictConfig], None], discard: bool = False
) -> Callable[[], None]:
    """The console script of ``conf/<name>.yaml``: ``free_text`` keys quoted, input errors one line
    (``discard``: the run folder Hydra made, removed then)."""
    import hydra

    @hydra.main(version_base="1.3", config_path=config_dir(), config_name=name)
    def run(cfg: DictConfig) -> None:
        with exit_on_user_error(discard=own_run_folder(cfg) if discard else None):
            body(cfg)

    def main() -> None:
        sys.argv = quote_free_text(sys.argv, free_text)
        run()

    return main
