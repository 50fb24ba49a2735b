"""Keep W&B from ever prompting: offline unless an API key is configured."""

from __future__ import annotations

import logging
import netrc
import os
from urllib.parse import urlparse

log = logging.getLogger(__name__)


def has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    path = os.environ.get("NETRC", os.path.expanduser("~/.netrc"))
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def ensure_wandb_mode() -> str:
    """Set ``WANDB_MODE=offline`` when it is unset and no key is configured (wandb would wait at its
    login prompt forever); return the mode."""
    if "WANDB_MODE" not in os.environ and not has_api_key():
        os.environ["WANDB_MODE"] = "offline"
        log.info("W&B: no API key configured, logging offline (upload later with `wandb sync`)")
    return os.environ.get("WANDB_MODE", "online")
