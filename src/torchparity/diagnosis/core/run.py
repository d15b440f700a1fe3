"""Running models for a diagnosis: its options, seeded captured runs, and one-module replays."""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypeVar

import torch
from torch import nn

from torchparity import backends as attention_backends
from torchparity.diagnosis.core.align import NameMap
from torchparity.diagnosis.core.capture import (
    CallArgs,
    Capture,
    ModuleCall,
    PatternSpec,
    Signature,
    bound_arguments,
    module_filter,
    read_caches,
    signature,
)
from torchparity.diagnosis.core.masks import fitted_keys, fitted_queries
from torchparity.diagnosis.core.state import StateRecorder, cast_held
from torchparity.diagnosis.core.trace import ReplayUnavailable
from torchparity.errors import UsageError, UserCodeError
from torchparity.sketching import kept
from torchparity.subject.blockwise import Float64Run, stream_grads
from torchparity.subject.factory import first_line
from torchparity.subject.padding import Padding
from torchparity.subject.running import (
    Inputs,
    LossFn,
    call_model,
    projection_loss,
    seeded,
    upcast,
)
from torchparity.subject.trees import PyTree, flatten_tensors, map_tensors, map_tensors_with_paths

#: An attention backend name for :func:`torchparity.backends.use`, or a function returning a
#: context manager that selects it (for models the registry does not drive), or None.
BackendSpec = str | Callable[[], contextlib.AbstractContextManager] | None

#: Which modules get a local error: those whose propagated error diverged (and those whose
#: backward ran before the first diverging gradient), or every one.
Local = Literal["diverged", "all"]

#: The golden's dtype: A's math with rounding far below any other dtype's.
GOLDEN_DTYPE = torch.float64


def in_golden_dtype(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor as the golden holds it: on the CPU, in float64 when floating."""
    return tensor.to("cpu", GOLDEN_DTYPE) if tensor.is_floating_point() else tensor.cpu()


def golden_inputs(inputs: PyTree) -> PyTree:
    """A fresh copy of recorded inputs in float64 on the CPU, a handed-in cache's buffers too
    (the float64 replay writes into it)."""
    inputs = upcast(inputs, GOLDEN_DTYPE, "cpu")
    cast_held(inputs, in_golden_dtype)
    return inputs


@dataclass(frozen=True)
class Options:
    """The settings of one diagnosis, built once and passed whole down the pipeline."""

    include: PatternSpec = None  # the modules captured, by glob or ``re:`` regex (None: all)
    exclude: PatternSpec = None
    backward: bool = True
    loss_fn: LossFn | None = None  # None: a fixed random projection of the first output
    backend_a: BackendSpec = None
    backend_b: BackendSpec = None
    progress: bool = False  # a progress bar on stderr
    local: Local = "diverged"
    padding: Padding = field(default_factory=Padding)  # left out of judgements and the loss
    dtype: torch.dtype | None = None  # the models run as copies in this dtype; None: as given
    compile_b: str | None = None  # B compiled module by module in this form (dynamic, static)
    name_map: NameMap | None = None  # A's module names mapped to B's
    ops: str | None = None  # B's module drilled down to its ops; None: the first divergence
    # ``more_ops(modules)`` records a trace with A's ops of those modules where the trace
    # judged against lacks them (``diagnose --base``)
    more_ops: Callable[[list[str]], Path] | None = None

    def __post_init__(self) -> None:
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise UsageError("loss_fn must be callable(output, inputs); got "
                             f"{type(self.loss_fn).__name__}")
        for spec in (self.backend_a, self.backend_b):
            if isinstance(spec, str) and spec not in attention_backends.names():
                raise UsageError(f"unknown attention backend {spec!r}; choose one of "
                                 f"{', '.join(attention_backends.names())}")
        if self.local not in ("diverged", "all"):
            raise UsageError(f"local must be 'diverged' or 'all'; got {self.local!r}")

    def selects(self) -> Callable[[str], bool]:
        """The filter of module names ``include`` and ``exclude`` make."""
        return module_filter(self.include, self.exclude)


class Models(NamedTuple):
    """The two models of a diagnosis: A, None where its side is read from a trace, and B."""

    a: nn.Module | None
    b: nn.Module


def backend_pair(backends: tuple[BackendSpec, BackendSpec] | None
                 ) -> tuple[BackendSpec, BackendSpec]:
    """``backends=(a, b)`` checked to be a pair; None: neither side's backend is set."""
    if backends is None:
        return None, None
    if not (isinstance(backends, (tuple, list)) and len(backends) == 2):
        raise UsageError("backends must be a pair (backend of A, backend of B); "
                         f"got {backends!r}")
    return backends[0], backends[1]


def shown(progress: bool | None) -> bool:
    """Whether a progress bar is shown: as asked, by default when stderr is a terminal."""
    return sys.stderr.isatty() if progress is None else progress


def stream_needed(*models: nn.Module) -> bool:
    """Whether A's side goes to disk: the models take over a quarter of the free memory
    (captures, the golden and replays come on top)."""
    size = sum(t.numel() * t.element_size() for model in models
               for t in [*model.parameters(), *model.buffers()])
    available = _available_memory()
    return available is not None and size > available / 4


def _available_memory() -> int | None:
    """Bytes of memory available (Linux's MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# --------------------------------------------------------------------------------------------
# Running a model


@contextlib.contextmanager
def backend_context(spec: BackendSpec) -> Iterator[None]:
    """Run under the attention backend ``spec`` (a registry name or a context factory)."""
    if spec is None:
        yield
    elif isinstance(spec, str):
        with attention_backends.use(spec):
            yield
    else:
        with spec():
            yield


def default_loss(output: PyTree, inputs: PyTree = None, padding: Padding | None = None
                 ) -> torch.Tensor:
    """The output's own scalar ``loss``, else a projection loss reaching every unpadded element
    of the first floating output."""
    flat = flatten_tensors(output)
    if "output.loss" in flat and flat["output.loss"].numel() == 1:
        return flat["output.loss"].reshape(())
    first = next(((p, t) for p, t in flat.items() if t.is_floating_point()), None)
    if first is None:
        raise UsageError("the model output has no floating tensor to take gradients of; pass "
                         "loss_fn or backward=False")
    return projection_loss(dict([first]), padding)


@dataclass
class CapturedRun:
    """What one captured run leaves: its calls, detached output, loss and parameter grads."""

    calls: list[ModuleCall]
    output: PyTree
    loss: torch.Tensor | None
    param_grads: dict[str, dict[str, torch.Tensor]]  # module name -> direct param name -> grad
    changing: set[str] = field(default_factory=set)  # modules that change their own state


def run_model(model: nn.Module, inputs: Inputs, opts: Options, backend: BackendSpec, *,
              backward: bool, float64: bool = False, states: StateRecorder | None = None,
              **capture: Any) -> CapturedRun:
    """One seeded forward (and backward, ``.grad`` untouched) with the selected modules captured
    and ``states`` recorded; each parameter's gradient kept (sketched when big) once complete.
    With ``float64`` the model runs module by module in float64 on the CPU, ``inputs`` already
    cast (no copy). A backward error is a one-line :class:`UserCodeError` naming
    ``--no-backward``."""
    loss = None
    names = {id(p): name for name, p in model.named_parameters()}
    grads: dict[str, Any] = {}

    def keep(name: str, grad: torch.Tensor) -> None:
        grads[name] = kept(name.rpartition(".")[2], grad)

    capturing = Capture(model, opts.selects(), grads=backward, states=states, **capture)
    recording = states if states is not None else contextlib.nullcontext()
    precision = (Float64Run(model, on_grad=keep, device="cpu") if float64
                 else contextlib.nullcontext())
    with backend_context(backend), seeded(), recording, capturing as cap, precision as run64:
        with torch.set_grad_enabled(backward):
            output = call_model(model, inputs)
            if backward:
                loss = (opts.loss_fn(output, inputs) if opts.loss_fn is not None
                        else default_loss(output, inputs, opts.padding))
                if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
                    shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss)
                    raise UsageError(f"loss_fn must return a scalar tensor; got {shape}")
                loss = loss.reshape(())
                _trainable(model)
                with _backward_errors(model):
                    if float64:
                        run64.backward(loss, unused=False)
                    else:
                        stream_grads(model, loss, keep, unused=False)
    # A weight shared by several modules (a tied head) is judged at the module whose name the
    # model gives it: its gradient is complete only when that module's backward has run.
    param_grads = {
        name: {pn: grads[names[id(p)]] for pn, p in module.named_parameters(recurse=False)
               if names.get(id(p)) == _qualified(name, pn) and names[id(p)] in grads}
        for name, module in cap.modules.items()
    }
    output = map_tensors(read_caches(output), lambda t: t.detach())
    return CapturedRun(cap.records, output, None if loss is None else loss.detach(), param_grads,
               set() if states is None else states.changing)


def _qualified(module: str, param: str) -> str:
    return f"{module}.{param}" if module else param


@contextlib.contextmanager
def _backward_errors(model: nn.Module) -> Iterator[None]:
    try:
        yield
    except RuntimeError as exc:  # e.g. a cache written in place while autograd needs it
        raise UserCodeError(f"the backward pass of {type(model).__name__} raised RuntimeError: "
                            f"{first_line(exc)}; to compare forward outputs only, run with "
                            "--no-backward (backward=False); a decoding needs no gradients "
                            "(--decode takes none)") from exc


class UnfitArguments(ReplayUnavailable):
    """A's recorded arguments have no sound mapping onto B's ``forward``."""


def rebind(recorded: Signature | None, inputs: CallArgs, module: nn.Module
           ) -> tuple[CallArgs, list[str]]:
    """A recorded call's arguments as another revision's ``module`` takes them, by meaning, and a
    note per argument handed to a parameter of another name: each bound to A's parameter and
    handed to B's of that name, or position where B renamed it (a None B has no parameter for
    dropped); :class:`UnfitArguments` when no sound mapping exists."""
    args, kwargs = inputs
    try:
        forward = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return inputs, []
    a_bound = bound_arguments(recorded, args, kwargs)
    # B binds an argument by another name than A did (``*args`` on either side names none)
    renamed = any(a_name != b_name and not a_name.startswith("args.")
                  and not b_name.startswith("args.") for a_name, b_name in
                  zip(a_bound, bound_arguments(signature(module), args, kwargs), strict=False))
    try:
        forward.bind(*args, **kwargs)
        if recorded is None or not renamed:
            return inputs, []
    except TypeError:
        pass
    names = [name for name, *_ in recorded or []]
    forward_text = f"B's {type(module).__name__}.forward({', '.join(forward.parameters)})"
    rebound: dict[str, Any] = {}
    notes = []
    for name, value in a_bound.items():
        target = name if name in forward.parameters else _renamed(name, names, forward)
        if target is None or target in rebound:
            if value is None:
                continue
            raise UnfitArguments(f"{forward_text} has no parameter that A's argument {name} "
                                 "surely maps to (none of its name, none new at its position)")
        if target != name:
            notes.append(f"A's {name} handed to B's {target}")
        rebound[target] = value
    try:
        bound = forward.bind(**rebound)
    except TypeError as exc:
        raise UnfitArguments(f"A's arguments do not bind to {forward_text}: {exc}") from None
    return CallArgs(bound.args, bound.kwargs), notes


def _renamed(name: str, names: list[str], forward: inspect.Signature) -> str | None:
    """B's parameter at ``name``'s position in A, taken as its new name: only one A lacks, and
    not ``*args``/``**kw``."""
    if name not in names or names.index(name) >= len(forward.parameters):
        return None
    target = list(forward.parameters)[names.index(name)]
    if target in names or forward.parameters[target].kind in (
            inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
        return None
    return target


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise UsageError(f"{type(model).__name__} has no parameter that requires grad; pass "
                         "backward=False")
    return params


def replay(module: nn.Module, inputs: CallArgs, backend: BackendSpec, *,
           grad_out: Mapping[str, torch.Tensor] | None = None,
           requires_grad: frozenset[str] = frozenset(), float64: bool = False,
           ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Run one module on recorded inputs; with ``grad_out``, also backward from it.

    Returns the outputs by path and, with ``grad_out``, the gradients of the inputs that required
    grad (``input.<path>``) and of the direct parameters (``param.<name>``); ``float64`` as in
    :func:`run_model`."""
    args, kwargs = inputs
    if float64:
        return _replay_float64(module, args, kwargs, backend, grad_out, requires_grad)
    with backend_context(backend), seeded():
        if not grad_out:
            with torch.no_grad():
                return flatten_tensors(read_caches(module(*args, **kwargs))), {}
        outputs, leaves, seeds = _forward_for_backward(module, args, kwargs, grad_out,
                                                       requires_grad)
        params = {f"param.{n}": p for n, p in module.named_parameters(recurse=False)
                  if p.requires_grad}
        targets = {**leaves, **params}
        grads = {}
        if seeds and targets:
            found = torch.autograd.grad([o for o, _ in seeds], list(targets.values()),
                                        [g for _, g in seeds], allow_unused=True)
            grads = {name: g for name, g in zip(targets, found, strict=True) if g is not None}
    return {p: t.detach() for p, t in outputs.items()}, grads


def _forward_for_backward(module: nn.Module, args: tuple, kwargs: dict,
                          grad_out: Mapping[str, torch.Tensor], requires_grad: frozenset[str]
                          ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor],
                                     list[tuple[torch.Tensor, torch.Tensor]]]:
    """The module's outputs, the inputs that required grad (now leaves), and each output
    backward starts from with its gradient."""
    leaves = {f"input.{path}": t.requires_grad_()
              for path, t in {**flatten_tensors(args, "args"),
                              **flatten_tensors(kwargs, "kwargs")}.items()
              if path in requires_grad}
    with torch.enable_grad():
        outputs = flatten_tensors(read_caches(module(*args, **kwargs)))
    seeds = [(outputs[p], g.to(outputs[p])) for p, g in grad_out.items()
             if p in outputs and outputs[p].requires_grad]
    return outputs, leaves, seeds


def _replay_float64(module: nn.Module, args: tuple, kwargs: dict, backend: BackendSpec,
                    grad_out: Mapping[str, torch.Tensor] | None, requires_grad: frozenset[str]
                    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    grads: dict[str, torch.Tensor] = {}
    direct = {n for n, p in module.named_parameters(recurse=False) if p.requires_grad}
    run64 = Float64Run(module, device="cpu", on_grad=lambda name, grad: grads.__setitem__(
        f"param.{name}", grad) if name in direct else None)
    with backend_context(backend), seeded(), run64:
        if not grad_out:
            with torch.no_grad():
                return flatten_tensors(read_caches(module(*args, **kwargs))), {}
        outputs, leaves, seeds = _forward_for_backward(module, args, kwargs, grad_out,
                                                       requires_grad)
        if seeds:
            found = run64.backward([o for o, _ in seeds], [g for _, g in seeds],
                                   tuple(leaves.values()), unused=False)
            grads.update({name: g for name, g in zip(leaves, found, strict=True)
                          if g is not None})
    return {p: t.detach() for p, t in outputs.items()}, grads


def placed_as_called(inputs: CallArgs, call: ModuleCall, sig: Signature | None = None
           ) -> CallArgs:
    """Recorded inputs moved to the device, floating ones cast to the dtype, that ``call``'s
    module saw there (by parameter of ``sig`` when given)."""
    own = {parameter_path(sig, path): found for path, found in call.input_placement.items()}

    def place(path: str, tensor: torch.Tensor) -> torch.Tensor:
        dtype, device = own.get(parameter_path(sig, path), (tensor.dtype, tensor.device))
        if not (tensor.is_floating_point() and dtype.is_floating_point):
            dtype = tensor.dtype
        return tensor.to(device=device, dtype=dtype)

    args, kwargs = inputs
    return CallArgs(map_tensors_with_paths(args, place, "args"),
                    map_tensors_with_paths(kwargs, place, "kwargs"))


def parameter_path(sig: Signature | None, path: str) -> str:
    """An input's path by the parameter it binds to (``args.1.0`` -> ``mask.0``), so positional
    and keyword passing agree; as given without ``sig``."""
    if sig is None:
        return path
    head, _, rest = path.partition(".")
    index, _, tail = rest.partition(".")
    positional = [name for name, kind, *_ in sig
                  if kind in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")]
    name = index if head == "kwargs" else (
        positional[int(index)] if int(index) < len(positional) else f"args.{index}")
    return f"{name}.{tail}" if tail else name


def fitted(inputs: CallArgs, call: ModuleCall, sig: Signature | None = None
           ) -> tuple[CallArgs, list[str]]:
    """Recorded inputs with each attention mask fitted to ``call``'s own (its queries' rows by
    ``cache_position``, then its keys, where no query's keys change), and a note per mask."""
    notes = []
    shapes = {parameter_path(sig, path): shape for path, shape in call.input_shapes.items()}
    args, kwargs = inputs
    positions = kwargs.get("cache_position")

    def fit(path: str, tensor: torch.Tensor) -> torch.Tensor:
        shape = shapes.get(parameter_path(sig, path))
        if shape is None or shape == tensor.shape or len(shape) != tensor.dim():
            return tensor
        said = []
        if shape[:-2] == tensor.shape[:-2] and shape[-2] != tensor.shape[-2]:
            rows = fitted_queries(tensor, positions if isinstance(positions, torch.Tensor)
                                  else None, shape[-2])
            if rows is None:
                return tensor
            tensor, how = rows
            said.append(how)
        if shape[:-1] != tensor.shape[:-1]:
            return tensor
        if shape != tensor.shape:
            keys = fitted_keys(tensor, shape[-1])
            if keys is None:
                return tensor
            tensor, how = keys
            said.append(how)
        notes.append(f"mask {path} {', '.join(said)}")
        return tensor

    return CallArgs(map_tensors_with_paths(args, fit, "args"),
                    map_tensors_with_paths(kwargs, fit, "kwargs")), notes


#: An argument of B's module by its parameter's name, and what it becomes in B's convention.
Converted = tuple[str, Callable[[object], object]]


def for_b(recorded: Signature | None, inputs: CallArgs, call: ModuleCall,
          module: nn.Module, fit: bool = False, as_none: str | None = None,
          converted: Converted | None = None) -> tuple[CallArgs, list[str]]:
    """A's recorded ``inputs`` as B's ``module`` takes them at ``call``, and notes: rebound by
    meaning, placed as B's call had them, parameter ``as_none`` None (B derives the rest from
    it), ``converted`` in B's form, and with ``fit`` masks fitted to B's keys."""
    inputs, notes = rebind(recorded, inputs, module)
    own = signature(module)
    inputs = placed_as_called(inputs, call, own)
    if as_none is not None:
        inputs = _with_replaced(inputs, own, as_none, lambda _: None)
    if converted is not None:
        inputs = _with_replaced(inputs, own, *converted)
    if fit:
        inputs, fits = fitted(inputs, call, own)
        notes += fits
    return inputs, notes


def _with_replaced(inputs: CallArgs, sig: Signature | None, name: str,
                   replace: Callable[[object], object]) -> CallArgs:
    """``inputs`` with the argument of parameter ``name`` replaced by ``replace`` of it."""
    args, kwargs = inputs
    args = tuple(replace(value) if parameter_path(sig, f"args.{i}") == name else value
                 for i, value in enumerate(args))
    return CallArgs(args, {key: replace(value) if key == name else value
                           for key, value in kwargs.items()})


Replayed = TypeVar("Replayed")


def fitting_masks(attempt: Callable[[bool], Replayed], notes: Callable[[bool], list[str]]
                  ) -> tuple[Replayed, list[str], bool]:
    """``attempt(False)``, a replay of B on A's inputs; where it fails and fitting changes a mask,
    ``attempt(True)`` on fitted inputs; with the notes of the one that ran and whether fitted.

    A static cache's mask (128 keys) fails B's module sized to the keys in use (12) on the shape
    alone; fitting only on failure lets a replay that takes the recorded mask run on it."""
    try:
        return attempt(False), list(dict.fromkeys(notes(False))), False
    except ReplayUnavailable:
        raise
    except Exception:
        fits = list(dict.fromkeys(notes(True)))
        if fits == list(dict.fromkeys(notes(False))):
            raise
    return attempt(True), fits, True


def dtype_label(dtype: torch.dtype | None) -> str:
    """``torch.float32`` -> ``float32``; None -> ``unknown``."""
    return "unknown" if dtype is None else str(dtype).removeprefix("torch.")


def backend_name(spec: BackendSpec) -> str | None:
    return spec if spec is None or isinstance(spec, str) else getattr(spec, "__name__", repr(spec))
