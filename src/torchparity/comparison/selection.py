"""Which elements of a tensor are judged: positions of its leading dimensions can be left out
(padding, arbitrary where a padded query attends to nothing), and reports say how many."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LeftOut:
    """Positions of a tensor's leading dimensions not judged (``mask``, True where left out), and
    why (``reason``)."""

    mask: torch.Tensor
    reason: str

    @property
    def positions(self) -> int:
        """How many positions are left out."""
        return int(self.mask.sum())

    @property
    def total(self) -> int:
        """How many positions the mask covers."""
        return self.mask.numel()

    def keep(self, shape: torch.Size | tuple[int, ...], device: torch.device | str = "cpu"
             ) -> torch.Tensor:
        """A bool tensor of ``shape``, True at every element that is judged."""
        kept = ~self.mask.to(device)
        return kept.reshape(*kept.shape, *(1,) * (len(shape) - kept.dim())).expand(shape)

    def judged(self, tensor: torch.Tensor) -> torch.Tensor:
        """The judged elements of ``tensor``, (judged positions, *trailing dimensions): a
        selection, so what is left out (NaN included) cannot reach a sum or its gradient."""
        return tensor[~self.mask.to(tensor.device)]


#: What :func:`~torchparity.comparison.compare` takes as ``padding``: a bool mask (True = left
#: out) applied to every tensor whose leading dimensions it covers, or a function of each
#: tensor's path and golden giving its :class:`LeftOut` (None: judge every element).
PaddingSpec = torch.Tensor | Callable[[str, torch.Tensor], "LeftOut | None"] | None

GIVEN = "padding per the mask given"


def left_out_of(padding: PaddingSpec, path: str, tensor: torch.Tensor) -> LeftOut | None:
    """What ``padding`` leaves out of the tensor at ``path`` (None: nothing); ``ValueError`` for
    a mask that is not bool or does not cover the leading dimensions."""
    if padding is None:
        return None
    if isinstance(padding, torch.Tensor):
        if padding.dtype != torch.bool:
            raise ValueError(f"padding must be a bool tensor, True at padded positions; got "
                             f"{padding.dtype} (from a 1/0 attention_mask, pass "
                             "attention_mask == 0)")
        covers = tensor.dim() >= padding.dim() > 0 and \
            tuple(tensor.shape[:padding.dim()]) == tuple(padding.shape)
        left_out = LeftOut(padding, GIVEN) if covers else None
    else:
        left_out = padding(path, tensor)
    if left_out is None or not bool(left_out.mask.any()):
        return None
    mask = left_out.mask
    if mask.dtype != torch.bool or tuple(tensor.shape[:mask.dim()]) != tuple(mask.shape):
        raise ValueError(f"{path}: the padding mask ({mask.dtype}, shape {tuple(mask.shape)}) "
                         f"must be bool and cover the leading dimensions of the tensor "
                         f"(shape {tuple(tensor.shape)})")
    return left_out


def sentence(left_out: list[tuple[str, int, int, str | None]]) -> str:
    """What was left out, for ``Comparison.explain``: per reason, the positions left out of those
    covered and in how many tensors (``left_out``: (path, left out, covered, reason))."""
    by_reason: dict[str | None, set[tuple[int, int]]] = {}
    tensors: dict[str | None, int] = {}
    for _, n, total, reason in left_out:
        by_reason.setdefault(reason, set()).add((n, total))
        tensors[reason] = tensors.get(reason, 0) + 1
    parts = [f"{', '.join(f'{n} of {total}' for n, total in sorted(counts))} positions of "
             f"{tensors[reason]} tensor(s), {reason or 'padding'}"
             for reason, counts in by_reason.items()]
    return f"Left out of the judgement: {'; '.join(parts)}."
