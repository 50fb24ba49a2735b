"""Rebuilding a trained run (model, data artifacts, data config) from its checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn

from attnlab.core.errors import CheckpointError
from attnlab.core.legacy import read_saved
from attnlab.core.run_paths import LAST_OF_ANY_RUN, resolve_ckpt_path
from attnlab.core.targets import check_targets
from attnlab.data.text.tokenizers import BPETokenizer, CharTokenizer, SubwordTokenizer, tokenizer_from_json
from attnlab.weights.checkpoint import check_fits, load_checkpoint, metadata, require_task
from attnlab.weights.lora import add_adapters, remove_adapters


class TrainedRun:
    """A checkpoint with the config and the data artifacts (e.g. tokenizer) it was trained with."""

    def __init__(self, spec: str, log_dir: Path, tasks: tuple[type, ...] = (), need: str = "") -> None:
        """``spec``: a checkpoint, or ``last``: the newest run under ``log_dir`` (of one of ``tasks``,
        when given; a checkpoint of another task is refused in one line saying ``need``)."""
        names = tuple(t.__name__ for t in tasks)
        self.path = resolve_ckpt_path(spec, log_dir, LAST_OF_ANY_RUN, names)
        self.ckpt = load_checkpoint(self.path)
        meta = metadata(self.ckpt, self.path)
        if names:
            require_task(meta, self.path, names, need)
        self.config: DictConfig = read_saved(meta["config"], str(self.path))  # old names read as now
        # the saved config is input, not code: nothing in it is built unless attnlab allows it
        check_targets(self.config, str(self.path))
        self.artifacts: dict[str, Any] = meta["artifacts"]
        self.meta = meta

    @classmethod
    def for_cli(cls, cfg: Any, task: type, need: str) -> TrainedRun:
        """The run an inference CLI's ``ckpt_path`` names, refused with ``need`` if of another task."""
        return cls(str(cfg.ckpt_path), Path(cfg.paths.log_dir), (task,), need)

    @property
    def tokenizer(self) -> CharTokenizer | BPETokenizer | SubwordTokenizer:
        if "tokenizer" not in self.artifacts:
            raise CheckpointError(f"checkpoint {self.path} holds no tokenizer (not a text model)")
        return tokenizer_from_json(self.artifacts["tokenizer"])

    def net(self, merge: bool = True) -> nn.Module:
        """The bare model (``model.net``) with the checkpoint's weights; a LoRA run's adapters
        merged into them (``merge=False``: kept)."""
        net = instantiate(self.config.model.net)
        if lora := self.config.model.get("lora"):
            add_adapters(net, lora)
        state = {
            k.removeprefix("net."): v for k, v in self.ckpt["state_dict"].items() if k.startswith("net.")
        }
        check_fits(net, state, self.path)
        net.load_state_dict(state)
        if lora and merge:
            remove_adapters(net, merge=True)
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
