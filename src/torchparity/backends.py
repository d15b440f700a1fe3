"""Attention backends behind one switch.

Every reference model computes attention through :func:`attention`, which dispatches to the
backend chosen by :func:`use` (innermost wins) or else by the model's config. All backends share
one contract, so they can be compared element by element:

- ``q`` is (batch, heads, q_len, head_dim); ``k`` and ``v`` are (batch, kv_heads, k_len, head_dim)
  with ``heads`` a multiple of ``kv_heads`` (GQA/MQA: key/value heads are repeated);
- ``mask`` is boolean, True where a query may attend, broadcastable to (batch, heads, q, k);
- ``bias`` is an additive float score bias (ALiBi, relative positions), broadcastable likewise;
- a query row with no visible key returns zeros (a padded query), on every backend.

A backend that cannot run a call (wrong device, dtype, or a feature its kernel lacks) raises
:class:`~torchparity.errors.BackendUnavailable` with the reason. Nothing ever falls back silently.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from torchparity.errors import BackendUnavailable, UsageError

_SDPA_KERNELS = {
    "sdpa-math": "MATH",
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
}
_CUDA_ONLY = {"sdpa-efficient", "sdpa-cudnn"}
# Backends forced by the active use() blocks, innermost last. A plain list rather than a
# ContextVar: torch.compile traces a module global (and guards on it) but breaks the graph at
# ContextVar.get. The choice is process-wide, like torch.backends settings.
_forced: list[str] = []


def names() -> list[str]:
    """All backend names, in a stable order: the plain reference first."""
    return ["manual", "sdpa", *_SDPA_KERNELS, "flex"]


def _check_name(name: str) -> None:
    if name not in names():
        raise UsageError(f"unknown attention backend {name!r}; choose one of {', '.join(names())}")


@contextlib.contextmanager
def use(name: str) -> Iterator[None]:
    """Force backend ``name`` for every reference model's attention inside the block."""
    _check_name(name)
    _forced.append(name)
    try:
        yield
    finally:
        _forced.pop()


def current(default: str = "manual") -> str:
    """The backend forced by the innermost :func:`use`, else ``default``."""
    return _forced[-1] if _forced else default


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
    ``q_len == k_len``); it may be combined with ``mask``. ``backend`` overrides :func:`use`.
    """
    name = backend or current()
    _check_name(name)
    if name in _CUDA_ONLY and q.device.type != "cuda":
        raise BackendUnavailable(f"{name} needs a CUDA device; tensors are on {q.device.type}")
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
    attn_mask = _sdpa_mask(mask, bias, q.dtype)
    if name == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal,
                                              scale=scale)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernel = getattr(SDPBackend, _SDPA_KERNELS[name])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel([kernel]):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                                      is_causal=causal, scale=scale)
        except RuntimeError as exc:
            reasons = [str(w.message).split("(Triggered")[0].strip() for w in caught]
            detail = "; ".join(r for r in reasons if r) or str(exc).splitlines()[0]
            raise BackendUnavailable(
                f"{name} cannot run this call ({q.device.type}, {q.dtype}, "
                f"{_describe_features(mask, bias, causal)}): {detail}"
            ) from None


def _describe_features(mask, bias, causal) -> str:
    parts = []
    if mask is not None:
        parts.append("boolean mask")
    if bias is not None:
        parts.append("trainable additive bias" if bias.requires_grad else "additive bias")
    if causal:
        parts.append("causal")
    return ", ".join(parts) or "no mask"


@functools.cache
def _flex_function(device_type: str) -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    # Compiling is what makes flex fast on CUDA; on the CPU eager keeps start-up cheap.
    return torch.compile(flex_attention, dynamic=False) if device_type == "cuda" else flex_attention


def _flex(q, k, v, mask, bias, scale, causal, name) -> torch.Tensor:
    if q.device.type == "cpu" and torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, bias)
    ):
        raise BackendUnavailable("flex has no backward pass on the CPU; run it without gradients")
    full = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    bias_full = None if bias is None else bias.expand(full)
    mask_full = None if mask is None else mask.expand(full)

    def score_mod(score, b, h, q_idx, kv_idx):
        if bias_full is not None:
            score = score + bias_full[b, h, q_idx, kv_idx]
        if mask_full is not None:
            score = torch.where(mask_full[b, h, q_idx, kv_idx], score, -float("inf"))
        if causal:
            score = torch.where(q_idx >= kv_idx, score, -float("inf"))
        return score

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
        warnings.filterwarnings("ignore", message=".*_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG")
        return _flex_function(q.device.type)(q, k, v, score_mod=score_mod, scale=scale)


_IMPLEMENTATIONS: dict[str, Callable[..., torch.Tensor]] = {
    "manual": _manual,
    "sdpa": _sdpa,
    **{name: _sdpa for name in _SDPA_KERNELS},
    "flex": _flex,
}


def available(device: str | torch.device = "cpu",
              dtype: torch.dtype = torch.float32) -> dict[str, str | None]:
    """Probe every backend with a tiny real masked call on ``device`` in ``dtype``.

    Returns ``{name: None}`` for a backend that ran, or ``{name: reason}`` saying why not.
    Results are cached per (device, dtype) for the life of the process.
    """
    return dict(_probe(str(torch.device(device)), dtype))


@functools.cache
def _probe(device: str, dtype: torch.dtype) -> tuple[tuple[str, str | None], ...]:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        return tuple((name, "no CUDA device is available") for name in names())
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=gen).to(dev, dtype) for _ in range(3))
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool, device=dev).tril()
    results = []
    for name in names():
        try:
            with torch.no_grad():
                attention(q, k, v, mask=mask, backend=name)
            results.append((name, None))
        except BackendUnavailable as exc:
            results.append((name, str(exc)))
        except (RuntimeError, NotImplementedError, TypeError) as exc:
            results.append((name, f"{name} failed on {dev.type} {dtype}: "
                                  f"{str(exc).splitlines()[0]}"))
    return tuple(results)


def resolve(name: str, device: str | torch.device, dtype: torch.dtype) -> str:
    """Return ``name`` if it runs on ``device``/``dtype``, else raise with the probe's reason."""
    _check_name(name)
    reason = available(device, dtype)[name]
    if reason is not None:
        raise BackendUnavailable(reason)
    return name
