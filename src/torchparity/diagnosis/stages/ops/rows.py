"""Stage 6's entry: the first divergent row (or the module asked for) drilled down to its ops,
and the first divergent gradient to its backward ops."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from torchparity.diagnosis.core.align import Match
from torchparity.diagnosis.core.progress import ProgressBar
from torchparity.diagnosis.core.reference import Reference
from torchparity.diagnosis.core.results import Row, module_label
from torchparity.diagnosis.core.run import Models, Options
from torchparity.diagnosis.stages.ops.calls import drill_call
from torchparity.diagnosis.stages.ops.library import built_at, holds_other_tensors, in_callers_code
from torchparity.diagnosis.stages.ops.report import ForwardCause, NoOps, OpReport
from torchparity.errors import UsageError
from torchparity.subject.factory import first_line

__all__ = ["drill_down"]


def drill_down(reference: Reference, matches: list[Match], rows: list[Row], models: Models,
               opts: Options, bar: ProgressBar,
               with_ops: Callable[[list[Match]], Reference] | None = None,
               changing: set[str] = frozenset()) -> None:
    """Drill the first divergent row (or ``opts.ops``) down to its ops, and the first gradient
    divergence to its backward ops where the forward ops do not explain it.

    A gradient divergence whose forward ops name the change, or whose backward ops name none
    while the forward diverges, says it follows from the forward divergence.

    Args:
        reference: A's side; its store holds A's ops when ``models.a`` is None.
        matches: B's calls aligned with A's, one per row.
        rows: the rows judged; their ``ops`` and ``grad_ops`` are set here, and why a row has
            none joins its notes.
        models: A (None: its ops read from the trace) and B.
        opts: the diagnosis's options.
        bar: the progress bar.
        with_ops: a reference from another trace holding A's ops where this one lacks them.
        changing: B's modules that keep state across calls.
    """
    module = opts.ops
    if module is not None:
        index = next((i for i, r in enumerate(rows) if r.module == module), None)
        if index is None:
            raise UsageError(f"--ops {module}: B has no recorded call of that module; "
                             f"modules: {', '.join(r.module for r in rows[:12])}")
    else:
        index = next((i for i, r in enumerate(rows) if r.local is not None and not r.local.ok),
                     None)
    broken = [i for i, r in enumerate(rows) if r.grad_local is not None and not r.grad_local.ok]
    # backward runs the later modules first
    grad = None if module is not None or not opts.backward else \
        max(broken, key=lambda i: rows[i].start, default=None)
    if index is None and grad is None:
        return  # nothing diverged: the drill-down costs nothing
    if with_ops is not None:
        drilled = [j for i in (index, grad) if i is not None
                   for j in (i, _parent_row(rows, i)) if j is not None]
        reference = with_ops([matches[j] for j in drilled])
    done = bar.phase("A, golden and B: the module's ops" if models.a is not None else
                     "B: the module's ops, against A's in the trace")
    if index is not None:
        rows[index].ops = _drilled(reference, matches, rows, index, models, opts,
                                   changing=changing)
    forward = None if index is None else ForwardCause.of(
        module_label(rows[index].module),
        rows[index].ops if isinstance(rows[index].ops, OpReport) else None)
    if grad is not None and index == grad and forward.op is not None:
        # the module's forward ops name the change: its gradient follows from it
        rows[grad].grad_ops = OpReport(f"{rows[grad].module} (backward)", [], None,
                                       follows=forward)
    elif grad is not None:
        rows[grad].grad_ops = _drilled(reference, matches, rows, grad, models, opts,
                                       backward=True, changing=changing)
        if isinstance(rows[grad].grad_ops, OpReport) and rows[grad].grad_ops.answer is None:
            rows[grad].grad_ops.follows = forward  # no backward op of its own differs
    for row in rows:  # a reason there is none goes to the notes, once for both passes
        for attr in ("ops", "grad_ops"):
            reason = getattr(row, attr)
            if isinstance(reason, NoOps):
                if reason.reason not in row.notes:
                    row.notes.append(reason.reason)
                setattr(row, attr, None)
    done()


def _drilled(reference: Reference, matches: list[Match], rows: list[Row], index: int,
             models: Models, opts: Options, backward: bool = False,
             changing: set[str] = frozenset()) -> OpReport | NoOps:
    """Row ``index``'s call drilled down, through its caller when its code is a library's; or
    why not."""
    row = rows[index]
    try:
        model_a, model_b = models
        found = drill_call(reference, matches[index], model_a, model_b, opts,
                           diverged=row.local is not None and not row.local.ok,
                           backward=backward, changing=changing)
        parent = _parent_row(rows, index)
        if isinstance(found, OpReport) and not found.has_source and parent is not None:
            caller = drill_call(reference, matches[parent], model_a, model_b, opts,
                                backward=backward, changing=changing)
            if isinstance(caller, OpReport):  # else the module's ops, without their line
                found = _through_caller(found, caller, rows, index, parent, matches,
                                        model_a, model_b)
    except Exception as exc:  # noqa: BLE001 - the module's verdicts stand without it
        found = NoOps(f"op drill-down failed: {type(exc).__name__}: {first_line(exc)}")
    return found


def _through_caller(found: OpReport, caller: OpReport, rows: list, index: int, parent: int,
                    matches: list, model_a: nn.Module | None, model_b: nn.Module) -> OpReport:
    """A library module's ops at the line of its caller that calls it, with where each side
    built it; the caller's ops when the module changed nothing or holds no call of it."""
    if (found.answer is None or holds_other_tensors(found)) and caller.answer is not None:
        return caller
    module = rows[index].module.split("#")[0]
    nth = sum(1 for r in rows if r.module.split("#")[0] == module
              and rows[parent].start <= r.start < rows[index].start)
    sides = {"A": (matches[index].a[0], matches[parent].a[0], model_a),
             "B": (matches[index].b[0], matches[parent].b[0], model_b)}
    calls = {side: _below(call.name, outer.name) for side, (call, outer, _) in sides.items()}
    built = {side: built_at(model, call.name) for side, (call, _, model) in sides.items()
             if model is not None}
    return in_callers_code(found, caller, calls, nth, built) or caller


def _below(name: str, outer: str) -> str:
    """Module ``name`` as its caller ``outer``'s op stream names it."""
    return name[len(outer) + 1:] if outer else name


def _parent_row(rows: list, index: int) -> int | None:
    """The row of the call that made the call of row ``index``: the latest started before it
    of its parent module."""
    parent = rows[index].module.split("#")[0].rpartition(".")[0]
    candidates = [i for i, r in enumerate(rows) if r.module.split("#")[0] == parent
                  and r.start <= rows[index].start]
    return max(candidates, key=lambda i: rows[i].start, default=None)
