"""A decoding's reference side, as every stage of a decoding diagnosis reads it.

Every side is teacher-forced along the same tokens (and a beam search's parents), seeded,
without gradients. A step's calls are stored under ``<call key>@<step>`` (A's outputs,
inputs with caches as placeholders, the state each read; the golden's outputs), its logits
under ``__step__@<step>``. :meth:`DecodeReference.at` reads one step as a forward pass's
``Reference``, so the stages serve a decoding unchanged."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from torchparity.diagnosis.core.capture import CallArgs, Capture, ModuleCall, Signature
from torchparity.diagnosis.core.judging import joined, judge
from torchparity.diagnosis.core.reference import golden_label
from torchparity.diagnosis.core.results import Mismatch, Result
from torchparity.diagnosis.core.run import BackendSpec, Options, backend_context
from torchparity.diagnosis.core.trace import Store, padded, sketched_in, stored_form
from torchparity.sketching import Sketch
from torchparity.subject.beams import BeamSettings, BeamStep
from torchparity.subject.decoding import (
    DecideFn,
    Decoding,
    Fed,
    ReorderFn,
    StepFn,
    teacher_forced,
)
from torchparity.subject.running import seeded
from torchparity.subject.sampling import SampleSettings
from torchparity.subject.trees import PyTree, flatten_tensors

STEP = "__step__"  # pseudo-call of a step's next-token logits


def step_key(key: str, step: int) -> str:
    """Where a call of one step is stored: ``decoder.layers.0.attn@1``."""
    return f"{key}@{step}"


@dataclass
class Side:
    """A model decoded by a step function (and ``reorder`` in a beam search) under a backend."""

    model: nn.Module
    inputs: PyTree
    step: StepFn
    backend: BackendSpec
    reorder: ReorderFn | None = None

    def decode(self, steps: int, tokens: torch.Tensor | None,
               parents: torch.Tensor | None = None, *, decide: DecideFn | None = None,
               during: Callable[[int], contextlib.AbstractContextManager] | None = None
               ) -> Decoding:
        """Teacher-forced decoding along ``tokens`` and ``parents`` (None: ``decide``'s choices,
        else greedy), seeded, without grad."""
        fed = tokens if parents is None else Fed(tokens, parents)
        with backend_context(self.backend), seeded(), torch.no_grad():
            return teacher_forced(self.step, self.model, self.inputs, steps, fed,
                                  reorder=self.reorder, decide=decide, during=during)


@dataclass
class DecodeReference:
    """A's side of a decoding diagnosis: the tokens (and a beam search's parents and choices), A's
    and the golden's logits and A's calls per step, and the golden used (None until stage 2)."""

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
    recorded_by: str | None = None  # a trace's record command line, when it has one
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
        """The golden as reports and traces write it."""
        return golden_label(self.golden, self.no_golden)

    def at(self, step: int, *, cut: bool = False) -> StepReference:
        """Step ``step`` as the stages read a reference (see :class:`StepReference`)."""
        return StepReference(self, step, cut)


class _StepStore:
    """A decoding reference's store as one step's calls read it (``@step`` implied)."""

    def __init__(self, store: Store, step: int) -> None:
        self._store, self._step = store, step

    def get(self, key: str, group: str) -> dict[str, torch.Tensor]:
        return self._store.get(step_key(key, self._step), group)

    def get_inputs(self, key: str, *, placeholders: bool = False) -> CallArgs:
        return self._store.get_inputs(step_key(key, self._step), placeholders=placeholders)


@dataclass
class StepReference:
    """One step of a decoding's reference as a ``Reference``; with ``cut`` A's tensors (a full
    recompute) are cut to the candidate's positions before judging."""

    decoding: DecodeReference
    step: int
    cut: bool = False

    @property
    def calls(self) -> list[ModuleCall]:
        return self.decoding.calls.get(self.step, [])

    @property
    def store(self) -> _StepStore:
        return _StepStore(self.decoding.store, self.step)

    @property
    def signatures(self) -> dict[str, Signature | None]:
        return self.decoding.signatures

    @property
    def has_golden(self) -> bool:
        return self.decoding.has_golden

    def judge(self, calls: tuple[ModuleCall, ...], candidate: dict[str, torch.Tensor],
              baseline_group: str, golden_group: str, kind: str) -> Result:
        """``candidate`` against the golden's group of ``calls``, A's as baseline
        (``Reference.judge``)."""
        store = self.store
        golden = joined([store.get(c.key, golden_group) for c in calls]) if self.has_golden \
            else {}
        return _judged(candidate, joined([store.get(c.key, baseline_group) for c in calls]),
                       golden, self.cut, kind)

    def judge_inputs(self, call: ModuleCall, candidate: dict[str, torch.Tensor]) -> Result:
        """A candidate's inputs against ``call``'s recorded ones under their dtype's analytic
        budget, tensors on one side only left out."""
        args, kwargs = self.store.get_inputs(call.key, placeholders=True)
        recorded = {**flatten_tensors(args, "args"), **flatten_tensors(kwargs, "kwargs")}
        return _judged(candidate, {}, recorded, self.cut, "forward", common_only=True)


def _judged(candidate: dict[str, torch.Tensor], baseline: dict[str, torch.Tensor],
            golden: dict[str, torch.Tensor], cut: bool, kind: str, *,
            common_only: bool = False) -> Result:
    """One step's tensors judged (``cut``: the others cut to the candidate's positions first;
    ``common_only``: only tensors every side has)."""
    candidate = {p: t.cpu() for p, t in candidate.items()}
    if cut:
        baseline, golden = _trailing(baseline, candidate), _trailing(golden, candidate)
        for part in (baseline, golden):
            if isinstance(part, Mismatch):
                return part
    if common_only:
        paths = set(candidate)
        for side in (baseline, golden):
            paths &= side.keys() if side else paths
        candidate = {p: t for p, t in candidate.items() if p in paths}
        baseline = {p: t for p, t in baseline.items() if p in paths}
        golden = {p: t for p, t in golden.items() if p in paths}
    return judge(candidate, golden, baseline, kind)


def _trailing(tensors: dict[str, torch.Tensor], like: dict[str, torch.Tensor]
              ) -> dict[str, torch.Tensor] | Mismatch:
    """``tensors`` cut to ``like``'s shapes by keeping the last positions where longer (a
    recompute's sequence against a cached step's new tokens)."""
    out = {}
    for path, tensor in tensors.items():
        target = like.get(path)
        if target is None or target.shape == tensor.shape:
            out[path] = tensor.cpu()
            continue
        longer = [d for d in range(tensor.dim()) if tensor.shape[d] != target.shape[d]]
        if tensor.dim() != target.dim() or len(longer) != 1 or \
                tensor.shape[longer[0]] < target.shape[longer[0]]:
            return Mismatch("forward", f"{path}: shape {tuple(tensor.shape)} cannot be cut to "
                                       f"{tuple(target.shape)}")
        dim = longer[0]
        out[path] = tensor.narrow(dim, tensor.shape[dim] - target.shape[dim], target.shape[dim])
    return out


@contextlib.contextmanager
def capturing_steps(model: nn.Module, store: Store, opts: Options,
                    calls: dict[int, list[ModuleCall]], group: str, *, state: bool
                    ) -> Iterator[Callable[[int], contextlib.AbstractContextManager[None]]]:
    """``during(step)`` for :func:`teacher_forced`: that step's calls captured into ``store``,
    step by step; hooks stay for the whole decoding (cheaper than placing them per step), big
    outputs sketched from the live tensor."""
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


def calls_at_step(side: Side, step: int, reference: DecodeReference, opts: Options
                  ) -> list[ModuleCall]:
    """``side`` decoded up to ``step`` along the reference, keeping every selected call there."""
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

    side.decode(step, reference.tokens, reference.parents, during=during)
    return captured
