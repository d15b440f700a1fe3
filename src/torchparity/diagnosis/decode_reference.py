"""A decoding's reference side, as every stage of a decoding diagnosis reads it.

Every side is teacher-forced along the same tokens (:func:`~torchparity.subject.decoding.
teacher_forced`), and with a beam search the same parents (A's search decides, the others follow
it), under its attention backend, seeded and without gradients. A step's calls are stored under
``<call key>@<step>``: for A its outputs (``out``), its inputs (tensors and containers; caches
stand as placeholders) and a summary of the state each module read (``call.state``); for the
golden its outputs (``golden_out``). The step's next-token logits are under the pseudo-call
``__step__@<step>``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchparity.diagnosis.capture import Capture, ModuleCall, Signature
from torchparity.diagnosis.reference import golden_copy, golden_label
from torchparity.diagnosis.run import GOLDEN_DTYPE, BackendSpec, Options, backend_context
from torchparity.diagnosis.trace import Store, padded, sketched_in, stored_form
from torchparity.sketching import Sketch
from torchparity.subject.beams import BeamSettings, BeamStep
from torchparity.subject.decoding import Decoding, ReorderFn, StepFn, teacher_forced
from torchparity.subject.running import seeded, upcast
from torchparity.subject.sampling import SampleSettings
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


@contextlib.contextmanager
def capturing_steps(model: nn.Module, store: Store, opts: Options,
                    calls: dict[int, list[ModuleCall]], group: str, *, state: bool
                    ) -> Iterator[Callable[[int], Any]]:
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
