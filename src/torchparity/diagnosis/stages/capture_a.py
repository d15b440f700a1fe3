"""Stage 1 of a diagnosis: the reference side, model A's calls and where their tensors are.

A runs once with every selected module's inputs, outputs and output gradients kept in a
store (memory, or a trace on disk); across revisions it is read back from the trace
``record`` wrote. A decoding's reference is captured alike at every step of A's decoding."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchparity.diagnosis.core.capture import ModuleCall, signature
from torchparity.diagnosis.core.decode_reference import (
    STEP,
    DecodeReference,
    Side,
    capturing_steps,
    step_key,
)
from torchparity.diagnosis.core.progress import ProgressBar
from torchparity.diagnosis.core.reference import (
    FoundIslands,
    Reference,
    grad_keeper,
    in_float64_islands,
    keep_run_results,
    parse_golden_label,
    state_key,
)
from torchparity.diagnosis.core.run import Options, run_model
from torchparity.diagnosis.core.state import Held, StateRecorder
from torchparity.diagnosis.core.trace import (
    Store,
    call_from_json,
    call_to_json,
    inputs_digest,
    module_tree,
    open_trace,
    pattern_json,
    weight_digests,
)
from torchparity.diagnosis.core.trace_meta import (
    DecodeTraceMeta,
    ForwardTraceMeta,
    KeptOps,
    meta_from_json,
)
from torchparity.errors import UsageError
from torchparity.subject.beams import BeamSearch, BeamSettings, BeamStep, prompt_rows
from torchparity.subject.padding import Padding
from torchparity.subject.running import Inputs
from torchparity.subject.sampling import Sampler, SampleSettings
from torchparity.subject.trees import PyTree


def capture_reference(model: nn.Module, inputs: Inputs, store: Store, opts: Options,
                      bar: ProgressBar) -> Reference:
    """Run A once, keeping each selected call's tensors and the final results in ``store``."""
    def keep_call(call: ModuleCall) -> None:
        store.put_inputs(call.key, call.args, call.kwargs)
        store.put(call.key, "out", call.outputs)

    store.padding = opts.padding  # sketches of padded tensors leave the padding out
    done = bar.phase("A: forward" + (" and backward" if opts.backward else ""))
    recorder = StateRecorder(model)
    with in_float64_islands(model) as islands:
        run = run_model(model, inputs, opts, opts.backend_a, backward=opts.backward,
                        what="tensors", keep=False, live=True, on_call=keep_call,
                        on_grad=grad_keeper(store, "grad_out", "judged_grad_out"),
                        states=recorder)
    keep_run_results(store, run, "out", "param_grad")
    states = recorder.snapshots_of_changing()
    for name, history in states.items():  # a trace keeps them for replays on another revision
        for clock, state in history:
            store.put_inputs(state_key(name, clock), (), state)
    done()
    return Reference(calls=run.calls, store=store, padding=opts.padding, states=states,
                     signatures={name: signature(module)
                                 for name, module in model.named_modules()},
                     islands=[islands] if islands is not None else [])


def capture_decoding(side: Side, steps: int, tokens: torch.Tensor | None, store: Store,
                     opts: Options, bar: ProgressBar,
                     search: BeamSettings | SampleSettings | None = None) -> DecodeReference:
    """Decode A with every selected call captured at every step into ``store``, along ``tokens``,
    else A's greedy choices, samples or beam search, as ``search`` says."""
    beams = search if isinstance(search, BeamSettings) else None
    sample = search if isinstance(search, SampleSettings) else None
    done = bar.phase(f"A: {'beam search' if beams else 'sampling' if sample else 'decoding'}, "
                     "every step captured")
    calls: dict[int, list[ModuleCall]] = {}
    rows = prompt_rows(side.inputs)
    decider = (BeamSearch(beams, rows // beams.beams) if beams else
               Sampler(sample, steps + 1, rows) if sample else None)
    with capturing_steps(side.model, store, opts, calls, "out", state=True) as during:
        decoded = side.decode(steps, tokens, decide=decider and decider.decide, during=during)
    store.put_all([(step_key(STEP, s), "out", {"logits": t})
                   for s, t in enumerate(decoded.logits)])
    done()
    signatures = {name: signature(module) for name, module in side.model.named_modules()}
    return DecodeReference(tokens=decoded.tokens, greedy=tokens is None, logits=decoded.logits,
                           golden_logits=None, calls=calls, store=store,
                           signatures=signatures, parents=decoded.parents,
                           beams=beams, choices=decider.history if beams else None,
                           sample=sample)


# --------------------------------------------------------------------------------------------
# Traces: the reference side on disk


def trace_meta(reference: Reference, model: nn.Module, inputs: Inputs, opts: Options,
               recorded_by: str | None, ops: KeptOps | None) -> ForwardTraceMeta:
    """What a trace's ``trace.json`` says besides its tensors (``model`` and ``inputs`` as the
    user gave them, before any cast to ``opts.dtype``)."""
    return ForwardTraceMeta(
        **_described(reference, model, inputs, opts),
        backward=opts.backward,
        calls=[call_to_json(c) for c in reference.calls],
        states={name: [clock for clock, _ in history]
                for name, history in reference.states.items()},
        padding=reference.padding.to_json(),
        islands=reference.found_islands() or None,
        recorded_by=recorded_by,
        ops=ops,
    )


def decode_meta(reference: DecodeReference, model: nn.Module, inputs: PyTree, opts: Options,
                recorded_by: str | None) -> DecodeTraceMeta:
    """What a decoding trace's ``trace.json`` says besides its tensors."""
    return DecodeTraceMeta(
        **_described(reference, model, inputs, opts),
        steps=reference.steps, tokens=reference.tokens.tolist(),
        greedy=reference.greedy, has_golden=reference.has_golden,
        calls={str(step): [_decode_call_json(c) for c in calls]
               for step, calls in reference.calls.items()},
        parents=None if reference.parents is None else reference.parents.tolist(),
        beams=None if reference.beams is None else reference.beams.to_dict(),
        choices=None if reference.choices is None else [
            {"kept": c.kept.tolist(), "ended": c.ended} for c in reference.choices],
        sample=None if reference.sample is None else reference.sample.to_dict(),
        recorded_by=recorded_by,
    )


def _described(reference: Reference | DecodeReference, model: nn.Module, inputs: PyTree,
               opts: Options) -> dict[str, Any]:
    """The fields every trace's metadata has: versions, model, weights, golden, settings, inputs."""
    import torchparity

    return {
        "torchparity": torchparity.__version__,
        "torch": torch.__version__,
        "model": type(model).__name__,
        "golden": reference.golden_label,
        "mode": reference.mode,
        "dtype": opts.dtype,
        "backend": opts.backend_a,
        "include": pattern_json(opts.include),
        "exclude": pattern_json(opts.exclude),
        "inputs_digest": inputs_digest(inputs),
        "weights": weight_digests(model),
        "modules": module_tree(model),
        "signatures": reference.signatures,
        "notes": reference.notes,
    }


def _decode_call_json(call: ModuleCall) -> dict[str, Any]:
    """A decoding's call with the state it read (a cache)."""
    return {**call_to_json(call), "state": {p: h.to_json() for p, h in call.state.items()}}


def _decode_call(data: dict[str, Any]) -> ModuleCall:
    call = call_from_json(data)
    call.state = {p: Held.from_json(h) for p, h in data["state"].items()}
    return call


def open_reference(path: str | Path) -> tuple[Reference, ForwardTraceMeta]:
    """The reference side a forward pass's trace holds (every call replayed), and its metadata
    (a decoding's trace opens with :func:`open_decode_reference`)."""
    data, store = open_trace(path)
    meta = meta_from_json(data)
    golden, no_golden = parse_golden_label(meta.golden)
    reference = Reference(calls=[call_from_json(c) for c in meta.calls], store=store,
                          golden=golden, no_golden=no_golden, mode=meta.mode,
                          notes=meta.notes,
                          source=str(path), recorded_by=meta.recorded_by,
                          signatures=meta.signatures,
                          states={name: [(clock, store.get_inputs(state_key(name, clock))[1])
                                         for clock in clocks]
                                  for name, clocks in meta.states.items()})
    if meta.padding:
        reference.padding = Padding.from_json(meta.padding)
    if meta.islands:
        reference.islands.append(FoundIslands(meta.islands))
    return reference, meta


def open_decode_reference(path: str | Path) -> tuple[DecodeReference, DecodeTraceMeta]:
    """The reference side a decoding trace holds, and its metadata; a forward pass's is a usage
    error."""
    data, store = open_trace(path)
    meta = meta_from_json(data)
    if not isinstance(meta, DecodeTraceMeta):
        raise UsageError(f"trace {path} records a forward pass, not a decoding; record one with "
                         "`torchparity record ENTRY --decode` (tp.record_decode)")
    steps = meta.steps
    logits = [store.get(step_key(STEP, s), "out")["logits"] for s in range(steps + 1)]
    golden = ([store.get(step_key(STEP, s), "golden_out")["logits"] for s in range(steps + 1)]
              if meta.has_golden else None)
    parents, beams, choices = meta.parents, meta.beams, meta.choices
    described, no_golden = parse_golden_label(meta.golden)
    reference = DecodeReference(
        tokens=torch.tensor(meta.tokens, dtype=torch.long).reshape(len(meta.tokens), -1),
        greedy=meta.greedy, logits=logits, golden_logits=golden,
        calls={int(s): [_decode_call(c) for c in calls] for s, calls in meta.calls.items()},
        store=store, signatures=meta.signatures, mode=meta.mode,
        golden=described, no_golden=no_golden,
        source=str(path), recorded_by=meta.recorded_by, notes=list(meta.notes),
        parents=None if parents is None else torch.tensor(parents, dtype=torch.long),
        beams=None if beams is None else BeamSettings(**beams),
        choices=None if choices is None else [
            BeamStep(None, torch.tensor(c["kept"], dtype=torch.long), c["ended"])
            for c in choices],
        sample=SampleSettings(**meta.sample) if meta.sample else None)
    return reference, meta
