"""Decoding traces: the reference side of a decoding diagnosis on disk (``record --decode``).

A decoding trace is a trace directory (:mod:`~torchparity.diagnosis.trace`) whose ``trace.json``
says ``"kind": "decode"`` and holds, besides the checksums and the module tree: the number of
steps, the tokens every side is fed and whether they were A's greedy choices (in a beam search:
its settings, the parent rows and A's choices per step; in a sampled one: its settings), the
golden used, the forward signature of every module of A, and per step the calls of A's modules
with the state each read (:class:`~torchparity.diagnosis.state.Held`). Its tensor files hold,
per step, A's and the golden's next-token logits and every call's outputs and inputs (written
step by step; a step's tensors are a token's worth each, and many steps share a file).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchparity.diagnosis.capture import ModuleCall
from torchparity.diagnosis.decoding.run import STEP, DecodeReference, step_key
from torchparity.diagnosis.reference import parse_golden_label
from torchparity.diagnosis.run import Options
from torchparity.diagnosis.state import Held
from torchparity.diagnosis.trace import (
    DECODE,
    call_from_json,
    call_to_json,
    inputs_digest,
    module_tree,
    open_trace,
    pattern_json,
    weight_digests,
)
from torchparity.diagnosis.trace_meta import DecodeTraceMeta, meta_from_json
from torchparity.errors import UsageError
from torchparity.subject.beams import BeamSettings, BeamStep
from torchparity.subject.sampling import SampleSettings


def decode_meta(reference: DecodeReference, model: nn.Module, inputs: Any, opts: Options,
                dtype: torch.dtype | None) -> DecodeTraceMeta:
    """What a decoding trace's ``trace.json`` says besides its tensors (``model`` and
    ``inputs`` as the user gave them, before any cast to ``dtype``)."""
    import torchparity

    return DecodeTraceMeta(
        torchparity=torchparity.__version__, torch=torch.__version__,
        model=type(model).__name__, golden=reference.golden_label, mode=reference.mode,
        dtype=None if dtype is None else str(dtype).removeprefix("torch."),
        backend=opts.backend_a,
        include=pattern_json(opts.include), exclude=pattern_json(opts.exclude),
        inputs_digest=inputs_digest(inputs), weights=weight_digests(model),
        modules=module_tree(model), signatures=reference.signatures,
        steps=reference.steps, tokens=reference.tokens.tolist(),
        greedy=reference.greedy, has_golden=reference.has_golden,
        calls={str(step): [_call_json(c) for c in calls]
               for step, calls in reference.calls.items()},
        notes=reference.notes,
        parents=None if reference.parents is None else reference.parents.tolist(),
        beams=None if reference.beams is None else reference.beams.to_dict(),
        choices=None if reference.choices is None else [
            {"kept": c.kept.tolist(), "ended": c.ended} for c in reference.choices],
        sample=None if reference.sample is None else reference.sample.to_dict(),
    )


def _call_json(call: ModuleCall) -> dict[str, Any]:
    return {**call_to_json(call), "state": {p: h.to_json() for p, h in call.state.items()}}


def _call(data: dict[str, Any]) -> ModuleCall:
    call = call_from_json(data)
    call.state = {p: Held.from_json(h) for p, h in data["state"].items()}
    return call


def is_decode_trace(meta: dict[str, Any]) -> bool:
    """Whether a trace's metadata is that of a decoding trace."""
    return meta.get("kind") == DECODE


def open_decode_reference(path: str | Path) -> tuple[DecodeReference, DecodeTraceMeta]:
    """The reference side a decoding trace holds, and its metadata; a trace of a forward pass
    is a one-line :class:`UsageError`."""
    data, store = open_trace(path)
    if not is_decode_trace(data):
        raise UsageError(f"trace {path} records a forward pass, not a decoding; record one with "
                         "`torchparity record ENTRY --decode` (tp.record_decode)")
    meta = meta_from_json(data)
    steps = meta.steps
    logits = [store.get(step_key(STEP, s), "out")["logits"] for s in range(steps + 1)]
    golden = ([store.get(step_key(STEP, s), "golden_out")["logits"] for s in range(steps + 1)]
              if meta.has_golden else None)
    parents, beams, choices = meta.parents, meta.beams, meta.choices
    described, no_golden = parse_golden_label(meta.golden)
    reference = DecodeReference(
        tokens=torch.tensor(meta.tokens, dtype=torch.long).reshape(len(meta.tokens), -1),
        greedy=meta.greedy, logits=logits, golden_logits=golden,
        calls={int(s): [_call(c) for c in calls] for s, calls in meta.calls.items()},
        store=store, signatures=meta.signatures, mode=meta.mode,
        golden=described, no_golden=no_golden,
        source=str(path), notes=list(meta.notes),
        parents=None if parents is None else torch.tensor(parents, dtype=torch.long),
        beams=None if beams is None else BeamSettings(**beams),
        choices=None if choices is None else [
            BeamStep(None, torch.tensor(c["kept"], dtype=torch.long), c["ended"])
            for c in choices],
        sample=SampleSettings(**meta.sample) if meta.sample else None)
    return reference, meta
