"""Stage 2 of a diagnosis: the float64 golden of model A.

A itself, run in float64 on the CPU module by module (no copy, see ``Float64Run``), gives the
golden of each recorded call; A's error against it measures the budget. For local errors
each call is replayed on demand, forward and backward. A decoding's golden is a float64 copy
of A decoded along A's tokens (:func:`add_decode_golden`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torchparity.diagnosis.core.capture import ModuleCall
from torchparity.diagnosis.core.decode_reference import (
    STEP,
    DecodeReference,
    Side,
    capturing_steps,
    step_key,
)
from torchparity.diagnosis.core.judging import judge_departure, module_padding
from torchparity.diagnosis.core.progress import ProgressBar
from torchparity.diagnosis.core.reference import (
    IN_FLOAT64,
    Reference,
    golden_copy,
    grad_keeper,
    keep_run_results,
    module_placement,
    placed_on,
)
from torchparity.diagnosis.core.results import UNKNOWN_LOCAL, Result
from torchparity.diagnosis.core.run import (
    GOLDEN_DTYPE,
    Options,
    backend_context,
    golden_inputs,
    in_golden_dtype,
    placed_as_called,
    replay,
    run_model,
)
from torchparity.diagnosis.core.state import replaying, states_within
from torchparity.diagnosis.core.trace import FINAL, ReplayUnavailable, Store
from torchparity.subject.blockwise import Float64Run
from torchparity.subject.factory import first_line
from torchparity.subject.islands import Islands
from torchparity.subject.running import Inputs, call_model, seeded, upcast
from torchparity.subject.trees import flatten_tensors


def golden_model(model: nn.Module) -> tuple[nn.Module | None, str]:
    """The model whose float64 run is the golden, and a description of it; or None and why
    (it runs in float64 already)."""
    dtype, _ = module_placement(model)
    if dtype == GOLDEN_DTYPE:
        return None, IN_FLOAT64
    return model, "float64 run of A on the CPU (module by module, no float64 copy)"


def add_golden(reference: Reference, model: nn.Module, inputs: Inputs, opts: Options,
               bar: ProgressBar) -> Reference:
    """Run A in float64 (:func:`golden_model`) into the reference's store and arm the replays
    of its calls."""
    store = reference.store
    golden, note = golden_model(model)
    if golden is None:
        reference.no_golden = note
    else:
        reference.golden = note
        done = bar.phase("golden (float64): forward" + (" and backward" if opts.backward else ""))
        try:
            with Islands(golden) as islands:
                golden_run = run_model(
                    golden, upcast(inputs, GOLDEN_DTYPE, "cpu"), opts, opts.backend_a,
                    backward=opts.backward, float64=True, what="outputs", keep=False,
                    live=True, on_call=lambda c: store.put(c.key, "golden_out", c.outputs),
                    on_grad=grad_keeper(store, "golden_grad_out"))
            reference.islands.append(islands)
            keep_run_results(store, golden_run, "golden_out", "golden_param_grad")
        except Exception as exc:  # noqa: BLE001 - e.g. an op without a float64 kernel
            reason = f"{type(exc).__name__}: {exc}"
            golden, reference.golden = None, None
            reference.no_golden = f"the float64 run failed ({reason})"
        done()
    reference.replayer = _Replayer(store, reference.notes, model, golden, opts,
                                   reference.states)
    return reference


def add_decode_golden(reference: DecodeReference, side: Side, opts: Options, bar: ProgressBar,
                      rebuild: Callable[[], nn.Module] | None = None) -> DecodeReference:
    """Decode a float64 copy of A along the reference's tokens and parents, every step captured;
    ``rebuild()`` makes A again where deepcopy fails."""
    store = reference.store
    golden, note = golden_copy(side.model, rebuild)
    described, no_golden = (None, note) if golden is None else (note, None)
    golden_logits = None
    if golden is not None:
        done = bar.phase("golden (float64): decoding, every step captured")
        golden_side = _in_float64(side, golden)
        try:
            with capturing_steps(golden, store, opts, {}, "golden_out", state=False) as during:
                golden_logits = golden_side.decode(reference.steps, reference.tokens,
                                                   reference.parents, during=during).logits
        except Exception as exc:  # noqa: BLE001 - e.g. an op without a float64 kernel
            no_golden = (f"the float64 decoding of A failed ({type(exc).__name__}: "
                    f"{first_line(exc)}); budgets come from A's own rounding")
        broken = next((s for s, (a, g) in enumerate(zip(reference.logits, golden_logits or [],
                                                        strict=False))
                       if bool((a.isfinite() & ~g.isfinite()).any())), None)
        if broken is not None:
            golden_logits = None
            no_golden = (f"the float64 decoding of A gives NaN or inf at step {broken} where A "
                    "is finite (its float64 path differs, e.g. eager attention's masks on "
                    "padded rows); budgets come from A's own rounding")
        if golden_logits is not None:
            store.put_all([(step_key(STEP, s), "golden_out", {"logits": t})
                           for s, t in enumerate(golden_logits)])
        done()
    reference.golden_logits = golden_logits
    reference.golden = described if golden_logits is not None else None
    reference.no_golden = no_golden
    return reference


def float64_decoding(side: Side, reference: DecodeReference, logits: list[torch.Tensor]
                     ) -> tuple[list[torch.Tensor] | None, str | None]:
    """B (``side``, whose decoding gave ``logits``) decoded in float64 along the reference's
    tokens and parents: its logits per step, or None and why there are none."""
    if module_placement(side.model)[0] == torch.float64:
        return logits, None  # B runs in float64 already
    copy, _ = golden_copy(side.model)
    if copy is None:
        return None, ("no float64 copy of B: flip verdicts compare A's margin with twice the "
                      "step's budget")
    try:
        return _in_float64(side, copy).decode(reference.steps, reference.tokens,
                                              reference.parents).logits, None
    except Exception as exc:  # noqa: BLE001 - e.g. an op without a float64 kernel
        return None, (f"B's float64 decoding failed ({type(exc).__name__}: {first_line(exc)}); "
                      "flip verdicts compare A's margin with twice the step's budget")


def _in_float64(side: Side, copy: nn.Module) -> Side:
    """``side`` decoding its float64 CPU ``copy`` on float64 inputs."""
    return Side(copy, upcast(side.inputs, GOLDEN_DTYPE, "cpu"), side.step, side.backend,
                side.reorder)


def float64_departure(reference: Reference, model: nn.Module, inputs: Inputs,
                      opts: Options) -> Result | None:
    """B's float64 output against A's float64 golden under float64 rounding (and its islands'):
    whether B computes other math even below A's own noise. None without a golden or float64 B."""
    if not reference.has_golden:
        return None
    golden = {p: t for p, t in reference.store.get(FINAL, "golden_out").items() if p != "loss"}
    a_output = reference.store.get(FINAL, "out")
    try:
        with backend_context(opts.backend_b), seeded(), torch.no_grad(), \
                Float64Run(model, device="cpu"), Islands(model) as islands:
            output = call_model(model, upcast(inputs, GOLDEN_DTYPE, "cpu"))
    except Exception:  # noqa: BLE001 - no float64 run of B: nothing to tell
        return None
    # What either float64 run computes in a narrower dtype rounds as that dtype does.
    reference.b_islands.append(islands)
    return judge_departure(flatten_tensors(output), golden, a_output,
                           module_padding(reference.padding, ""), reference.islands_of())


class _Replayer:
    """Local goldens (and local gradients of A and the golden) of A's recorded calls."""

    def __init__(self, store: Store, notes: dict[str, str], model: nn.Module,
                 golden: nn.Module | None, opts: Options,
                 states: dict[str, list[tuple[int, Any]]]) -> None:
        self.store, self.notes, self.opts, self.states = store, notes, opts, states
        self.modules = dict(model.named_modules())
        self.golden_modules = dict(golden.named_modules()) if golden is not None else None

    def __call__(self, call: ModuleCall) -> None:
        store, opts = self.store, self.opts
        grad_out = store.get(call.key, "grad_out") if opts.backward else {}
        # A module keeping state across calls is replayed on its state at the recorded call.
        states = states_within(self.states, call.name, call.clock)
        try:
            if grad_out:
                module = self.modules[call.name]
                with replaying(module, states, placed_on):
                    _, grads = replay(module, placed_as_called(store.get_inputs(call.key), call),
                                      opts.backend_a, grad_out=grad_out,
                                      requires_grad=call.inputs_requiring_grad)
                store.put(call.key, "local_grad", grads)
            if self.golden_modules is not None:
                module = self.golden_modules[call.name]
                with replaying(module, states, lambda t, m: in_golden_dtype(t)):
                    outputs, grads = replay(
                        module, golden_inputs(store.get_inputs(call.key)),
                        opts.backend_a, grad_out=upcast(grad_out, GOLDEN_DTYPE, "cpu"),
                        requires_grad=call.inputs_requiring_grad, float64=True)
                store.put(call.key, "local_golden", outputs)
                store.put(call.key, "local_golden_grad", grads)
        except ReplayUnavailable as exc:
            self.notes[call.key] = f"{UNKNOWN_LOCAL}: not replayable: {exc}"
        except Exception as exc:  # noqa: BLE001 - report it on the row, keep diagnosing
            detail = " ".join(f"{type(exc).__name__}: {exc}".split())
            self.notes[call.key] = (f"{UNKNOWN_LOCAL}: the float64 golden of A's module "
                                    f"could not be replayed on its recorded inputs ({detail}), "
                                    "so whether this module itself changed the result is not "
                                    "known")

