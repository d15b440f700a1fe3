"""Attention masks compared by what they mean, not by their bits: an additive float mask, a
boolean "attend" one (SDPA) or a boolean "masked" one differ only where a judged (unpadded)
query attends to other keys."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchparity.comparison.selection import PaddingSpec, left_out_of

#: Additive masks block a key with a value at most this (``-inf``, ``finfo.min``, ``-1e9``,
#: BERT's ``-10000``); softmax gives it a weight below exp(-10000) of a key that is attended.
LARGE_NEGATIVE = -1e4


@dataclass(frozen=True)
class Meaning:
    """Two masks compared by meaning: how they differ, None when every judged query sees alike."""

    detail: str | None

    @property
    def same(self) -> bool:
        return self.detail is None


def readings(mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The ways ``mask`` reads as a bool "attends" tensor (bool either way, additive float, 1/0
    integer); empty for anything else (an ALiBi bias is no mask)."""
    if mask.dtype == torch.bool:
        return {"boolean attend": mask, "boolean masked": ~mask}
    if mask.is_floating_point():
        attends = mask == 0
        return {"additive float": attends} if bool((attends | (mask <= LARGE_NEGATIVE)).all()) \
            else {}
    if mask.is_complex():
        return {}
    attends = mask == 1
    return {"1/0 attend": attends} if bool((attends | (mask == 0)).all()) else {}


def mask_forms(dtype: torch.dtype) -> tuple[str, ...]:
    """The forms a mask of ``dtype`` may take (the names :func:`readings` gives)."""
    if dtype == torch.bool:
        return ("boolean attend", "boolean masked")
    return ("additive float",) if dtype.is_floating_point else ("1/0 attend",)


def in_form(mask: torch.Tensor, reading: str, form: str, dtype: torch.dtype) -> torch.Tensor:
    """``mask`` read as ``reading`` and written in ``form`` in ``dtype``: the same keys attended."""
    attends = readings(mask)[reading]
    if form == "boolean attend":
        return attends
    if form == "boolean masked":
        return ~attends
    if form == "additive float":
        zeros = torch.zeros(attends.shape, dtype=dtype, device=attends.device)
        return zeros.masked_fill(~attends, torch.finfo(dtype).min)
    return attends.to(dtype)


def by_meaning(a: torch.Tensor, b: torch.Tensor, padding: PaddingSpec = None,
               path: str = "mask") -> Meaning | None:
    """A's and B's masks compared by what they let each judged query attend to; None when one is
    no mask or their shapes do not broadcast.

    Keys are the last dimension, queries the one before, batch the first; ``padding`` rows are
    not compared. Two bool masks keep one convention; across forms the best-agreeing readings
    are compared, so an inverted form is no difference but one flipped entry is."""
    a_readings, b_readings = readings(a), readings(b.to(a.device))
    if not a_readings or not b_readings:
        return None
    try:
        shape = torch.broadcast_shapes(a.shape, b.shape)
    except RuntimeError:
        return None
    judged = _judged(shape, padding, path, a.device)
    if judged is not None:
        shape = torch.broadcast_shapes(shape, judged.shape)
    compared = int(judged.expand(shape).sum()) if judged is not None else shape.numel()
    best: tuple[int, str, str] | None = None
    for a_form, a_attends in a_readings.items():
        for b_form, b_attends in b_readings.items():
            if a.dtype == b.dtype == torch.bool and a_form != b_form:
                continue
            differ = a_attends.expand(shape) != b_attends.expand(shape)
            n = int((differ & judged).sum()) if judged is not None else int(differ.sum())
            if best is None or n < best[0]:
                best = (n, a_form, b_form)
    n, a_form, b_form = best
    if n == 0:
        return Meaning(None)
    what = "(query, key) pairs of judged queries" if len(shape) >= 3 else "entries"
    return Meaning(f"{n} of {compared} {what} attend otherwise (A: {a_form} mask, B: {b_form}"
                   " mask)")


def _judged(shape: torch.Size, padding: PaddingSpec, path: str, device: torch.device
            ) -> torch.Tensor | None:
    """Bool over (batch, ..., queries, keys), True on judged queries' rows; None when all are."""
    if len(shape) < 3:
        return None
    rows = torch.empty((shape[0], shape[-2]), device="meta")
    left_out = left_out_of(padding, path, rows)
    if left_out is None:
        return None
    kept = ~left_out.mask.to(device)
    return kept.reshape(shape[0], *(1,) * (len(shape) - 3), shape[-2], 1)


def fitted_queries(mask: torch.Tensor, positions: torch.Tensor | None, queries: int
                   ) -> tuple[torch.Tensor, str] | None:
    """``mask``'s rows of the ``queries`` at ``positions``, and how; None when impossible (a static
    cache's mask over every cache position, rows picked by ``cache_position``)."""
    if positions is None or mask.dim() < 3 or positions.dim() != 1 or \
            positions.numel() != queries or positions.dtype.is_floating_point or \
            not readings(mask):
        return None
    rows = mask.shape[-2]
    if not bool(((positions >= 0) & (positions < rows)).all()):
        return None
    picked = mask.index_select(-2, positions.to(mask.device))
    first, last = int(positions[0]), int(positions[-1])
    return picked, (f"rows of queries {first}..{last} of {rows} picked by cache_position, "
                    "as A's attention picks them")


def fitted_keys(mask: torch.Tensor, keys: int) -> tuple[torch.Tensor, str] | None:
    """``mask`` made ``keys`` long without changing what any query attends, and how; None when
    impossible (a static cache's 128 keys against the 12 in use). Keys past ``keys`` are dropped
    only when unattended, missing ones added masked; bool reads "True: attend", floats additive."""
    forms = readings(mask)
    if not forms or mask.dim() == 0:
        return None
    have = mask.shape[-1]
    if keys < have:
        extra = next(iter(forms.values()))[..., keys:]
        if bool(extra.any()):
            return None
        return mask[..., :keys], (f"trimmed from {have} to {keys} keys: the "
                                  f"{have - keys} others are masked for every query")
    blocked = (False if mask.dtype == torch.bool else
               torch.finfo(mask.dtype).min if mask.is_floating_point() else 0)
    padding = mask.new_full((*mask.shape[:-1], keys - have), blocked)
    return torch.cat((mask, padding), -1), (f"padded from {have} to {keys} keys: the "
                                            f"{keys - have} added are masked for every query")
