"""The public entry points of a diagnosis: ``diagnose``, ``record`` and ``diagnose_against``.

Each stage is one module, called here in order and by nothing else; the data passes once:
1. ``stages.capture_a``: A's selected modules' inputs, outputs and output gradients;
2. ``stages.float64_golden``: A's float64 golden, and on-demand replays for local goldens;
3-4. ``stages.propagated``: B run whole, judged against the golden as it runs, then aligned
   with A (``core.align``: names, ``name_map``, call order and shapes, fusion);
5. ``stages.local``: B's modules replayed on A's inputs; ``stages.entry``: where a divergent
   container's error enters (the argument carrying a mask or position built above);
6. ``stages.ops``: the first divergence drilled down to the op and source line;
7. ``reports.diagnosis``: the report (table, JSON, HTML).
``record`` runs 1-2 on one revision and writes them to disk; ``diagnose_against`` reads them
back and runs 3-5 and 7, or hands a decoding's trace to ``pipelines.decoding``.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from torchparity.collector import with_older_objects_frozen
from torchparity.diagnosis.core.align import Match, NameMap
from torchparity.diagnosis.core.capture import PatternSpec
from torchparity.diagnosis.core.progress import ProgressBar, progress_bar
from torchparity.diagnosis.core.reference import Reference, describe_mode
from torchparity.diagnosis.core.results import Result, module_label
from torchparity.diagnosis.core.run import (
    BackendSpec,
    Local,
    Models,
    Options,
    backend_name,
    backend_pair,
    shown,
    stream_needed,
)
from torchparity.diagnosis.core.trace import (
    MemoryStore,
    Store,
    TraceWriter,
    changed_weights,
    check_recorded_inputs,
    open_trace,
)
from torchparity.diagnosis.core.trace_meta import DecodeTraceMeta, KeptOps, meta_from_json
from torchparity.diagnosis.pipelines.compiled import compile_form, localise
from torchparity.diagnosis.pipelines.decoding import DecodeOptions, DecodeReport, decode_against
from torchparity.diagnosis.reports.diagnosis import DiagnosisReport
from torchparity.diagnosis.reports.meta import DiagnosisMeta, with_weights
from torchparity.diagnosis.stages.capture_a import capture_reference, open_reference, trace_meta
from torchparity.diagnosis.stages.entry import find_entry
from torchparity.diagnosis.stages.float64_golden import add_golden, float64_departure
from torchparity.diagnosis.stages.local import backward_before_divergence, judge_local
from torchparity.diagnosis.stages.ops import a_side, drill_down, keep_ops
from torchparity.diagnosis.stages.ops.recorded import recorded_side
from torchparity.diagnosis.stages.propagated import judge_propagated
from torchparity.errors import UsageError
from torchparity.subject.decoding import ReorderFn, StepFn
from torchparity.subject.islands import summary
from torchparity.subject.padding import PaddingLike, padding_of
from torchparity.subject.running import Inputs, LossFn, check_models, in_dtype

__all__ = ["diagnose", "diagnose_against", "record"]

#: Why a decoding is not localised compiled.
COMPILED_DECODING = ("--compile-b localises a forward pass; a compiled decoding is judged step "
                     "by step, with its recompiles, by `torchparity check --model ENTRY "
                     "--compile` (docs/compile.md)")
#: Why ``--ops`` is not taken with a decoding.
DECODE_OPS = ("--ops drills down a forward diagnosis; a decoding drills down the first "
              "divergent module at its first divergent step by itself (against a trace: "
              "one recorded with `torchparity record ENTRY --decode --ops MODULE`)")


@with_older_objects_frozen
def diagnose(
    model_a: nn.Module,
    model_b: nn.Module,
    inputs: Inputs,
    loss_fn: LossFn | None = None,
    name_map: NameMap | None = None,
    backward: bool = True,
    *,
    include: PatternSpec = None,
    exclude: PatternSpec = None,
    backends: tuple[BackendSpec, BackendSpec] | None = None,
    stream: bool | None = None,
    local: Local = "diverged",
    progress: bool | None = None,
    dtype: torch.dtype | None = None,
    padding: PaddingLike = None,
    compile_b: str | None = None,
    ops: str | None = None,
) -> DiagnosisReport:
    """Localise where ``model_b`` starts to compute something other than ``model_a``.

    The first module whose local error breaks its budget is where B computes something
    else; everything after it inherits the error. Both models, their gradients and the RNG
    state are left as they were; every run is seeded alike; unmatched modules are listed.

    Args:
        model_a: the reference implementation; its golden is A itself run in float64
            module by module (no copy).
        model_b: the changed one; a compiled one (``torch.compile``) is diagnosed compiled.
        inputs: a tuple of positional arguments or a dict of keyword arguments (a tensor:
            one positional argument); both models get the same.
        loss_fn: ``loss_fn(output, inputs)``, the scalar gradients are taken of (None: a
            fixed random projection of the first floating output).
        name_map: A's module names mapped to B's (dict, or ``(regex, replacement)`` pairs);
            unmapped renamed or fused modules are aligned by call order and output shapes.
        backward: take and judge gradients.
        include: the modules selected (glob or ``re:`` regex).
        exclude: the modules left out.
        backends: the attention backends of A and B.
        stream: keep A's side in a temporary trace on disk (None: when the models take more
            than a quarter of the free memory).
        local: ``"diverged"``: a local error for modules whose propagated output or gradient
            diverged or could not be judged, and those whose backward ran before the first
            divergent gradient; ``"all"``: every module.
        progress: show a progress bar on stderr (None: when stderr is a terminal).
        dtype: run copies of both models and the inputs in this dtype; ``torch.float64``
            judges with float64 budgets, so a change below the models' own noise is found.
        padding: the positions left out of every judgement and of the default loss (None:
            the inputs' 1/0 attention masks; a bool (batch, sequence) tensor, True at
            padding; a dict of them by output path; False: none; see ``subject.padding``).
        compile_b: run B by ``torch.compile`` in this form (``"dynamic"``, ``"static"``) and
            name the first module whose compiled output leaves its budget.
        ops: B's module to drill down to its ops and source lines (None: the first
            divergence).

    Returns:
        The :class:`~torchparity.diagnosis.reports.diagnosis.DiagnosisReport`.
    """
    model_b, compile_b = compile_form(model_b, compile_b)
    if compile_b is not None and model_b is model_a:  # A's replays must stay eager
        model_b = copy.deepcopy(model_b)
    backend_a, backend_b = backend_pair(backends)
    opts = Options(include=include, exclude=exclude, backward=bool(backward), loss_fn=loss_fn,
                   backend_a=backend_a, backend_b=backend_b, progress=shown(progress),
                   local=local, padding=padding_of(padding, inputs, model_a), dtype=dtype,
                   compile_b=compile_b, name_map=name_map, ops=ops)
    check_models(model_a=model_a, model_b=model_b)
    (model_a, model_b), inputs = in_dtype([model_a, model_b], inputs, opts.dtype)
    if stream is None:
        stream = stream_needed(model_a, model_b)
    with progress_bar(opts.progress) as bar:
        if stream:
            with tempfile.TemporaryDirectory(prefix="torchparity-") as tmp:
                writer = TraceWriter(Path(tmp) / "reference.tptrace")
                reference = _reference(model_a, inputs, writer.store, opts, bar)
                return _diagnose_candidate(reference, model_b, inputs, opts, bar, model_a)
        reference = _reference(model_a, inputs, MemoryStore(), opts, bar)
        return _diagnose_candidate(reference, model_b, inputs, opts, bar, model_a)


@with_older_objects_frozen
def record(
    model: nn.Module,
    inputs: Inputs,
    path: str | Path,
    *,
    loss_fn: LossFn | None = None,
    backward: bool = True,
    include: PatternSpec = None,
    exclude: PatternSpec = None,
    backend: BackendSpec = None,
    progress: bool | None = None,
    dtype: torch.dtype | None = None,
    padding: PaddingLike = None,
    ops: str | None = None,
    ops_only: bool = False,
    recorded_by: str | None = None,
) -> Path:
    """Write the reference side of a diagnosis of ``model`` to the trace ``path``.

    Run it on the base revision; :func:`diagnose_against` judges another one against it. The
    trace (safetensors files and ``trace.json``) is written call by call into a temporary
    folder that replaces ``path`` only when complete.

    Args:
        model: the model of the base revision.
        inputs: a tuple of positional arguments or a dict of keyword arguments.
        path: the trace's folder.
        loss_fn: as in :func:`diagnose`.
        backward: record gradients.
        include: the modules recorded (glob or ``re:`` regex).
        exclude: the modules left out.
        backend: the attention backend's name (stored in the trace).
        progress: show a progress bar on stderr.
        dtype: run a copy of the model in this dtype; B is run in it too.
        padding: as in :func:`diagnose`; B's diagnosis leaves the recorded padding out.
        ops: ``"all"`` or module names joined by commas whose ops are kept at every call,
            for :func:`diagnose_against` to drill down to the op.
        ops_only: keep only what that drill-down reads (one forward and backward of A, no
            golden, no replays), as ``diagnose --base`` records the first divergence.
        recorded_by: the command line that records it, for a drill-down missing A's ops to
            say how to add them.

    Returns:
        The path.
    """
    # the root as reports name it: its forward's calls of library modules have its lines
    modules = None if ops is None else \
        ["" if m == module_label("") else m for m in ops.split(",")]
    if ops_only:
        if ops in (None, "all"):
            raise UsageError("--ops-only keeps the ops of named modules: give --ops MODULE")
        include, exclude = [f"re:^{re.escape(m)}$" for m in modules], None
    if backend is not None and not isinstance(backend, str):
        raise UsageError("record(backend=...) takes a backend name, which the trace stores")
    opts = Options(include=include, exclude=exclude, backward=bool(backward), loss_fn=loss_fn,
                   backend_a=backend, progress=shown(progress),
                   padding=padding_of(padding, inputs, model), dtype=dtype)
    check_models(model=model)
    names = [name for name, _ in model.named_modules()]
    unknown = [m for m in modules or [] if ops != "all" and m not in names]
    if unknown:
        raise UsageError(f"--ops {ops}: the model has no module {unknown[0]}; give all or "
                         f"module names joined by commas, such as {names[-1]}")
    (cast,), cast_inputs = in_dtype([model], inputs, opts.dtype)
    with TraceWriter(path) as writer:
        with progress_bar(opts.progress) as bar:
            if ops_only:
                reference = capture_reference(cast, cast_inputs, writer.store, opts, bar)
            else:
                reference = _reference(cast, cast_inputs, writer.store, opts, bar)
                # The trace must serve any later candidate: every call is replayed now.
                reference.replay_all(bar)
            missing = [] if ops is None else _keep_ops(reference, cast, modules, opts, bar)
        meta = trace_meta(reference, model, inputs, opts, recorded_by,
                          None if ops is None else KeptOps(ops, ops_only, missing))
        return writer.commit(meta.to_json())


@with_older_objects_frozen
def diagnose_against(
    path: str | Path,
    model: nn.Module,
    inputs: Inputs,
    *,
    loss_fn: LossFn | None = None,
    name_map: NameMap | None = None,
    backward: bool | None = None,
    backend: BackendSpec = None,
    local: Local = "diverged",
    progress: bool | None = None,
    padding: PaddingLike = None,
    compile_b: str | None = None,
    step: StepFn | None = None,
    reorder: ReorderFn | None = None,
    decode: bool = False,
    ops: str | None = None,
    more_ops: Callable[[list[str]], Path] | None = None,
) -> DiagnosisReport | DecodeReport:
    """Diagnose ``model`` (the changed revision) against the trace :func:`record` wrote.

    Propagated errors compare the live run with the recorded golden; local errors replay the
    recorded inputs into this model's modules, in the recorded dtype and module selection.
    Weights that differ from the recorded ones are listed in ``report.meta.weights``.

    Args:
        path: the trace :func:`record` (or :func:`torchparity.record_decode`) wrote; a
            decoding's is judged by :func:`torchparity.diagnose_decode_against`, where
            ``loss_fn``, ``backward``, ``local`` and ``padding`` go unused.
        model: the model of the changed revision.
        inputs: the recorded inputs (checked by checksum).
        loss_fn: as in :func:`diagnose` (a forward pass's).
        name_map: A's module names mapped to the model's.
        backward: judge gradients (None: whether the trace has them).
        backend: the model's attention backend.
        local: as in :func:`diagnose`.
        progress: show a progress bar on stderr.
        padding: the positions left out (None: the recorded ones).
        compile_b: as in :func:`diagnose` (a usage error with a decoding).
        step: a decoding's step function.
        reorder: a beam search's cache reorder.
        decode: require the trace to be a decoding's.
        ops: the model's module to drill down to its ops, with A's ops the trace holds.
        more_ops: ``more_ops(modules)`` records a trace with A's ops of those modules where
            this one lacks them; without it the report says which command adds them.

    Returns:
        A :class:`~torchparity.diagnosis.reports.diagnosis.DiagnosisReport`, or a
        :class:`~torchparity.diagnosis.pipelines.decoding.DecodeReport` for a decoding's trace.
    """
    # The trace's metadata says which pipeline judges it: a decoding's has its own
    # (decode=True only asks that it be one).
    if isinstance(meta_from_json(open_trace(path)[0]), DecodeTraceMeta):
        if compile_b is not None:
            raise UsageError(COMPILED_DECODING)
        if ops is not None:
            raise UsageError(DECODE_OPS)
        return decode_against(path, model, inputs, DecodeOptions(
            name_map=name_map, backend_b=backend, progress=shown(progress), step=step,
            reorder=reorder, more_ops=more_ops))
    if decode:
        raise UsageError(f"trace {path} records a forward pass, not a decoding; record one "
                         "with `torchparity record ENTRY --decode`")
    model, compile_b = compile_form(model, compile_b)
    reference, meta = open_reference(path)
    if meta.ops is not None and meta.ops.only:
        raise UsageError(f"trace {path} holds only the ops of {meta.ops.module} "
                         "(record --ops-only); record it without --ops-only")
    if backward and not meta.backward:
        raise UsageError(f"trace {path} has no gradients; record it with backward=True or pass "
                         "backward=False")
    check_recorded_inputs(path, inputs, meta.inputs_digest, "inputs")
    if padding is not None or meta.padding is None:  # else the recorded one
        reference.padding = padding_of(padding, inputs, model)
    opts = Options(include=meta.include, exclude=meta.exclude,
                   backward=bool(meta.backward if backward is None else backward),
                   loss_fn=loss_fn, backend_a=meta.backend, backend_b=backend,
                   progress=shown(progress), local=local, padding=reference.padding,
                   dtype=meta.dtype, compile_b=compile_b, name_map=name_map, ops=ops,
                   more_ops=more_ops)
    check_models(model=model)
    weights = changed_weights(meta.weights, model)
    (model,), inputs = in_dtype([model], inputs, opts.dtype)
    with progress_bar(opts.progress) as bar:
        report = _diagnose_candidate(reference, model, inputs, opts, bar)
    report.meta = with_weights(report.meta, weights)
    return report


def _reference(model: nn.Module, inputs: Inputs, store: Store, opts: Options, bar: ProgressBar
               ) -> Reference:
    """Stages 1 and 2: A captured into ``store``, and its float64 golden."""
    reference = add_golden(capture_reference(model, inputs, store, opts, bar), model, inputs,
                           opts, bar)
    reference.mode = describe_mode(model, opts.dtype, reference.has_golden)
    return reference


def _keep_ops(reference: Reference, model: nn.Module, modules: list[str], opts: Options,
              bar: ProgressBar) -> list[str]:
    """A's ops of the calls of ``modules`` (``["all"]``: every call) put into the store; why any
    call has none."""
    calls = [c for c in reference.calls if modules == ["all"] or c.name in modules]
    if not calls:
        raise UsageError(f"--ops {','.join(modules)}: the run records no call of those "
                         "modules (not selected, or never called)")
    done = bar.phase(f"A and golden: the ops of {len(calls)} call(s)")
    missing = keep_ops(reference.store, calls, opts.backward,
                       lambda call, backward: a_side(reference, call, model, opts, backward))
    done()
    return missing


def _diagnose_candidate(reference: Reference, model: nn.Module, inputs: Inputs, opts: Options,
                        bar: ProgressBar, model_a: nn.Module | None = None) -> DiagnosisReport:
    """Stages 3 to 7: B aligned, judged propagated then local, drilled down to the op."""
    if opts.compile_b is None:
        propagated = judge_propagated(reference, model, inputs, opts, bar)
        alignment = propagated.alignment
        replayed = judge_local(reference, alignment.matches, propagated.rows, model, opts, bar,
                               propagated.changing)
        done = bar.phase("where the first divergence enters")
        find_entry(reference, alignment.matches, propagated.rows, model, opts,
                   propagated.changing)
        done()
        with_ops = None if model_a is not None or opts.more_ops is None else \
            (lambda matches: _with_ops(reference, matches, opts.more_ops))
        drill_down(reference, alignment.matches, propagated.rows, Models(model_a, model), opts,
                   bar, with_ops, propagated.changing)
    else:  # each stage per level of B's modules, compiled; the search for an entry replays
        # modules eagerly, which a compiled B does not run
        propagated, replayed, compiled_note = localise(reference, model, inputs, opts, bar)
        alignment = propagated.alignment
    notes = [] if reference.has_golden else [f"golden: {reference.golden_label}"]
    if reference.padding:
        notes.append(f"{reference.padding.summary()}: left out of every judgement and of the "
                     "default loss")
    if reference.mode.startswith("float64") and reference.found_islands("AB"):
        notes.append(islands_note(reference.found_islands("A"), reference.found_islands("B")))
    below_noise = None
    if opts.compile_b is None and propagated.output.verdict != "identical" and all(
            r.local is None or r.local.ok for r in propagated.rows):
        done = bar.phase("B in float64: forward")
        departure = float64_departure(reference, model, inputs, opts)
        done()
        if departure is not None and not departure.ok:
            below_noise = (
                f"B's float64 output departs from A's float64 golden ({_share(departure)} of the "
                "float64 budget): a change below the noise of this dtype; run with --dtype fp64 "
                "(dtype=torch.float64) to localise it")
    seconds = {**bar.seconds, "judging while B runs": reference.judging_seconds}
    if opts.compile_b is not None:
        notes.append(compiled_note)
    elif opts.local != "all":
        notes.append(
            f"local errors of {replayed} of {len(propagated.rows)} module(s): those whose "
            "propagated error diverged or could not be judged"
            + (", and those whose backward ran before the first diverging gradient"
               if backward_before_divergence(propagated.rows) else "")
            + " (local='all' computes every one)")
    return DiagnosisReport(
        rows=propagated.rows,
        output=propagated.output,
        loss=propagated.loss,
        unmatched_a=[c.key for c in alignment.unmatched_a],
        unmatched_b=[c.key for c in alignment.unmatched_b],
        meta=DiagnosisMeta(
            reference=reference.source, model_b=type(model).__name__,
            golden=reference.golden_label, backward=opts.backward,
            backends=[backend_name(opts.backend_a), backend_name(opts.backend_b)],
            mode=reference.mode, alignment=alignment.counts(), notes=notes, seconds=seconds,
            below_noise=below_noise, compile_b=opts.compile_b),
    )


def _with_ops(reference: Reference, matches: list[Match],
              more_ops: Callable[[list[str]], Path]) -> Reference:
    """``reference`` reading A's ops from the trace ``more_ops`` records where its own lacks them
    (the caller's too: a library module's ops have no user line)."""
    calls = [m.a[0] for m in matches if len(m.a) == 1]
    if not calls or recorded_side(reference.store, calls[0].key, False) is not None:
        return reference
    other, _ = open_reference(more_ops(list(dict.fromkeys(module_label(c.name)
                                                           for c in calls))))
    return dataclasses.replace(reference, store=other.store)


def islands_note(a: dict[str, list[str]], b: dict[str, list[str]]) -> str:
    """What A's and B's float64 runs computed in a narrower dtype, and how it is judged."""
    def where(islands: dict[str, list[str]]) -> str:
        return "; ".join(f"{dtype} at {', '.join(summary(modules))}"
                         for dtype, modules in islands.items()) or "nowhere"

    return (f"islands: parts computed in a narrower dtype whatever the model's own (A: "
            f"{where(a)}; B: {where(b)}): that dtype's budget judges a module holding one, "
            "and every propagated error")


def _share(result: Result) -> str:
    worst = max((t.headroom for t in result.tensors), default=float("inf"))
    return f"{worst:.3g}x"
