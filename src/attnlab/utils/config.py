"""Printing, saving and checking the composed Hydra config."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import rich
import rich.syntax
import rich.tree
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf, open_dict

from attnlab.errors import ConfigError

log = logging.getLogger(__name__)

PRINT_ORDER = ("data", "model", "callbacks", "logger", "trainer", "paths", "extras")


@rank_zero_only
def print_config_tree(cfg: DictConfig) -> None:
    """Print the resolved config as a rich tree, main groups first."""
    tree = rich.tree.Tree("CONFIG", style="dim", guide_style="dim")
    keys = [k for k in PRINT_ORDER if k in cfg] + [k for k in cfg if k not in PRINT_ORDER]
    for key in keys:
        branch = tree.add(str(key), style="bold")
        value = cfg[key]
        text = OmegaConf.to_yaml(value, resolve=True) if isinstance(value, DictConfig) else str(value)
        branch.add(rich.syntax.Syntax(text, "yaml"))
    rich.print(tree)


@rank_zero_only
def save_config(cfg: DictConfig, path: Path) -> None:
    """The resolved config as YAML (Hydra's ``.hydra/config.yaml`` keeps the unresolved one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(OmegaConf.to_yaml(cfg, resolve=True))


def resolve(cfg: DictConfig) -> None:
    """Resolve every interpolation now, naming the key that fails."""
    try:
        OmegaConf.resolve(cfg)
    except Exception as e:  # omegaconf raises several types, all with the key in the message
        raise ConfigError(f"config cannot be resolved: {e}") from e


def fill_missing(node: DictConfig, values: Mapping[str, Any], where: str) -> None:
    """Set the ``???`` fields of ``node`` from ``values`` (e.g. the data's vocab_size)."""
    with open_dict(node):
        for key, value in values.items():
            if key not in node.keys():
                continue
            if OmegaConf.is_missing(node, key):
                node[key] = value
                log.info("%s.%s = %s (from the data)", where, key, value)
            elif node[key] is not None and node[key] < value:
                raise ConfigError(f"{where}.{key}={node[key]} is smaller than the data's {key} {value}")


def container(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


def check_config(cfg: DictConfig) -> None:
    """Check every value's type against the constructor it is passed to (see ``check_types``)."""
