"""Hypothesis strategies for attention modules' inputs and constructor arguments (docs/twins.md).

Everything shrinks toward the smallest problem (one row, one token, no padding, position 0, no
history); floats are drawn by seed (:func:`torchparity.random_tensor`, the same on every
machine), so shrinking moves shapes and seeds, not thousands of floats. Needs ``hypothesis``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from torchparity import strategies as tps
from torchparity.dtypes import dtype_name
from torchparity.subject.weights import random_tensor
from torchparity.twins.running import Steps

#: Mask conventions, each a tensor built from which keys a query may see:
#: ``key-padding`` (batch, keys), 1 for a real token and 0 for padding (Hugging Face's
#: ``attention_mask``); ``bool-attend`` (batch, 1, queries, keys), True where a query may
#: attend (SDPA's); ``bool-masked`` the same inverted (``nn.MultiheadAttention``'s);
#: ``additive`` the same as a float bias, 0 or :data:`MASKED`; ``causal`` no mask
#: tensor (the module is causal by itself); ``none`` neither padding nor mask.
MASKS = ("none", "causal", "key-padding", "bool-attend", "bool-masked", "additive")
PADDINGS = tps.PADDINGS
#: The additive mask's value at a masked key: fp16's lowest, which every floating dtype holds
#: (float32's would become -inf in bf16 and fp16, and a fully masked row NaN).
MASKED = torch.finfo(torch.float16).min
#: The argument names of :func:`attention_inputs`'s tensors, by role.
NAMES = {"hidden": "hidden_states", "mask": "attention_mask", "positions": "position_ids"}

Range = tuple[int, int] | Sequence[object] | SearchStrategy | Callable[[dict], object]


@dataclass
class TwinInputs:
    """One drawn example: the inputs, and its query positions that are padding (True), or None."""

    inputs: tuple | dict | Steps
    padding: torch.Tensor | None = None


def _strategy(value: Range, drawn: dict) -> SearchStrategy:
    if isinstance(value, SearchStrategy):
        return value
    if callable(value):
        return _strategy(value(drawn), drawn)
    if isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return st.integers(*value)
    if isinstance(value, Sequence) and not isinstance(value, str):
        return st.sampled_from(list(value))
    return st.just(value)


@st.composite
def constructor_args(draw: st.DrawFn, **ranges: Range) -> dict[str, object]:
    """A module's constructor keyword arguments, drawn in the order given.

    Each range is ``(lo, hi)`` integers, a list to choose from (the first simplest), a strategy,
    a plain value, or a function of those drawn so far (``n_kv_heads=lambda a:
    divisors(a["n_heads"])``).
    """
    drawn: dict[str, object] = {}
    for name, value in ranges.items():
        drawn[name] = draw(_strategy(value, drawn), label=name)
    return drawn


def divisors(n: int) -> list[int]:
    """The divisors of ``n``, smallest first: the key/value head counts GQA allows."""
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def hidden_states(draw: st.DrawFn, d_model: int, *, batch: Range = (1, 3),
                  seq: Range = (1, 8)) -> torch.Tensor:
    """A float32 (batch, seq, d_model) tensor of unit-variance values."""
    shape = (draw(_strategy(batch, {})), draw(_strategy(seq, {})), d_model)
    return random_tensor(shape, draw(st.integers(0, 2**16), label="seed"))


def mask_in(convention: str, allow: torch.Tensor, real: torch.Tensor) -> torch.Tensor | None:
    """The ``convention`` mask of ``allow`` (batch, 1, q, k) and real keys ``real`` (batch, k)."""
    if convention in ("none", "causal"):
        return None
    if convention == "key-padding":
        return real.long()
    if convention == "bool-attend":
        return allow
    if convention == "bool-masked":
        return ~allow
    if convention == "additive":
        return torch.zeros(allow.shape).masked_fill(~allow, MASKED)
    raise ValueError(f"unknown mask convention {convention!r}; use one of {', '.join(MASKS)}")


def causal(q_len: int, k_len: int) -> torch.Tensor:
    """(q, k) bool: query i (the last q of k positions) sees keys up to its own position."""
    return torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)


@st.composite
def attention_inputs(draw: st.DrawFn, d_model: int, *, batch: Range = (1, 3),
                     seq: Range = (1, 8), mask: str | Sequence[str] = "key-padding",
                     padding: str | Sequence[str] = PADDINGS,
                     positions: tuple[int, int] | None = None,
                     names: Mapping[str, str] = NAMES) -> TwinInputs:
    """Keyword inputs of a causal self-attention: hidden states, a mask, maybe position ids.

    Args:
        draw: hypothesis' draw (given by ``@st.composite``).
        d_model: the width of the hidden states.
        batch: the rows drawn from.
        seq: the sequence lengths drawn from.
        mask: the mask convention, or several drawn from (:data:`MASKS`).
        padding: the padding side, or several drawn from; every row its own length, a row possibly
            all padding.
        positions: the range of the position ids' offset (a model continuing a long text); None:
            no position ids.
        names: the arguments' names by role (hidden, mask, positions), renaming :data:`NAMES`.
    """
    names = {**NAMES, **names}
    convention = draw(_strategy(mask if isinstance(mask, str) else list(mask), {}))
    side = "none" if convention in ("none", "causal") else draw(_strategy(
        padding if isinstance(padding, str) else list(padding), {}))
    hidden = draw(hidden_states(d_model, batch=batch, seq=seq))
    rows, length = hidden.shape[:2]
    shortest = length if side == "none" else 0
    lengths = [draw(st.integers(shortest, length), label="real tokens") for _ in range(rows)]
    _, real = tps.pad_rows([[1] * n for n in lengths], side, length)
    real = torch.ones(rows, length, dtype=torch.bool) if real is None else real.bool()
    allow = causal(length, length)[None, None] & real[:, None, None, :]
    inputs: dict[str, object] = {names["hidden"]: hidden}
    if (tensor := mask_in(convention, allow, real)) is not None:
        inputs[names["mask"]] = tensor
    if positions is not None:
        offset = draw(st.integers(*positions), label="position offset")
        inputs[names["positions"]] = offset + (real.long().cumsum(-1) - 1).clamp(min=0)
    return TwinInputs(inputs, padding=None if side == "none" else ~real)


@st.composite
def decoding_inputs(draw: st.DrawFn, d_model: int, *, batch: Range = (1, 2),
                    history: Range = (1, 8), chunks: Range = (1, 3), chunk: Range = (1, 4),
                    name: str = NAMES["hidden"]) -> TwinInputs:
    """Steps of a decoding twin: a prompt of ``history`` positions, then ``chunks`` of ``chunk``.

    Queries are causal with an offset: each sees the whole history.
    """
    rows = draw(_strategy(batch, {}))
    sizes = [draw(_strategy(history, {}), label="history")]
    sizes += [draw(_strategy(chunk, {}), label="chunk")
              for _ in range(draw(_strategy(chunks, {}), label="chunks"))]
    seed = draw(st.integers(0, 2**16), label="seed")
    hidden = random_tensor((rows, sum(sizes), d_model), seed)
    return TwinInputs(Steps({name: part} for part in hidden.split(sizes, dim=1)))


def dtypes(device: str | torch.device = "cpu",
           candidates: Sequence[str] = ("fp32", "bf16", "fp16")) -> SearchStrategy[str]:
    """The names of the ``candidates`` that compute on ``device`` (fp32 first)."""
    from torchparity.dtypes import torch_dtype

    runs = tps.dtypes(device, [torch_dtype(name) for name in candidates])
    return runs.map(dtype_name)


def backends(device: str | torch.device = "cpu", dtype: str = "fp32") -> SearchStrategy[str]:
    """The attention backends that run on ``device`` in ``dtype`` ("manual" first)."""
    from torchparity.dtypes import torch_dtype

    return tps.attention_backends(device, torch_dtype(dtype))
