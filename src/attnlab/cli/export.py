"""``attnlab-export ckpt_path=... out=<folder>``: a trained run in its counterpart library's
format (transformers, timm, open_clip: ``attnlab.weights.pretrained``), or ``format=onnx``. A LoRA
run's adapters are merged into the weights, or with ``merge=false`` written beside the base weights
as a PEFT adapter folder.

The export is written into ``<out>.partial`` and moved into place once complete (as
``attnlab-prepare`` does): a killed run leaves only that folder, which the next one clears; a
failed or refused one leaves nothing. ``overwrite=true`` replaces an earlier export only then."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from omegaconf import DictConfig

from attnlab.cli.common import inference_main, resolve_checkpoint
from attnlab.core.errors import ConfigError, DataError

FORMATS = ("native", "onnx")
# every file an export writes (transformers, timm, open_clip, ONNX): overwrite=true replaces a
# folder holding only these, never one holding anything else (a user's files would go with it)
EXPORT_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.txt"}
EXPORT_FILES |= {"open_clip_config.json", "open_clip_model.safetensors", "model.onnx", "model.onnx.data"}
EXPORT_FILES |= {"attnlab.json", "adapter_config.json", "adapter_model.safetensors"}


def check_out(cfg: DictConfig) -> Path:
    """``out=`` as a folder to write, checked before torch loads: with ``overwrite``, only an earlier
    export is replaced; never a symlink or a folder holding one."""
    if cfg.format not in FORMATS:
        raise ConfigError(f"format must be one of {', '.join(FORMATS)}, got {cfg.format!r}")
    if not isinstance(cfg.merge, bool):
        raise ConfigError(f"merge must be true or false, got {cfg.merge!r}")
    if not cfg.merge and cfg.format == "onnx":
        raise ConfigError("merge=false: an ONNX graph holds merged weights (format=native keeps them apart)")
    # absolute without following links: a symlinked out= is refused, not resolved
    out = Path(os.path.abspath(Path(str(cfg.out)).expanduser()))
    if not out.name:
        raise ConfigError(f"out={cfg.out}: not a folder an export can be written to")
    if out.is_symlink():
        raise DataError(f"out={out} is a symlink (to {os.readlink(out)}); give a real folder to export into")
    if out.exists() and not out.is_dir():
        raise DataError(f"out={out} exists and is not an empty folder (give a new or empty folder)")
    entries = sorted(out.iterdir()) if out.is_dir() else []
    for entry in entries:
        if entry.is_symlink():
            raise DataError(
                f"out={out} holds a symlink, {entry.name} -> {os.readlink(entry)} (an export writes only "
                "real files: remove it)"
            )
    if foreign := [e.name for e in entries if e.name not in EXPORT_FILES or not e.is_file()]:
        raise DataError(
            f"out={out} exists and is not an empty folder: it holds {foreign[0]}, which no export "
            "writes (give a new or empty folder; overwrite=true replaces only an earlier export)"
        )
    if entries and not cfg.overwrite:
        raise DataError(f"out={out} exists and is not an empty folder (set overwrite=true to replace it)")
    return out


def publish(partial: Path, out: Path) -> None:
    """The complete export moved into place; an earlier one removed only once the new one is there."""
    old = out.with_name(out.name + ".partial.old")
    shutil.rmtree(old, ignore_errors=True)
    if out.is_dir() and any(out.iterdir()):
        os.replace(out, old)
    elif out.is_dir():
        out.rmdir()
    try:
        os.replace(partial, out)
    except OSError:
        if old.is_dir() and not out.exists():
            os.replace(old, out)  # the earlier export back where it was
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def staged(out: Path) -> Iterator[Path]:
    """``<out>.partial`` to write into, published at the end; on any failure removed, and a write
    that fails (an unwritable folder, a full disk) one line naming ``out``."""
    from safetensors import SafetensorError

    from attnlab.data.shards.writer import start_partial  # prepare's: the same folder, cleaned alike

    partial = out.with_name(out.name + ".partial")
    try:
        partial = start_partial(out)
        yield partial
        publish(partial, out)
    except (OSError, SafetensorError) as e:
        reason = getattr(e, "strerror", None) or (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DataError(f"out={out}: cannot write the export ({reason}); nothing was exported") from e
    finally:
        with suppress(OSError):
            if partial.is_symlink():
                partial.unlink()
        shutil.rmtree(partial, ignore_errors=True)


def export(cfg: DictConfig) -> Path:
    """Write the run ``ckpt_path`` names into ``out``; returns the folder."""
    out = check_out(cfg)
    resolve_checkpoint(cfg)
    from attnlab.core.run_paths import model_names
    from attnlab.inference.runs import TrainedRun

    run = TrainedRun(str(cfg.ckpt_path), Path(cfg.paths.log_dir))
    task, _ = model_names(run.config.model)
    lora = run.config.model.get("lora")
    if not cfg.merge and not lora:
        raise ConfigError(f"merge=false: {run.path} trained no LoRA adapters (model.lora) to keep apart")
    net = run.net(merge=cfg.merge)
    with staged(out) as partial:
        if cfg.format == "onnx":
            from attnlab.weights.export import export_onnx

            export_onnx(net, task, run.artifacts, partial)
        elif not cfg.merge:
            from attnlab.weights.export import export_adapters

            export_adapters(net, lora, partial, run.artifacts)
        else:
            from attnlab.weights.pretrained import export_pretrained

            export_pretrained(net, partial, run.artifacts)
    return out


def show(cfg: DictConfig) -> None:
    out = export(cfg)
    print(f"{cfg.ckpt_path} exported ({cfg.format}) to {out}")


main = inference_main("export", (), show)


if __name__ == "__main__":
    main()
