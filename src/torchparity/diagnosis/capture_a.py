"""Stage 1 of a diagnosis: the reference side, model A's calls and where their tensors are.

In one process A runs once with every selected module's inputs, outputs and output gradients
kept in a store (memory, or a trace directory on disk with ``stream``/``record``); across
revisions the reference is read back from the trace :func:`torchparity.record` wrote. Its float64
golden is added by :mod:`torchparity.diagnosis.float64_golden`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from torchparity.diagnosis.capture import ModuleCall, signature
from torchparity.diagnosis.progress import ProgressBar
from torchparity.diagnosis.reference import (
    Reference,
    grad_keeper,
    keep_run_results,
    parse_golden_label,
    state_key,
)
from torchparity.diagnosis.run import Options, run_model
from torchparity.diagnosis.state import StateRecorder
from torchparity.diagnosis.trace import (
    Store,
    call_from_json,
    call_to_json,
    inputs_digest,
    module_tree,
    open_trace,
    pattern_json,
    weight_digests,
)
from torchparity.diagnosis.trace_meta import ForwardTraceMeta, meta_from_json
from torchparity.subject.padding import Padding
from torchparity.subject.running import Inputs


def capture_reference(model: nn.Module, inputs: Inputs, store: Store, opts: Options,
                      bar: ProgressBar) -> Reference:
    """Run A once, keeping each selected call's inputs, outputs and output gradients in
    ``store``, and the final output, loss and parameter gradients."""
    def keep_call(call: ModuleCall) -> None:
        store.put_inputs(call.key, call.args, call.kwargs)
        store.put(call.key, "out", call.outputs)

    store.padding = opts.padding  # sketches of padded tensors leave the padding out
    done = bar.phase("A: forward" + (" and backward" if opts.backward else ""))
    recorder = StateRecorder(model)
    run = run_model(model, inputs, opts, opts.backend_a, backward=opts.backward, what="tensors",
                    keep=False, live=True, on_call=keep_call,
                    on_grad=grad_keeper(store, "grad_out", "judged_grad_out"), states=recorder)
    keep_run_results(store, run, "out", "param_grad")
    states = recorder.kept()
    for name, history in states.items():  # a trace keeps them for replays on another revision
        for clock, state in history:
            store.put_inputs(state_key(name, clock), (), state)
    done()
    return Reference(calls=run.calls, store=store, padding=opts.padding, states=states,
                     signatures={name: signature(module)
                                 for name, module in model.named_modules()})


# --------------------------------------------------------------------------------------------
# Traces: the reference side on disk


def trace_meta(reference: Reference, model: nn.Module, inputs: Inputs, opts: Options,
               dtype: torch.dtype | None) -> ForwardTraceMeta:
    """What a trace's ``trace.json`` says besides its tensors (``model`` and ``inputs`` as the
    user gave them, before any cast to ``dtype``)."""
    import torchparity

    return ForwardTraceMeta(
        torchparity=torchparity.__version__,
        torch=torch.__version__,
        model=type(model).__name__,
        golden=reference.golden_label,
        mode=reference.mode,
        dtype=None if dtype is None else str(dtype).removeprefix("torch."),
        backward=opts.backward,
        backend=opts.backend_a,
        include=pattern_json(opts.include),
        exclude=pattern_json(opts.exclude),
        inputs_digest=inputs_digest(inputs),
        weights=weight_digests(model),
        modules=module_tree(model),
        calls=[call_to_json(c) for c in reference.calls],
        signatures=reference.signatures,
        states={name: [clock for clock, _ in history]
                for name, history in reference.states.items()},
        notes=reference.notes,
        padding=reference.padding.to_json(),
    )


def open_reference(path: str | Path) -> tuple[Reference, ForwardTraceMeta]:
    """The reference side a trace of a forward pass holds (every call already replayed), and
    its metadata (:func:`~torchparity.diagnosis.api.diagnose_against` sends a decoding trace to
    the decoding pipeline)."""
    data, store = open_trace(path)
    meta = meta_from_json(data)
    golden, no_golden = parse_golden_label(meta.golden)
    reference = Reference(calls=[call_from_json(c) for c in meta.calls], store=store,
                          golden=golden, no_golden=no_golden, mode=meta.mode,
                          notes=meta.notes,
                          source=str(path), signatures=meta.signatures,
                          states={name: [(clock, store.get_inputs(state_key(name, clock))[1])
                                         for clock in clocks]
                                  for name, clocks in meta.states.items()})
    if meta.padding:
        reference.padding = Padding.from_json(meta.padding)
    return reference, meta
