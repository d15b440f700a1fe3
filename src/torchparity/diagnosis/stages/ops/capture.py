"""Op capture inside one module call: the aten operations its own code runs, in order.

A ``TorchDispatchMode`` sees every op below autograd by its aten name, however Python spelled
it, in-place writes into a buffer included. A child module's call is one step, judged as the
child. Each step keeps its inputs as they were when it ran (copies), its outputs (past
:data:`KEPT_WHOLE_BYTES`, big floating ones as sketches seeded by their place, so every
side's compare), which earlier step made each input (the dataflow the alignment follows),
and its user frames outside torch and torchparity, innermost first."""

from __future__ import annotations

import contextlib
import functools
import linecache
import os
import re
import site
import sys
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

import torchparity
from torchparity import sketching
from torchparity.comparison.selection import PaddingSpec, left_out_of
from torchparity.sketching import Sketch, wants_sketch
from torchparity.subject.trees import PyTree

__all__ = ["Frame", "Step", "capture_steps", "capturing_first_call"]

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_PACKAGE_DIR = os.path.dirname(torchparity.__file__) + os.sep
#: torchparity's own models are user code here: the zoo is what is under test.
_SUBJECT_DIR = os.path.join(_PACKAGE_DIR, "reference") + os.sep
#: Bytes of outputs one captured call keeps whole; past them a big output is kept as its
#: sketch (a pass over it, and an estimate when judged): a small module's outputs stay whole
#: and exact, a large one's memory stays bounded.
KEPT_WHOLE_BYTES = 256 << 20
#: Ops that compute nothing: autograd's and tracing's bookkeeping.
_SKIPPED = {"aten::detach", "aten::lift_fresh", "aten::alias"}


@dataclass(frozen=True)
class Frame:
    """One source line of a step: ``path:line`` and the line's text."""

    path: str
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass
class Step:
    """One step of a module call: an aten op, or a child module's call by its relative path."""

    index: int
    name: str
    kind: str
    call: Callable[..., Any] = field(repr=False)  # the op overload, or the child module
    args: tuple = field(repr=False)
    kwargs: dict = field(repr=False)
    # "out.0", ...; "base.0": the buffer an op wrote into through a view
    outputs: dict[str, torch.Tensor | Sketch] = field(repr=False)
    producers: tuple[int | None, ...]  # per tensor input, the step that made it (None: given)
    stack: tuple[Frame, ...]
    scalars: dict[str, Any] = field(default_factory=dict)  # non-tensor arguments by name
    returned: bool = False  # an output of the step is an output of the module
    # the golden op's outputs on this step's inputs in float64 (A's steps, once paired)
    local_golden: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    @property
    def inputs(self) -> list[torch.Tensor]:
        return [t for t in tree_flatten((self.args, self.kwargs))[0]
                if isinstance(t, torch.Tensor)]

    @property
    def op(self) -> str:
        """The op without its overload (``aten::mul`` for ``aten::mul.Tensor``)."""
        return self.name.split(".")[0] if self.kind == "op" else self.name

    @property
    def code(self) -> str:
        """The innermost source line's text, or "" when the step has none."""
        return self.stack[0].text if self.stack else ""

    @functools.cached_property
    def signature(self) -> tuple:
        """Kind, op, input and output shapes and dtypes, kept: the alignment reads it per pair."""
        return (self.kind, self.op,
                tuple((tuple(t.shape), t.dtype) for t in self.inputs),
                tuple((tuple(t.shape), t.dtype) for t in self.outputs.values()))


def capture_steps(module: nn.Module, args: tuple, kwargs: dict, *, children: bool = True,
                  padding: PaddingSpec = None) -> list[Step]:
    """The steps ``module(*args, **kwargs)``'s own code runs, without gradients (``children=False``:
    every op at any depth; ``padding``: zeros in a sketched output)."""
    recorder = OpRecorder(module if children else nn.Module(), sys._getframe(),
                         padding=padding)
    with torch.no_grad(), recorder:
        try:
            output = module(*args, **kwargs)
        finally:
            recorder.remove_hooks()
    for index in recorder._producers(output):
        if index is not None:
            recorder.steps[index].returned = True
    return recorder.steps


@contextlib.contextmanager
def capturing_first_call(module: nn.Module, into: list[Step]) -> Iterator[None]:
    """Within the block, the steps of ``module``'s first call are appended to ``into``."""
    recorder: list[OpRecorder] = []

    def entering(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not recorder:  # the frame that calls forward bounds the stacks
            recorder.append(OpRecorder(module, sys._getframe(1)))
            recorder[0].__enter__()

    def leaving(_module: nn.Module, _args: tuple, _kwargs: dict, output: PyTree) -> None:
        if recorder and not into:
            recorder[0].__exit__(None, None, None)
            recorder[0].remove_hooks()
            for index in recorder[0]._producers(output):
                if index is not None:
                    recorder[0].steps[index].returned = True
            into.extend(recorder[0].steps)

    handles = [module.register_forward_pre_hook(entering, with_kwargs=True),
               module.register_forward_hook(leaving, with_kwargs=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def detached_copy(value: PyTree) -> PyTree:
    """``value`` with every tensor copied (detached)."""
    return tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, value)


class _Called(NamedTuple):
    """A step as it is entered: what is called, on copies of what, made by which steps, from
    where."""

    name: str
    kind: str
    call: Callable[..., Any]
    args: tuple
    kwargs: dict[str, Any]
    producers: tuple[int | None, ...]
    stack: tuple[Frame, ...]


class OpRecorder(TorchDispatchMode):
    def __init__(self, module: nn.Module, anchor: FrameType | None, *,
                 backward: bool = False, padding: PaddingSpec = None) -> None:
        super().__init__()
        self.anchor, self.backward, self.padding = anchor, backward, padding
        self.kept_bytes = 0
        self.steps: list[Step] = []
        self.made: dict[int, int] = {}  # id of a tensor -> the step that made or last wrote it
        # storage -> the step that last wrote into it: an alias written in place (torch's own
        # ``weight.detach()`` that nn.Embedding's max_norm renormalises) is neither the
        # tensor read later nor its ``_base``
        self.wrote: dict[tuple, int] = {}
        self.alive: list[torch.Tensor] = []  # keeps the ids above unique during the call
        self.depth = 0
        self.pending: list[_Called] = []
        self.handles = []
        for name, child in module.named_modules():
            if child is not module:
                self.handles.append(child.register_forward_pre_hook(
                    self._entering(name, child), with_kwargs=True))
                self.handles.append(child.register_forward_hook(self._leaving,
                                                                with_kwargs=True))

    def remove_hooks(self) -> None:
        for handle in self.handles:
            handle.remove()

    # -- child modules: one step each -----------------------------------------------------------

    def _entering(self, name: str, child: nn.Module) -> Callable:
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            self.depth += 1  # first: the copies below are no ops of the module's own code
            if self.depth == 1:
                self.pending.append(_Called(name, "module", child, detached_copy(args),
                                            detached_copy(kwargs),
                                            self._producers((args, kwargs)), self._stack()))
        return hook

    def _leaving(self, _module: nn.Module, _args: tuple, _kwargs: dict, output: PyTree) -> None:
        if self.depth == 1:
            self._add(self.pending.pop(), output, {})
        self.depth -= 1

    # -- ops ------------------------------------------------------------------------------------

    def __torch_dispatch__(self, func: torch._ops.OpOverload, types: tuple[type, ...],
                           args: tuple = (), kwargs: dict | None = None) -> PyTree:
        kwargs = kwargs or {}
        name = func.name()
        if self.depth or name.split(".")[0] in _SKIPPED:
            return func(*args, **kwargs)
        before = detached_copy((args, kwargs))
        producers = self._producers((args, kwargs))
        output = func(*args, **kwargs)
        written = _written(func, args, kwargs)
        for t in written:
            if _storage(t) is not None:
                self.wrote[_storage(t)] = len(self.steps)
                self.alive.append(t)
        self._add(_Called(name, "op", func, *before, producers, self._stack()), output,
                  _scalars(func, args, kwargs), [t._base for t in written if t._base is not None])
        return output

    def _add(self, called: _Called, output: PyTree, scalars: dict[str, Any],
             written: list[torch.Tensor] = ()) -> None:
        """The step ``called`` that returned ``output`` (and wrote ``written``), outputs kept."""
        index = len(self.steps)
        outs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
        outputs = {f"out.{i}": t for i, t in enumerate(outs)}
        outputs.update({f"base.{i}": t for i, t in enumerate(written)})
        outputs = {path: self._kept(path, t) for path, t in outputs.items()}
        for t in [*outs, *written]:
            self.made[id(t)] = index
            self.alive.append(t)
        self.steps.append(Step(index, called.name, called.kind, called.call, called.args,
                               called.kwargs, outputs, called.producers, called.stack, scalars))

    def _kept(self, path: str, tensor: torch.Tensor) -> torch.Tensor | Sketch:
        """An output as a step keeps it: a copy, or past the threshold a sketch seeded by its path
        (so sides compare), its left-out positions at zero."""
        if self.kept_bytes < KEPT_WHOLE_BYTES or not wants_sketch(tensor):
            self.kept_bytes += tensor.numel() * tensor.element_size()
            return tensor.detach().clone()
        left_out = left_out_of(self.padding, path, tensor)
        return sketching.sketch(sketching.masked(tensor.detach(), left_out and left_out.mask),
                                path)

    def _producers(self, value: PyTree) -> tuple[int | None, ...]:
        """For each tensor in ``value``, the step that made or last wrote into it (or its base)."""
        found = []
        for t in tree_flatten(value)[0]:
            if isinstance(t, torch.Tensor):
                base = t._base if t._base is not None else t
                steps = [self.made.get(id(t)), self.made.get(id(base)),
                         self.wrote.get(_storage(t))]
                found.append(max((s for s in steps if s is not None), default=None))
        return tuple(found)

    def _stack(self) -> tuple[Frame, ...]:
        """The user frames from here out to the module's call, innermost first; in a backward, the
        backward's own (a custom ``Function.backward`` is the user's), then the forward op's that
        made the running node (under anomaly detection)."""
        frames = []
        frame = sys._getframe(2)
        while frame is not None and frame is not self.anchor:
            path = frame.f_code.co_filename
            if _is_user_code(path):
                text = linecache.getline(path, frame.f_lineno).strip()
                frames.append(Frame(display_path(path), frame.f_lineno, text))
            elif self.backward and path.startswith(_PACKAGE_DIR):
                break  # the backward this capture started: outside the module's code
            frame = frame.f_back
        if self.backward:
            node = torch._C._current_autograd_node()
            if node is not None:
                frames += forward_stack(node.metadata.get("traceback_") or [])
        return tuple(frames)


_TRACEBACK_LINE = re.compile(r'File "(?P<path>[^"]+)", line (?P<line>\d+)')


def forward_stack(traceback: list[str]) -> tuple[Frame, ...]:
    """A forward op's anomaly-mode stack as user frames, innermost first, up to ours."""
    frames = []
    for entry in reversed(traceback):
        found = _TRACEBACK_LINE.search(entry)
        if found is None:
            continue
        path, line = found["path"], int(found["line"])
        if not _is_user_code(path):
            if path.startswith(_PACKAGE_DIR):
                break  # the replay that called the module: outside the module's code
            continue
        frames.append(Frame(display_path(path), line, linecache.getline(path, line).strip()))
    return tuple(frames)


def _is_user_code(path: str) -> bool:
    if path.startswith(_TORCH_DIR) or path.startswith("<"):
        return False
    return not path.startswith(_PACKAGE_DIR) or path.startswith(_SUBJECT_DIR)


def display_path(path: str) -> str:
    """A source path as a report names it: an installed package's file from the package
    (``transformers/models/...``), another relative to the working directory."""
    installed = max((d for d in _installed_dirs() if path.startswith(d)), key=len, default=None)
    if installed is not None:
        return path[len(installed):]
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


@functools.cache
def _installed_dirs() -> tuple[str, ...]:
    """The folders packages are installed into, each ending in a separator."""
    found = {sysconfig.get_path(key) for key in ("purelib", "platlib")}
    found.update(site.getsitepackages() + [site.getusersitepackages()])
    found.update(p for p in sys.path if os.path.basename(p) in ("site-packages",
                                                                "dist-packages"))
    return tuple(os.path.join(os.path.abspath(d), "") for d in found if d)


def _written(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an in-place (or ``out=``) op wrote into."""
    written = []
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        if isinstance(value, torch.Tensor):
            written.append(value)
    return written


def _storage(tensor: torch.Tensor) -> tuple | None:
    """Where a tensor's elements live, shared by its aliases; None without storage or elements."""
    try:
        place = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return (tensor.device, place) if place else None


def _scalars(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The op's arguments that hold no tensor, by their names in its schema."""
    found = {}
    for i, argument in enumerate(func._schema.arguments):
        if i < len(args):
            value = args[i]
        elif argument.name in kwargs:
            value = kwargs[argument.name]
        else:
            continue
        if not any(isinstance(x, torch.Tensor) for x in tree_flatten(value)[0]):
            found[argument.name] = value
    return found
