"""Decoding diagnosis: the first step and module where B's decoding parts from A, and
whether each changed token is a near tie or a real change.

The forward pipeline's stages, at every step: A decodes teacher-forced (its greedy choices,
given tokens, a beam search or a seeded sampler) with every module captured, beside its
float64 golden fed the same tokens; B is fed the same tokens, so a difference at one step
cannot change what the next sees. Each step's logits are judged against the golden
(``decoding.judging``); at the first step that leaves its budget B runs once more captured,
aligned and judged, the entry named (or the reorder of a beam search) and the first
divergent module drilled down to its ops. No gradients are taken.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from torchparity.collector import with_older_objects_frozen
from torchparity.diagnosis.core.align import Alignment, NameMap
from torchparity.diagnosis.core.capture import PatternSpec
from torchparity.diagnosis.core.decode_reference import (
    DecodeReference,
    Side,
    calls_at_step,
    step_key,
)
from torchparity.diagnosis.core.progress import ProgressBar, progress_bar
from torchparity.diagnosis.core.reference import describe_mode
from torchparity.diagnosis.core.run import (
    BackendSpec,
    Options,
    backend_name,
    backend_pair,
    shown,
)
from torchparity.diagnosis.core.trace import (
    MemoryStore,
    Store,
    TraceWriter,
    changed_weights,
    check_recorded_inputs,
    open_trace,
)
from torchparity.diagnosis.pipelines.decoding.beams import (
    Sides,
    keeps_differ,
    nbest_swaps,
    reorder_entry,
    step_swaps,
)
from torchparity.diagnosis.pipelines.decoding.judging import first_flips, first_module, judge_steps
from torchparity.diagnosis.pipelines.decoding.report import DecodeReport
from torchparity.diagnosis.pipelines.decoding.sampling import first_changed_draws
from torchparity.diagnosis.reports.meta import DecodeMeta, with_weights
from torchparity.diagnosis.stages.capture_a import (
    capture_decoding,
    decode_meta,
    open_decode_reference,
)
from torchparity.diagnosis.stages.entry import argument_entry
from torchparity.diagnosis.stages.float64_golden import add_decode_golden, float64_decoding
from torchparity.diagnosis.stages.ops import judged_streams, ops_at_steps
from torchparity.diagnosis.stages.ops.recorded import ASide, missing_ops, put_side, recorded_side
from torchparity.diagnosis.stages.propagated import judge_captured
from torchparity.errors import UsageError
from torchparity.subject.beams import BeamSettings, builtin_reorder, expand_prompt
from torchparity.subject.decoding import (
    STEP_HINT,
    ReorderFn,
    StepFn,
    builtin_step,
    recompute_step,
)
from torchparity.subject.running import check_models, in_dtype
from torchparity.subject.sampling import SampleSettings
from torchparity.subject.trees import PyTree
from torchparity.text import with_article

__all__ = ["DecodeOptions", "decode_against", "diagnose_decode", "diagnose_decode_against",
           "record_decode"]

#: Decoding steps after the prompt when none are asked for.
STEPS = 8


@dataclass(frozen=True)
class DecodeOptions(Options):
    """The settings of one decoding diagnosis: :class:`Options` and the decoding's own."""

    step: StepFn | None = None  # A's (against a trace: the judged model's); None: built-in
    step_b: StepFn | None = None  # B's where it differs from A's
    steps: int = STEPS  # after the prompt
    tokens: torch.Tensor | None = None  # fed, (batch, steps); None: A's own choices
    rebuild: Callable[[], nn.Module] | None = None  # A again, where deepcopy fails
    beams: BeamSettings | None = None  # A's beam search, which every other side follows
    reorder: ReorderFn | None = None  # A's cache reorder (against a trace: the judged model's)
    reorder_b: ReorderFn | None = None  # B's where it differs from A's
    sample: SampleSettings | None = None  # A's seeded sampling


@with_older_objects_frozen
def diagnose_decode(
    model_a: nn.Module,
    model_b: nn.Module | None,
    inputs: PyTree,
    *,
    step: StepFn | None = None,
    step_b: StepFn | None = None,
    steps: int = STEPS,
    tokens: torch.Tensor | None = None,
    name_map: NameMap | None = None,
    include: PatternSpec = None,
    exclude: PatternSpec = None,
    backends: tuple[BackendSpec, BackendSpec] | None = None,
    progress: bool | None = None,
    dtype: torch.dtype | None = None,
    rebuild: Callable[[], nn.Module] | None = None,
    beams: BeamSettings | None = None,
    reorder: ReorderFn | None = None,
    reorder_b: ReorderFn | None = None,
    sample: SampleSettings | None = None,
) -> DecodeReport:
    """Decode A and B along the same tokens and report where B parts from A.

    A, B, the golden and B's float64 copy see identical tokens; ``report.first_step`` is the
    first step whose logits break their budget (or None), ``report.rows`` judge every aligned
    module there, and every sequence's first token flip is in ``report.flips``.

    Args:
        model_a: the reference implementation.
        model_b: the changed one, or None to compare A's cached decoding with its full
            recompute (the check of a cache; built-in steps only).
        inputs: the prompt, as the step's first call takes it.
        step: ``step(model, tokens, state) -> (logits, state)`` of A (and B, unless
            ``step_b``); None: the built-in one of reference and ``transformers`` models.
        step_b: B's step where it differs.
        steps: the decoding steps after the prompt (step 0 runs the prompt).
        tokens: the tokens fed ``(batch, steps)``; None: A's greedy choices.
        name_map: as in :func:`torchparity.diagnose`.
        include: the modules captured (glob or ``re:`` regex).
        exclude: the modules left out.
        backends: the attention backends of A and B.
        progress: show a progress bar on stderr.
        dtype: as in :func:`torchparity.diagnose`.
        rebuild: makes A again where it cannot be deep-copied into float64.
        beams: A's beam search, which every other side follows.
        reorder: A's cache reorder of a beam search (and B's, unless ``reorder_b``).
        reorder_b: B's reorder where it differs.
        sample: A's seeded sampling.

    Returns:
        The :class:`~torchparity.diagnosis.pipelines.decoding.report.DecodeReport`.
    """
    cut = model_b is None
    if cut:
        step_a = step or recompute_step(model_a)
        if step_a is None:
            raise UsageError(f"model_b=None compares a cached decoding with its full recompute, "
                             f"which only built-in steps offer, not {type(model_a).__name__}'s; "
                             "pass model_b")
        model_b, step_b, step = model_a, step_b or _step_of(model_a, None), step_a
    inputs = _prompt(inputs, beams, sample, tokens, cut)
    backend_a, backend_b = backend_pair(backends)
    opts = DecodeOptions(include=include, exclude=exclude, backward=False,
                         backend_a=backend_a, backend_b=backend_b, progress=shown(progress),
                         dtype=dtype, name_map=name_map, step=step, step_b=step_b,
                         steps=steps, tokens=tokens, rebuild=rebuild, beams=beams,
                         reorder=reorder, reorder_b=reorder_b, sample=sample)
    check_models(model_a=model_a, model_b=model_b)
    (model_a, model_b), inputs = in_dtype([model_a, model_b], inputs, opts.dtype)
    side_a = Side(model_a, inputs, _step_of(model_a, opts.step), opts.backend_a,
                  opts.reorder or builtin_reorder(model_a))
    side_b = Side(model_b, inputs, _step_of(model_b, opts.step_b or opts.step), opts.backend_b,
                  opts.reorder_b or opts.reorder or builtin_reorder(model_b))
    with progress_bar(opts.progress) as bar:
        reference = _reference(side_a, MemoryStore(), opts, bar)
        reference.mode = describe_mode(model_a, opts.dtype, reference.has_golden)
        report = judge_candidate(reference, side_b, opts, bar, cut=cut)
        row = report.first_module
        if row is not None and not cut:
            _drill_down(report, side_b, reference, bar,
                        lambda: _step_ops(side_a, reference, report.first_step, row.a_module))
        return report


@with_older_objects_frozen
def record_decode(
    model: nn.Module,
    inputs: PyTree,
    path: str | Path,
    *,
    step: StepFn | None = None,
    steps: int = STEPS,
    tokens: torch.Tensor | None = None,
    include: PatternSpec = None,
    exclude: PatternSpec = None,
    backend: str | None = None,
    progress: bool | None = None,
    dtype: torch.dtype | None = None,
    rebuild: Callable[[], nn.Module] | None = None,
    beams: BeamSettings | None = None,
    reorder: ReorderFn | None = None,
    sample: SampleSettings | None = None,
    ops: str | None = None,
    recorded_by: str | None = None,
) -> Path:
    """Write A's side of a decoding diagnosis to the trace ``path`` (on the base revision).

    Per step it holds A's and the golden's logits, every call's inputs, outputs and the state
    it read, and the tokens fed (with a beam search's parents); it replaces ``path`` only
    when complete. Arguments as in :func:`diagnose_decode`, and:

    Args:
        path: the trace's folder.
        backend: the attention backend's name (stored in the trace).
        ops: ``MODULE[,MODULE]`` whose first call's ops are kept at every step (one more
            decoding of A per module), for :func:`diagnose_decode_against` to drill down.
        recorded_by: the command line that records it, for a drill-down missing A's ops to
            say how to add them.

    Returns:
        The path.
    """
    if backend is not None and not isinstance(backend, str):
        raise UsageError("record_decode(backend=...) takes a backend name, which the trace "
                         "stores")
    opts = DecodeOptions(include=include, exclude=exclude, backward=False, backend_a=backend,
                         progress=shown(progress), dtype=dtype, step=step, steps=steps,
                         tokens=tokens, rebuild=rebuild, beams=beams, reorder=reorder,
                         sample=sample, ops=ops)
    check_models(model=model)
    modules = _ops_modules(model, ops)
    (cast,), cast_inputs = in_dtype([model], _prompt(inputs, beams, sample, tokens),
                                    opts.dtype)
    with TraceWriter(path) as writer:
        with progress_bar(opts.progress) as bar:
            side = Side(cast, cast_inputs, _step_of(cast, opts.step), opts.backend_a,
                        opts.reorder or builtin_reorder(cast))
            reference = _reference(side, writer.store, opts, bar)
            reference.mode = describe_mode(cast, opts.dtype, reference.has_golden)
            for module in modules:
                done = bar.phase(f"A: decoding again, the ops of {module} at every step")
                kept = ops_at_steps(side, reference, module, range(reference.steps + 1))
                for at, ops_at in kept.items():
                    put_side(writer.store, step_key(module, at), ASide(ops_at, {}))
                done()
        return writer.commit(decode_meta(reference, model, inputs, opts, recorded_by).to_json())


@with_older_objects_frozen
def diagnose_decode_against(
    path: str | Path,
    model: nn.Module,
    inputs: PyTree,
    *,
    step: StepFn | None = None,
    name_map: NameMap | None = None,
    backend: BackendSpec = None,
    progress: bool | None = None,
    reorder: ReorderFn | None = None,
) -> DecodeReport:
    """Judge ``model`` decoding along the tokens of the trace :func:`record_decode` wrote.

    The module selection and dtype are the recorded ones; weights that differ from the
    recorded ones are listed in ``report.meta.weights``; where the trace lacks A's ops of the
    first divergence, a note says which command adds them.

    Args:
        path: the trace.
        model: the model judged (the changed revision).
        inputs: the recorded prompt (checked by checksum).
        step: the model's step (None: the built-in one).
        name_map: A's module names mapped to the model's.
        backend: the model's attention backend.
        progress: show a progress bar on stderr (None: when stderr is a terminal).
        reorder: the model's cache reorder of a beam search (None: the built-in one).

    Returns:
        The :class:`DecodeReport`.
    """
    return decode_against(path, model, inputs, DecodeOptions(
        name_map=name_map, backend_b=backend, progress=shown(progress), step=step,
        reorder=reorder))


def decode_against(path: str | Path, model: nn.Module, inputs: PyTree,
                   options: DecodeOptions) -> DecodeReport:
    """:func:`diagnose_decode_against` with its settings in ``options``."""
    reference, meta = open_decode_reference(path)
    check_recorded_inputs(path, inputs, meta.inputs_digest, "prompt")
    opts = dataclasses.replace(options, include=meta.include, exclude=meta.exclude,
                               backward=False, backend_a=meta.backend, dtype=meta.dtype)
    check_models(model=model)
    weights = changed_weights(meta.weights, model)
    if reference.beams is not None:
        inputs = expand_prompt(inputs, reference.beams.beams)
    (model,), inputs = in_dtype([model], inputs, opts.dtype)
    side = Side(model, inputs, _step_of(model, opts.step), opts.backend_b,
                opts.reorder or builtin_reorder(model))
    with progress_bar(opts.progress) as bar:
        report = judge_candidate(reference, side, opts, bar)
        row = report.first_module
        if row is not None:  # A's model is not here: its ops come from a trace
            module = row.a_module.split("#")[0]
            key = step_key(module, report.first_step)
            kept = recorded_side(reference.store, key, False)
            if kept is None and opts.more_ops is not None:
                done = bar.phase(f"A at the base: the ops of {module}")
                kept = recorded_side(open_trace(opts.more_ops([module]))[1], key, False)
                done()
            if kept is None:
                report.meta.notes.append(missing_ops(reference.recorded_by, module,
                                                     decode=True))
            else:
                _drill_down(report, side, reference, bar, lambda: kept.steps)
    report.meta = with_weights(report.meta, weights)
    return report


def _reference(side: Side, store: Store, opts: DecodeOptions, bar: ProgressBar
               ) -> DecodeReference:
    """Stages 1 and 2 at every step: A's decoding captured, then its float64 golden's."""
    reference = capture_decoding(side, opts.steps, opts.tokens, store, opts, bar,
                                 opts.beams or opts.sample)
    return add_decode_golden(reference, side, opts, bar, opts.rebuild)


def _drill_down(report: DecodeReport, side_b: Side, reference: DecodeReference,
                bar: ProgressBar, a_steps: Callable[[], list]) -> None:
    """The first divergent module's ops at the first divergent step, A's and B's, judged."""
    row, step = report.first_module, report.first_step
    done = bar.phase(f"B: step {step} again, the module's ops")
    try:
        row.ops = judged_streams(row.module, a_steps(),
                                 _step_ops(side_b, reference, step, row.module))
    except Exception as exc:  # noqa: BLE001 - the step's verdicts stand without it
        row.notes.append(f"op drill-down failed: {type(exc).__name__}: {exc}")
    done()


def judge_candidate(reference: DecodeReference, side: Side, opts: Options, bar: ProgressBar,
                    *, cut: bool = False) -> DecodeReport:
    """B decoded along the reference's tokens and judged: steps, modules, entry, flips."""
    done = bar.phase("B: decoding along A's tokens")
    decoded = side.decode(reference.steps, reference.tokens, reference.parents)
    steps = judge_steps(reference, decoded.logits)
    first_step = next((s for s, r in enumerate(steps) if not r.ok), None)
    done()
    notes = list(reference.notes)
    if not reference.has_golden:
        notes.insert(0, f"golden: {reference.golden_label}")
    rows = []
    if first_step is not None:
        done = bar.phase(f"B: step {first_step} again, every module captured")
        calls = calls_at_step(side, first_step, reference, opts)
        at_step = reference.at(first_step, cut=cut)
        alignment, rows = judge_captured(at_step, calls, opts.name_map)
        notes += _unmatched(alignment, first_step)
        row = first_module(rows)
        if row is not None and not cut:
            if reference.parents is not None:  # rows without their parents' state first
                row.entry, stale = reorder_entry(side, reference, first_step, row.module)
                notes += stale
            if row.entry is None:
                row.entry = argument_entry(at_step, row, calls, side.model,
                                           f"{row.module} @ step {first_step}")
        done()
    logits64 = None
    beams = reference.beams is not None
    if _needs_float64(reference, decoded.logits):
        done = bar.phase("B in float64: decoding, for the verdicts of "
                         + ("beam swaps" if beams else "token flips"))
        logits64, note = float64_decoding(side, reference, decoded.logits)
        if note:
            notes.append(note)
        done()
    swaps, nbest, flips = [], [], []
    if beams:
        sides = Sides.follow(reference, decoded.logits, logits64)
        swaps, nbest = step_swaps(reference, sides), nbest_swaps(reference, sides)
    elif reference.sample is not None:
        flips = first_changed_draws(reference, decoded.logits, steps, reference.sample)
    else:
        flips = first_flips(reference, decoded.logits, steps, logits64)
    meta = DecodeMeta(
        reference=reference.source, model_b=type(side.model).__name__,
        steps=reference.steps,
        tokens=("A's beam search" if beams else "A's samples" if reference.sample else
                "A's greedy choices" if reference.greedy else "given"),
        beams=reference.beams.to_dict() if beams else None,
        sample=None if reference.sample is None else reference.sample.to_dict(),
        golden=reference.golden_label, mode=reference.mode,
        backends=[backend_name(opts.backend_a), backend_name(opts.backend_b)],
        flip_verdicts=("the uniform's distance from the boundary that moved, against the "
                       "step's budget in probability" if reference.sample else
                       "B's float64 decoding" if logits64 is not None
                       else "margin against twice the step's budget"),
        notes=notes, seconds=dict(bar.seconds),
    )
    return DecodeReport(steps=steps, first_step=first_step, rows=rows, flips=flips,
                        tokens=reference.tokens, meta=meta, swaps=swaps, nbest=nbest,
                        parents=reference.parents)


def _unmatched(alignment: Alignment, step: int) -> list[str]:
    """Notes on the calls of ``step`` left unmatched on either side."""
    return [f"unmatched in {side} at step {step}: {', '.join(c.key for c in calls)}"
            for side, calls in (("A", alignment.unmatched_a), ("B", alignment.unmatched_b))
            if calls]


def _step_ops(side: Side, reference: DecodeReference, step: int, module: str) -> list:
    """The ops of ``module``'s first call at ``step``."""
    return ops_at_steps(side, reference, module, range(step, step + 1))[step]


def _ops_modules(model: nn.Module, ops: str | None) -> list[str]:
    """The modules ``ops`` names; a usage error for one not in the model."""
    modules = [] if ops is None else ops.split(",")
    names = dict(model.named_modules())
    for module in modules:
        if module not in names:
            raise UsageError(f"--ops {module}: {type(model).__name__} has no such module; "
                             "name one by its path (decoder.layers.0.attn)")
    return modules


def _needs_float64(reference: DecodeReference, logits: list[torch.Tensor]) -> bool:
    """Whether verdicts need B's float64 decoding: a beam swap or token flip to judge."""
    if reference.sample is not None:
        return False
    if reference.beams is not None:
        return keeps_differ(reference, logits)
    return any(bool((a.argmax(-1) != b.argmax(-1)).any())
               for a, b in zip(reference.logits, logits, strict=True))


def _prompt(inputs: PyTree, beams: BeamSettings | None, sample: SampleSettings | None,
            tokens: torch.Tensor | None, cut: bool = False) -> PyTree:
    """The prompt a decoding runs: expanded to its beams in a beam search."""
    if sample is not None and (beams is not None or tokens is not None):
        raise UsageError("sampling chooses its own tokens, without beams; give one of tokens, "
                         "beams or sample")
    if beams is None:
        return inputs
    if tokens is not None:
        raise UsageError("a beam search chooses its own tokens; give tokens or beams, not both")
    if cut:
        raise UsageError("a beam search compares two models; pass model_b (a cached decoding "
                         "is checked against its recompute greedily)")
    if beams.beams < 1:
        raise UsageError(f"beams={beams.beams}: search with one beam or more")
    return expand_prompt(inputs, beams.beams)


def _step_of(model: nn.Module, step: StepFn | None) -> StepFn:
    chosen = step or builtin_step(model)
    if chosen is None:
        raise UsageError(f"torchparity cannot decode {with_article(type(model).__name__)} by "
                         f"itself; pass step=, or from the command line {STEP_HINT}")
    return chosen
