"""The constrained types constructor signatures use, so that a signature is the spec its config is
checked against (``attnlab.core.config.check_config``, with pydantic, before torch loads).

A constraint on one value lives in the annotation (``dim: PositiveInt``); a rule that ties two
values together (``dim`` divisible by ``n_head``) is a plain ``ValueError`` in the constructor whose
message starts with the argument's name (``"dim: must be divisible by n_head (6), got 100"``), which
the entry points prefix with the node's full key (``model.net.image.dim: ...``)."""

from __future__ import annotations

from typing import Annotated

from annotated_types import Ge, Gt, Interval

PositiveInt = Annotated[int, Gt(0)]
NonNegativeInt = Annotated[int, Ge(0)]
PositiveFloat = Annotated[float, Gt(0)]
NonNegativeFloat = Annotated[float, Ge(0)]
Probability = Annotated[float, Interval(ge=0, le=1)]
DropRate = Annotated[float, Interval(ge=0, lt=1)]  # dropout: 1 would zero every activation
