"""State a module reads besides its arguments' values: caches and other tensors it keeps.

It lives on the module (buffers, ``self.k_cache``, a ``layer_cache`` dict) or in objects
handed to it (a ``KVCache``, a ``DynamicCache``). :func:`held_state` summarises each tensor
after a call by how far each dimension is written (:class:`Held`: a preallocated cache is
judged by what it holds, a never-written slot named); :func:`state_difference` says where
A's and B's differ. :class:`StateRecorder` keeps each module's state before each call and
:func:`replaying` puts it back for a replay; :func:`why_not_replayable` says when B keeps
its state otherwise."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from torchparity.comparison.structure import cache_layers
from torchparity.subject.trees import PyTree, walk

#: How deep attributes are followed into plain objects, dicts, lists and tuples.
_DEPTH = 6
#: How many never-written slots of one dimension are named.
_HOLES = 8


@dataclass(frozen=True)
class Held:
    """One state tensor after a call: its shape, the extent written per dimension, the all-zero
    slices below it."""

    shape: tuple[int, ...]
    extent: tuple[int, ...]
    holes: dict[int, tuple[int, ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Held:
        values = tensor.detach()
        magnitude = (values.abs().nan_to_num(nan=1.0) if values.is_floating_point()  # NaN: written
                     else values.ne(0).to(torch.uint8))
        extent, holes = [], {}
        for dim, largest in enumerate(_largest_along(magnitude)):
            written = largest.gt(0).tolist()
            end = len(written) - written[::-1].index(True) if True in written else 0
            if False in written[:end]:  # rare: the slots are listed only then
                holes[dim] = tuple([i for i in range(end) if not written[i]][:_HOLES])
            extent.append(end)
        return cls(tuple(values.shape), tuple(extent), holes)

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "extent": list(self.extent),
                "holes": {str(d): list(h) for d, h in self.holes.items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Held:
        return cls(tuple(data["shape"]), tuple(data["extent"]),
                   {int(d): tuple(h) for d, h in data["holes"].items()})


def _largest_along(magnitude: torch.Tensor) -> list[torch.Tensor]:
    """For each dimension, the largest value of each of its slices (two passes over the tensor,
    not one per dimension)."""
    if magnitude.dim() <= 1:
        return [magnitude] if magnitude.dim() else []
    return [*_largest_along(magnitude.amax(dim=-1)),
            magnitude.amax(dim=tuple(range(magnitude.dim() - 1)))]


#: Summaries already made, by tensor identity and version (with the tensor, so that the
#: identity is not reused): a cache handed to every layer is summarised once per change.
Summaries = dict[tuple[int, int], tuple[torch.Tensor, Held]]


def held_state(module: nn.Module, args: tuple, kwargs: dict,
               summaries: Summaries | None = None) -> dict[str, Held]:
    """The state ``module`` reads, summarised: ``state.<path>`` for what it keeps itself (not its
    submodules'), ``args.<i>.<path>`` / ``kwargs.<name>.<path>`` inside objects it was handed."""
    summaries = {} if summaries is None else summaries

    def of(tensor: torch.Tensor) -> Held:
        key = (id(tensor), tensor._version)
        if key not in summaries or summaries[key][0] is not tensor:
            summaries[key] = (tensor, Held.of(tensor))
        return summaries[key][1]

    held = {f"state.{path}": of(t) for path, t in kept_tensors(module, recurse=False)}
    for path, leaf in walk(args, "args") + walk(kwargs, "kwargs"):
        if isinstance(leaf, (torch.Tensor, *_HOLDS_NO_TENSOR)):  # an argument, or a setting
            continue
        layered = cache_layers(leaf)
        if layered is None and not _is_object(leaf):
            continue
        inside = layered.items() if layered is not None else _tensors_in(vars(leaf), "", 0)
        held.update({f"{path}.{inner}": of(t) for inner, t in inside})
    return held


def kept_tensors(module: nn.Module, recurse: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Buffers and tensors ``module`` (and with ``recurse`` its submodules) keeps as attributes,
    by attribute path; parameters are weights, not state."""
    owners = module.named_modules() if recurse else [("", module)]
    for prefix, owner in owners:
        dotted = f"{prefix}." if prefix else ""
        for name, buffer in owner._buffers.items():  # named_buffers() costs more than a call
            if buffer is not None:
                yield f"{dotted}{name}", buffer
        for key, value in vars(owner).items():
            if key.startswith("_") or isinstance(value, (*_HOLDS_NO_TENSOR, nn.Module)):
                continue
            for path, tensor in _tensors_in(value, key, 1):
                if not isinstance(tensor, nn.Parameter):
                    yield f"{dotted}{path}", tensor


#: Values that hold no tensor, most of a module's attributes (its settings), told apart first.
_HOLDS_NO_TENSOR = (bool, int, float, str, bytes, type(None), torch.dtype, torch.device)


def _tensors_in(value: PyTree, path: str, depth: int) -> list[tuple[str, torch.Tensor]]:
    found: list[tuple[str, torch.Tensor]] = []
    _collect_tensors(value, path, depth, found)
    return found


def _collect_tensors(value: PyTree, path: str, depth: int,
                     found: list[tuple[str, torch.Tensor]]) -> None:
    # A plain recursion into one list (see subject.trees.walk): every captured call of a
    # decoding step comes through here.
    if isinstance(value, _HOLDS_NO_TENSOR):
        return
    if isinstance(value, torch.Tensor):
        found.append((path, value))
        return
    # A builtin container has no attributes of its own: only other objects can be caches.
    layered = None if type(value) in (dict, list, tuple) else cache_layers(value)
    if layered is not None:
        found.extend((f"{path}.{inner}" if path else inner, t) for inner, t in layered.items())
    elif depth > _DEPTH or isinstance(value, (nn.Module, type)):
        return
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(item, _HOLDS_NO_TENSOR):
                _collect_tensors(item, f"{path}.{key}" if path else str(key), depth + 1, found)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            if not isinstance(item, _HOLDS_NO_TENSOR):
                _collect_tensors(item, f"{path}.{index}" if path else str(index), depth + 1,
                                 found)
    elif _is_object(value):
        _collect_tensors(vars(value), path, depth + 1, found)


def _is_object(value: object) -> bool:
    """A plain object whose attributes may hold tensors (a cache), not a module or a class."""
    return hasattr(value, "__dict__") and not isinstance(value, (nn.Module, type)) and \
        not callable(value)


def state_difference(a: dict[str, Held], b: dict[str, Held]) -> tuple[str, str] | None:
    """The first state path both hold whose written extent differs, and how (``holds 12 positions
    in B, 11 in A; ...``); another capacity written alike is none; an object handed under
    another name in B is compared under A's."""
    b = _renamed_as_in(a, b)
    for path in [p for p in a if p in b]:
        detail = _held_difference(a[path], b[path])
        if detail is not None:
            return path, detail
    return None


def _renamed_as_in(a: dict[str, Held], b: dict[str, Held]) -> dict[str, Held]:
    """B's state with the object argument only B has named as the one only A has."""
    def arguments(held: dict[str, Held]) -> set[str]:
        return {".".join(p.split(".")[:2]) for p in held if not p.startswith("state.")}

    only_a, only_b = arguments(a) - arguments(b), arguments(b) - arguments(a)
    if len(only_a) != 1 or len(only_b) != 1:
        return b
    (old,), (new,) = only_b, only_a
    return {f"{new}{p[len(old):]}" if p.startswith(f"{old}.") else p: h for p, h in b.items()}


def _held_difference(a: Held, b: Held) -> str | None:
    if len(a.shape) != len(b.shape):
        return f"{len(b.shape)}-d in B, {len(a.shape)}-d in A"
    for dim in range(len(a.shape)):
        if a.extent[dim] == b.extent[dim] and a.holes.get(dim) == b.holes.get(dim):
            continue
        # Caches lay positions out in the last but one dimension (..., positions, features).
        positions = dim == len(a.shape) - 2
        slots, slot = ("positions", "position") if positions else (f"entries along dim {dim}",
                                                                   "entry")
        text = f"holds {b.extent[dim]} {slots} in B, {a.extent[dim]} in A"
        for side, held in (("B", b), ("A", a)):
            if held.holes.get(dim):
                which = ", ".join(map(str, held.holes[dim]))
                text += f"; {side} never wrote {slot} {which} (all zeros)"
        return text
    return None


# --------------------------------------------------------------------------------------------
# State across calls: what a replay must restore


#: A module's own state: attribute name -> value (tensors, None, numbers, and lists, tuples and
#: dicts of them); its buffers among them.
OwnState = dict[str, Any]

_PLAIN = (type(None), bool, int, float, str)


def own_state(module: nn.Module) -> OwnState:
    """The state ``module`` keeps on itself: buffers and public attributes holding tensors,
    numbers or containers of them."""
    state: OwnState = dict(module._buffers)
    for name, value in vars(module).items():
        if not name.startswith("_") and name != "training" and _is_plain_state(value):
            state[name] = value
    return state


def _is_plain_state(value: object, depth: int = 0) -> bool:
    if isinstance(value, torch.Tensor):
        return not isinstance(value, nn.Parameter)
    if isinstance(value, _PLAIN):
        return True
    if depth < _DEPTH and isinstance(value, (list, tuple)):
        return all(_is_plain_state(v, depth + 1) for v in value)
    if depth < _DEPTH and isinstance(value, dict):
        return all(_is_plain_state(v, depth + 1) for v in value.values())
    return False


def _fingerprint(value: PyTree) -> PyTree:
    """A cheap fingerprint of a state: tensors by identity, version and shape, the rest by value."""
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), value._version, tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        return tuple((k, _fingerprint(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return tuple(_fingerprint(v) for v in value)
    return value


class StateRecorder:
    """Records each module's own state before each of its calls, and which modules change theirs.

    ``clock`` counts all modules' calls as they start; ``snapshots=False`` records only which
    modules change (cheap, for B); an unchanged tensor's copy is shared across calls."""

    def __init__(self, model: nn.Module, snapshots: bool = True) -> None:
        self.modules = dict(model.named_modules())
        self.snapshots = snapshots
        self.clock = 0
        self.history: dict[str, list[tuple[int, OwnState]]] = {}
        self.changing: set[str] = set()
        self._pending: dict[str, list[PyTree]] = {}  # fingerprints of states before a call
        self._copies: dict[str, dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]]] = {}
        self._handles: list[RemovableHandle] = []

    def __enter__(self) -> StateRecorder:
        for name, module in self.modules.items():
            self._handles.append(module.register_forward_pre_hook(self._before(name)))
            self._handles.append(module.register_forward_hook(self._after(name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _before(self, name: str) -> Callable[[nn.Module, tuple], None]:
        def hook(module: nn.Module, args: tuple) -> None:
            self.clock += 1
            state = own_state(module)
            self._pending.setdefault(name, []).append(_fingerprint(state))
            if self.snapshots:
                self.history.setdefault(name, []).append((self.clock, self._copy(name, state)))
        return hook

    def _after(self, name: str) -> Callable[[nn.Module, tuple, PyTree], None]:
        def hook(module: nn.Module, args: tuple, output: PyTree) -> None:
            if self._pending.get(name) and \
                    self._pending[name].pop() != _fingerprint(own_state(module)):
                self.changing.add(name)
        return hook

    def _copy(self, name: str, value: PyTree) -> PyTree:
        if isinstance(value, torch.Tensor):
            copies = self._copies.setdefault(name, {})
            key = (id(value), value._version)
            if key not in copies or copies[key][0] is not value:
                copies[key] = (value, value.detach().clone())
            return copies[key][1]
        if isinstance(value, dict):
            return {k: self._copy(name, v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._copy(name, v) for v in value)
        return value

    def snapshots_of_changing(self) -> dict[str, list[tuple[int, OwnState]]]:
        """The snapshots of the modules that change their state across calls."""
        return {name: self.history.get(name, []) for name in sorted(self.changing)}


def state_at(history: dict[str, list[tuple[int, PyTree]]], name: str, clock: int) -> PyTree:
    """A module's state when the call at ``clock`` starts (None: no call from then on)."""
    return next((state for started, state in history.get(name, []) if started >= clock), None)


def restore(module: nn.Module, state: OwnState) -> None:
    """Put ``state`` (from :func:`own_state` or a snapshot) back on ``module``."""
    for name, value in state.items():
        if name in module._buffers:
            module._buffers[name] = value
        else:
            setattr(module, name, value)


def copied(value: PyTree) -> PyTree:
    """``value`` with every tensor cloned (a snapshot a replay may write into)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: copied(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(copied(v) for v in value)
    return value


def states_within(history: dict[str, list[tuple[int, OwnState]]], name: str, clock: int
                  ) -> dict[str, OwnState]:
    """The states of ``name`` and its changing submodules, by relative name, at its call at
    ``clock``."""
    states = {}
    for module in history:
        relative = _relative(module, name)
        if relative is not None:
            state = state_at(history, module, clock)
            if state is not None:
                states[relative] = state
    return states


def _relative(module: str, root: str) -> str | None:
    if module == root:
        return ""
    if not root:
        return module
    return module[len(root) + 1:] if module.startswith(f"{root}.") else None


def changing_within(changing: set[str], name: str) -> set[str]:
    """The names, relative to ``name``, of it and its submodules that change their state."""
    return {r for r in (_relative(m, name) for m in changing) if r is not None}


def why_not_replayable(a_states: dict[str, OwnState], b_root: nn.Module,
                       b_changing: set[str]) -> str | None:
    """Why B's module cannot be replayed on A's recorded state (B keeps state where A does not,
    or in other attributes), or None."""
    def where(relative: str) -> str:
        return f"its submodule {relative}" if relative else "it"

    for relative in sorted(b_changing - a_states.keys()):
        return (f"the module keeps state across calls ({where(relative)} changes its state "
                "in B, not in A)")
    for relative, state in a_states.items():
        try:
            b_state = own_state(b_root.get_submodule(relative))
        except AttributeError:
            return f"the module keeps state across calls in {where(relative)}, which B lacks"
        if set(b_state) != set(state):
            return (f"the module keeps state across calls, in {', '.join(sorted(state))} in "
                    f"A and {', '.join(sorted(b_state))} in B")
    return None


@contextlib.contextmanager
def replaying(root: nn.Module, states: dict[str, OwnState],
              place: Callable[[torch.Tensor, nn.Module], torch.Tensor]) -> Iterator[None]:
    """Within the block, ``root``'s modules named in ``states`` hold copies of them, placed by
    ``place(tensor, module)``; afterwards what they held before."""
    modules = {relative: root.get_submodule(relative) for relative in states}
    before = {relative: own_state(module) for relative, module in modules.items()}
    try:
        for relative, module in modules.items():
            restore(module, _mapped(copied(states[relative]), lambda t, m=module: place(t, m)))
        yield
    finally:
        for relative, module in modules.items():
            restore(module, before[relative])


def _mapped(value: PyTree, fn: Callable[[torch.Tensor], torch.Tensor]) -> PyTree:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: _mapped(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_mapped(v, fn) for v in value)
    return value



def cast_held(value: PyTree, cast: Callable[[torch.Tensor], torch.Tensor], *, inside: bool = False,
              depth: int = 0) -> None:
    """Every tensor held inside an object in ``value`` (a ``StaticCache``'s buffers) replaced in
    place by ``cast(tensor)``, so a float64 replay writes into a float64 cache; ``value`` must
    be the caller's copy, and tensors that are arguments themselves are left to the caller."""
    if depth > _DEPTH or isinstance(value, (*_HOLDS_NO_TENSOR, nn.Module, type)):
        return
    if isinstance(value, (dict, list)):
        slots, assign = (value.items() if isinstance(value, dict) else enumerate(value),
                         value.__setitem__)
    elif isinstance(value, tuple):
        slots, assign = enumerate(value), None
    elif _is_object(value):
        slots, assign, inside = vars(value).items(), lambda k, v: setattr(value, k, v), True
    else:
        return
    for key, item in list(slots):
        if not isinstance(item, torch.Tensor):
            cast_held(item, cast, inside=inside, depth=depth + 1)
        elif inside and assign is not None:
            assign(key, cast(item))
