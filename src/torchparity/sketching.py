"""Sketches: tensors too big to keep, summarised so that the tolerance model can still judge them.

A :class:`Sketch` holds a CountSketch *projection* of k coordinates (each element added, with a
sign, to one of k buckets drawn from a stream seeded by the tensor's name: linear, so the
projection of an error is the difference of two, its squared norm an unbiased estimate, relative
standard deviation at most sqrt(2 / k)); exact RMS, absmax, mean and non-finite count; and exact
*slices*, the first elements of the first and last row, judged by the ordinary max-abs rule.
Buckets come from numpy's PCG64 through ``SeedSequence`` (stable across versions), in fixed
chunks, sums in float64: a sketch made on one machine compares with one made on another.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from torchparity import tolerance
from torchparity.memory import memory_key, version

#: Environment variable overriding :attr:`SketchTolerance.min_elements` (a number of
#: elements): floating tensors with at least this many elements are sketched.
SKETCH_ABOVE_ENV = "TORCHPARITY_SKETCH_ABOVE"
#: Elements per chunk of the random stream (part of the format: changing it changes sketches).
CHUNK = 1 << 22
#: Version of the bucket and sign stream; recorded in goldens beside each sketch.
METHOD = "countsketch-pcg64/1"
#: Bytes of bucket streams kept for reuse (:class:`_Streams`).
STREAM_CACHE_BYTES = 128 << 20
#: Streams remembered as drawn once (their keys only), so that a second draw keeps its stream.
DRAWN_KEYS = 4096
#: Sketches kept for reuse by the memory their tensor reads (:class:`_Made`).
SKETCH_CACHE_ENTRIES = 64


@dataclass(frozen=True, eq=False)
class Sketch:
    """A tensor of ``shape`` and ``dtype`` kept as its projection, statistics and exact slices."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    seed: int
    projection: torch.Tensor
    slices: torch.Tensor
    rms: float
    absmax: float
    mean: float
    nonfinite: int = 0

    @property
    def size(self) -> int:
        """k, the coordinates of the projection."""
        return self.projection.numel()

    def numel(self) -> int:
        """The elements of the tensor sketched, as ``Tensor.numel`` counts them."""
        return math.prod(self.shape)

    def dim(self) -> int:
        """The dimensions of the tensor sketched, as ``Tensor.dim`` counts them."""
        return len(self.shape)

    # projection: float64, the same linear function of the values for every sketch of one seed and
    # size; rms, absmax and mean exact over the finite elements (nonfinite counts the others, which
    # the projection leaves out)
    def is_floating_point(self) -> bool:
        """Always: only floating tensors are sketched."""
        return True

    def cpu(self) -> Sketch:
        """The sketch itself (sketches live on the CPU): code moving a tensor there takes one."""
        return self

    @property
    def std(self) -> float:
        """Standard deviation of the finite elements."""
        return math.sqrt(max(self.rms**2 - self.mean**2, 0.0))

    def slice_index(self, position: int) -> tuple[int, ...]:
        """The index in the tensor of element ``position`` of :attr:`slices` (the worst's)."""
        for start, length in slice_ranges(self.shape):
            if position < length:
                return tuple(int(j) for j in np.unravel_index(start + position, self.shape))
            position -= length
        raise IndexError(f"a sketch of shape {self.shape} has no slice element {position}")

    def same_values(self, other: Sketch) -> bool:
        """Whether two sketches are bit-equal: all they tell of two tensors being bit-identical."""
        return (self.dtype == other.dtype and self.shape == other.shape
                and self.seed == other.seed and torch.equal(self.projection, other.projection)
                and _bits_equal(self.slices, other.slices)
                and (self.rms, self.absmax, self.mean, self.nonfinite)
                == (other.rms, other.absmax, other.mean, other.nonfinite))

    def __repr__(self) -> str:
        shape = ", ".join(map(str, self.shape))
        return f"Sketch({shape}) {str(self.dtype).removeprefix('torch.')} k={self.size}"


def threshold() -> int:
    """Elements from which floating tensors are sketched: ``$TORCHPARITY_SKETCH_ABOVE`` or default.

    Raises:
        UsageError: the variable is not an integer.
    """
    value = os.environ.get(SKETCH_ABOVE_ENV)
    if not value:
        return tolerance.SKETCH.min_elements
    try:
        return max(1, int(value))
    except ValueError:
        from torchparity.errors import UsageError

        raise UsageError(f"${SKETCH_ABOVE_ENV}={value!r} is not a number of elements; set it to "
                         f"an integer such as {tolerance.SKETCH.min_elements}") from None


def wants_sketch(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is kept as a sketch: floating, at least :func:`threshold` elements."""
    return tensor.is_floating_point() and tensor.numel() >= threshold()


def kept(name: str, tensor: torch.Tensor, left_out: torch.Tensor | None = None
         ) -> torch.Tensor | Sketch:
    """``tensor`` as a run keeps it: a sketch (seeded by ``name``) when big, else a CPU copy."""
    if wants_sketch(tensor):
        return sketch(masked(tensor, left_out), name)
    return tensor.detach().to("cpu", copy=True)


def masked(tensor: torch.Tensor, left_out: torch.Tensor | None) -> torch.Tensor:
    """``tensor`` with its padded positions (``left_out``) 0, adding nothing to its sketch."""
    if left_out is None or not bool(left_out.any()):
        return tensor
    mask = left_out.to(tensor.device)
    return tensor.masked_fill(mask.reshape(*mask.shape, *(1,) * (tensor.dim() - mask.dim())), 0)


def seed_of(name: str) -> int:
    """The 64-bit seed of a tensor's buckets and signs: a pure function of its name."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")


def slice_ranges(shape: tuple[int, ...] | torch.Size) -> list[tuple[int, int]]:
    """``(flat start, length)`` of a sketch's exact slices: the first and last rows' starts."""
    n = math.prod(shape)
    if n == 0:
        return []
    row = shape[-1] if len(shape) else 1
    length = min(row, tolerance.SKETCH.slice_elements)
    starts = [0] if n == row else [0, n - row]
    return [(start, length) for start in starts]


def sketch(tensor: torch.Tensor, name: str | None = None, *, seed: int | None = None,
           size: int | None = None) -> Sketch:
    """The sketch of ``tensor``, remembered while the tensor's memory is unchanged.

    Args:
        tensor: a floating tensor.
        name: its name, which seeds the buckets.
        seed: the buckets' seed, instead of ``name`` (to match another sketch).
        size: the coordinates of the projection (default :attr:`SketchTolerance.size`).

    Raises:
        ValueError: neither ``name`` nor ``seed`` is given, or ``size`` is not a power of two
            up to 16384.
    """
    if seed is None:
        if name is None:
            raise ValueError("sketch() needs the tensor's name or a seed")
        seed = seed_of(name)
    size = size or tolerance.SKETCH.size
    made = _MADE.get(tensor, seed, size)
    if made is None:
        made = _MADE.put(tensor, seed, size, _sketch(tensor, seed, size))
    return made


def _sketch(tensor: torch.Tensor, seed: int, size: int) -> Sketch:
    flat = tensor.detach().reshape(-1)
    chunks = (flat[start:start + CHUNK] for start in range(0, flat.numel(), CHUNK))
    return _sketch_chunks(tuple(tensor.shape), tensor.dtype, chunks, seed, size)


def sketch_chunks(shape: tuple[int, ...], dtype: torch.dtype, chunks: Iterable[torch.Tensor],
                  name: str) -> Sketch:
    """The sketch :func:`sketch` makes, bit for bit, from flat values in chunks of :data:`CHUNK`."""
    # each chunk is made when read, so the tensor is never whole in one place (a gradient sharded
    # over ranks)
    return _sketch_chunks(tuple(shape), dtype, chunks, seed_of(name), tolerance.SKETCH.size)


def _sketch_chunks(shape: tuple[int, ...], dtype: torch.dtype, chunks: Iterable[torch.Tensor],
                   seed: int, size: int) -> Sketch:
    buckets = torch.zeros(2 * size, dtype=torch.float64)
    squares = total = 0.0
    absmax, nonfinite = 0.0, 0
    slices, start = [], 0
    for index, chunk in enumerate(chunks):
        slices += [chunk[max(first - start, 0):first + length - start].to("cpu", copy=True)
                   for first, length in slice_ranges(shape)
                   if first < start + chunk.numel() and first + length > start]
        start += chunk.numel()
        values = chunk.to("cpu", torch.float64)
        chunk_total = values.sum().item()
        if not math.isfinite(chunk_total) and not bool(values.isfinite().all()):
            finite = values.isfinite()
            nonfinite += int((~finite).sum())
            values = chunk = torch.where(finite, values, 0.0)
            chunk_total = values.sum().item()
        # Buckets 0..k-1 add the element, k..2k-1 subtract it: bucket and sign in one draw.
        # scatter_add_ adds in element order, as index_add_ does, at twice its speed.
        buckets.scatter_add_(0, _bucket_stream(seed, index, values.numel(), size), values)
        squares += tolerance.dot(values, values)  # wherever a float64 tensor sits
        total += chunk_total
        if values.numel():  # in the tensor's own dtype: exact, and fewer bytes to read
            low, high = torch.aminmax(chunk)
            absmax = max(absmax, -low.item(), high.item())
    finite = math.prod(shape) - nonfinite
    return Sketch(shape=shape, dtype=dtype, seed=seed,
                  projection=buckets[:size] - buckets[size:],
                  slices=torch.cat(slices) if slices else torch.empty(0, dtype=dtype),
                  rms=math.sqrt(squares / finite) if finite else 0.0, absmax=absmax,
                  mean=total / finite if finite else 0.0, nonfinite=nonfinite)


def _bucket_stream(seed: int, chunk: int, n: int, size: int) -> torch.Tensor:
    """Bucket (with the sign as its high half) of each of ``n`` elements of one chunk."""
    if size & (size - 1) or size > 2**14:
        raise ValueError(f"sketch size must be a power of two up to 16384, got {size}")
    return _STREAMS.get((seed, chunk, n, size))


class _Streams:
    """The bucket streams drawn more than once, the last up to :data:`STREAM_CACHE_BYTES` in all."""

    def __init__(self) -> None:
        # every tensor of one name and size shares its stream (most diagnosis outputs are named
        # output) and drawing one is a fifth of a sketch; a first-drawn stream is not kept: a golden
        # update sketches each name once
        self._kept: OrderedDict[tuple[int, int, int, int], torch.Tensor] = OrderedDict()
        self._drawn: OrderedDict[tuple[int, int, int, int], None] = OrderedDict()
        self._bytes = 0

    def get(self, key: tuple[int, int, int, int]) -> torch.Tensor:
        if key in self._kept:
            self._kept.move_to_end(key)
            return self._kept[key]
        stream = self._draw(*key)
        if key not in self._drawn:
            self._drawn[key] = None
            while len(self._drawn) > DRAWN_KEYS:
                self._drawn.popitem(last=False)
            return stream
        while self._kept and self._bytes + stream.nbytes > STREAM_CACHE_BYTES:
            self._bytes -= self._kept.popitem(last=False)[1].nbytes
        self._kept[key] = stream
        self._bytes += stream.nbytes
        return stream

    @staticmethod
    def _draw(seed: int, chunk: int, n: int, size: int) -> torch.Tensor:
        words = np.random.PCG64(np.random.SeedSequence((seed, chunk))).random_raw(-(-n // 4))
        draws = np.empty(n, dtype=np.int64)  # scatter_add_ takes int64 indices
        np.bitwise_and(words.view(np.uint16)[:n], np.uint16(2 * size - 1), out=draws,
                       casting="unsafe")
        return torch.from_numpy(draws)


_STREAMS = _Streams()


class _Made:
    """The last :data:`SKETCH_CACHE_ENTRIES` sketches by their tensor's memory, while unchanged."""

    def __init__(self) -> None:
        # keyed by storage, offset, shape, strides, dtype and _version: a comparison sketches a
        # baseline twice, and a module's output is often its parent's
        self._kept: OrderedDict[tuple, tuple[StorageWeakRef, int, Sketch]] = OrderedDict()

    def get(self, tensor: torch.Tensor, seed: int, size: int) -> Sketch | None:
        key = memory_key(tensor)
        found = None if key is None else self._kept.get((*key, seed, size))
        if found is None or found[0].expired() or found[1] != version(tensor):
            return None
        return found[2]

    def put(self, tensor: torch.Tensor, seed: int, size: int, made: Sketch) -> Sketch:
        key, changes = memory_key(tensor), version(tensor)
        if key is not None and changes is not None:
            self._kept[(*key, seed, size)] = (StorageWeakRef(tensor.untyped_storage()), changes,
                                              made)
            while len(self._kept) > SKETCH_CACHE_ENTRIES:
                self._kept.popitem(last=False)
        return made


_MADE = _Made()


def like(reference: Sketch, value: torch.Tensor | Sketch) -> Sketch:
    """``value`` (a tensor, sketched now, or a sketch) with ``reference``'s buckets and size.

    Raises:
        ValueError: ``value`` is a sketch made with other buckets: the two cannot be compared.
    """
    if isinstance(value, Sketch):
        if (value.seed, value.size) != (reference.seed, reference.size):
            raise ValueError("sketched with other buckets: the two sketches cannot be compared")
        return value
    return sketch(value, seed=reference.seed, size=reference.size)


def error_estimate(a: Sketch, b: Sketch) -> float:
    """The RMS of ``a - b`` as the projections estimate it (unbiased in the square)."""
    difference = a.projection - b.projection
    return tolerance.rms(difference) * math.sqrt(a.size / max(a.numel(), 1))


def cosine_estimate(a: Sketch, b: Sketch) -> float:
    """The cosine similarity of two tensors as their projections estimate it, in [-1, 1]."""
    norms = torch.linalg.vector_norm(a.projection) * torch.linalg.vector_norm(b.projection)
    if norms == 0:
        return 1.0 if torch.equal(a.projection, b.projection) else 0.0
    return max(-1.0, min(1.0, tolerance.dot(a.projection, b.projection) / norms.item()))


def shifted(golden: torch.Tensor | Sketch, plus: torch.Tensor | Sketch,
            minus: torch.Tensor | Sketch) -> torch.Tensor | Sketch:
    """``golden + (plus - minus)``: the golden moved by the change between two runs."""
    # with a sketch, the result's sketch: projection and slices are linear; the statistics are the
    # golden's, which the shift moves by rounding only
    reference = next((v for v in (golden, plus, minus) if isinstance(v, Sketch)), None)
    if reference is None:
        return golden + (plus - minus)
    golden, plus, minus = (like(reference, v) for v in (golden, plus, minus))
    slices = golden.slices.double() + (plus.slices.double() - minus.slices.double())
    return Sketch(shape=golden.shape, dtype=golden.dtype, seed=golden.seed,
                  projection=golden.projection + (plus.projection - minus.projection),
                  slices=slices.to(golden.dtype), rms=golden.rms, absmax=golden.absmax,
                  mean=golden.mean, nonfinite=golden.nonfinite)


#: The stored tensors of one sketch, by part name (see :func:`parts`).
PARTS = ("sketch", "slices", "stats")


def parts(value: Sketch) -> dict[str, torch.Tensor]:
    """The tensors a file stores of a sketch (:data:`PARTS`); :func:`from_parts` reads them back."""
    stats = torch.tensor([value.rms, value.absmax, value.mean, float(value.nonfinite)],
                         dtype=torch.float64)
    return {"sketch": value.projection, "slices": value.slices, "stats": stats}


def describe_sketch(value: Sketch) -> dict[str, list[int] | str | int]:
    """What a file records beside a sketch's parts, as JSON (seed a string: JSON loses int64)."""
    return {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch."),
            "method": METHOD, "size": value.size, "seed": str(value.seed)}


def from_parts(description: Mapping[str, Any], stored: Mapping[str, torch.Tensor]) -> Sketch:
    """The sketch :func:`parts` and :func:`describe_sketch` wrote, equal to the one stored.

    Raises:
        ValueError: a part is missing or malformed, or the sketch was made by another method.
    """
    try:
        if description["method"] != METHOD:
            raise ValueError(f"sketched by {description['method']!r}, this torchparity "
                             f"sketches by {METHOD!r}")
        rms, absmax, mean, nonfinite = stored["stats"].tolist()
        return Sketch(shape=tuple(int(n) for n in description["shape"]),
                      dtype=getattr(torch, str(description["dtype"])),
                      seed=int(description["seed"]), projection=stored["sketch"],
                      slices=stored["slices"], rms=rms, absmax=absmax, mean=mean,
                      nonfinite=int(nonfinite))
    except (KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"incomplete sketch ({type(exc).__name__}: {exc})") from None


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point:
        views = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        a, b = a.view(views[a.element_size()]), b.view(views[b.element_size()])
    return torch.equal(a, b)
