"""The constrained types of constructor signatures, the specs configs are checked against (pydantic,
before torch loads); a rule tying two values is a ``ValueError("arg: ...")`` in the constructor."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any, NotRequired

from annotated_types import Ge, Gt, Interval
from typing_extensions import TypedDict  # pydantic reads typing's only from Python 3.12

PositiveInt = Annotated[int, Gt(0)]
NonNegativeInt = Annotated[int, Ge(0)]
PositiveFloat = Annotated[float, Gt(0)]
NonNegativeFloat = Annotated[float, Ge(0)]
Probability = Annotated[float, Interval(ge=0, le=1)]
DropRate = Annotated[float, Interval(ge=0, lt=1)]  # dropout: 1 would zero every activation


class LoRA(TypedDict, closed=True):
    """``model.lora`` (``attnlab.weights.lora``): adapters of rank ``r`` scaled by ``alpha / r``
    (``alpha``: ``r`` unless set), ``dropout`` on their input, on the layers ``targets`` names."""

    r: PositiveInt
    alpha: NotRequired[PositiveFloat]
    dropout: NotRequired[DropRate]
    targets: list[str]


class Start(TypedDict, total=False):
    """What every task may start from (``attnlab.training.base.Task``): ``init_from``'s weights
    (``attnlab.weights.init.load_init``), with ``lora`` adapters on them."""

    init_from: str | dict[str, str] | None
    lora: LoRA | None


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
