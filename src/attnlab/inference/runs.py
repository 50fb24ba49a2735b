"""Rebuilding a trained run (model, data artifacts, data config) from its checkpoint."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from attnlab.core.config import translate_renamed
from attnlab.core.errors import CheckpointError
from attnlab.core.run_paths import LAST_OF_ANY_RUN, resolve_ckpt_path
from attnlab.core.targets import check_targets, translate_moved, translate_moved_keys
from attnlab.data.sources import translate_flat
from attnlab.data.text.tokenizers import BPETokenizer, CharTokenizer, SubwordTokenizer, tokenizer_from_json
from attnlab.weights.checkpoint import check_fits, load_checkpoint, metadata, require_task

log = logging.getLogger(__name__)


class TrainedRun:
    """A checkpoint with the config and the data artifacts (e.g. tokenizer) it was trained with."""

    def __init__(self, spec: str, log_dir: Path, tasks: tuple[type, ...] = (), need: str = "") -> None:
        """``spec``: a checkpoint, or ``last``: the newest run under ``log_dir`` (of one of
        ``tasks``, when given). A checkpoint of another task than ``tasks`` is refused with one
        line saying what it holds and ``need``."""
        names = tuple(t.__name__ for t in tasks)
        self.path = resolve_ckpt_path(spec, log_dir, LAST_OF_ANY_RUN, names)
        self.ckpt = load_checkpoint(self.path)
        meta = metadata(self.ckpt, self.path)
        if names:
            require_task(meta, self.path, names, need)
        self.config: DictConfig = OmegaConf.create(meta["config"])
        # a run saved before attnlab's packages took their layers (issue 58) names its classes
        # where they were, and one saved before the hyper-parameters got one vocabulary (issue 28)
        # names those the old way; its weights are named as now, so the translated config builds
        # the same model
        read_as = translate_moved(self.config)
        if self.config.get("data") is not None:  # its source as flat keys (before issue 58)
            read_as += translate_flat(self.config.data)
        # the saved config is input, not code: nothing in it is built unless attnlab allows it
        check_targets(self.config, str(self.path))
        if self.config.get("model") is not None:  # one optimisation spec since issue 58
            read_as += translate_moved_keys(self.config.model)
        for part in ("model", "data"):  # the data keys got the model's vocabulary in issue 58
            if self.config.get(part) is not None:
                read_as += translate_renamed(self.config[part], part)
        if read_as:
            log.warning("%s was saved by an older attnlab, read as: %s", self.path, ", ".join(read_as))
        self.artifacts: dict[str, Any] = meta["artifacts"]
        self.meta = meta

    @classmethod
    def for_cli(cls, cfg: Any, task: type, need: str) -> TrainedRun:
        """The run an inference CLI's ``ckpt_path`` names (``last``: its task's newest under
        ``paths.log_dir``), refused with ``need`` if it trained another task."""
        return cls(str(cfg.ckpt_path), Path(cfg.paths.log_dir), (task,), need)

    @property
    def tokenizer(self) -> CharTokenizer | BPETokenizer | SubwordTokenizer:
        if "tokenizer" not in self.artifacts:
            raise CheckpointError(f"checkpoint {self.path} holds no tokenizer (not a text model)")
        return tokenizer_from_json(self.artifacts["tokenizer"])

    def net(self) -> nn.Module:
        """The bare model (``model.net``) with the checkpoint's weights."""
        net = instantiate(self.config.model.net)
        state = {
            k.removeprefix("net."): v for k, v in self.ckpt["state_dict"].items() if k.startswith("net.")
        }
        check_fits(net, state, self.path)
        net.load_state_dict(state)
        return net.eval()

    def task(self) -> Any:
        """The LightningModule with the checkpoint's weights (without what only training needs:
        a distillation teacher, the pre-trained weights it started from)."""
        model_cfg = self.config.model.copy()
        for training_only in ("distillation", "init_from"):
            if model_cfg.get(training_only) is not None:
                model_cfg[training_only] = None
        task = instantiate(model_cfg)
        check_fits(task, self.ckpt["state_dict"], self.path)
        task.load_state_dict(self.ckpt["state_dict"])
        return task
