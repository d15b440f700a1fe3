"""What a trace's ``trace.json`` says besides its tensors, for a forward pass (``record``) and a
decoding (``record --decode``). The fields are the file's keys in its order; the storage keys
(``files``, ``aliases``, ``input_specs``) stay with the ``DiskStore`` that reads them."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from torchparity.diagnosis.core.trace import DECODE, SCHEMA


@dataclasses.dataclass(frozen=True)
class KeptOps:
    """The ops of one module a trace keeps (``record --ops``); ``only``: nothing else."""

    module: str
    only: bool
    missing: list[str]


@dataclasses.dataclass(frozen=True)
class ForwardTraceMeta:
    """A trace of a forward pass (and backward, when ``backward``)."""

    torchparity: str
    torch: str
    model: str  # the class name
    golden: str  # the golden's label (reference.golden_label)
    mode: str
    dtype: torch.dtype | None  # what the models were cast to, None: as given
    backward: bool
    backend: str | None
    include: Any  # the module selection, as pattern_json writes it
    exclude: Any
    inputs_digest: str
    weights: dict[str, str]  # digest of every parameter and buffer
    modules: list[dict[str, Any]]
    calls: list[dict[str, Any]]
    signatures: dict[str, Any]
    states: dict[str, list[int]]  # the clocks of each stateful module
    notes: list[str]
    padding: dict[str, Any] | None = None  # None: a trace from before padding was kept
    ops: KeptOps | None = None  # written only when record kept ops
    recorded_by: str | None = None  # the record command line (None: the Python API)
    #: where A's float64 run computed in a narrower dtype: dtype name -> modules
    islands: dict[str, list[str]] | None = None

    def to_json(self) -> dict[str, Any]:
        data = {"schema": SCHEMA, **_fields(self)}
        if self.ops is None:
            del data["ops"]
        else:
            data["ops"] = dataclasses.asdict(self.ops)
        return data


@dataclasses.dataclass(frozen=True)
class DecodeTraceMeta:
    """A trace of a teacher-forced decoding of ``steps`` steps after the prompt."""

    torchparity: str
    torch: str
    model: str
    golden: str
    mode: str
    dtype: torch.dtype | None
    backend: str | None
    include: Any
    exclude: Any
    inputs_digest: str
    weights: dict[str, str]
    modules: list[dict[str, Any]]
    signatures: dict[str, Any]
    steps: int
    tokens: list[list[int]]  # what every side is fed
    greedy: bool  # whether the tokens are A's greedy choices
    has_golden: bool
    calls: dict[str, list[dict[str, Any]]]  # by step
    notes: list[str]
    parents: list[list[int]] | None = None  # a beam search's parent rows per step
    beams: dict[str, Any] | None = None  # its settings
    choices: list[dict[str, Any]] | None = None  # A's choices per step
    sample: dict[str, Any] | None = None  # a sampled decoding's settings
    recorded_by: str | None = None  # the record command line (None: the Python API)

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "kind": DECODE, **_fields(self)}


TraceMeta = ForwardTraceMeta | DecodeTraceMeta


def meta_from_json(data: dict[str, Any]) -> TraceMeta:
    """The metadata of a ``trace.json`` (:func:`~torchparity.diagnosis.core.trace.open_trace`
    checked its schema)."""
    cls = DecodeTraceMeta if data.get("kind") == DECODE else ForwardTraceMeta
    known = {f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data}
    if known.get("ops") is not None:
        known["ops"] = KeptOps(**known["ops"])
    if known.get("dtype") is not None:  # the file names it, float64
        known["dtype"] = getattr(torch, known["dtype"])
    return cls(**known)


def _fields(meta: ForwardTraceMeta | DecodeTraceMeta) -> dict[str, Any]:
    fields = {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)}
    if meta.dtype is not None:
        fields["dtype"] = str(meta.dtype).removeprefix("torch.")
    return fields
