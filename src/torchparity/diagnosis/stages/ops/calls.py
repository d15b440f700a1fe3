"""The ops of one aligned module call: A's (captured or from the trace), the golden's and B's,
aligned and judged."""


from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from torch import nn

from torchparity.comparison.selection import PaddingSpec
from torchparity.diagnosis.core.align import Match
from torchparity.diagnosis.core.capture import CallArgs
from torchparity.diagnosis.core.decode_reference import DecodeReference, Side
from torchparity.diagnosis.core.judging import module_padding
from torchparity.diagnosis.core.reference import ModuleCall, Reference, placed_on
from torchparity.diagnosis.core.results import module_label
from torchparity.diagnosis.core.run import (
    GOLDEN_DTYPE,
    Options,
    backend_context,
    fitting_masks,
    for_b,
    golden_inputs,
    in_golden_dtype,
    placed_as_called,
)
from torchparity.diagnosis.core.state import OwnState, replaying, states_within
from torchparity.diagnosis.core.trace import ReplayUnavailable
from torchparity.diagnosis.stages.ops.align import align_steps
from torchparity.diagnosis.stages.ops.backward import capture_backward
from torchparity.diagnosis.stages.ops.capture import Step, capture_steps, capturing_first_call
from torchparity.diagnosis.stages.ops.determinism import run_to_run_spreads
from torchparity.diagnosis.stages.ops.judge import golden_on_inputs, judge_ops
from torchparity.diagnosis.stages.ops.recorded import ASide, missing_ops, recorded_side
from torchparity.diagnosis.stages.ops.report import NoOps, OpReport
from torchparity.subject.running import seeded

__all__ = ["a_side", "drill_call", "judged_streams", "ops_at_steps"]


def drill_call(reference: Reference, match: Match, model_a: nn.Module | None,
               model_b: nn.Module, opts: Options, *, diverged: bool = True,
               backward: bool = False, changing: set[str] = frozenset()) -> OpReport | NoOps:
    """The op report of one aligned call, or the :class:`NoOps` saying why there is none.

    ``diverged``: whether its local error left its budget. With ``backward``, its backward ops
    from A's recorded output gradient, each with its forward op's lines. A's side is captured
    from ``model_a``, or read from the trace when None. Replays run on the state the module had
    when the call started (``changing``: B's modules that change theirs)."""
    if len(match.a) != 1 or len(match.b) != 1:
        return NoOps("no op drill-down of a fused group of modules")
    a_call, b_call = match.a[0], match.b[0]
    grad_out = reference.store.get(a_call.key, "grad_out") if backward else {}
    if backward and not grad_out:
        return NoOps("no backward op drill-down: no output gradient was recorded for the call")
    if model_a is None:
        side = recorded_side(reference.store, a_call.key, backward)
        if side is None:
            return NoOps(missing_ops(reference.recorded_by, module_label(a_call.name)))
    else:
        side = a_side(reference, a_call, model_a, opts, backward)
    module_b = dict(model_b.named_modules())[b_call.name]
    padding = module_padding(reference.padding, a_call.name)

    def handed(fit: bool) -> tuple[CallArgs, list[str]]:
        # each replay its own copy of the inputs: a replay writes into a cache handed to it
        return for_b(reference.signatures.get(a_call.name),
                     reference.store.get_inputs(a_call.key), b_call, module_b, fit)

    def b_steps_on(fit: bool) -> list[Step]:
        args_b, kwargs_b = handed(fit)[0]
        with reference.on_recorded_state(a_call, module_b, b_call.name, changing), \
                backend_context(opts.backend_b), seeded():
            return _capture(module_b, args_b, kwargs_b, grad_out, backward, padding)

    try:
        b_steps, _, fit = fitting_masks(b_steps_on, lambda fit: handed(fit)[1])
    except ReplayUnavailable as exc:
        return NoOps(f"no op drill-down: B's module is not replayable: {exc}")
    pairs = align_steps(side.steps, b_steps)
    lines, first = judge_ops(pairs, side.golden, padding, module_diverged=diverged)
    if first is not None:  # before an op is called the change: is it run-to-run noise?
        spreads = run_to_run_spreads(b_steps, b_steps_on(fit))
        if spreads:
            lines, first = judge_ops(pairs, side.golden, padding, module_diverged=diverged,
                                     spreads=spreads)
    label = f"{b_call.name} (backward)" if backward else b_call.name
    return OpReport(label, lines, first, side.notes)


def a_side(reference: Reference, a_call: ModuleCall, model_a: nn.Module, opts: Options,
           backward: bool) -> ASide:
    """A's steps of one recorded call replayed on its inputs (and output gradient), each paired
    with the golden's and its output on the step's own inputs."""
    grad_out = reference.store.get(a_call.key, "grad_out") if backward else {}
    module_a = dict(model_a.named_modules())[a_call.name]
    padding = module_padding(reference.padding, a_call.name)
    states = states_within(reference.states, a_call.name, a_call.clock)
    args_a, kwargs_a = placed_as_called(reference.store.get_inputs(a_call.key), a_call)
    with replaying(module_a, states, placed_on), backend_context(opts.backend_a), seeded():
        steps = _capture(module_a, args_a, kwargs_a, grad_out, backward, padding)
    inputs = (*placed_as_called(reference.store.get_inputs(a_call.key), a_call), grad_out)
    golden, notes = _golden_steps(module_a, states, inputs, opts, backward, padding)
    partners = {p.a.index: p.b for p in align_steps(steps, golden)
                if p.a is not None and p.b is not None}
    for step in steps:
        step.local_golden = golden_on_inputs(step, partners.get(step.index))
    return ASide(steps, partners, notes)


def judged_streams(module: str, a_steps: list[Step], b_steps: list[Step]) -> OpReport:
    """Two captured calls aligned and judged, A's outputs standing in for a golden not captured."""
    lines, first = judge_ops(align_steps(a_steps, b_steps), {})
    notes = [] if a_steps else ["A's call of the module was not captured"]
    return OpReport(module, lines, first, notes)


def ops_at_steps(side: Side, reference: DecodeReference, module: str, steps: range
                 ) -> dict[int, list]:
    """The ops of ``module``'s first call at each of ``steps``, ``side`` decoded again along the
    reference's tokens."""
    found: dict[int, list] = {s: [] for s in steps}
    target = side.model.get_submodule(module.split("#")[0])

    @contextlib.contextmanager
    def during(s: int) -> Iterator[None]:
        if s not in found:
            yield
            return
        with capturing_first_call(target, found[s]):
            yield

    side.decode(steps[-1], reference.tokens, reference.parents, during=during)
    return found


def _capture(module: nn.Module, args: tuple, kwargs: dict, grads: dict[str, torch.Tensor],
             backward: bool, padding: PaddingSpec) -> list[Step]:
    if backward:
        return capture_backward(module, args, kwargs, grads, padding)
    return capture_steps(module, args, kwargs, padding=padding)


def _golden_steps(module: nn.Module, states: dict[str, OwnState],
                  inputs: tuple[tuple, dict, dict], opts: Options, backward: bool,
                  padding: PaddingSpec) -> tuple[list[Step], list[str]]:
    """The steps of a float64 copy of A's module on the same inputs and ``states``; none (A's
    outputs serve, with the analytic budget) when it cannot be copied."""
    try:
        golden = copy.deepcopy(module).to(device="cpu", dtype=GOLDEN_DTYPE)
    except Exception as exc:  # noqa: BLE001 - judged against A then, and said so
        return [], [f"no float64 golden of the module's ops: copying it failed "
                    f"({type(exc).__name__}: {exc})"]
    args, kwargs, grads = golden_inputs(inputs)
    with replaying(golden, states, lambda t, m: in_golden_dtype(t)), \
            backend_context(opts.backend_a), seeded():
        return _capture(golden, args, kwargs, grads, backward, padding), []
