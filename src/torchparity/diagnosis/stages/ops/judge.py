"""A verdict per op from the tolerance model, and the op where the divergence enters.

Each paired step gets a *local* result (B's op on A's op inputs against the golden op, A's
output the baseline) and a *prop.* one (B's output in B's replay against the golden's). The
answer is the first step in B's order that is paired and whose local error leaves its budget,
or whose output leaves it while its inputs agree (an in-place write into the wrong slot), or
that one side alone runs and whose consumers leave theirs. An input no step made (an
argument, a weight, a saved tensor) is judged itself: an op fed a divergent one inherits."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from torchparity.comparison.selection import PaddingSpec
from torchparity.diagnosis.core.judging import judge_quickly
from torchparity.diagnosis.core.results import Result
from torchparity.diagnosis.stages.ops.align import LAYOUT, Pair
from torchparity.diagnosis.stages.ops.capture import Step

__all__ = ["OpLine", "golden_on_inputs", "judge_ops"]

#: Ops whose output is no function of their inputs: nothing to judge locally.
_UNJUDGED = ("empty", "new_empty", "empty_like", "empty_strided", "bernoulli", "rand",
             "randn", "normal", "uniform", "native_dropout", "multinomial")


@dataclass
class OpLine:
    """One aligned step with its verdicts; ``why`` is set on the answer."""

    pair: Pair
    local: Result | None = None
    propagated: Result | None = None
    why: str = ""
    replaces: Step | None = None  # on a step only in B: the step only in A it stands in for
    reads_divergent: bool = False  # an input from outside the stream leaves its budget
    #: On the answer: the run of steps on one side only it ends, in run order, when it is
    #: more than the answer's own step or the answer is the paired op the run feeds
    dropped: list[Step] = field(default_factory=list)


def judge_ops(pairs: list[Pair], golden: dict[int, Step], padding: PaddingSpec = None, *,
              module_diverged: bool = True, spreads: dict[int, float] | None = None
              ) -> tuple[list[OpLine], int | None]:
    """Each pair judged (``golden``: A's step index -> the golden's; ``padding`` left out) and the
    index where the divergence enters (None: no op explains it). ``module_diverged``: a one-sided
    step the module returns is then its cause; ``spreads``: B's run-to-run differences, which
    join the budgets' noise."""
    spreads = spreads or {}
    lines = [OpLine(pair, *_results(pair, golden.get(pair.a.index) if pair.a else None,
                                    padding, spreads.get(pair.b.index) if pair.b else None))
             for pair in pairs]
    for line in lines:
        if line.pair.a is not None and line.pair.b is not None and \
                _diverged(line.propagated) and not _diverged(line.local):
            line.reads_divergent = _given_inputs_diverge(line.pair,
                                                         golden.get(line.pair.a.index))
    diverged = {side: {getattr(line.pair, side).index for line in lines
                       if getattr(line.pair, side) is not None and _diverged(line.propagated)}
                for side in ("a", "b")}
    for index, line in enumerate(lines):
        why = _why(line, diverged, lines, module_diverged)
        if not why:
            continue
        if line.pair.b is None:  # B's stand-in, on one side in the same gap, says it better
            for later in range(index + 1, len(lines)):
                other = lines[later]
                if other.pair.kind == "paired":
                    break
                if other.pair.a is None and _why(other, diverged, lines, module_diverged):
                    other.why = _why(other, diverged, lines, module_diverged)
                    other.replaces = line.pair.a
                    return lines, later
        line.why = why
        return _with_dropped_run(lines, index)
    return lines, None


def _with_dropped_run(lines: list[OpLine], index: int) -> tuple[list[OpLine], int]:
    """The answer at ``index`` as the run of ops one side alone applies, where it is one or feeds
    it (a soft-cap only A applies), with the run's steps; else as it is."""
    line = lines[index]
    by_step = {side: {getattr(x.pair, side).index: i for i, x in enumerate(lines)
                      if getattr(x.pair, side) is not None} for side in ("a", "b")}
    if line.pair.kind == "paired":
        if not line.why.startswith("its output leaves its budget"):
            return lines, index
        feeding = [(side, by_step[side][p]) for side in ("a", "b")
                   for p in getattr(line.pair, side).producers
                   if p in by_step[side] and lines[by_step[side][p]].pair.kind != "paired"]
        if not feeding:
            return lines, index
        side, last = feeding[0]
        reader = line.pair.name
        index, line = last, lines[last]
        line.why = (f"it runs in {side.upper()} only and {reader}, which reads its output, "
                    "diverges")
    if line.replaces is not None:
        return lines, index
    side = "a" if line.pair.b is None else "b"
    run, step = [], getattr(line.pair, side)
    while step is not None:
        run.insert(0, step)
        step = next((getattr(lines[by_step[side][p]].pair, side) for p in step.producers
                     if p in by_step[side] and lines[by_step[side][p]].pair.kind != "paired"),
                    None)
    if len(run) > 1:
        line.dropped = run
    return lines, index


def _why(line: OpLine, diverged: dict[str, set[int]], lines: list[OpLine],
         module_diverged: bool) -> str:
    a, b = line.pair.a, line.pair.b
    if a is not None and b is not None:
        if _diverged(line.local):
            return "its local error leaves its budget"
        inputs_agree = not line.reads_divergent and \
            not any(p in diverged["b"] for p in b.producers if p is not None)
        if _diverged(line.propagated) and inputs_agree:
            return "its output leaves its budget while every input it reads agrees"
        return ""
    side = "b" if b is not None else "a"
    step = b if b is not None else a
    readers = [getattr(x.pair, side) for x in lines if getattr(x.pair, side) is not None]
    consumers = [r for r in readers if step.index in r.producers]
    name = side.upper()
    if any(c.index in diverged[side] for c in consumers):
        return f"it runs in {name} only and the ops reading its output diverge"
    if step.returned and module_diverged:
        return f"it runs in {name} only and the module returns its output, which diverges"
    # a layout op on one side only relays what it reads (A's addmm, whose view nn.Linear
    # returns, where B's mm runs without the bias): the op that made it is the answer
    relays = [x for x in lines if getattr(x.pair, side) in consumers
              and x.pair.kind != "paired" and x.pair.name.split(".")[0] in LAYOUT]
    if any(_why(x, diverged, lines, module_diverged) for x in relays):
        return f"it runs in {name} only and the layout of its output that {name} alone " \
            "makes diverges"
    return ""


def _given_inputs_diverge(pair: Pair, golden: Step | None) -> bool:
    """Whether an input of B's step that no step made leaves its budget against the golden
    op's same input, A's as the baseline (not known without a golden: taken as agreeing)."""
    a, b = pair.a, pair.b
    if golden is None or not len(a.inputs) == len(b.inputs) == len(golden.inputs):
        return False
    for producer, b_in, a_in, g_in in zip(b.producers, b.inputs, a.inputs, golden.inputs,
                                          strict=True):
        if producer is not None or not b_in.is_floating_point() or \
                not b_in.shape == a_in.shape == g_in.shape:
            continue
        if _diverged(judge_quickly({"in": b_in}, {"in": g_in}, {"in": a_in}, "forward")):
            return True
    return False


def _diverged(result: Result | None) -> bool:
    return result is not None and not result.ok


def _results(pair: Pair, golden: Step | None, padding: PaddingSpec, spread: float | None
             ) -> tuple[Result | None, Result | None]:
    a, b = pair.a, pair.b
    if a is None or b is None:
        return None, None
    baseline = a.outputs
    golden_outputs = golden.outputs if golden is not None else {}
    propagated = judge_quickly(b.outputs, golden_outputs, baseline, "forward", padding,
                               noise=spread)
    if any(part in a.op for part in _UNJUDGED):
        return None, propagated
    candidate = _applied(b, a.inputs)
    exact = a.local_golden if a.local_golden is not None else golden_on_inputs(a, golden)
    if candidate is None or exact is None:
        return None, propagated
    out = {p: t for p, t in baseline.items() if p.startswith("out.")}
    return judge_quickly(candidate, exact, out, "forward", padding, noise=spread), propagated


def golden_on_inputs(step: Step, golden: Step | None) -> dict[str, torch.Tensor] | None:
    """The golden op (``step`` itself without one) on ``step``'s inputs in float64: the
    exact output the local error of its partner in B is judged against."""
    return _applied(golden if golden is not None else step,
                    [_to_float64(t) for t in step.inputs])


def _applied(step: Step, tensors: list[torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """``step`` run again with ``tensors`` in place of its tensor inputs (copies: an in-place
    op must not change them); None when they do not fit its arguments."""
    leaves, spec = tree_flatten((step.args, step.kwargs))
    slots = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    if len(slots) != len(tensors) or any(
            tuple(leaves[i].shape) != tuple(t.shape) for i, t in zip(slots, tensors, strict=True)):
        return None
    for i, tensor in zip(slots, tensors, strict=True):
        leaves[i] = tensor.clone()
    args, kwargs = tree_unflatten(leaves, spec)
    try:
        with torch.no_grad():
            output = step.call(*args, **kwargs)
    except Exception:  # noqa: BLE001 - an op that does not take the other side's inputs
        return None
    outs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
    return {f"out.{i}": t.detach() for i, t in enumerate(outs)}


def _to_float64(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(torch.float64) if tensor.is_floating_point() else tensor
