"""``attnlab-export ckpt_path=... out=<folder>``: a trained run in its counterpart library's
format (transformers, timm, open_clip: ``attnlab.models.pretrained``), or ``format=onnx``."""

from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig

from attnlab.cli.common import config_dir, exit_on_user_error, resolve_checkpoint
from attnlab.errors import ConfigError, DataError

FORMATS = ("native", "onnx")


def check_out(cfg: DictConfig) -> Path:
    """``out=`` as a folder to write, refused (before torch loads) when it holds files and
    ``overwrite`` is not set: an earlier export is never replaced by accident."""
    if cfg.format not in FORMATS:
        raise ConfigError(f"format must be one of {', '.join(FORMATS)}, got {cfg.format!r}")
    out = Path(str(cfg.out)).expanduser()
    if out.is_file() or (out.is_dir() and any(out.iterdir()) and not cfg.overwrite):
        raise DataError(f"out={out} exists and is not an empty folder (set overwrite=true to write into it)")
    return out


def export(cfg: DictConfig) -> Path:
    """Write the run ``ckpt_path`` names into ``out``; returns the folder."""
    out = check_out(cfg)
    resolve_checkpoint(cfg)
    from attnlab.inference.runs import TrainedRun
    from attnlab.utils.run_paths import model_names

    run = TrainedRun(str(cfg.ckpt_path), Path(cfg.paths.log_dir))
    task, _ = model_names(run.config.model)
    net = run.net()
    if cfg.format == "onnx":
        from attnlab.inference.export import export_onnx

        export_onnx(net, task, run.artifacts, out)
    else:
        from attnlab.models.pretrained import export_pretrained

        export_pretrained(net, out, run.artifacts)
    return out


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="export")
def run(cfg: DictConfig) -> None:
    with exit_on_user_error():
        out = export(cfg)
        print(f"{cfg.ckpt_path} exported ({cfg.format}) to {out}")


def main() -> None:
    run()


if __name__ == "__main__":
    main()
