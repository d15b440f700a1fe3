"""Running models for a diagnosis: its options, seeded whole-model runs with capture, and
replays of one module on recorded inputs. Every stage runs models through here."""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import torch
from torch import nn

from torchparity import backends as attention_backends
from torchparity.diagnosis.capture import (
    Capture,
    ModuleCall,
    PatternSpec,
    Signature,
    bound_arguments,
    module_filter,
    read_caches,
)
from torchparity.diagnosis.masks import fitted_keys
from torchparity.diagnosis.state import StateRecorder, cast_held
from torchparity.diagnosis.trace import ReplayUnavailable
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
from torchparity.subject.trees import flatten_tensors, map_tensors, map_tensors_with_paths

#: An attention backend name for :func:`torchparity.backends.use`, or a function returning a
#: context manager that selects it (for models the registry does not drive), or None.
BackendSpec = str | Callable[[], contextlib.AbstractContextManager] | None

#: Which modules get a local error: those whose propagated error diverged, or every one.
Local = Literal["diverged", "all"]

#: The golden's dtype: A's math with rounding far below any other dtype's.
GOLDEN_DTYPE = torch.float64


def in_golden_dtype(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor as the golden holds it: on the CPU, in float64 when floating."""
    return tensor.to("cpu", GOLDEN_DTYPE) if tensor.is_floating_point() else tensor.cpu()


def golden_inputs(inputs: Any) -> Any:
    """Recorded inputs (a fresh copy) as the golden's replay takes them: tensors in float64
    on the CPU, those inside a cache handed in (a ``StaticCache``'s buffers) too, so that the
    float64 replay's writes into the cache keep one dtype."""
    inputs = upcast(inputs, GOLDEN_DTYPE, "cpu")
    cast_held(inputs, in_golden_dtype)
    return inputs


@dataclass(frozen=True)
class Options:
    """Settings shared by the reference and the candidate side of one diagnosis."""

    include: PatternSpec = None
    exclude: PatternSpec = None
    backward: bool = True
    loss_fn: LossFn | None = None
    backend_a: BackendSpec = None
    backend_b: BackendSpec = None
    progress: bool | None = None
    local: Local = "diverged"
    padding: Padding = field(default_factory=Padding)  # left out of every judgement and loss
    # B run by torch.compile in this form (dynamic, static), module by module
    # (compiled_localisation.py)
    compile_b: str | None = None

    def selects(self) -> Callable[[str], bool]:
        return module_filter(self.include, self.exclude)


# --------------------------------------------------------------------------------------------
# Checking arguments


def make_options(backward: bool, loss_fn: LossFn | None, include: PatternSpec,
                 exclude: PatternSpec, backends: tuple[BackendSpec, BackendSpec] | None,
                 progress: bool | None, local: Local = "diverged",
                 padding: Padding | None = None) -> Options:
    """Check the arguments every diagnosis shares; progress defaults to "stderr is a tty"."""
    if loss_fn is not None and not callable(loss_fn):
        raise UsageError(f"loss_fn must be callable(output, inputs); got {type(loss_fn).__name__}")
    if backends is not None and not (isinstance(backends, (tuple, list)) and len(backends) == 2):
        raise UsageError("backends must be a pair (backend of A, backend of B); "
                         f"got {backends!r}")
    backend_a, backend_b = backends if backends is not None else (None, None)
    for spec in (backend_a, backend_b):
        if isinstance(spec, str) and spec not in attention_backends.names():
            raise UsageError(f"unknown attention backend {spec!r}; choose one of "
                             f"{', '.join(attention_backends.names())}")
    if local not in ("diverged", "all"):
        raise UsageError(f"local must be 'diverged' or 'all'; got {local!r}")
    if progress is None:
        progress = sys.stderr.isatty()
    return Options(include, exclude, bool(backward), loss_fn, backend_a, backend_b, progress,
                   local, padding or Padding())


def stream_needed(*models: nn.Module) -> bool:
    """Whether a diagnosis of ``models`` should keep A's side on disk: when the models take
    more than a quarter of the memory available now (the captured tensors, A's float64
    golden and the replays come on top)."""
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


def default_loss(output: Any, inputs: Any = None, padding: Padding | None = None
                 ) -> torch.Tensor:
    """A scalar whose gradient reaches every unpadded element of the first floating output:
    its :func:`~torchparity.subject.running.projection_loss`. Uses the output's own ``loss``
    field when it has one."""
    flat = flatten_tensors(output)
    if "output.loss" in flat and flat["output.loss"].numel() == 1:
        return flat["output.loss"].reshape(())
    first = next(((p, t) for p, t in flat.items() if t.is_floating_point()), None)
    if first is None:
        raise UsageError("the model output has no floating tensor to take gradients of; pass "
                         "loss_fn or backward=False")
    return projection_loss(dict([first]), padding)


@dataclass
class Run:
    """What one captured run leaves: its calls, detached output, loss and parameter grads."""

    calls: list[ModuleCall]
    output: Any
    loss: torch.Tensor | None
    param_grads: dict[str, dict[str, torch.Tensor]]  # module name -> direct param name -> grad
    changing: set[str] = field(default_factory=set)  # modules that change their own state


def run_model(model: nn.Module, inputs: Inputs, opts: Options, backend: BackendSpec, *,
              backward: bool, float64: bool = False, states: StateRecorder | None = None,
              **capture: Any) -> Run:
    """One seeded forward (and backward, ``.grad`` untouched) with the selected modules
    captured, and every module's state recorded by ``states``. Each parameter's gradient is
    kept (sketched above the size threshold, by its name in its module) as soon as it is
    complete. With ``float64`` the model runs in float64 on the CPU module by module
    (:class:`~torchparity.subject.blockwise.Float64Run`), its ``inputs`` already cast: no
    float64 copy of it is made. An error of the backward pass is a one-line
    :class:`UserCodeError` that names ``--no-backward``."""
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
    param_grads = {
        name: {pn: grads[names[id(p)]] for pn, p in module.named_parameters(recurse=False)
               if names.get(id(p)) in grads}
        for name, module in cap.modules.items()
    }
    output = map_tensors(read_caches(output), lambda t: t.detach())
    return Run(cap.records, output, None if loss is None else loss.detach(), param_grads,
               set() if states is None else states.changing)


@contextlib.contextmanager
def _backward_errors(model: nn.Module) -> Iterator[None]:
    try:
        yield
    except RuntimeError as exc:  # e.g. a cache written in place while autograd needs it
        raise UserCodeError(f"the backward pass of {type(model).__name__} raised RuntimeError: "
                            f"{first_line(exc)}; to compare forward outputs only, run with "
                            "--no-backward (backward=False); a decoding needs no gradients "
                            "(--decode takes none)") from exc


def rebind(recorded: Signature | None, inputs: tuple[tuple, dict], module: nn.Module
           ) -> tuple[tuple, dict]:
    """A recorded call's arguments as ``module`` (another revision's) takes them: as they were
    when its forward binds them; else each bound to B's parameter of the same name, or of the
    same position when B renamed it, a None for which B has no parameter left out (its
    default); :class:`ReplayUnavailable` saying why when they still do not bind."""
    args, kwargs = inputs
    try:
        forward = inspect.signature(module.forward)
    except (TypeError, ValueError):
        return args, kwargs
    try:
        forward.bind(*args, **kwargs)
        return args, kwargs
    except TypeError:
        pass
    names = [name for name, *_ in recorded or []]
    b_names = list(forward.parameters)
    rebound: dict[str, Any] = {}
    for name, value in bound_arguments(recorded, args, kwargs).items():
        target = name if name in forward.parameters else None
        if target is None and name in names and names.index(name) < len(b_names):
            target = b_names[names.index(name)]
            if forward.parameters[target].kind in (inspect.Parameter.VAR_POSITIONAL,
                                                   inspect.Parameter.VAR_KEYWORD):
                target = None
        if target is None or target in rebound:
            if value is None:
                continue
            raise ReplayUnavailable(f"B's {type(module).__name__}.forward({', '.join(b_names)}) "
                                    f"has no parameter for the recorded argument {name}")
        rebound[target] = value
    try:
        bound = forward.bind(**rebound)
    except TypeError as exc:
        raise ReplayUnavailable(f"the recorded arguments do not bind to B's "
                                f"{type(module).__name__}.forward: {exc}") from None
    return bound.args, bound.kwargs


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise UsageError(f"{type(model).__name__} has no parameter that requires grad; pass "
                         "backward=False")
    return params


def replay(module: nn.Module, inputs: tuple[tuple, dict], backend: BackendSpec, *,
           grad_out: Mapping[str, torch.Tensor] | None = None,
           requires_grad: frozenset[str] = frozenset(), float64: bool = False,
           ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Run one module on recorded inputs; with ``grad_out``, also backward from it.

    Returns the output tensors by path and, with ``grad_out``, the gradients of the inputs
    that required grad in the recorded run (``input.<path>``) and of the module's direct
    parameters (``param.<name>``). With ``float64`` the module runs in float64 on the CPU
    without a float64 copy (its ``inputs`` already cast, see :func:`run_model`).
    """
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
    """The module's outputs by path, the inputs that required grad in the recorded run (now
    leaves that require it), and each output that backward starts from with its gradient."""
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


def placed(inputs: tuple[tuple, dict], call: ModuleCall, *, fit: bool = False
           ) -> tuple[tuple, dict]:
    """Recorded inputs with each tensor moved to the device, and floating ones cast to the
    dtype, that ``call``'s module saw at the same input in its own run; with ``fit``, each mask
    also sized to the keys of ``call``'s own (:func:`fitted`)."""
    def place(path: str, tensor: torch.Tensor) -> torch.Tensor:
        dtype, device = call.input_placement.get(path, (tensor.dtype, tensor.device))
        if not (tensor.is_floating_point() and dtype.is_floating_point):
            dtype = tensor.dtype
        return tensor.to(device=device, dtype=dtype)

    args, kwargs = inputs
    moved = (map_tensors_with_paths(args, place, "args"),
             map_tensors_with_paths(kwargs, place, "kwargs"))
    return fitted(moved, call)[0] if fit else moved


def fitted(inputs: tuple[tuple, dict], call: ModuleCall
           ) -> tuple[tuple[tuple, dict], list[str]]:
    """Recorded inputs with each attention mask sized to the keys of ``call``'s own mask, where
    that changes no query's keys (see :func:`~torchparity.diagnosis.masks.fitted_keys`), and a
    note per mask changed."""
    notes = []

    def fit(path: str, tensor: torch.Tensor) -> torch.Tensor:
        shape = call.input_shapes.get(path)
        if shape is None or shape[:-1] != tensor.shape[:-1] or shape == tensor.shape:
            return tensor
        found = fitted_keys(tensor, shape[-1])
        if found is None:
            return tensor
        notes.append(f"mask {path} {found[1]}")
        return found[0]

    args, kwargs = inputs
    return (map_tensors_with_paths(args, fit, "args"),
            map_tensors_with_paths(kwargs, fit, "kwargs")), notes


Replayed = TypeVar("Replayed")


def fitting_masks(attempt: Callable[[bool], Replayed], inputs: tuple[tuple, dict],
                  calls: list[ModuleCall]) -> tuple[Replayed, list[str]]:
    """``attempt(False)``: a replay of B on A's recorded ``inputs`` as recorded; where it fails
    and :func:`fitted` changes a mask for one of B's ``calls``, ``attempt(True)`` (the replay
    on fitted inputs) with the notes saying how.

    Another revision may size the mask to a static cache (128 keys) where B sizes it to the keys
    in use (12): fed as recorded, B's module would fail on the shape alone. Fitted only on a
    failure, so that a replay that takes the recorded mask (B slices it, or is handed A's cache
    and its keys) runs on it unchanged."""
    try:
        return attempt(False), []
    except ReplayUnavailable:
        raise
    except Exception:
        notes = list(dict.fromkeys(note for call in calls for note in fitted(inputs, call)[1]))
        if not notes:
            raise
    return attempt(True), notes


def dtype_label(dtype: torch.dtype | None) -> str:
    """``torch.float32`` -> ``float32``; None -> ``unknown``."""
    return "unknown" if dtype is None else str(dtype).removeprefix("torch.")


def backend_name(spec: BackendSpec) -> str | None:
    return spec if spec is None or isinstance(spec, str) else getattr(spec, "__name__", repr(spec))
