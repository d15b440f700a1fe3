"""Running decodings for a diagnosis: the reference side (A, and its float64 golden, every module
captured at every step into a store) and the candidate (B plainly, then captured at one step).

Every side is teacher-forced along the same tokens (:func:`~torchparity.subject.decoding.
teacher_forced`), and with a beam search the same parents (A's search decides, the others follow
it), under its attention backend, seeded and without gradients. A step's calls
are stored under ``<call key>@<step>``: for A its outputs (``out``), its inputs (tensors and
containers; caches stand as placeholders) and a summary of the state each module read
(``call.state``); for the golden its outputs (``golden_out``). The step's next-token logits
are under the pseudo-call ``__step__@<step>``.
With a KV cache a step's module outputs are a token's worth each, so the trace stays small.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchparity.diagnosis.capture import Capture, ModuleCall, Signature, signature
from torchparity.diagnosis.progress import ProgressBar
from torchparity.diagnosis.reference import golden_copy, golden_label
from torchparity.diagnosis.run import GOLDEN_DTYPE, BackendSpec, Options, backend_context
from torchparity.diagnosis.trace import Store, padded, sketched_in, stored_form
from torchparity.sketching import Sketch
from torchparity.subject.beams import BeamSearch, BeamSettings, BeamStep
from torchparity.subject.decoding import Decoding, ReorderFn, StepFn, teacher_forced
from torchparity.subject.factory import first_line
from torchparity.subject.running import seeded, upcast
from torchparity.subject.sampling import Sampler, SampleSettings
from torchparity.subject.trees import flatten_tensors

STEP = "__step__"  # pseudo-call of a step's next-token logits


def step_key(key: str, step: int) -> str:
    """Where a call of one step is stored: ``decoder.layers.0.attn@1``."""
    return f"{key}@{step}"


@dataclass
class Side:
    """A model decoded by a step function (and reordered by ``reorder`` in a beam search)
    under an attention backend."""

    model: nn.Module
    inputs: Any
    step: StepFn
    backend: BackendSpec
    reorder: ReorderFn | None = None

    def decode(self, steps: int, tokens: torch.Tensor | None,
               parents: torch.Tensor | None = None, *, decide: Any = None,
               during: Any = None) -> Decoding:
        """Teacher-forced decoding along ``tokens`` and ``parents`` (when ``tokens`` is None:
        ``decide``'s choices, else greedy), seeded, without grad."""
        with backend_context(self.backend), seeded(), torch.no_grad():
            return teacher_forced(self.step, self.model, self.inputs, steps, tokens,
                                  parents=parents, reorder=self.reorder, decide=decide,
                                  during=during)

    def in_float64(self) -> Side | None:
        """A float64 CPU copy of this side, or None when the model cannot be copied so."""
        copy, _ = golden_copy(self.model)
        if copy is None:
            return None
        return Side(copy, upcast(self.inputs, GOLDEN_DTYPE, "cpu"), self.step, self.backend,
                    self.reorder)


@dataclass
class DecodeReference:
    """A's side of a decoding diagnosis: the tokens every side is fed (and the parent rows, in
    a beam search: its settings and A's choices per step), A's and the golden's next-token
    logits per step, A's calls per step (inputs, outputs and golden outputs in the store), the
    forward parameter names of A's modules, and which golden was used (None when there is
    none, ``no_golden`` then says why)."""

    tokens: torch.Tensor
    greedy: bool
    logits: list[torch.Tensor]
    golden_logits: list[torch.Tensor] | None
    calls: dict[int, list[ModuleCall]]
    store: Store
    signatures: dict[str, Signature | None]
    golden: str | None = None
    no_golden: str | None = None
    mode: str = ""
    source: str = "in-process"
    notes: list[str] = field(default_factory=list)
    parents: torch.Tensor | None = None
    beams: BeamSettings | None = None
    choices: list[BeamStep] | None = None
    sample: SampleSettings | None = None

    @property
    def steps(self) -> int:
        """Decoding steps after the prompt."""
        return len(self.logits) - 1

    @property
    def has_golden(self) -> bool:
        return self.golden_logits is not None

    @property
    def golden_label(self) -> str:
        """The golden as reports and traces write it
        (:func:`~torchparity.diagnosis.reference.golden_label`)."""
        return golden_label(self.golden, self.no_golden)


def record_reference(side: Side, steps: int, tokens: torch.Tensor | None, store: Store,
                     opts: Options, bar: ProgressBar,
                     rebuild: Callable[[], nn.Module] | None = None,
                     search: BeamSettings | SampleSettings | None = None) -> DecodeReference:
    """Decode A with every selected module captured at every step (along ``tokens``, else
    A's greedy choices, A's samples or A's beam search over ``side.inputs``, the prompt
    expanded to its beams, as ``search`` says), then its float64 golden along the same tokens
    and parents, into
    ``store``. ``rebuild()`` makes A again when it cannot be deep-copied into float64 (see
    :func:`~torchparity.diagnosis.reference.golden_copy`)."""
    beams = search if isinstance(search, BeamSettings) else None
    sample = search if isinstance(search, SampleSettings) else None
    done = bar.phase(f"A: {'beam search' if beams else 'sampling' if sample else 'decoding'}, "
                     "every step captured")
    calls: dict[int, list[ModuleCall]] = {}
    rows = _rows(side.inputs)
    decider = (BeamSearch(beams, rows // beams.beams) if beams else
               Sampler(sample, steps + 1, rows) if sample else None)
    with _capturing(side.model, store, opts, calls, "out", state=True) as during:
        decoded = side.decode(steps, tokens, decide=decider and decider.decide, during=during)
    store.put_all([(step_key(STEP, s), "out", {"logits": t})
                   for s, t in enumerate(decoded.logits)])
    done()
    golden, note = golden_copy(side.model, rebuild)
    described, no_golden = (None, note) if golden is None else (note, None)
    golden_logits = None
    if golden is not None:
        done = bar.phase("golden (float64): decoding, every step captured")
        golden_side = Side(golden, upcast(side.inputs, GOLDEN_DTYPE, "cpu"), side.step,
                           side.backend, side.reorder)
        try:
            with _capturing(golden, store, opts, {}, "golden_out", state=False) as during:
                golden_logits = golden_side.decode(steps, decoded.tokens, decoded.parents,
                                                   during=during).logits
        except Exception as exc:  # noqa: BLE001 - e.g. an op without a float64 kernel
            no_golden = (f"the float64 decoding of A failed ({type(exc).__name__}: "
                    f"{first_line(exc)}); budgets come from A's own rounding")
        broken = next((s for s, (a, g) in enumerate(zip(decoded.logits, golden_logits or [],
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
    signatures = {name: signature(module) for name, module in side.model.named_modules()}
    return DecodeReference(tokens=decoded.tokens, greedy=tokens is None, logits=decoded.logits,
                           golden_logits=golden_logits, calls=calls, store=store,
                           signatures=signatures,
                           golden=described if golden_logits is not None else None,
                           no_golden=no_golden, parents=decoded.parents,
                           beams=beams, choices=decider.history if beams else None,
                           sample=sample)


def _rows(inputs: Any) -> int:
    """The rows of a prompt: the first dimension of its first tensor."""
    return next(iter(flatten_tensors(inputs, "inputs").values())).shape[0]


@contextlib.contextmanager
def _capturing(model: nn.Module, store: Store, opts: Options, calls: dict[int, list[ModuleCall]],
               group: str, *, state: bool) -> Iterator[Callable[[int], Any]]:
    """``during(step)`` for :func:`teacher_forced`: capture that step's calls into ``store``
    (A's outputs, inputs and state in ``out``/``in``; the golden's outputs in
    ``golden_out``), written step by step on disk. The hooks stay in place for the whole
    decoding (placing them costs more than a step of a small model); what runs between steps
    is not kept. An output the store keeps as a sketch (the prompt's big ones) is sketched
    from the live tensor when its call ends; the others are copied then."""
    entries: list[tuple[str, str, dict[str, torch.Tensor | Sketch]]] = []
    now: dict[str, int | None] = {"step": None}

    def keep(call: ModuleCall) -> None:
        if now["step"] is None:  # between steps
            return
        key = step_key(call.key, now["step"])

        def held(path: str, tensor: torch.Tensor) -> torch.Tensor | Sketch:
            if not sketched_in(group, tensor):
                return capture.copy(tensor)
            return stored_form(group, path, tensor, padded(store.padding, key, group, path, tensor))

        entries.append((key, group, {path: held(path, t) for path, t in call.outputs.items()}))
        if group == "out":
            entries.append(store.inputs_entry(key, call.args, call.kwargs))

    @contextlib.contextmanager
    def during(step: int) -> Iterator[None]:
        now["step"] = step
        entries.clear()
        capture.restart()
        yield
        now["step"] = None
        store.put_all(entries, owned=True)  # the capture's copies and sketches
        calls[step] = capture.records

    what = "tensors" if group == "out" else "outputs"
    with Capture(model, opts.selects(), what=what, objects=False, state=state,
                 share=True, keep=False, live=True, on_call=keep) as capture:
        yield during


def capture_step(side: Side, step: int, reference: DecodeReference, opts: Options
                 ) -> tuple[Decoding, list[ModuleCall]]:
    """Decode ``side`` up to ``step`` along the reference's tokens and parents, keeping every
    selected module's call at that step (inputs with caches as placeholders, outputs, the
    state each read)."""
    captured: list[ModuleCall] = []

    @contextlib.contextmanager
    def during(s: int) -> Iterator[None]:
        if s != step:
            yield
            return
        with Capture(side.model, opts.selects(), what="tensors", objects=False,
                     state=True) as capture:
            yield
        captured.extend(capture.records)

    return side.decode(step, reference.tokens, reference.parents, during=during), captured


def flat_inputs(store: Store, key: str) -> dict[str, torch.Tensor]:
    """A stored call's input tensors by path (``args.0``, ``kwargs.mask``)."""
    args, kwargs = store.get_inputs(key, placeholders=True)
    return {**flatten_tensors(args, "args"), **flatten_tensors(kwargs, "kwargs")}
