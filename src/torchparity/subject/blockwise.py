"""A model's float64 forward and backward pass without a float64 copy of the model.

:class:`Float64Run` computes what ``model.double()`` would (the same float64 operations on the
same float64 numbers, checked bit for bit on ``transformers`` models and the zoo) while only the
module running at the moment holds its parameters in float64. Peak memory is the model in its own
dtype, one module's parameters (and gradient) in float64, and the float64 activations.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

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
    """A saved float64 parameter (or a view of one) kept as the parameter it came from."""

    name: str
    parameter: torch.Tensor
    size: torch.Size
    stride: tuple[int, ...]
    offset: int
    spec: tuple[object, ...] | None = None  # a DTensor's (mesh, placements, shape, stride)


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

    Outputs, loss and gradients equal those of ``model.double()`` (with ``device``, of
    ``model.to(device, torch.float64)``), float64 being the default dtype meanwhile; parameters,
    buffers and ``.grad`` are as before when the block ends, also after an exception. Forward
    passes under ``torch.no_grad()`` run in float64 too. ``perturb`` changes the float64 weights
    every module sees, in forward and backward alike.
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
            # floating buffers stay float64 the whole run: they are small (rotary tables, masks)
            self._cast_buffers(stack)
            for module in self.model.modules():
                if any(p is not None and p.is_floating_point()
                       for p in module._parameters.values()):
                    # its own parameters become float64 in a pre-hook, back in the forward hook
                    stack.enter_context(_removing(
                        module.register_forward_pre_hook(self._quietly(self._enter_module),
                                                         prepend=True),
                        module.register_forward_hook(self._quietly(self._leave_module),
                                                     always_call=True)))
            stack.enter_context(self._progress)
            # a saved float64 parameter is kept as the parameter and cast again when backward reads
            # it, so no module's float64 weights outlive its call
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(
                self._quietly(self._pack), self._quietly(self._unpack)))
            # ops without a float64 kernel (MoE's grouped matmul) run as the ops they stand for
            stack.enter_context(Float64Ops())
            # a parameter read outside its module (a tied head, a weight passed as an argument) is
            # cast as it is read
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
        """Backpropagate, handing every parameter's float64 gradient to ``on_grad`` exactly once.

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
            # each parameter's gradient went to on_grad, through its own hooks, once all its uses
            # contributed
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
        """The float64 value a module sees of ``parameter`` (perturbed when asked), a new tensor.
        """
        with self._quiet_block():
            value = parameter.detach().to(self._device(parameter), torch.float64, copy=True)
            return self.perturb(name, value) if self.perturb is not None else value

    def read_outside(self, parameter: torch.Tensor) -> torch.Tensor:
        """The float64 value of ``parameter`` where code outside its module's forward reads it.
        """
        value = self._cast(parameter, self.names[id(parameter)])
        # known to the saved-tensor hooks while it lives: autograd keeps the parameter, not the copy
        weakref.finalize(value, self._live.pop, _storage(value), None)
        return value

    def is_read_outside(self, tensor: object) -> bool:
        """Whether ``tensor`` is a floating parameter of the model to cast where it is read."""
        # not while the run's own code reads it
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

    def _quietly(self, function: Callable[..., object]) -> Callable[..., object]:
        def quietly(*args: object) -> object:
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
        """Floating buffers, and floating tensors held as plain attributes, in float64."""
        # both are read outside any parameter's module; model.double() would miss the attributes (a
        # table precomputed but not registered)
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
        """One use's gradient of parameter ``name``; the sum goes on once all uses have come."""
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
    """Hands torch functions reading a run's parameter outside its module its float64 value."""

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
        # a function reading no values (a shape) gets the parameter itself
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
    """Reports ``progress(phase, done, n)`` over a model's repeated blocks in the block."""

    def __init__(self, model: nn.Module, progress: Progress | None) -> None:
        self.progress = progress
        names = {id(p): n for n, p in model.named_parameters()}
        self._blocks = repeated_blocks(model) if progress is not None else []
        self._block_of = {n: i for i, block in enumerate(self._blocks)
                          for n in _parameter_names(block, names)}
        self._left = [len(_parameter_names(b, names)) for b in self._blocks]
        self._handles: list[RemovableHandle] = []

    # forward: as the pass enters block i; backward: once j blocks have all their gradients
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

    Each gradient goes to ``on_grad(name, grad)`` as soon as it is complete, then is dropped;
    ``.grad`` is as before. ``unused``: zeros for a parameter the loss does not reach.
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
        # one whose .grad the model's own hooks set, bypassing accumulation (FSDP2), goes after the
        # backward
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


def _dtensor_spec(tensor: torch.Tensor) -> tuple[object, ...] | None:
    """A DTensor's ``(mesh, placements, shape, stride)``; None for a plain tensor."""
    if not is_dtensor(tensor):
        return None
    return tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride()


def _storage(tensor: torch.Tensor) -> int:
    """Where the memory of ``tensor`` (of its local part, for a DTensor) begins."""
    return local_part(tensor).untyped_storage().data_ptr()


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The children of the module list holding most parameters in 2+ modules of one class."""
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
