"""What a diagnosis report says besides its rows: its settings, notes and phase timings, as
two frozen dataclasses (a forward pass's, a decoding's). Their fields are the keys of the
report's ``meta`` JSON; :meth:`to_json` writes them in the order reports always did, leaving
out the optional ones a diagnosis did not set."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar


def _json(meta: Any, optional: tuple[str, ...], order: tuple[str, ...]) -> dict[str, Any]:
    values = {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)}
    return {key: values[key] for key in order
            if not (key in optional and values[key] is None)}


@dataclasses.dataclass(frozen=True)
class DiagnosisMeta:
    """A diagnosis of a forward pass (and backward, when ``backward``)."""

    reference: str  # where A's side came from: a trace's path, or the model A
    model_b: str  # B's class name
    golden: str  # the golden's label
    backward: bool
    backends: list[str]  # A's and B's attention backends
    mode: str
    alignment: dict[str, int]  # how many calls were matched, and how
    notes: list[str]
    seconds: dict[str, float]  # wall time of each phase
    below_noise: str | None = None  # B departs from the golden below this dtype's noise
    compile_b: str | None = None  # B was run by torch.compile in this form
    weights: dict[str, list[str]] | None = None  # against a trace: weights that differ

    def to_json(self) -> dict[str, Any]:
        return _json(self, ("below_noise", "compile_b", "weights"), (
            "reference", "model_b", "golden", "backward", "backends", "mode", "alignment",
            "notes", "below_noise", "seconds", "compile_b", "weights"))


@dataclasses.dataclass(frozen=True)
class AttributionMeta:
    """An attribution of B's output error to its units of change."""

    backends: list[str]  # A's and B's attention backends
    error: str  # what the error of a unit is

    def to_json(self) -> dict[str, Any]:
        return {"backends": self.backends, "error": self.error}


@dataclasses.dataclass(frozen=True)
class DecodeMeta:
    """A diagnosis of a teacher-forced decoding of ``steps`` steps after the prompt."""

    reference: str
    model_b: str
    steps: int
    tokens: str  # what every side was fed: A's greedy choices, samples, beam search, given
    beams: dict[str, Any] | None  # a beam search's settings
    sample: dict[str, Any] | None  # a sampled decoding's settings
    golden: str
    mode: str
    backends: list[str]
    flip_verdicts: str  # what a token flip is judged by
    notes: list[str]
    seconds: dict[str, float]
    weights: dict[str, list[str]] | None = None  # against a trace: weights that differ

    def to_json(self) -> dict[str, Any]:
        return _json(self, ("weights",), tuple(f.name for f in dataclasses.fields(self)))


Meta = TypeVar("Meta", DiagnosisMeta, DecodeMeta)


def with_weights(meta: Meta, weights: dict[str, list[str]]) -> Meta:
    """``meta`` of a diagnosis against a trace, with the weights that differ from the recorded
    ones (:func:`~torchparity.diagnosis.core.trace.changed_weights`) and, when any do, a note."""
    if weights["changed"]:
        meta.notes.append(f"{len(weights['changed'])} parameter(s)/buffer(s) differ from the "
                          f"recorded ones, e.g. {weights['changed'][0]}")
    return dataclasses.replace(meta, weights=weights)
