"""Stage 5 of a diagnosis: local errors, each of B's modules replayed on A's recorded inputs.

B's module is fed A's inputs (and output gradient) and judged against the golden module fed
the same, with A's replay as the baseline: the error it makes itself. By default only
modules whose propagated error diverged are replayed (replaying all costs many runs), and,
with gradients, those whose backward ran before the first divergent output gradient (a
custom backward changes only the gradients it hands back). A module handed a mask in
another convention (None against a tensor, float against bool) is judged by B's own run,
since A's mask makes it compute what B never does."""

from __future__ import annotations

import functools
import math

from torch import nn

from torchparity.diagnosis.core.align import Match
from torchparity.diagnosis.core.arguments import Convention, convention_change
from torchparity.diagnosis.core.capture import CallArgs, ModuleCall, signature
from torchparity.diagnosis.core.judging import joined
from torchparity.diagnosis.core.masks import in_form
from torchparity.diagnosis.core.progress import ProgressBar
from torchparity.diagnosis.core.reference import Reference
from torchparity.diagnosis.core.results import UNKNOWN_LOCAL, Result, Row, headroom
from torchparity.diagnosis.core.run import (
    Converted,
    Options,
    UnfitArguments,
    fitting_masks,
    for_b,
    replay,
)
from torchparity.diagnosis.core.trace import ReplayUnavailable


def judge_local(reference: Reference, matches: list[Match], rows: list[Row], model: nn.Module,
                opts: Options, bar: ProgressBar, changing: set[str] = frozenset()) -> int:
    """Fill the local results of the rows that need them; how many were replayed."""
    before = backward_before_divergence(rows)
    to_replay = [(match, row) for index, (match, row) in enumerate(zip(matches, rows,
                                                                       strict=True))
                 if opts.local == "all" or needs_local(row) or index in before]
    modules = dict(model.named_modules())
    advance = bar.phase("A, golden and B: module replays", total=len(to_replay))
    for match, row in to_replay:
        for call in match.a:
            reference.ensure_replayed(call)
        row.notes += [reference.notes[c.key] for c in match.a if c.key in reference.notes]
        row.local, row.grad_local, note = _local(reference, match, modules, opts, changing)
        changed = _convention_change(reference, match, modules)
        if changed is not None and row.local is not None and not row.local.ok:
            row.local, row.grad_local, note = _by_own_run(reference, match, row, modules, opts,
                                                          changing, changed)
        if note:
            row.notes.append(note)
        advance()
    return len(to_replay)


def needs_local(row: Row) -> bool:
    """Whether a row's propagated results diverged, or its forward one is missing."""
    return row.propagated is None or any(
        result is not None and not result.ok for result in (row.propagated, row.grad_propagated))


def backward_before_divergence(rows: list[Row]) -> range:
    """The rows after the last one whose propagated gradient diverged."""
    diverged = [i for i, row in enumerate(rows)
                if row.grad_propagated is not None and not row.grad_propagated.ok]
    return range(max(diverged) + 1, len(rows)) if diverged else range(0)


def _local(reference: Reference, match: Match, modules: dict[str, nn.Module], opts: Options,
           changing: set[str], as_none: str | None = None, converted: Converted | None = None
           ) -> tuple[Result | None, Result | None, str | None]:
    """B's module(s) fed A's recorded inputs, judged against the local golden with A's replay as
    baseline; B's parameter ``as_none`` handed None, and ``converted`` in B's form."""
    a = match.a[0]
    if a.key in reference.notes:
        return None, None, None
    store = reference.store

    def handed(b: ModuleCall, fit: bool) -> tuple[CallArgs, list[str]]:
        return for_b(reference.signatures.get(a.name), store.get_inputs(a.key), b,
                     modules[b.name], fit, as_none, converted)

    def inputs(b: ModuleCall, fit: bool) -> CallArgs:
        return handed(b, fit)[0]

    def notes(fit: bool) -> list[str]:
        return [note for b in match.b for note in handed(b, fit)[1]]

    def judged(fit: bool) -> tuple[Result, Result | None]:
        outputs = []
        for b in match.b:
            with reference.on_recorded_state(a, modules[b.name], b.name, changing):
                outputs.append(replay(modules[b.name], inputs(b, fit), opts.backend_b)[0])
        local = reference.judge(match.a, joined(outputs), "out", "local_golden", "forward")
        grad_out = store.get(a.key, "grad_out") if opts.backward and match.one_to_one else {}
        if not grad_out:
            return local, None
        b = match.b[0]
        with reference.on_recorded_state(a, modules[b.name], b.name, changing):
            _, grads = replay(modules[b.name], inputs(b, fit), opts.backend_b,
                              grad_out=grad_out, requires_grad=a.inputs_requiring_grad)
        return local, reference.judge(match.a, grads, "local_grad", "local_golden_grad", "grad")

    try:
        (local, grad_local), fits, _ = fitting_masks(judged, notes)
        return local, grad_local, "; ".join(fits) or None
    except UnfitArguments as exc:
        return None, None, (f"{UNKNOWN_LOCAL}: A's recorded arguments do not fit B's module: "
                            f"{exc}; whether this module itself changed the result is not "
                            "known")
    except ReplayUnavailable as exc:
        return None, None, f"{UNKNOWN_LOCAL}: not replayable: {exc}"
    except Exception as exc:  # noqa: BLE001 - report it on the row, keep diagnosing
        detail = " ".join(f"{type(exc).__name__}: {exc}".split())
        return None, None, (f"{UNKNOWN_LOCAL}: replay of B's module on A's recorded inputs "
                            f"failed ({detail}); A's arguments may not fit B (an argument "
                            "renamed or moved, a mask sized to another cache length), so "
                            "whether this module itself changed the result is not known")


def _convention_change(reference: Reference, match: Match, modules: dict[str, nn.Module]
                       ) -> Convention | None:
    """:func:`convention_change` of a match of one call each; None for any other."""
    if not match.one_to_one:
        return None
    a, b = match.a[0], match.b[0]
    try:
        a_inputs = reference.store.get_inputs(a.key, placeholders=True)
    except ReplayUnavailable:
        return None
    return convention_change(reference.signatures.get(a.name), a_inputs,
                             signature(modules[b.name]), b)


def _by_own_run(reference: Reference, match: Match, row: Row, modules: dict[str, nn.Module],
                opts: Options, changing: set[str], changed: Convention
                ) -> tuple[Result | None, Result | None, str]:
    """A module handed a mask in another convention judged by B's own run; where B passes None,
    replayed with that argument as B passes it, so that what it adds is its own."""
    said = f"{CONVENTION}: {changed.argument}: {changed.detail}"
    if row.propagated is not None and row.propagated.ok:
        return row.propagated, None, (f"{said}; the replay on A's arguments is no evidence: "
                                      "judged by B's own run, where it is within budget")
    if changed.forms:
        return _in_b_form(reference, match, modules, opts, changing, changed, said)
    if not changed.b_none:
        return None, None, (f"{UNKNOWN_LOCAL}: {said}; the replay on A's arguments is no "
                            "evidence, and in B's own run its output diverged, with what it "
                            "inherits")
    local, grad_local, note = _local(reference, match, modules, opts, changing,
                                     as_none=changed.argument)
    replayed = (f"{said}; replayed on A's arguments with {changed.argument} as B passes it "
                "(None)")
    return local, grad_local, f"{note}; {replayed}" if note else replayed


def _in_b_form(reference: Reference, match: Match, modules: dict[str, nn.Module],
               opts: Options, changing: set[str], changed: Convention, said: str
               ) -> tuple[Result | None, Result | None, str]:
    """A module handed A's mask in B's form, once per reading of it (a bool mask may mean attend
    or masked): the replay that errs least is what it adds."""
    tried = []
    for reading, form in changed.forms:
        convert = functools.partial(in_form, reading=reading, form=form,
                                    dtype=changed.b_dtype)
        local, grad_local, note = _local(reference, match, modules, opts, changing,
                                         converted=(changed.argument, convert))
        if local is not None:
            tried.append((headroom(local) if headroom(local) is not None else math.inf,
                          local, grad_local, note, form))
    if not tried:
        return None, None, (f"{UNKNOWN_LOCAL}: {said}; the replay on A's arguments is no "
                            "evidence, and it failed with the mask in B's form")
    _, local, grad_local, note, form = min(tried, key=lambda t: t[0])
    replayed = f"{said}; replayed on A's arguments with {changed.argument} in B's form ({form})"
    return local, grad_local, f"{note}; {replayed}" if note else replayed


#: The start of a note saying that a module's arguments changed convention between A and B.
CONVENTION = "arguments in another convention"
