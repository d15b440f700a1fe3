"""What the stages of a diagnosis share: the reference side, A's recorded calls, where their
tensors are and the float64 golden that judges them; each stage reads and adds to a
:class:`Reference`."""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from torchparity.diagnosis.core.capture import ModuleCall, Signature, call_key
from torchparity.diagnosis.core.judging import joined, judge, judge_quickly, module_padding
from torchparity.diagnosis.core.progress import ProgressBar
from torchparity.diagnosis.core.results import Result
from torchparity.diagnosis.core.run import GOLDEN_DTYPE, CapturedRun, dtype_label
from torchparity.diagnosis.core.state import (
    OwnState,
    changing_within,
    replaying,
    states_within,
    why_not_replayable,
)
from torchparity.diagnosis.core.trace import FINAL, ReplayUnavailable, Store, weight_digests
from torchparity.subject.factory import first_line
from torchparity.subject.islands import Islands, narrowest
from torchparity.subject.padding import Padding
from torchparity.subject.trees import flatten_tensors

#: Why a model already in float64 has no golden of its own.
IN_FLOAT64 = "A already runs in float64; budgets use the analytic bound"


def golden_label(golden: str | None, no_golden: str | None) -> str:
    """The golden as reports write it: its description, or ``none: `` and why."""
    return golden if golden is not None else f"none: {no_golden or 'not made yet'}"


def parse_golden_label(label: str) -> tuple[str | None, str | None]:
    """``(golden, no_golden)`` from a label :func:`golden_label` wrote (a trace's)."""
    if label.startswith("none: "):
        return None, label.removeprefix("none: ")
    return label, None


@dataclass(frozen=True)
class FoundIslands:
    """Islands a run found earlier (a trace's): what its :attr:`Islands.found` said."""

    found: dict[str, list[str]]


@dataclass
class Reference:
    """A's recorded calls and where their tensors are; ``golden`` describes the golden (None:
    none, ``no_golden`` says why; or not made yet); ``replayer`` replays calls on demand (None
    when all were, as in a trace)."""

    calls: list[ModuleCall]
    store: Store
    golden: str | None = None
    no_golden: str | None = None
    mode: str = ""
    notes: dict[str, str] = field(default_factory=dict)
    source: str = "in-process"
    recorded_by: str | None = None  # a trace's record command line, when it has one
    replayer: Callable[[ModuleCall], None] | None = None
    replayed: set[str] = field(default_factory=set)
    judging_seconds: float = 0.0  # spent judging B's tensors while B runs (``quick``)
    padding: Padding = field(default_factory=Padding)  # positions no judgement counts
    signatures: dict[str, Signature | None] = field(default_factory=dict)  # A's forwards
    #: Modules that change their own state across calls: name -> (clock, state before a call).
    states: dict[str, list[tuple[int, OwnState]]] = field(default_factory=dict)
    #: Watches of A's float64 runs (its golden, A in float64 mode; a trace's as recorded) and
    #: of B's (B in float64 mode, B's float64 copy): where each computes in a narrower dtype
    #: whatever its own (see :meth:`islands_of`).
    islands: list[Islands | FoundIslands] = field(default_factory=list)
    b_islands: list[Islands] = field(default_factory=list)

    def ensure_replayed(self, call: ModuleCall) -> None:
        """The local golden (and local gradients) of ``call`` are in the store after this."""
        if self.replayer is not None and call.key not in self.replayed:
            self.replayer(call)
            self.replayed.add(call.key)

    def replay_all(self, bar: ProgressBar) -> None:
        """Replay every call now (a trace must serve any later candidate)."""
        advance = bar.phase("A and golden: module replays", total=len(self.calls))
        for call in self.calls:
            self.ensure_replayed(call)
            advance()

    @property
    def has_golden(self) -> bool:
        return self.golden is not None

    @property
    def golden_label(self) -> str:
        """The golden as reports and traces write it (:func:`golden_label`)."""
        return golden_label(self.golden, self.no_golden)

    def tensors(self, calls: tuple[ModuleCall, ...], group: str) -> dict[str, torch.Tensor]:
        return joined([self.store.get(c.key, group) for c in calls])

    def found_islands(self, side: str = "A") -> dict[str, list[str]]:
        """Each narrower dtype -> the modules ``side``'s float64 runs ("A", "B", "AB")
        computed in it."""
        watches = [*(self.islands if "A" in side else []),
                   *(self.b_islands if "B" in side else [])]
        found: dict[str, dict[str, None]] = {}
        for watch in watches:
            for dtype, modules in watch.found.items():
                found.setdefault(dtype, {}).update(dict.fromkeys(modules))
        return {dtype: list(modules) for dtype, modules in found.items()}

    def islands_of(self, module: str | None = None) -> str | None:
        """The narrowest dtype either float64 run computed in inside ``module`` (None: anywhere): an
        island rounds what it is fed, so a float64 tensor carries every island it went through."""
        return narrowest({dtype: [m for m in modules if module is None or module == "" or
                                  m == module or m.startswith(module + ".")]
                          for dtype, modules in self.found_islands("AB").items()})

    def judge(self, calls: tuple[ModuleCall, ...], candidate: dict[str, torch.Tensor],
              baseline_group: str, golden_group: str, kind: str, *, quick: bool = False
              ) -> Result:
        """``candidate`` against the golden's ``golden_group`` of ``calls``, A's ``baseline_group``
        the baseline (``quick``: :func:`~torchparity.diagnosis.core.judging.judge_quickly`); padding
        left out; a local judgement allows the islands inside the module, a propagated one all."""
        start = time.perf_counter()
        golden = self.tensors(calls, golden_group) if self.has_golden else {}
        padding = None if baseline_group == "param_grad" else \
            module_padding(self.padding, calls[0].name)
        islands = self.islands_of(calls[0].name if golden_group.startswith("local_") else None)
        result = (judge_quickly if quick else judge)(
            candidate, golden, self.tensors(calls, baseline_group), kind, padding,
            islands=islands)
        if quick:
            self.judging_seconds += time.perf_counter() - start
        return result

    def on_recorded_state(self, a: ModuleCall, module: nn.Module, name: str,
                          changing: set[str]) -> contextlib.AbstractContextManager:
        """B's ``module`` (``name`` in B) holding the state A's had when call ``a`` started;
        :class:`ReplayUnavailable` when B keeps state otherwise."""
        states = states_within(self.states, a.name, a.clock)
        b_changing = changing_within(changing, name)
        if not states and not b_changing:
            return contextlib.nullcontext()
        reason = why_not_replayable(states, module, b_changing)
        if reason is not None:
            raise ReplayUnavailable(reason)
        return replaying(module, states, placed_on)


@contextlib.contextmanager
def in_float64_islands(model: nn.Module) -> Iterator[Islands | None]:
    """A watch of where ``model``'s float64 run computes in a narrower dtype (None: not float64)."""
    if module_placement(model)[0] != GOLDEN_DTYPE:
        yield None
        return
    with Islands(model) as islands:
        yield islands


def state_key(name: str, clock: int) -> str:
    """Where a module's state before one of its calls is stored."""
    return f"state|{name}@{clock}"


def grad_keeper(store: Store, *groups: str) -> Callable[[ModuleCall, str, torch.Tensor], None]:
    """An ``on_grad`` callback putting each output gradient into each of ``groups`` of its call."""
    return lambda call, path, grad: store.put_all([(call.key, group, {path: grad})
                                                   for group in groups])


def keep_run_results(store: Store, run: CapturedRun, out_group: str, param_group: str) -> None:
    """Store a run's final output and loss (under FINAL) and each module's parameter gradients."""
    final = flatten_tensors(run.output)
    if run.loss is not None:
        final["loss"] = run.loss
    store.put(FINAL, out_group, final)
    for name, grads in run.param_grads.items():
        if grads:
            store.put(call_key(name, 0), param_group, grads)


# --------------------------------------------------------------------------------------------
# The float64 golden: which model gives it, and how a diagnosis says so


def module_placement(module: nn.Module) -> tuple[torch.dtype | None, torch.device | None]:
    """The floating dtype and device of a module's parameters/buffers (None when it has none)."""
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.is_floating_point():
            return tensor.dtype, tensor.device
    return None, None


def placed_on(tensor: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """A state tensor on ``module``'s device, in its floating dtype when floating."""
    dtype, device = module_placement(module)
    if dtype is None or not tensor.is_floating_point():
        dtype = tensor.dtype
    return tensor.to(device=device or tensor.device, dtype=dtype)


def describe_mode(model: nn.Module, dtype: torch.dtype | None, has_golden: bool) -> str:
    """The precision a diagnosis runs in (``float32: A and B as given, against A's float64
    golden``)."""
    a_dtype = dtype_label(module_placement(model)[0])
    mode = (f"{a_dtype}: A and B both cast to {a_dtype}" if dtype is not None
            else f"{a_dtype}: A and B as given")
    return mode + (", against A's float64 golden" if has_golden
                   else f", budgets from {a_dtype} rounding")


def golden_warning(label: str) -> str | None:
    """The first line saying no float64 golden could be made, why and the fix; None otherwise."""
    golden, no_golden = parse_golden_label(label)
    if golden is not None or no_golden == IN_FLOAT64:
        return None
    return f"warning: no float64 golden: {no_golden}"


#: What to do when A cannot be copied into float64.
COPY_FIX = ("fix: make the model deep-copyable, or diagnose it from its factory (the command "
            "line builds it again in float64 when copying fails; seed its initialisation)")


def golden_copy(model: nn.Module, rebuild: Callable[[], nn.Module] | None = None
                ) -> tuple[nn.Module | None, str]:
    """A float64 CPU copy of ``model`` and the golden's description, or None and why; a model
    deepcopy fails on is built by ``rebuild()`` and used when its weights are A's."""
    dtype, _ = module_placement(model)
    if dtype == GOLDEN_DTYPE:
        return None, IN_FLOAT64
    try:
        golden = copy.deepcopy(model)
    except Exception as exc:  # noqa: BLE001 - any failure means: try again, or say why
        failure = f"copying A to float64 failed ({type(exc).__name__}: {first_line(exc)})"
        if rebuild is None:
            return None, f"{failure}; budgets come from A's own rounding; {COPY_FIX}"
        golden = rebuild()
        if weight_digests(golden) != weight_digests(model):
            return None, (f"{failure}, and the factory built other weights when called "
                          "again; budgets come from A's own rounding; fix: seed the factory's "
                          "initialisation, or make the model deep-copyable")
        return golden.to(device="cpu", dtype=GOLDEN_DTYPE).eval(), (
            f"float64 copy of A on the CPU, built again by its factory ({failure})")
    return golden.to(device="cpu", dtype=GOLDEN_DTYPE), "float64 copy of A on the CPU"
