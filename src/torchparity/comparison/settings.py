"""What judging one tensor takes besides the tensors, as one frozen object passed down whole.

:func:`~torchparity.comparison.compare` makes one :class:`Settings` from its arguments, and per
tensor a copy with what the tensors judged with it showed (their group's scale and noise, the
rounding a residue handed on); :func:`~torchparity.comparison.tensor.compare_tensor` and
:func:`~torchparity.comparison.sketch.compare_sketch` read it, and hand it to the tolerance
model's budget. A new setting is one field here.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchparity.tolerance import DtypeLike


@dataclass(frozen=True)
class Settings:
    """The settings of one comparison (see :func:`~torchparity.comparison.compare` for each)
    and, per tensor, what its group showed."""

    kind: str = "forward"
    compute_dtype: DtypeLike | None = None  # None: the candidate tensor's own dtype
    reduction_length: int | None = None  # None: the tensor's last dimension
    step: int | None = None
    equal_nan: bool = False
    atol: float = 0.0
    rtol: float = 0.0
    islands: DtypeLike | None = None
    #: Per tensor, from the tensors judged with it (:mod:`~torchparity.comparison.groups`).
    group_scale: float | None = None
    group_noise: float | None = None
    inherited: float = 0.0
