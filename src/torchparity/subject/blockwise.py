"""A model's float64 forward and backward pass without a float64 copy of the model.

:class:`Float64Run` runs a model as if it had been cast to float64 (``model.double()``), while
only the module running at the moment holds its parameters in float64:

- every module with parameters of its own gets them as float64 tensors in a forward pre-hook
  and its own back in the forward hook; floating buffers are float64 for the whole run (they
  are small: rotary tables, masks), and so are floating tensors a module holds as plain
  attributes (a table precomputed but not registered, which ``model.double()`` would miss);
- autograd saves what the backward pass needs; a saved float64 parameter is kept as a
  reference to the model's own parameter and cast again when the backward pass reads it
  (:func:`torch.autograd.graph.saved_tensors_hooks`), so no module's float64 weights outlive its
  call. The activations are saved in float64 as usual;
- each float64 parameter enters the graph through a function whose backward hands its gradient
  to ``on_grad(name, grad)`` as soon as every use of the parameter has contributed, through
  the hooks registered on the parameter (``register_hook``: a sharding plan's reduction) as
  autograd would pass it: gradients are float64, one (or a few) at a time, and the model's
  ``.grad`` is never touched.

Peak memory is the model in its own dtype, one module's parameters (and gradient) in float64,
and the float64 activations. The values are those of ``model.double()``: the same float64
operations on the same float64 numbers (the cast of a float32 or bfloat16 parameter to float64
is exact), which the tests check bit for bit on ``transformers`` models and the zoo.

A parameter read outside its module's forward (a tied head's ``x @ self.emb.weight.t()``, as
Megatron's output layer reads the embedding; a weight passed to another module as an argument)
is cast as it is read: a torch function mode hands every torch function that takes a plain
model parameter its float64 value instead, its gradient joining the parameter's other uses; its
``dtype`` reads float64 (``x.to(self.proj.weight.dtype)`` before ``self.proj`` runs, and
``transformers``' ``model.dtype``, which sizes its caches). Operations without a float64
kernel (the grouped matmul of mixture-of-experts layers) run as the float64 operations they
stand for (:mod:`torchparity.subject.float64_ops`).
``progress(phase, done, total)`` reports the model's repeated blocks (the layers) as
the forward pass enters them and as the backward pass completes their gradients.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.function import FunctionCtx
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map
from torch.utils.hooks import RemovableHandle

from torchparity.subject.float64_ops import Float64Ops
from torchparity.subject.running import grad_hooks, is_dtensor, local_part

#: ``on_grad(parameter name, float64 gradient)``.
GradSink = Callable[[str, torch.Tensor], None]
#: ``perturb(parameter name, float64 value) -> float64 value``: the weights a run sees.
Perturb = Callable[[str, torch.Tensor], torch.Tensor]
#: ``progress(phase, done, total)``, phase "forward" or "backward".
Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class _Recast:
    """A saved float64 parameter (or a view of one), kept as the parameter it was cast from:
    the view's size, stride and offset in the cast's storage (of its local part, for a
    DTensor), and for a DTensor its ``(mesh, placements, shape, stride)``."""

    name: str
    parameter: torch.Tensor
    size: torch.Size
    stride: tuple[int, ...]
    offset: int
    spec: tuple[Any, ...] | None = None


class _AsFloat64(torch.autograd.Function):
    """The float64 value of a parameter, whose gradient goes to the run's sink."""

    @staticmethod
    def forward(ctx: FunctionCtx, anchor: torch.Tensor, parameter: torch.Tensor, run: Float64Run,
                name: str) -> torch.Tensor:
        ctx.run, ctx.name = run, name
        return run.value(name, parameter)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[None, None, None, None]:
        ctx.run.receive(ctx.name, grad)
        return None, None, None, None


class Float64Run:
    """Run ``model`` in float64 inside the ``with`` block, one module's parameters at a time.

    >>> with Float64Run(model, on_grad=keep) as run:
    ...     loss = loss_fn(model(**upcast(inputs, torch.float64)))
    ...     run.backward(loss)

    Guarantees: outputs, loss and gradients equal those of ``model.double()`` on the same
    inputs, float64 being the default dtype (tensors the model makes in the default dtype are
    float64 too: transformers 4.46's GPT-2 fills its causal mask with float64's minimum in it)
    (with ``device``, those of ``model.to(device, torch.float64)``: a CUDA model's
    golden on the CPU, its weights copied over one module at a time); the model's parameters,
    buffers and ``.grad`` are as before when the block ends (also after an exception);
    :meth:`backward` hands every parameter that requires a gradient to ``on_grad`` exactly
    once (zeros for one the loss does not reach). Forward passes under ``torch.no_grad()``
    (decoding) run in float64 too and record no gradients. ``perturb`` changes the float64
    weights every module sees, the same way in forward and backward.
    """

    def __init__(self, model: nn.Module, *, on_grad: GradSink | None = None,
                 perturb: Perturb | None = None, progress: Progress | None = None,
                 device: str | torch.device | None = None) -> None:
        self.model = model
        self.device = None if device is None else torch.device(device)
        self.on_grad = on_grad
        self.perturb = perturb
        self.progress = progress
        self.names: dict[int, str] = {id(p): n for n, p in model.named_parameters()}
        # Every name of a tied parameter -> the name the model gives it (its first).
        first: dict[int, str] = {}
        self._tied = {n: first.setdefault(id(p), n)
                      for n, p in model.named_parameters(remove_duplicate=False)}
        self._prefixes = {id(m): f"{n}." if n else "" for n, m in model.named_modules()}
        self._anchor = torch.zeros((), dtype=torch.float64, requires_grad=True)
        self._live: dict[int, tuple[str, torch.Tensor]] = {}  # storage of a float64 copy
        self._swapped: dict[int, list[list[tuple[str, torch.Tensor, int]]]] = {}
        self._uses: dict[str, int] = {}
        self._received: dict[str, int] = {}
        self._pending: dict[str, torch.Tensor] = {}
        self._hooks: dict[str, list[Callable[[torch.Tensor], torch.Tensor | None]]] = {}
        self._delivered: set[str] = set()
        self._progress = BlockProgress(model, progress)
        self._exit = contextlib.ExitStack()
        # While the run's own code reads the model's parameters, they are not cast.
        self._quiet = False

    # -- the block -----------------------------------------------------------------------------

    def __enter__(self) -> Float64Run:
        stack = self._exit.__enter__()
        try:
            stack.callback(self._restore_parameters)
            stack.enter_context(_default_dtype(torch.float64))
            self._cast_buffers(stack)
            for module in self.model.modules():
                if any(p is not None and p.is_floating_point()
                       for p in module._parameters.values()):
                    stack.enter_context(_removing(
                        module.register_forward_pre_hook(self._quietly(self._enter_module),
                                                         prepend=True),
                        module.register_forward_hook(self._quietly(self._leave_module),
                                                     always_call=True)))
            stack.enter_context(self._progress)
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(
                self._quietly(self._pack), self._quietly(self._unpack)))
            stack.enter_context(Float64Ops())
            stack.enter_context(_ReadsOutside(self))
        except BaseException:
            self._exit.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._exit.__exit__(*exc)

    def backward(self, outputs: torch.Tensor | list[torch.Tensor],
                 grad_outputs: list[torch.Tensor] | None = None,
                 inputs: tuple[torch.Tensor, ...] = (), *, unused: bool = True
                 ) -> tuple[torch.Tensor | None, ...]:
        """Backpropagate and hand every parameter's float64 gradient to ``on_grad``.

        Args:
            outputs: a loss, or tensors with their ``grad_outputs``.
            grad_outputs: the gradients of ``outputs`` (None for a scalar loss).
            inputs: tensors whose gradients are wanted too (a module's inputs, for a replay).
            unused: give a parameter the outputs do not reach zeros, else nothing.

        Returns:
            The gradients of ``inputs``, None for one not reached.
        """
        outputs = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
        found: tuple[torch.Tensor | None, ...] = (None,) * len(inputs)
        if any(o.requires_grad for o in outputs):
            found = torch.autograd.grad(outputs, [*inputs, self._anchor], grad_outputs,
                                        allow_unused=True)[:len(inputs)]
        with self._quiet_block():
            for name, param in self.model.named_parameters():
                if not param.requires_grad or name in self._delivered:
                    continue
                grad = self._pending.pop(name, None)
                if grad is None and unused:
                    grad = torch.zeros(param.shape, dtype=torch.float64,
                                       device=self._device(param))
                if grad is not None:
                    self._deliver(name, grad)
        return found

    # -- casting -------------------------------------------------------------------------------

    def value(self, name: str, parameter: torch.Tensor) -> torch.Tensor:
        """The float64 value a module sees of ``parameter`` (perturbed when asked).

        Args:
            name: the parameter's name in the model.
            parameter: the parameter as the model holds it.

        Returns:
            A new float64 tensor on the run's device.
        """
        with self._quiet_block():
            value = parameter.detach().to(self._device(parameter), torch.float64, copy=True)
            return self.perturb(name, value) if self.perturb is not None else value

    def read_outside(self, parameter: torch.Tensor) -> torch.Tensor:
        """The float64 value of ``parameter`` where code outside its module's forward reads it.

        The value is known to the saved-tensor hooks while it lives, so autograd keeps the
        parameter rather than the float64 copy.

        Args:
            parameter: one of the model's parameters.

        Returns:
            Its float64 value.
        """
        value = self._cast(parameter, self.names[id(parameter)])
        weakref.finalize(value, self._live.pop, _storage(value), None)
        return value

    def is_read_outside(self, tensor: object) -> bool:
        """Whether this run casts ``tensor`` where it is read.

        Args:
            tensor: an argument of a torch function.

        Returns:
            True for one of the model's floating parameters as the model holds it (its module not
            running, the run's own code not reading it).
        """
        return (not self._quiet and isinstance(tensor, nn.Parameter)
                and id(tensor) in self.names and tensor.is_floating_point()
                and not is_dtensor(tensor))

    @contextlib.contextmanager
    def _quiet_block(self) -> Iterator[None]:
        before, self._quiet = self._quiet, True
        try:
            yield
        finally:
            self._quiet = before

    def _quietly(self, function: Callable[..., Any]) -> Callable[..., Any]:
        def quietly(*args: Any) -> Any:
            with self._quiet_block():
                return function(*args)
        return quietly

    def _device(self, tensor: torch.Tensor) -> torch.device:
        return tensor.device if self.device is None else self.device

    def _cast(self, parameter: torch.Tensor, name: str) -> torch.Tensor:
        if torch.is_grad_enabled() and parameter.requires_grad and self.on_grad is not None:
            self._uses[name] = self._uses.get(name, 0) + 1
            self._hooks[name] = grad_hooks(parameter)
            value = _AsFloat64.apply(self._anchor, parameter.detach(), self, name)
        else:
            value = self.value(name, parameter)
        self._live[_storage(value)] = (name, parameter)
        return value

    def _enter_module(self, module: nn.Module, args: tuple[object, ...]) -> None:
        swapped = []
        for key, parameter in list(module._parameters.items()):
            if parameter is not None and parameter.is_floating_point():
                # By the model's name for it; a parameter the model holds under another
                # object while the module runs (FSDP2's unsharded one) by the module's, a
                # tied one's by the name the model gives it, as one process names it.
                own = f"{self._prefixes[id(module)]}{key}"
                name = self.names.get(id(parameter), self._tied.get(own, own))
                value = self._cast(parameter, name)
                module._parameters[key] = value
                swapped.append((key, parameter, _storage(value)))
        self._swapped.setdefault(id(module), []).append(swapped)

    def _leave_module(self, module: nn.Module, args: tuple[object, ...], output: object
                      ) -> None:
        calls = self._swapped.get(id(module))
        if not calls:
            return
        for key, parameter, storage in calls.pop():
            module._parameters[key] = parameter
            self._live.pop(storage, None)

    def _restore_parameters(self) -> None:
        """Put back every parameter a module still holds in float64 (after an exception)."""
        modules = {id(m): m for m in self.model.modules()}
        for module_id, calls in self._swapped.items():
            for swapped in reversed(calls):
                for key, parameter, _ in swapped:
                    modules[module_id]._parameters[key] = parameter
        self._swapped.clear()
        self._live.clear()

    def _cast_buffers(self, stack: contextlib.ExitStack) -> None:
        """Every floating buffer in float64 until the block ends, and every floating tensor a
        module holds as a plain attribute (a table precomputed in ``__init__`` but not
        registered), which ``model.double()`` would leave as it is: both are read outside
        any parameter's module."""
        converted: dict[int, torch.Tensor] = {}

        def cast(tensor: torch.Tensor) -> torch.Tensor:
            if id(tensor) not in converted:
                dtype = (torch.float64 if tensor.is_floating_point() else torch.complex128
                         if tensor.is_complex() else tensor.dtype)
                converted[id(tensor)] = tensor.to(self._device(tensor), dtype)
            return converted[id(tensor)]

        for module in self.model.modules():
            for key, buffer in list(module._buffers.items()):
                if buffer is None or not (buffer.is_floating_point() or self.device):
                    continue
                module._buffers[key] = cast(buffer)
                stack.callback(module._buffers.__setitem__, key, buffer)
            attributes = vars(module)
            for key, value in list(attributes.items()):
                if (type(value) is torch.Tensor
                        and (value.is_floating_point() or value.is_complex() or self.device)):
                    attributes[key] = cast(value)
                    stack.callback(attributes.__setitem__, key, value)

    # -- saved tensors -------------------------------------------------------------------------

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor | _Recast:
        if tensor.dtype != torch.float64 or tensor.layout != torch.strided:
            return tensor
        try:
            found = self._live.get(_storage(tensor))
        except (RuntimeError, NotImplementedError):  # a tensor without storage
            return tensor
        if found is None:
            return tensor
        name, parameter = found
        spec = _dtensor_spec(tensor)
        view = local_part(tensor)
        return _Recast(name, parameter, view.size(), view.stride(), view.storage_offset(), spec)

    def _unpack(self, saved: torch.Tensor | _Recast) -> torch.Tensor:
        if not isinstance(saved, _Recast):
            return saved
        value = self.value(saved.name, saved.parameter)
        if saved.spec is None:
            return value.as_strided(saved.size, saved.stride, saved.offset)
        from torch.distributed.tensor import DTensor

        mesh, placements, shape, stride = saved.spec
        view = local_part(value).as_strided(saved.size, saved.stride, saved.offset)
        return DTensor.from_local(view, mesh, placements, run_check=False, shape=shape,
                                  stride=stride)

    # -- gradients -----------------------------------------------------------------------------

    def receive(self, name: str, grad: torch.Tensor) -> None:
        """One use's gradient of parameter ``name``; the sum goes on once all uses have come.

        Args:
            name: the parameter's name.
            grad: that use's float64 gradient.
        """
        grad = grad.detach()
        pending = self._pending.get(name)
        if pending is not None:
            pending.add_(grad)  # in place: a tied embedding's gradient is gigabytes
        else:  # a copy of its own when more uses will add to it
            self._pending[name] = grad.clone() if self._uses.get(name, 0) > 1 else grad
        self._received[name] = self._received.get(name, 0) + 1
        if self._received[name] == self._uses.get(name, 0):
            self._deliver(name, self._pending.pop(name))

    def _deliver(self, name: str, grad: torch.Tensor) -> None:
        self._delivered.add(name)
        for hook in self._hooks.get(name, ()):  # the parameter's own (a plan's reduction)
            changed = hook(grad)
            grad = grad if changed is None else changed
        if self.on_grad is not None:
            self.on_grad(name, grad)
        self._progress.gradient_done(name)


class _ReadsOutside(TorchFunctionMode):
    """Every torch function that takes one of the run's parameters outside its module's
    forward gets the parameter's float64 value (:meth:`Float64Run.read_outside`); functions
    that read no values (a shape) get the parameter, but its ``dtype`` reads float64 (and its
    ``device`` the run's device)."""

    def __init__(self, run: Float64Run) -> None:
        super().__init__()
        self.run = run

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", None)
        if name == "__get__" and args and self.run.is_read_outside(args[0]):
            # ``x.to(self.proj.weight.dtype)`` before ``self.proj`` runs: the float64 it
            # will compute in, as a model cast to float64 says.
            attribute = getattr(getattr(func, "__self__", None), "__name__", None)
            if attribute == "dtype":
                return torch.float64
            if attribute == "device" and self.run.device is not None:
                return self.run.device
        if name not in _READS_NO_VALUES:
            args, kwargs = tree_map(self._cast, (args, kwargs))
        return func(*args, **kwargs)

    def _cast(self, leaf: object) -> object:
        return self.run.read_outside(leaf) if self.run.is_read_outside(leaf) else leaf


#: Torch functions that read a tensor's metadata, not its values.
_READS_NO_VALUES = {"__get__", "__set__", "size", "dim", "numel", "stride", "storage_offset",
                    "is_floating_point", "is_complex", "is_contiguous", "data_ptr",
                    "untyped_storage", "element_size", "requires_grad_", "register_hook",
                    "register_post_accumulate_grad_hook", "__repr__", "__format__",
                    "__hash__", "__len__"}


class BlockProgress:
    """Progress through a model's repeated blocks while the ``with`` block runs:
    ``progress("forward", i, n)`` as the forward pass enters block i of n, and
    ``progress("backward", j, n)`` once j blocks have all their gradients (reported through
    :meth:`gradient_done`). Nothing is reported for a model without repeated blocks."""

    def __init__(self, model: nn.Module, progress: Progress | None) -> None:
        self.progress = progress
        names = {id(p): n for n, p in model.named_parameters()}
        self._blocks = repeated_blocks(model) if progress is not None else []
        self._block_of = {n: i for i, block in enumerate(self._blocks)
                          for n in _parameter_names(block, names)}
        self._left = [len(_parameter_names(b, names)) for b in self._blocks]
        self._handles: list[RemovableHandle] = []

    def __enter__(self) -> BlockProgress:
        self._handles = [block.register_forward_pre_hook(
            lambda *_, i=index: self._report("forward", i + 1))
            for index, block in enumerate(self._blocks)]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def gradient_done(self, name: str) -> None:
        """Count parameter ``name``'s gradient as complete, reporting its block once all of it is.

        Args:
            name: the parameter's name.
        """
        block = self._block_of.get(name)
        if block is None:
            return
        self._left[block] -= 1
        if self._left[block] == 0:
            self._report("backward", sum(left == 0 for left in self._left))

    def _report(self, phase: str, done: int) -> None:
        if self.progress is not None:
            self.progress(phase, done, len(self._blocks))


def stream_grads(model: nn.Module, loss: torch.Tensor, on_grad: GradSink,
                 progress: BlockProgress | None = None, *, unused: bool = True) -> None:
    """Backpropagate ``loss`` through ``model`` in its own dtype, one gradient at a time.

    Each parameter's gradient goes to ``on_grad`` as soon as it is complete, then is dropped:
    at most the gradients in flight are held, never all of them. One whose ``.grad`` the model's
    own hooks set, bypassing accumulation (FSDP2's sharded parameters), goes after the
    backward. ``.grad`` is as before.

    Args:
        model: the model ``loss`` was computed by.
        loss: the scalar loss.
        on_grad: called once with ``(name, grad)`` for every parameter requiring a gradient.
        progress: told of each complete gradient, to report the blocks done.
        unused: give a parameter the loss does not reach zeros, else nothing.
    """
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    names = {id(p): name for name, p in params.items()}
    saved = {name: p.grad for name, p in params.items()}
    done: set[str] = set()

    def complete(param: torch.Tensor) -> None:
        name = names[id(param)]
        grad, param.grad = param.grad, None
        done.add(name)
        on_grad(name, grad)
        if progress is not None:
            progress.gradient_done(name)

    for p in params.values():
        p.grad = None
    handles = [p.register_post_accumulate_grad_hook(complete) for p in params.values()]
    try:
        if loss.requires_grad:
            loss.backward()
        for name, p in params.items():  # set by the model's own hooks (FSDP2's reduce-scatter)
            if name not in done and p.grad is not None:
                complete(p)
    finally:
        for handle in handles:
            handle.remove()
        for name, p in params.items():
            p.grad = saved[name]
    for name, p in params.items():
        if name not in done and unused:
            on_grad(name, torch.zeros_like(p))


def _dtensor_spec(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    """A DTensor's ``(mesh, placements, shape, stride)``; None for a plain tensor."""
    if not is_dtensor(tensor):
        return None
    return tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride()


def _storage(tensor: torch.Tensor) -> int:
    """Where the memory of ``tensor`` (of its local part, for a DTensor) begins."""
    return local_part(tensor).untyped_storage().data_ptr()


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks (its layers), for progress through a big model.

    Args:
        model: any model.

    Returns:
        The children of the list of modules (a ``ModuleList`` or ``Sequential``) holding the
        most parameters in two or more modules of one class; empty when there is none.
    """
    best: list[nn.Module] = []
    best_size = 0
    for module in model.modules():
        if not isinstance(module, nn.ModuleList | nn.Sequential):
            continue
        children = list(module.children())
        if len(children) < 2 or len({type(c) for c in children}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if size > best_size:
            best, best_size = children, size
    return best


def _parameter_names(module: nn.Module, names: dict[int, str]) -> set[str]:
    return {names[id(p)] for p in module.parameters() if p.requires_grad and id(p) in names}


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@contextlib.contextmanager
def _removing(*handles: RemovableHandle) -> Iterator[None]:
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
