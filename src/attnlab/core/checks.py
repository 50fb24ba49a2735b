"""Range checks of constructor arguments, raising one ``ConfigError`` that names the config key.

Types are checked before anything is built (``attnlab.core.config.check_types``); these check
the ranges a type cannot say.
"""

from __future__ import annotations

from typing import Any

from attnlab.core.errors import ConfigError


def is_int(value: Any) -> bool:
    """An integer, not a bool (a config's ``true``/``false`` parse as bools, which are ints)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or a float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_positive(where: str, **values: Any) -> None:
    """Each value must be an integer > 0; ``where`` is the config node, e.g. "model.net"."""
    for name, value in values.items():
        if not is_int(value) or value <= 0:
            raise ConfigError(f"{where}.{name} must be a positive integer, got {value!r}")


def check_positive_number(where: str, **values: Any) -> None:
    """Each value must be a number > 0 (ratios such as ``mlp_ratio``)."""
    for name, value in values.items():
        if not is_number(value) or not value > 0:
            raise ConfigError(f"{where}.{name} must be a number > 0, got {value!r}")


def check_num_classes(num_classes: Any) -> None:
    """``model.net.num_classes`` must be an integer >= 0 (0: a headless net, its features out)."""
    if not is_int(num_classes) or num_classes < 0:
        raise ConfigError(f"model.net.num_classes must be >= 0 (0: no head), got {num_classes!r}")


def check_probability(where: str, **values: Any) -> None:
    """Each value must be in [0, 1) (dropout rates, label smoothing)."""
    for name, value in values.items():
        if not is_number(value) or not 0.0 <= value < 1.0:
            raise ConfigError(f"{where}.{name} must be in [0, 1), got {value!r}")


def check_choice(where: str, name: str, value: Any, choices: tuple[Any, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{where}.{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
