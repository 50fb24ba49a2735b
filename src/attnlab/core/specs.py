"""The constrained types constructor signatures use, so that a signature is the spec its config is
checked against (``attnlab.core.config.check_config``, with pydantic, before torch loads).

A constraint on one value lives in the annotation (``dim: PositiveInt``); a rule that ties two
values together (``dim`` divisible by ``n_head``) is a plain ``ValueError`` in the constructor whose
message starts with the argument's name (``"dim: must be divisible by n_head (6), got 100"``), which
the entry points prefix with the node's full key (``model.net.image.dim: ...``)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

from annotated_types import Ge, Gt, Interval

PositiveInt = Annotated[int, Gt(0)]
NonNegativeInt = Annotated[int, Ge(0)]
PositiveFloat = Annotated[float, Gt(0)]
NonNegativeFloat = Annotated[float, Ge(0)]
Probability = Annotated[float, Interval(ge=0, le=1)]
DropRate = Annotated[float, Interval(ge=0, lt=1)]  # dropout: 1 would zero every activation


@contextmanager
def nested(name: str) -> Iterator[None]:
    """Name a sub-net's refusal by its argument: ``with nested("lm"): self.lm = lm(...)`` turns a
    ``ValueError`` ``"dim: ..."`` raised inside into ``"lm.dim: ..."`` (``model.net.lm.dim``)."""
    try:
        yield
    except ValueError as e:
        if type(e) is not ValueError:  # a ConfigError, or some other subclass: as raised
            raise
        message = str(e)
        named = re.fullmatch(r"\w+(\.\w+|\[\d+\])*", message.partition(": ")[0])
        raise ValueError(f"{name}.{message}" if named else f"{name}: {message}") from e


def is_int(value: Any) -> bool:
    """An integer, not a bool (a config's ``true``/``false`` parse as bools, which are ints)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or a float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
