"""Refactored twins of reference components: the edits production code makes.

Each twin is a drop-in replacement for one reference module computing the same function another
way; where the parameter layout changes, weights convert on the way in and tensors convert back,
so gradients compare name for name::

    twin = swap_in(model, "fused-qkv")          # a converted copy; ``model`` is untouched
    twin(**batch)                               # same function as model(**batch)
    reference_gradients(twin)                   # {"decoder.layers.0.attn.q_proj.weight": ...}

Two variants are not pure reorderings: ``softmax-input-dtype`` computes the softmax in the input
dtype (bit-identical in fp32 only), and ``preallocated-cache`` changes only how decoding stores
keys and values.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from torchparity import backends
from torchparity.reference.attention import Attention, AttentionContext
from torchparity.reference.cache import KVCache
from torchparity.reference.config import TransformerConfig
from torchparity.reference.mlp import MLP
from torchparity.reference.models import Model
from torchparity.reference.positions import (
    apply_rotary,
    compute_dtype,
    rotary_angles,
    rotate_half,
    rotate_pairs,
)

Tensors = dict[str, torch.Tensor]
T = TypeVar("T", bound="Twin")


class Twin(nn.Module):
    """A module replacing one of :attr:`reference_type`, its weights converted exactly."""

    reference_type: type[nn.Module] = nn.Module

    @classmethod
    def blank_like(cls: type[T], reference: nn.Module, config: TransformerConfig) -> T:
        """An empty twin (fresh weights) shaped like ``reference``; subclasses say how."""
        raise NotImplementedError

    @classmethod
    def from_reference(cls: type[T], reference: nn.Module,
                       config: TransformerConfig | None = None) -> T:
        """A twin computing ``reference``'s function, on its device, dtype and train/eval mode.

        Raises:
            ValueError: no ``config`` is given and ``reference`` keeps none (the MLP does not).
        """
        config = config if config is not None else getattr(reference, "config", None)
        if config is None:
            raise ValueError(f"{cls.__name__}.from_reference needs the model's config for a "
                             f"{type(reference).__name__}: pass config=model.config")
        twin = cls.blank_like(reference, config)
        first = next(reference.parameters(), None)
        if first is not None:
            twin.to(device=first.device, dtype=first.dtype)
        with torch.no_grad():
            twin.load_state_dict(twin.twin_layout(reference.state_dict()))
        return twin.train(reference.training)

    def twin_layout(self, state: Tensors) -> Tensors:
        """Reference-layout tensors, by the reference's local names, in this twin's layout."""
        return dict(state)

    def reference_layout(self, tensors: Tensors) -> Tensors:
        """This twin's weights or gradients in the reference's names and layout."""
        return dict(tensors)


class AttentionTwin(Twin, Attention):
    """Base of the attention twins: the reference :class:`Attention` with one step replaced."""

    reference_type = Attention

    @classmethod
    def blank_like(cls, reference: Attention, config: TransformerConfig) -> AttentionTwin:
        """An attention twin for ``reference``'s layer, self- or cross-attention alike."""
        return cls(config, reference.layer_idx, cross=reference.cross)


# --- fused projections ------------------------------------------------------------------------


class FusedQKVAttention(AttentionTwin):
    """One ``in_proj`` matmul for queries, keys and values (GPT-2, ``nn.MultiheadAttention``)."""

    def __init__(self, config: TransformerConfig, layer_idx: int, *, cross: bool = False) -> None:
        super().__init__(config, layer_idx, cross=cross)
        del self.q_proj, self.k_proj, self.v_proj
        self.in_proj = nn.Linear(config.d_model, sum(self._sizes()), bias=config.qkv_bias)

    def _sizes(self) -> list[int]:
        kv = self.n_kv_heads * self.head_dim
        return [self.n_heads * self.head_dim, kv, kv]

    def _rows(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        bias = self.in_proj.bias
        return self.in_proj.weight[start:stop], None if bias is None else bias[start:stop]

    # cross-attention uses in_proj's rows apart: queries from the decoder, keys and values from the
    # encoder
    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        """The queries (batch, heads, len, head_dim), from the query rows of ``in_proj``."""
        return self.split_heads(F.linear(x, *self._rows(0, self._sizes()[0])), self.n_heads)

    def project_kv(self, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values, each (batch, kv_heads, len, head_dim), from ``in_proj``'s rows."""
        q_size, kv_size, _ = self._sizes()
        k, v = F.linear(source, *self._rows(q_size, q_size + 2 * kv_size)).split(kv_size, -1)
        return self.split_heads(k, self.n_kv_heads), self.split_heads(v, self.n_kv_heads)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values from one ``in_proj`` matmul, split by rows into heads."""
        q, k, v = self.in_proj(x).split(self._sizes(), -1)
        return (self.split_heads(q, self.n_heads), self.split_heads(k, self.n_kv_heads),
                self.split_heads(v, self.n_kv_heads))

    def twin_layout(self, state: Tensors) -> Tensors:
        """``q_proj``, ``k_proj`` and ``v_proj`` concatenated by rows into ``in_proj``."""
        return _fuse(state, ("q_proj", "k_proj", "v_proj"), "in_proj")

    def reference_layout(self, tensors: Tensors) -> Tensors:
        """``in_proj`` split by rows back into ``q_proj``, ``k_proj`` and ``v_proj``."""
        return _unfuse(tensors, "in_proj", ("q_proj", "k_proj", "v_proj"), self._sizes())


class FusedGateUpMLP(Twin, MLP):
    """Gated MLP with one ``gate_up_proj`` matmul, split in halves (vLLM, many Llama ports)."""

    reference_type = MLP

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__(config)
        if not config.gated:
            raise ValueError(f"fused gate_up needs a gated activation; "
                             f"activation={config.activation!r}")
        self.d_ff = config.d_ff
        del self.gate_proj, self.up_proj
        self.gate_up_proj = nn.Linear(config.d_model, 2 * config.d_ff, bias=config.ffn_bias)

    @classmethod
    def blank_like(cls, reference: MLP, config: TransformerConfig) -> FusedGateUpMLP:
        """A fused MLP of the model's config (the MLP it replaces keeps none)."""
        return cls(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The gated MLP with gate and up projections from one matmul, split in halves."""
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)

    def twin_layout(self, state: Tensors) -> Tensors:
        """``gate_proj`` and ``up_proj`` concatenated by rows into ``gate_up_proj``."""
        return _fuse(state, ("gate_proj", "up_proj"), "gate_up_proj")

    def reference_layout(self, tensors: Tensors) -> Tensors:
        """``gate_up_proj`` split in halves back into ``gate_proj`` and ``up_proj``."""
        return _unfuse(tensors, "gate_up_proj", ("gate_proj", "up_proj"), [self.d_ff] * 2)


def _fuse(state: Tensors, parts: tuple[str, ...], fused: str) -> Tensors:
    """Concatenate the weights (and biases) of ``parts`` along the output rows into ``fused``."""
    out = {k: v for k, v in state.items() if k.split(".")[0] not in parts}
    for param in ("weight", "bias"):
        if f"{parts[0]}.{param}" in state:
            out[f"{fused}.{param}"] = torch.cat([state[f"{p}.{param}"] for p in parts])
    return out


def _unfuse(tensors: Tensors, fused: str, parts: tuple[str, ...], sizes: list[int]) -> Tensors:
    out = {k: v for k, v in tensors.items() if k.split(".")[0] != fused}
    for param in ("weight", "bias"):
        if f"{fused}.{param}" in tensors:
            for part, piece in zip(parts, tensors[f"{fused}.{param}"].split(sizes), strict=True):
                out[f"{part}.{param}"] = piece
    return out


# --- rotary forms -----------------------------------------------------------------------------


def rotary_permutation(head_dim: int, rotary_dim: int, source: str, target: str) -> torch.Tensor:
    """``p`` (head_dim,): channel ``j`` in layout ``target`` is channel ``p[j]`` of ``source``."""
    # applied to both q and k projections, it leaves q.k and so the model unchanged
    half = rotary_dim // 2
    # Half-split pairs channel i with i + half; interleaved pairs 2i with 2i + 1.
    interleaved_from_half = torch.arange(rotary_dim).view(2, half).t().flatten()
    if source == target:
        perm = torch.arange(rotary_dim)
    elif source == "half":
        perm = interleaved_from_half
    else:
        perm = interleaved_from_half.argsort()
    return torch.cat((perm, torch.arange(rotary_dim, head_dim)))


def _permute_heads(tensor: torch.Tensor, head_dim: int, perm: torch.Tensor) -> torch.Tensor:
    """Permute the channels of every head in the rows of a projection weight or bias."""
    return tensor.unflatten(0, (-1, head_dim))[:, perm].flatten(0, 1)


class RotaryFormAttention(AttentionTwin):
    """Rotary embedding in another ``form``, with q/k weights permuted into the form's layout.

    "rotate-half" (Hugging Face Llama, GPT-NeoX) and "interleaved" (GPT-J) are the
    real-arithmetic layouts; "complex" (Meta's Llama) multiplies adjacent channel pairs by
    ``exp(i * angle)``.
    """

    form = "rotate-half"
    layouts = {"rotate-half": "half", "interleaved": "interleaved", "complex": "interleaved"}

    @property
    def layout(self) -> str:
        """The real-arithmetic layout this form's channels pair in ("half" or "interleaved")."""
        return self.layouts[self.form]

    def _permute(self, tensors: Tensors, source: str, target: str) -> Tensors:
        perm = rotary_permutation(self.head_dim, self.config.rotary_dims, source, target)
        return {name: _permute_heads(t, self.head_dim, perm)
                if name.split(".")[0] in ("q_proj", "k_proj") else t
                for name, t in tensors.items()}

    def twin_layout(self, state: Tensors) -> Tensors:
        """The q/k projection rows permuted from the config's rotary layout into this form's."""
        return self._permute(state, self.config.rotary_layout, self.layout)

    def reference_layout(self, tensors: Tensors) -> Tensors:
        """The q/k projection rows permuted back into the config's rotary layout."""
        return self._permute(tensors, self.layout, self.config.rotary_layout)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x`` (batch, heads, seq, head_dim) rotated in this form, in its dtype."""
        if self.form == "complex":
            return _rotate_complex(x, positions, self.config.rotary_dims, self.config.rope_theta)
        return apply_rotary(x, positions, rotary_dim=self.config.rotary_dims,
                            theta=self.config.rope_theta, layout=self.layout)


class RotateHalfAttention(RotaryFormAttention):
    """Rotary via ``rotate_half`` (Llama in Hugging Face, GPT-NeoX)."""
    form = "rotate-half"


class InterleavedRotaryAttention(RotaryFormAttention):
    """Rotary on interleaved channel pairs (GPT-J)."""
    form = "interleaved"


class ComplexRotaryAttention(RotaryFormAttention):
    """Rotary as a complex product of channel pairs (Meta's Llama)."""
    form = "complex"


def _rotate_complex(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int,
                    theta: float) -> torch.Tensor:
    """Interleaved rotary as a complex product, computed in fp32 (fp64 for fp64 inputs)."""
    cdtype = compute_dtype(x.dtype)
    angles = rotary_angles(positions, rotary_dim, theta, x.dtype)[:, None]  # (b, 1, s, r/2)
    rotation = torch.polar(torch.ones_like(angles), angles)
    pairs = torch.view_as_complex(x[..., :rotary_dim].to(cdtype).unflatten(-1, (-1, 2)))
    rotated = torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


class RotaryTableAttention(AttentionTwin):
    """Rotary from cos/sin tables made once per dtype and device, indexed by position."""

    def __init__(self, config: TransformerConfig, layer_idx: int, *, cross: bool = False) -> None:
        super().__init__(config, layer_idx, cross=cross)
        self._tables: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def table(self, length: int, dtype: torch.dtype, device: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, each (>= length, rotary_dim), grown to the next power of two on demand."""
        cos, _ = self._tables.get((dtype, device), (None, None))
        if cos is None or cos.shape[0] < length:
            positions = torch.arange(1 << max(length - 1, 1).bit_length(), device=device)[None]
            angles = rotary_angles(positions, self.config.rotary_dims, self.config.rope_theta,
                                   dtype)[0]
            if self.config.rotary_layout == "half":
                angles = torch.cat((angles, angles), dim=-1)
            else:
                angles = angles.repeat_interleave(2, dim=-1)
            self._tables[dtype, device] = (angles.cos().to(dtype), angles.sin().to(dtype))
        return self._tables[dtype, device]

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x`` (batch, heads, seq, head_dim) rotated with the tables' cos and sin by position."""
        cos, sin = self.table(int(positions.max()) + 1, x.dtype, x.device)
        cos, sin = cos[positions][:, None], sin[positions][:, None]  # (b, 1, s, rotary_dim)
        turn = rotate_half if self.config.rotary_layout == "half" else rotate_pairs
        r = self.config.rotary_dims
        x_rot, x_pass = x[..., :r], x[..., r:]
        return torch.cat((x_rot * cos + turn(x_rot) * sin, x_pass), dim=-1)


# --- masks, head reshapes and softmax precision --------------------------------------------


def _empty_rows(mask: torch.Tensor) -> torch.Tensor:
    """Query rows that see no key: the backends' contract makes their output zero."""
    return ~mask.any(dim=-1, keepdim=True)


class AdditiveMaskAttention(AttentionTwin):
    """The mask as an additive float bias (0 or ``finfo.min``), as Hugging Face passes it."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext,
               bias: torch.Tensor | None) -> torch.Tensor:
        """Attention with the mask added as a float bias; rows seeing no key zeroed, not NaN."""
        if ctx.mask is None:
            return super().attend(q, k, v, ctx, bias)
        empty = _empty_rows(ctx.mask)
        dtype = q.dtype if bias is None else bias.dtype
        # Rows without a visible key are left unmasked (no all-min rows, no NaN) and zeroed.
        additive = torch.zeros(ctx.mask.shape, dtype=dtype, device=q.device).masked_fill(
            ~(ctx.mask | empty), torch.finfo(dtype).min)
        out = backends.attention(
            q, k, v, bias=additive if bias is None else bias + additive, scale=self.scale,
            causal=ctx.causal, backend=backends.current(self.config.attention_backend))
        return out.masked_fill(empty, 0.0)


class ContiguousViewAttention(AttentionTwin):
    """Heads split and merged with ``view`` (after ``contiguous()``) instead of reshapes."""

    def split_heads(self, x: torch.Tensor, n_heads: int) -> torch.Tensor:
        """(batch, len, heads * head_dim) split into (batch, heads, len, head_dim) with ``view``."""
        batch, length, _ = x.shape
        return x.view(batch, length, n_heads, self.head_dim).transpose(1, 2)

    def merge_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, heads, len, head_dim) merged by ``contiguous().view`` instead of ``flatten``."""
        batch, _, length, _ = x.shape
        return x.transpose(1, 2).contiguous().view(batch, length, -1)


class InputDtypeSoftmaxAttention(AttentionTwin):
    """Attention scaled, biased and soft-maxed in the input dtype (bf16/fp16), not fp32."""

    # its own math: it ignores the attention backend
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext,
               bias: torch.Tensor | None) -> torch.Tensor:
        """Attention by hand in the input dtype, softmax included; rows seeing no key are zero."""
        repeats = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        scores = (q @ k.transpose(-2, -1)) * self.scale
        if bias is not None:
            scores = scores + bias.to(scores.dtype)
        mask = ctx.mask
        if ctx.causal:
            mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        if mask is None:
            return scores.softmax(dim=-1) @ v
        empty = _empty_rows(mask)
        scores = scores.masked_fill(~(mask | empty), float("-inf"))
        return (scores.softmax(dim=-1) @ v).masked_fill(empty, 0.0)


# --- KV cache ---------------------------------------------------------------------------------


class PreallocatedKVCache(KVCache):
    """A KV cache writing into buffers grown ``chunk`` positions at a time (vLLM/TGI-style)."""

    # same interface and contents as KVCache; meant for inference (torch.no_grad)
    def __init__(self, chunk: int = 4) -> None:
        super().__init__()
        if chunk < 1:
            raise ValueError(f"chunk must be a positive number of positions; got {chunk}")
        self.chunk = chunk
        self.buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.lengths: dict[int, int] = {}

    def __len__(self) -> int:
        return self.lengths.get(0, 0)

    def capacity(self, layer: int = 0) -> int:
        """Positions allocated for ``layer``: a multiple of ``chunk``, 0 before the first call."""
        return self.buffers[layer][0].shape[-2] if layer in self.buffers else 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``layer``'s new keys and values into its buffers; views of all positions so far."""
        start = self.lengths.get(layer, 0)
        stop = start + k.shape[-2]
        if stop > self.capacity(layer):
            self._grow(layer, k, v, math.ceil(stop / self.chunk) * self.chunk)
        buf_k, buf_v = self.buffers[layer]
        buf_k[..., start:stop, :] = k
        buf_v[..., start:stop, :] = v
        self.lengths[layer] = stop
        return buf_k[..., :stop, :], buf_v[..., :stop, :]

    def _grow(self, layer: int, k: torch.Tensor, v: torch.Tensor, capacity: int) -> None:
        grown = []
        for new, old in zip((k, v), self.buffers.get(layer, (None, None)), strict=True):
            shape = (*new.shape[:-2], capacity, new.shape[-1])
            buf = new.new_zeros(shape)
            if old is not None:
                buf[..., : old.shape[-2], :] = old
            grown.append(buf)
        self.buffers[layer] = (grown[0], grown[1])

    def reorder(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (in that order) in the buffers too."""
        super().reorder(index)
        for layer, (k, v) in self.buffers.items():
            self.buffers[layer] = (k.index_select(0, index), v.index_select(0, index))


# --- GQA as MHA -------------------------------------------------------------------------------


def expand_kv_heads(model: Model) -> Model:
    """An MHA copy of a GQA/MQA ``model``, each key/value head repeated for its query heads."""
    config = model.config.replace(n_kv_heads=None)
    mha = type(model)(config)
    first = next(model.parameters())
    mha.to(device=first.device, dtype=first.dtype)
    repeats = model.config.n_heads // model.config.kv_heads
    head_dim = model.config.dim_head
    state = {
        name: _repeat_heads(t, head_dim, repeats) if _is_kv_projection(name) else t
        for name, t in model.state_dict().items()
    }
    mha.load_state_dict(state)
    return mha.train(model.training)


def fold_kv_heads(tensors: Tensors, gqa_config: TransformerConfig) -> Tensors:
    """Gradients of an :func:`expand_kv_heads` model summed per group, as the GQA model's."""
    repeats = gqa_config.n_heads // gqa_config.kv_heads
    head_dim = gqa_config.dim_head
    return {
        name: t.unflatten(0, (-1, repeats, head_dim)).sum(1).flatten(0, 1)
        if _is_kv_projection(name) else t
        for name, t in tensors.items()
    }


def _is_kv_projection(name: str) -> bool:
    return name.split(".")[-2] in ("k_proj", "v_proj")


def _repeat_heads(t: torch.Tensor, head_dim: int, repeats: int) -> torch.Tensor:
    return t.unflatten(0, (-1, head_dim)).repeat_interleave(repeats, dim=0).flatten(0, 1)


# --- the registry -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """A named refactor: which twin replaces which modules, and where it applies."""

    name: str
    description: str
    twin: type[Twin] | None
    # why it does not apply to a config; None when it does
    requires: Callable[[TransformerConfig], str | None]
    uses_backend: bool = True  # False for twins computing attention themselves
    numerics_change: bool = False  # not a reordering: may leave the band in low precision
    # which modules of the reference type are replaced
    swaps: Callable[[nn.Module], bool] = lambda module: True

    def applies(self, config: TransformerConfig) -> bool:
        """Whether the variant applies to models of ``config``."""
        return self.requires(config) is None


def _always(config: TransformerConfig) -> str | None:
    return None


def _needs_rotary(config: TransformerConfig) -> str | None:
    return None if config.positions == "rotary" else "needs positions='rotary'"


def _needs_gated(config: TransformerConfig) -> str | None:
    return None if config.gated else "needs a gated activation (gated-silu or gated-gelu)"


def _self_attention(module: nn.Module) -> bool:
    return not module.cross


_VARIANTS = [
    Variant("fused-qkv", "one in_proj matmul for q, k and v instead of three projections",
            FusedQKVAttention, _always),
    Variant("fused-gate-up", "one gate_up matmul in the gated MLP instead of two",
            FusedGateUpMLP, _needs_gated),
    Variant("rotary-rotate-half", "rotary via rotate_half, q/k weights permuted to that layout",
            RotateHalfAttention, _needs_rotary, swaps=_self_attention),
    Variant("rotary-interleaved", "rotary on interleaved pairs, q/k weights permuted",
            InterleavedRotaryAttention, _needs_rotary, swaps=_self_attention),
    Variant("rotary-complex", "rotary as complex multiplication, q/k weights permuted",
            ComplexRotaryAttention, _needs_rotary, swaps=_self_attention),
    Variant("rotary-table", "precomputed cos/sin tables instead of computing them per call",
            RotaryTableAttention, _needs_rotary, swaps=_self_attention),
    Variant("additive-mask", "additive float mask (0 / finfo.min) instead of a boolean mask",
            AdditiveMaskAttention, _always),
    Variant("contiguous-view", "heads split/merged with contiguous().view instead of reshape",
            ContiguousViewAttention, _always),
    Variant("softmax-input-dtype", "attention scores and softmax in the input dtype, not fp32",
            InputDtypeSoftmaxAttention, _always, uses_backend=False, numerics_change=True),
    Variant("preallocated-cache", "KV cache in preallocated buffers grown in chunks of 4",
            None, _always),
]
_BY_NAME = {v.name: v for v in _VARIANTS}


def names() -> list[str]:
    """Names of all variants, in a stable order."""
    return list(_BY_NAME)


def get(name: str) -> Variant:
    """The variant called ``name``; a ``KeyError`` for an unknown name lists the known ones."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown variant {name!r}; known variants: {', '.join(names())}") from None


def applicable(config: TransformerConfig) -> list[str]:
    """Names of the variants that apply to models of ``config``, in registry order."""
    return [v.name for v in _VARIANTS if v.applies(config)]


def swap_in(model: Model, name: str, *, inplace: bool = False) -> Model:
    """A model computing the same function as ``model`` with variant ``name`` swapped in.

    Args:
        model: a reference model.
        name: a variant's name.
        inplace: change ``model`` itself instead of a deep copy.

    Raises:
        ValueError: the variant does not apply to the model's config, saying why.
        KeyError: an unknown variant name.
    """
    variant = get(name)
    reason = variant.requires(model.config)
    if reason is not None:
        raise ValueError(f"variant {name!r} does not apply to this model: {reason}")
    model = model if inplace else copy.deepcopy(model)
    if variant.twin is None:
        model.new_cache = functools.partial(PreallocatedKVCache, chunk=4)
        return model
    targets = [(n, m) for n, m in model.named_modules()
               if type(m) is variant.twin.reference_type and variant.swaps(m)]
    for module_name, module in targets:
        parent_name, _, child = module_name.rpartition(".")
        twin = variant.twin.from_reference(module, model.config)
        setattr(model.get_submodule(parent_name), child, twin)
    return model


def reference_layout(model: nn.Module, tensors: Tensors) -> Tensors:
    """A swapped model's weights or gradients in the reference model's names and layout."""
    out = dict(tensors)
    for prefix, module in model.named_modules():
        if not isinstance(module, Twin):
            continue
        local = {name[len(prefix) + 1:]: out.pop(name) for name in list(out)
                 if name.startswith(prefix + ".")}
        out.update({f"{prefix}.{name}": t for name, t in module.reference_layout(local).items()})
    return out


def reference_gradients(model: nn.Module) -> Tensors:
    """The gradients of ``model``'s parameters (zeros where none) in reference names and layout."""
    grads = {name: p.grad if p.grad is not None else torch.zeros_like(p)
             for name, p in model.named_parameters()}
    return reference_layout(model, grads)

