"""Attention backends behind one switch, sharing one contract so they compare element by element.

- ``q`` is (batch, heads, q_len, head_dim), ``k`` and ``v`` (batch, kv_heads, k_len, head_dim),
  ``heads`` a multiple of ``kv_heads`` (GQA/MQA: key/value heads are repeated);
- ``mask`` is boolean, True where a query may attend, ``bias`` an additive float score bias,
  both broadcastable to (batch, heads, q, k);
- a query row with no visible key returns zeros (a padded query), on every backend.

Inside :func:`use` every call of ``F.scaled_dot_product_attention`` (Hugging Face, torchtune,
nanoGPT-style code) runs on the chosen backend too. A backend that cannot run a call raises
:class:`~torchparity.errors.BackendUnavailable` with the reason: nothing falls back silently, and
an error of a kernel selected to run propagates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import NamedTuple, TypeVar

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from torchparity.errors import BackendUnavailable, UsageError

_SDPA_KERNELS = {
    "sdpa-math": "MATH",
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
}
_CUDA_ONLY = {"sdpa-efficient", "sdpa-cudnn"}
# What PyTorch raises when no enabled SDPA kernel accepts a call (CPU and CUDA wording).
_NO_KERNEL_MESSAGES = ("No available kernel", "No viable backend")

#: Why a backend cell of a model that made no attention call in its :func:`use` block is n/a.
NO_SDPA_CALLS_REASON = "the model never called scaled_dot_product_attention"

# The function as PyTorch defines it, taken before anyone could wrap it.
_SDPA = F.scaled_dot_product_attention


@dataclasses.dataclass(eq=False)
class Intercepted:
    """What one :func:`use` block ran: its ``backend`` and attention ``calls`` (SDPA, reference)."""

    backend: str
    intercept: bool = True
    # A tensor rather than an int: a compiled graph adds to it on every run, where an int
    # would be a constant that dynamo guards on, and every later call would recompile.
    _count: torch.Tensor = dataclasses.field(
        default_factory=lambda: torch.zeros((), dtype=torch.int64), repr=False)

    @property
    def calls(self) -> int:
        return int(self._count)

    def not_applicable_reason(self) -> str | None:
        """:data:`NO_SDPA_CALLS_REASON` when the block ran no attention call, else None."""
        return NO_SDPA_CALLS_REASON if self.calls == 0 else None


# The open use() blocks, innermost last. A plain list rather than a ContextVar: torch.compile
# traces a module global (and guards on it) but breaks the graph at ContextVar.get. The choice is
# process-wide, like torch.backends settings.
_blocks: list[Intercepted] = []
# Non-empty while torchparity itself calls the SDPA function, which is then not redirected.
_own_calls: list[None] = []


def names() -> list[str]:
    """All backend names, in a stable order: the plain reference first."""
    return ["manual", "sdpa", *_SDPA_KERNELS, "flex"]


def _check_name(name: str) -> None:
    if name not in names():
        raise UsageError(f"unknown attention backend {name!r}; choose one of {', '.join(names())}")


@contextlib.contextmanager
def use(name: str, *, intercept: bool = True) -> Iterator[Intercepted]:
    """Run every attention call inside the block on backend ``name``; the innermost block wins.

    Yields an :class:`Intercepted` counting the attention calls made in the block::

        with tp.backends.use("sdpa-flash") as intercepted:
            model(**batch)
        assert intercepted.calls > 0, backends.NO_SDPA_CALLS_REASON

    Intercepting costs a few microseconds per PyTorch call of the block: a block running only
    reference models, which reach SDPA through :func:`attention` alone, saves it with
    ``intercept=False``.
    """
    _check_name(name)
    block = Intercepted(name, intercept)
    # One redirecting mode serves nested blocks: it reads the innermost backend at every call.
    redirecting = any(outer.intercept for outer in _blocks)
    redirect = _RedirectSdpa() if intercept and not redirecting else contextlib.nullcontext()
    _blocks.append(block)
    try:
        with redirect:
            yield block
    finally:
        _blocks.remove(block)


def current(default: str = "manual") -> str:
    """The backend forced by the innermost :func:`use`, else ``default``."""
    return _blocks[-1].backend if _blocks else default


def _count_call() -> None:
    for block in _blocks:
        block._count.add_(1)


class _RedirectSdpa(TorchFunctionMode):
    """Sends SDPA calls to the innermost :func:`use` block's backend; every other call passes."""

    def __enter__(self) -> _RedirectSdpa:
        if "torch._dynamo" in sys.modules:  # loaded: something may compile in the block
            from torch._dynamo.eval_frame import skip_code

            # Compiled graphs inline the redirect. Called on its own (a compiled graph's
            # runtime wrapper makes tensors of its scalar inputs under the mode), it is not
            # worth a graph, and dynamo would compile and recompile one per scalar.
            skip_code(type(self).__torch_function__.__code__)
        return super().__enter__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA and _blocks and not _own_calls:
            _count_call()
            return _redirected_sdpa(_blocks[-1].backend, SdpaCall(*args, **kwargs))
        name = getattr(func, "__name__", "") if torch.compiler.is_compiling() else ""
        if name and getattr(torch.Tensor, name, None) is func:
            # As a method: torch.compile traces x.unflatten(...) but not the body of
            # Tensor.unflatten(x, ...), which calls super().
            return getattr(args[0], name)(*args[1:], **kwargs)
        return func(*args, **kwargs)


_Result = TypeVar("_Result")


class SdpaCall(NamedTuple):
    """One call of ``F.scaled_dot_product_attention``, its arguments by name (as it takes them)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: torch.Tensor | None = None
    dropout_p: float = 0.0
    is_causal: bool = False
    scale: float | None = None
    enable_gqa: bool = False

    def apply(self, function: Callable[..., _Result]) -> _Result:
        """``function`` (SDPA, or PyTorch's choice of kernel for it) called with these arguments."""
        return function(*self[:6], scale=self.scale, enable_gqa=self.enable_gqa)


def _redirected_sdpa(name: str, call: SdpaCall) -> torch.Tensor:
    """One SDPA call of user code on backend ``name``: a kernel as made, others translated."""
    if name == "sdpa" or name in _SDPA_KERNELS:
        return _run_sdpa(name, call)
    query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa = call
    if dropout_p > 0:
        raise BackendUnavailable(f"{name} runs attention without dropout, and this call asks for "
                                 f"dropout_p={dropout_p}; put the model in eval() mode")
    if attn_mask is not None and is_causal:
        raise RuntimeError("scaled_dot_product_attention: an explicit attn_mask cannot be "
                           "combined with is_causal=True")
    batch = query.shape[:-3]
    q, k, v = (_four_dims(t.expand(*batch, *t.shape[-3:]) if batch else t)
               for t in (query, key, value))
    if not enable_gqa and k.shape[1] not in (1, q.shape[1]):
        raise RuntimeError(f"scaled_dot_product_attention: query has {q.shape[1]} heads and "
                           f"key {k.shape[1]}; pass enable_gqa=True for grouped-query attention")
    mask = bias = None
    if attn_mask is not None:
        if len(batch) > 1:
            attn_mask = _four_dims(attn_mask.expand(*query.shape[:-1], key.shape[-2]))
        if attn_mask.dtype == torch.bool:
            mask = attn_mask
        else:
            # A float mask is a bias whose -inf entries hide keys: as a boolean mask they get
            # the zero rows of the contract where real kernels give them too (not NaN).
            mask = attn_mask != float("-inf")
            bias = attn_mask.masked_fill(~mask, 0.0)
    out = _attend(q, k, v, mask=mask, bias=bias, scale=scale, causal=is_causal, backend=name)
    return out.reshape(*query.shape[:-1], value.shape[-1])


def _four_dims(t: torch.Tensor) -> torch.Tensor:
    """(*batch, heads, length, dim) with any number of batch dims as (batch, heads, length, dim)."""
    if t.dim() > 4:
        return t.reshape(-1, *t.shape[-3:])
    return t.reshape(*(1,) * (4 - t.dim()), *t.shape)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    scale: float | None = None,
    causal: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention on the selected backend (see the module docstring).

    ``causal=True`` applies a top-left aligned causal mask in the kernel itself (only valid when
    ``q_len == k_len``), combined with ``mask`` if given; ``backend`` overrides :func:`use`. The
    call counts as one attention call of every open :func:`use` block.
    """
    _count_call()
    return _attend(q, k, v, mask=mask, bias=bias, scale=scale, causal=causal, backend=backend)


def _attend(q, k, v, *, mask, bias, scale, causal, backend) -> torch.Tensor:
    name = backend or current()
    _check_name(name)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if k.shape[1] != q.shape[1]:
        repeats = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    if causal and (mask is not None or bias is not None):
        mask = _causal_mask(q.shape[-2], k.shape[-2], q.device) & (True if mask is None else mask)
        causal = False

    # Rows that see no key would give NaN in softmax; let them see everything, then zero them.
    # Compiled, always (asking whether there are any would break the graph).
    empty_rows = None
    if mask is not None:
        has_key = mask.any(dim=-1, keepdim=True)
        if torch.compiler.is_compiling() or not bool(has_key.all()):
            empty_rows = ~has_key
            mask = mask | empty_rows
    out = _IMPLEMENTATIONS[name](q, k, v, mask, bias, scale, causal, name)
    return out if empty_rows is None else out.masked_fill(empty_rows, 0.0)


def _causal_mask(q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril()


def _manual(q, k, v, mask, bias, scale, causal, name) -> torch.Tensor:
    # The plain textbook path: matmul in the input dtype, softmax in (at least) fp32.
    scores = (q @ k.transpose(-2, -1)).to(torch.promote_types(q.dtype, torch.float32)) * scale
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    if causal:
        mask = _causal_mask(q.shape[-2], k.shape[-2], q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1).to(q.dtype)
    return probs @ v


def _sdpa_mask(mask, bias, dtype) -> torch.Tensor | None:
    if bias is None:
        return mask
    bias = bias.to(dtype)
    return bias if mask is None else bias.masked_fill(~mask, float("-inf"))


def _sdpa(q, k, v, mask, bias, scale, causal, name) -> torch.Tensor:
    return _run_sdpa(name, SdpaCall(q, k, v, _sdpa_mask(mask, bias, q.dtype), 0.0, causal,
                                    scale=scale))


def _run_sdpa(name: str, call: SdpaCall) -> torch.Tensor:
    """The SDPA function with ``call``'s arguments on kernel ``name`` ("sdpa": PyTorch's choice)."""
    def run() -> torch.Tensor:
        _own_calls.append(None)
        try:
            return call.apply(_SDPA)
        finally:
            _own_calls.pop()

    if name == "sdpa":
        return run()
    device = call.query.device.type
    if name in _CUDA_ONLY and device != "cuda":
        raise BackendUnavailable(f"{name} needs a CUDA device; tensors are on {device}")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([getattr(SDPBackend, _SDPA_KERNELS[name])]):
        if not torch.compiler.is_compiling():  # compiled, the kernel is chosen at lowering
            # the kernel's own selection decides first (BackendUnavailable with its reasons); the
            # kernel's own errors propagate
            _check_kernel_accepts(name, call)
        return run()


def _check_kernel_accepts(name: str, call: SdpaCall) -> None:
    """Raise BackendUnavailable with PyTorch's reasons where its kernels would not run ``call``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            call.apply(torch._fused_sdp_choice)
            return
        except RuntimeError as exc:
            if not any(m in str(exc) for m in _NO_KERNEL_MESSAGES):
                raise
            detail = str(exc).splitlines()[0]
    reasons = [str(w.message).split("(Triggered")[0].strip() for w in caught]
    # PyTorch may announce a reason and give none ("... not used because:"): dropped.
    detail = "; ".join(r for r in reasons if r and not r.endswith(":")) or (
        _mask_gradient_reason(call) or detail)
    raise BackendUnavailable(
        f"{name} cannot run this call ({call.query.device.type}, {call.query.dtype}, "
        f"{_describe_call(call)}): {detail}"
    )


def _mask_gradient_reason(call: SdpaCall) -> str | None:
    """Why a kernel refused a call PyTorch does not explain: it lacks the mask's gradient."""
    if call.attn_mask is None or not call.attn_mask.requires_grad:
        return None
    # the same call with the mask detached runs
    try:
        call._replace(attn_mask=call.attn_mask.detach()).apply(torch._fused_sdp_choice)
    except RuntimeError:
        return None
    return ("the kernel computes no gradient for an attention mask (PyTorch gives no reason; "
            "the same call with the mask not requiring grad runs)")


def _describe_call(call: SdpaCall) -> str:
    """The call's mask, causality, dropout and grouping, as a refusal names them."""
    attn_mask, dropout_p, is_causal, enable_gqa = (call.attn_mask, call.dropout_p,
                                                   call.is_causal, call.enable_gqa)
    parts = []
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        parts.append("boolean mask")
    elif attn_mask is not None:
        parts.append("trainable additive bias" if attn_mask.requires_grad else "additive bias")
    if is_causal:
        parts.append("causal")
    if dropout_p > 0:
        parts.append(f"dropout {dropout_p}")
    if enable_gqa:
        parts.append("grouped-query")
    return ", ".join(parts) or "no mask"


@functools.cache
def _flex_function(device_type: str) -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    # Compiling is what makes flex fast on CUDA; on the CPU eager keeps start-up cheap.
    return torch.compile(flex_attention, dynamic=False) if device_type == "cuda" else flex_attention


# The switch that stops eager flex_attention from tracing itself (see _flex_untraced).
_FLEX_TRACE_FLAG = "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG"


@contextlib.contextmanager
def _flex_untraced() -> Iterator[None]:
    """Eager flex on the CPU without its dynamo pass, value for value the same."""
    # eager flex traces with dynamo (a compile per shape, dtype and mask: most of a zoo check) only
    # to run the same unfused math, which it runs on score_mod directly untraced; the trace matters
    # only to the backward, which flex lacks on the CPU
    from torch.nn.attention import flex_attention as module

    previous = getattr(module, _FLEX_TRACE_FLAG, None)
    if previous is None:  # a torch without the switch: flex traces as before
        yield
        return
    setattr(module, _FLEX_TRACE_FLAG, True)
    try:
        yield
    finally:
        setattr(module, _FLEX_TRACE_FLAG, previous)


def _flex(q, k, v, mask, bias, scale, causal, name) -> torch.Tensor:
    if q.device.type == "cpu" and torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, bias)
    ):
        raise BackendUnavailable("flex has no backward pass on the CPU; run it without gradients")
    full = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    bias_full = None if bias is None else bias.expand(full)
    mask_full = None if mask is None else mask.expand(full)
    eager_cpu = q.device.type == "cpu" and not torch.compiler.is_compiling()
    # Eager flex vmaps score_mod over (b, h, q, kv), where a tensor's [] runs an
    # autograd.Function whose vmap rule is rebuilt at every call (most of flex's time on the
    # CPU); with no backward pass there, aten.index gathers the same values directly.
    at = _gather if eager_cpu else _subscript

    def score_mod(score, b, h, q_idx, kv_idx):
        if bias_full is not None:
            score = score + at(bias_full, b, h, q_idx, kv_idx)
        if mask_full is not None:
            score = torch.where(at(mask_full, b, h, q_idx, kv_idx), score, -float("inf"))
        if causal:
            score = torch.where(q_idx >= kv_idx, score, -float("inf"))
        return score

    from torch._dynamo.exc import BackendCompilerFailed

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
        warnings.filterwarnings("ignore", message=".*_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG")
        untraced = _flex_untraced() if eager_cpu else contextlib.nullcontext()
        try:
            with untraced:
                return _flex_function(q.device.type)(q, k, v, score_mod=score_mod, scale=scale)
        except BackendCompilerFailed as exc:
            # Flex's kernel selection is its compiler: a kernel it cannot build for this call
            # (a head dim under 16 on CUDA, say) cannot run here. A built kernel that fails
            # at run time raises as it is.
            cause = exc
            while cause.__cause__ is not None:
                cause = cause.__cause__
            raise BackendUnavailable(
                f"flex cannot compile this call ({q.device.type}, {q.dtype}, head dim "
                f"{q.shape[-1]}): {str(cause).strip().splitlines()[0]}") from None


def _subscript(t: torch.Tensor, *index: torch.Tensor) -> torch.Tensor:
    return t[index]


def _gather(t: torch.Tensor, *index: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.index.Tensor(t, list(index))


_IMPLEMENTATIONS: dict[str, Callable[..., torch.Tensor]] = {
    "manual": _manual,
    "sdpa": _sdpa,
    **{name: _sdpa for name in _SDPA_KERNELS},
    "flex": _flex,
}


def available(device: str | torch.device = "cpu",
              dtype: torch.dtype = torch.float32) -> dict[str, str | None]:
    """Probe every backend with tiny real calls: ``{name: None}`` where one ran, else the reason.

    A causal call without a mask (what flash kernels take) and one with a boolean mask; each
    later call is still judged on its own. A kernel selected that then fails propagates. Cached
    per (device, dtype) for the life of the process.
    """
    return dict(_probe(str(torch.device(device)), dtype))


@functools.cache
def _probe(device: str, dtype: torch.dtype) -> tuple[tuple[str, str | None], ...]:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        return tuple((name, "no CUDA device is available") for name in names())
    gen = torch.Generator().manual_seed(0)
    # Head dim 16: the smallest that every kernel takes (flex on CUDA needs 16).
    q, k, v = (torch.randn(1, 2, 8, 16, generator=gen).to(dev, dtype) for _ in range(3))
    mask = torch.ones(1, 1, 8, 8, dtype=torch.bool, device=dev).tril()
    results = []
    for name in names():
        reasons = []
        for call_mask, causal in ((None, True), (mask, False)):
            try:
                with torch.no_grad():
                    _attend(q, k, v, mask=call_mask, bias=None, scale=None, causal=causal,
                            backend=name)
                break
            except BackendUnavailable as exc:
                reasons.append(str(exc))
        results.append((name, reasons[0] if len(reasons) == 2 else None))
    return tuple(results)


def resolve(name: str, device: str | torch.device, dtype: torch.dtype) -> str:
    """Return ``name`` if it runs on ``device``/``dtype``, else raise with the probe's reason."""
    _check_name(name)
    reason = available(device, dtype)[name]
    if reason is not None:
        raise BackendUnavailable(reason)
    return name
