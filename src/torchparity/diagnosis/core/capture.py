"""Per-module capture of a model's forward and backward pass.

``Capture`` hooks the selected modules (glob or regex) and records each call's inputs,
outputs and, when asked, the gradient reaching each output. It keeps tensors, statistics
(shape, dtype, mean, std, absmax, non-finite count: where values blow up on models too big
to copy), or shapes only; ``on_call`` / ``on_grad`` receive each record as it exists, which
then drops its tensors, so ``diagnose`` compares big models on the fly in bounded memory."""

from __future__ import annotations

import copy
import dataclasses
import enum
import fnmatch
import inspect
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal, NamedTuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from torchparity.comparison.structure import cache_pairs
from torchparity.diagnosis.core.state import Held, StateRecorder, Summaries, held_state
from torchparity.errors import UsageError
from torchparity.memory import SharedCopies
from torchparity.subject.trees import (
    PyTree,
    field_names,
    flatten_tensors,
    map_objects,
    map_tensors,
    rebuilt_from_fields,
    walk,
)

__all__ = [
    "Capture",
    "bound_arguments",
    "ModuleCall",
    "Signature",
    "TensorStats",
    "call_key",
    "module_filter",
    "read_caches",
    "signature",
    "Uncopyable",
    "snapshot",
    "uncopyable_leaves",
]

Pattern = str | re.Pattern[str]
PatternSpec = Pattern | Sequence[Pattern] | Callable[[str], bool] | None

# Leaves that are plain data: safe to reuse, replay and write to JSON.
_PLAIN = (type(None), bool, int, float, complex, str, torch.dtype, torch.device, enum.Enum, slice)


# --------------------------------------------------------------------------------------------
# Module selection


def module_filter(include: PatternSpec = None,
                  exclude: PatternSpec = None) -> Callable[[str], bool]:
    """A predicate on qualified module names (the root is ``""``).

    A pattern is a glob matched against the whole name, ``"re:..."`` or a compiled
    ``re.Pattern`` (``search``), a sequence of those, or a callable; None includes every
    module and excludes none."""
    wanted = _matcher(include, default=True)
    unwanted = _matcher(exclude, default=False)
    return lambda name: wanted(name) and not unwanted(name)


def _matcher(spec: PatternSpec, *, default: bool) -> Callable[[str], bool]:
    if spec is None:
        return lambda name: default
    if callable(spec) and not isinstance(spec, re.Pattern):
        return spec
    patterns = [spec] if isinstance(spec, (str, re.Pattern)) else list(spec)
    tests = [_one_pattern(p) for p in patterns]
    return lambda name: any(test(name) for test in tests)


def _one_pattern(pattern: Pattern) -> Callable[[str], bool]:
    if isinstance(pattern, re.Pattern):
        return lambda name: pattern.search(name) is not None
    if pattern.startswith("re:"):
        regex = re.compile(pattern[3:])
        return lambda name: regex.search(name) is not None
    return lambda name: fnmatch.fnmatchcase(name, pattern)


class Uncopyable:
    """Stands in for an input object that was not copied; its call cannot be replayed."""

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name

    def __repr__(self) -> str:
        return f"Uncopyable({self.type_name})"


def read_caches(output: PyTree) -> PyTree:
    """``output`` with each ``transformers`` cache read now as ``((keys, values), ...)`` per
    layer (later calls write to the same object)."""
    return map_objects(output, cache_pairs)


def uncopyable_leaves(tree: PyTree) -> list[str]:
    """Type names of the inputs in ``tree`` that :func:`snapshot` could not copy."""
    return [leaf.type_name for _, leaf in walk(tree, "") if isinstance(leaf, Uncopyable)]


def snapshot(tree: PyTree, objects: bool = True,
             copy_tensor: Callable[[torch.Tensor], torch.Tensor] | None = None) -> PyTree:
    """Detached copy of the tensors in ``tree`` (by ``copy_tensor``); caches deep-copied so a
    replay sees them as at this call, or with ``objects=False`` standing as :class:`Uncopyable`."""
    copied = map_tensors(tree, copy_tensor or (lambda t: t.detach().clone()))
    return _copy_opaque(copied, objects)


def _copy_opaque(tree: PyTree, objects: bool = True) -> PyTree:
    if isinstance(tree, (torch.Tensor, Uncopyable, *_PLAIN)):
        return tree
    if isinstance(tree, dict):
        return {key: _copy_opaque(value, objects) for key, value in tree.items()}
    if isinstance(tree, (tuple, list)) and not hasattr(tree, "_fields"):
        return type(tree)(_copy_opaque(v, objects) for v in tree)
    if not objects:
        if rebuilt_from_fields(tree):
            return dataclasses.replace(tree, **{name: _copy_opaque(getattr(tree, name), False)
                                                for name in field_names(tree, init=True)})
        return Uncopyable(type(tree).__name__)
    # Tensors inside the object may be non-leaf graph nodes, which deepcopy refuses: hand it
    # detached clones of every tensor it can reach.
    memo = {id(t): t.detach().clone() for t in _reachable_tensors(tree)}
    try:
        return copy.deepcopy(tree, memo)
    except Exception:  # noqa: BLE001 - whatever the reason, the object cannot be snapshotted
        return Uncopyable(type(tree).__name__)


def _reachable_tensors(obj: object, seen: set[int] | None = None, depth: int = 0
                       ) -> Iterator[torch.Tensor]:
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 8:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _reachable_tensors(value, seen, depth + 1)
    elif isinstance(obj, (list, tuple, set)):
        for value in obj:
            yield from _reachable_tensors(value, seen, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (nn.Module, type)):
        yield from _reachable_tensors(vars(obj), seen, depth + 1)


# --------------------------------------------------------------------------------------------
# Records

#: A forward's parameters as ``(name, kind)``, ``kind`` one of ``inspect.Parameter``'s kinds
#: by name (``POSITIONAL_OR_KEYWORD``, ...), followed by the default when it is plain data
#: (``("sliding_window", "POSITIONAL_OR_KEYWORD", 0)``): what binding a recorded call and
#: comparing it by meaning need, and JSON-able.
Signature = list[tuple[str, str] | tuple[str, str, object]]
_JSON_PLAIN = (type(None), bool, int, float, str)


def signature(module: nn.Module) -> Signature | None:
    """The parameters of ``module.forward`` (None when it has no signature)."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    return [(p.name, p.kind.name, p.default) if isinstance(p.default, _JSON_PLAIN)
            else (p.name, p.kind.name) for p in parameters]


def bound_arguments(sig: Signature | None, args: tuple, kwargs: dict) -> dict[str, Any]:
    """A call's arguments by the parameter each binds to (``args.<i>`` past the positional
    ones, or without a signature)."""
    positional = [name for name, kind, *_ in sig or []
                  if kind in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")]
    bound = {(positional[i] if i < len(positional) else f"args.{i}"): value
             for i, value in enumerate(args)}
    bound.update(kwargs)
    return bound




@dataclasses.dataclass(frozen=True)
class TensorStats:
    """Summary of one tensor, computed in float64 (NaN/Inf excluded from the moments)."""

    shape: tuple[int, ...]
    dtype: str
    mean: float
    std: float
    absmax: float
    nonfinite: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorStats:
        values = tensor.detach().to(torch.float64) if tensor.is_floating_point() else None
        if values is None or values.numel() == 0:
            return cls(tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), 0.0, 0.0,
                       0.0, 0)
        finite = values[torch.isfinite(values)]
        return cls(
            shape=tuple(tensor.shape),
            dtype=str(tensor.dtype).removeprefix("torch."),
            mean=float(finite.mean()) if finite.numel() else float("nan"),
            std=float(finite.std(unbiased=False)) if finite.numel() else float("nan"),
            absmax=float(finite.abs().max()) if finite.numel() else float("nan"),
            nonfinite=int(values.numel() - finite.numel()),
        )


def call_key(name: str, call: int) -> str:
    """Key of one call of a module: its name for the first call, ``name#k`` for later ones."""
    return name if call == 0 else f"{name}#{call}"


class CallArgs(NamedTuple):
    """A call's arguments, as ``module(*args, **kwargs)`` takes them."""

    args: tuple
    kwargs: dict[str, Any]


@dataclasses.dataclass
class ModuleCall:
    """One call of one module, as seen by ``Capture``; ``start`` is pre-order, ``order``
    children before parents."""

    name: str
    call: int
    module_type: str
    start: int
    order: int = -1
    args: tuple | None = None  # the inputs and output pytree, when tensors are kept
    kwargs: dict[str, Any] | None = None
    output: PyTree = None
    # the shapes, inputs requiring grad and placement (dtype, device) are filled in every mode
    output_shapes: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    input_stats: dict[str, TensorStats] = dataclasses.field(default_factory=dict)
    output_stats: dict[str, TensorStats] = dataclasses.field(default_factory=dict)
    grad_output: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    grad_stats: dict[str, TensorStats] = dataclasses.field(default_factory=dict)
    inputs_requiring_grad: frozenset[str] = frozenset()
    input_placement: dict[str, tuple[torch.dtype, torch.device]] = dataclasses.field(
        default_factory=dict)
    input_shapes: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    state: dict[str, Held] = dataclasses.field(default_factory=dict)
    clock: int = 0  # the call's place among all modules' calls, with a StateRecorder

    @property
    def key(self) -> str:
        return call_key(self.name, self.call)

    @property
    def depth(self) -> int:
        return 0 if self.name == "" else self.name.count(".") + 1

    @property
    def outputs(self) -> dict[str, torch.Tensor]:
        """The output tensors by path (empty when tensors were not kept)."""
        return flatten_tensors(self.output)

    @property
    def inputs(self) -> dict[str, torch.Tensor]:
        """The input tensors by path: ``args.i`` and ``kwargs.name`` (empty when not kept)."""
        if self.args is None:
            return {}
        return {**flatten_tensors(self.args, "args"), **flatten_tensors(self.kwargs, "kwargs")}

    def drop_tensors(self) -> None:
        self.args = self.kwargs = self.output = None
        self.grad_output = {}


# --------------------------------------------------------------------------------------------
# The hooks


@dataclasses.dataclass(frozen=True)
class CaptureSettings:
    """What a :class:`Capture` keeps of each call."""

    # copies of inputs and outputs, of outputs only, statistics only, or output shapes only
    what: Literal["tensors", "outputs", "stats", "shapes"] = "tensors"
    grads: bool = False  # a backward inside the block fills each call's grad_output
    keep: bool = True  # keep each record's tensors once its callback has run
    objects: bool = True  # copy input objects other than tensors and containers (caches)
    state: bool = False  # summarise after each call the state the module read (call.state)
    share: bool = False  # one copy of a tensor that several calls see
    # without keep, hand on_call the outputs themselves, detached: it judges or sketches
    # them at once and copies what it keeps, before the model can change them
    live: bool = False


class Capture:
    """Record the calls of a model's modules while the ``with`` block runs.

    >>> with Capture(model, include="decoder.layers.*") as cap:
    ...     model(**batch)
    >>> cap["decoder.layers.0"].outputs

    Hooks are removed on exit, also after an exception; tensors are detached copies taken when
    the module was called or finished; ``records`` lists calls in the order they finished; a
    backward inside the block fills ``grad_output``; calls made while ``paused()`` are not
    recorded."""

    def __init__(
        self,
        model: nn.Module,
        include: PatternSpec = None,
        exclude: PatternSpec = None,
        *,
        settings: CaptureSettings | None = None,
        on_call: Callable[[ModuleCall], None] | None = None,
        on_grad: Callable[[ModuleCall, str, torch.Tensor], None] | None = None,
        states: StateRecorder | None = None,
        **keywords: Any,
    ) -> None:
        """Select the modules to hook (they are hooked on entering the ``with`` block).

        Args:
            model: the model whose modules are recorded.
            include: the modules selected, by glob or ``re:`` regex, or a filter (None: all).
            exclude: the modules left out.
            settings: what is kept of each call; keywords (``what="shapes"``) replace its fields.
            on_call: ``on_call(call)`` runs when a call finishes.
            on_grad: ``on_grad(call, path, grad)`` runs when a gradient arrives.
            states: a ``StateRecorder`` entered before, which gives each call its ``clock``.
        """
        settings = dataclasses.replace(settings or CaptureSettings(), **keywords)
        what, keep = settings.what, settings.keep
        if what not in ("tensors", "outputs", "stats", "shapes"):
            raise UsageError(
                f"Capture(what={what!r}): use 'tensors', 'outputs', 'stats' or 'shapes'")
        selected = module_filter(include, exclude)
        self.modules = {name: mod for name, mod in model.named_modules() if selected(name)}
        self.what = what
        self.grads = settings.grads
        self.on_call = on_call
        self.on_grad = on_grad
        self.keep = keep
        self.objects = settings.objects
        self.state = settings.state
        self.states = states
        self._summaries: Summaries = {}
        self._copies = SharedCopies() if settings.share else None
        self.live = settings.live and not keep
        self._paused = 0
        self._handles: list[RemovableHandle] = []
        self.restart()

    def restart(self) -> None:
        """Forget the calls recorded so far, hooks kept: what follows is a run of its own (a
        decoding's next step), numbered from 0."""
        self.records: list[ModuleCall] = []
        self._by_key: dict[str, ModuleCall] = {}
        self._calls_per_name: dict[str, int] = {}
        self._open: dict[str, list[ModuleCall]] = {}  # calls in flight per module (recursion)
        self._started = 0
        self._summaries.clear()
        if self._copies is not None:
            self._copies.clear()

    # -- context management ------------------------------------------------------------------

    def __enter__(self) -> Capture:
        for name, module in self.modules.items():
            self._handles.append(module.register_forward_pre_hook(
                self._pre_hook(name), with_kwargs=True))
            self._handles.append(module.register_forward_hook(
                self._post_hook(name), with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        """Remove all hooks (idempotent). Gradient hooks on tensors already made stay active."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Run modules without recording them (e.g. to replay a module inside a callback)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    # -- lookup -----------------------------------------------------------------------------

    def __getitem__(self, key: str) -> ModuleCall:
        return self._by_key[key]

    def __contains__(self, key: str) -> bool:
        return key in self._by_key

    def keys(self) -> list[str]:
        return [record.key for record in self.records]

    # -- hooks ------------------------------------------------------------------------------

    def _pre_hook(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self._paused:
                return
            call = ModuleCall(
                name=name,
                call=self._calls_per_name.get(name, 0),
                module_type=type(module).__name__,
                start=self._started,
                clock=self.states.clock if self.states is not None else 0,
            )
            self._calls_per_name[name] = call.call + 1
            self._started += 1
            inputs = {**flatten_tensors(args, "args"), **flatten_tensors(kwargs, "kwargs")}
            call.inputs_requiring_grad = frozenset(p for p, t in inputs.items() if t.requires_grad)
            call.input_placement = {p: (t.dtype, t.device) for p, t in inputs.items()}
            call.input_shapes = {p: tuple(t.shape) for p, t in inputs.items()}
            if self.what == "tensors":
                # Copied now: the module (or its callers) may change them in place later.
                call.args = snapshot(args, self.objects, self.copy)
                call.kwargs = snapshot(kwargs, self.objects, self.copy)
            elif self.what == "stats":
                call.input_stats = {path: TensorStats.of(t) for path, t in inputs.items()}
            self._open.setdefault(name, []).append(call)

        return hook

    def _post_hook(self, name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: PyTree) -> None:
            if self._paused or not self._open.get(name):
                return
            call = self._open[name].pop()
            call.order = len(self.records)
            held = read_caches(output) if self.objects else output
            outputs = flatten_tensors(held)
            call.output_shapes = {path: tuple(t.shape) for path, t in outputs.items()}
            if self.state:
                call.state = held_state(module, args, kwargs, self._summaries)
            if self.what == "stats":
                call.output_stats = {path: TensorStats.of(t) for path, t in outputs.items()}
            elif self.what != "shapes":
                call.output = map_tensors(held, torch.Tensor.detach if self.live else self.copy)
            if self.grads:
                output, outputs = _downstream_only(
                    output, outputs if held is output else flatten_tensors(output))
                self._watch_grads(call, outputs)
            self.records.append(call)
            self._by_key[call.key] = call
            if self.on_call is not None:
                self._paused += 1  # what the callback runs is not recorded (``paused()``)
                try:
                    self.on_call(call)
                finally:
                    self._paused -= 1
            if not self.keep:
                call.drop_tensors()
            return output

        return hook

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A detached copy of ``tensor``; with ``share``, one copy per unchanged memory (a
        call's output is the next call's input)."""
        if self._copies is None:
            return tensor.detach().clone()
        return self._copies.copy(tensor)

    def _watch_grads(self, call: ModuleCall, outputs: dict[str, torch.Tensor]) -> None:
        for path, tensor in outputs.items():
            if tensor.requires_grad:
                tensor.register_hook(self._grad_hook(call, path))

    def _grad_hook(self, call: ModuleCall, path: str) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            if self.what == "stats":
                call.grad_stats[path] = TensorStats.of(grad)
            elif self.what != "shapes" and (self.keep or self.on_grad is None):
                call.grad_output[path] = _accumulate(call.grad_output.get(path), grad)
            if self.on_grad is not None:
                self.on_grad(call, path, grad.detach())

        return hook


def _downstream_only(output: PyTree, outputs: dict[str, torch.Tensor]
                     ) -> tuple[PyTree, dict[str, torch.Tensor]]:
    """Each differentiable output handed on as an identity view, so its hook sees only what
    the rest of the model does with it (not an inner use, as attention's weights), the gradient
    a replay can be seeded with."""
    if sum(t.requires_grad for t in outputs.values()) < 2:
        return output, outputs
    output = map_tensors(output, lambda t: t.view_as(t) if t.requires_grad else t)
    return output, flatten_tensors(output)


def _accumulate(previous: torch.Tensor | None, grad: torch.Tensor) -> torch.Tensor:
    # A second backward through the same graph adds up, like ``.grad`` does.
    grad = grad.detach().clone()
    return grad if previous is None else previous + grad
