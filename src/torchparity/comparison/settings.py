"""What judging one tensor takes besides the tensors, as one frozen object passed down whole:
``compare`` makes one, and per tensor a copy with what its group showed (scale, noise, a
residue's rounding); ``compare_tensor`` and ``compare_sketch`` read it. A new setting is one
field here."""

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
