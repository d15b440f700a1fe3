"""The models a benchmark times: zoo cases at a size, one attention call alone, and a twin pair."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from torchparity import backends
from torchparity.bench.rounds import Row
from torchparity.bench.settings import Size
from torchparity.reference import DecoderLM, EncoderDecoder, TransformerConfig, zoo
from torchparity.reference.config import FieldValue


def model_config(case: str, size: Size) -> TransformerConfig:
    """Zoo case ``case`` scaled to ``size``, its variants (norms, positions, GQA share) kept."""
    base = zoo.get(case).config
    kv_heads = None if base.n_kv_heads is None else max(
        1, size.n_heads * base.kv_heads // base.n_heads)
    changes: dict[str, FieldValue] = dict(
        d_model=size.d_model, n_heads=size.n_heads, n_kv_heads=kv_heads, head_dim=None,
        n_layers=size.n_layers, d_ff=size.d_ff, vocab_size=size.vocab_size,
        max_positions=max(base.max_positions, size.seq_len),
    )
    if base.is_encoder_decoder:
        changes.update(n_encoder_layers=size.n_layers, src_vocab_size=size.vocab_size)
    return base.replace(**changes)


def tokens_per_step(config: TransformerConfig, size: Size) -> int:
    """Tokens a step reads, for tokens/s: an encoder-decoder reads a source and a target."""
    return size.batch_size * size.seq_len * (2 if config.is_encoder_decoder else 1)


def size_fields(case: str, config: TransformerConfig, size: Size) -> Row:
    """The fields of a row that say which model, at which size, was timed."""
    return {"case": case, "model": config.architecture, "size": size.name,
            "d_model": size.d_model, "n_layers": size.n_layers, "seq_len": size.seq_len,
            "batch_size": size.batch_size}


def timing_model(config: TransformerConfig, device: torch.device, dtype: torch.dtype,
                 seed: int = 0) -> nn.Module:
    """The reference model of ``config`` with seeded weights meant for timing only."""
    model = (EncoderDecoder if config.is_encoder_decoder else DecoderLM)(config)
    # every matrix and linear bias uniform with std 1/sqrt(fan_in), seeded, so all workers and both
    # models of a diagnosis hold the same weights; build_model's float64 init would cost more than
    # the measurement at GPU sizes
    gen = torch.Generator().manual_seed(seed)

    def draw(param: torch.Tensor, fan_in: int) -> None:
        bound = (3.0 / fan_in) ** 0.5
        param.copy_(torch.rand(param.shape, generator=gen) * (2 * bound) - bound)

    with torch.no_grad():
        for module in model.modules():
            for param in module.parameters(recurse=False):
                if param.dim() >= 2:
                    draw(param, param.shape[-1])
                elif isinstance(module, nn.Linear):
                    draw(param, module.in_features)
    return model.to(device=device, dtype=dtype)


class AttentionOnly(torch.nn.Module):
    """The causal attention call of one layer of ``config`` alone, over trainable q, k, v."""

    def __init__(self, config: TransformerConfig, batch_size: int, seq_len: int,
                 seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)

        def heads(count: int) -> torch.nn.Parameter:
            shape = (batch_size, count, seq_len, config.dim_head)
            return torch.nn.Parameter(torch.randn(shape, generator=gen))

        self.q, self.k, self.v = heads(config.n_heads), heads(config.kv_heads), heads(
            config.kv_heads)
        # the kernels' own speed, without the rest of the model
        self.backend = config.attention_backend

    def forward(self) -> torch.Tensor:
        """One attention call over the trainable q, k, v: (batch, heads, seq, head_dim)."""
        return backends.attention(self.q, self.k, self.v, causal=True, backend=self.backend)

    @staticmethod
    def loss(output: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The mean square of the output in float32: its backward reaches every element."""
        return output.float().square().mean()


class ThreeProjectionAttention(nn.Module):
    """A causal attention as first written: three projections, GQA by repeating key/value heads."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads or n_heads
        self.head_dim = d_model // n_heads
        self.sizes = [n_heads * self.head_dim] + [self.n_kv_heads * self.head_dim] * 2
        self.q, self.k, self.v = (nn.Linear(d_model, size, bias=False) for size in self.sizes)
        # a query with nothing to attend to (all padding) gets zeros
        self.o = nn.Linear(n_heads * self.head_dim, d_model, bias=False)

    def forward(self, hidden_states: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of ``hidden_states`` (batch, seq, d_model) over themselves."""
        q, k, v = self.heads(self.q(hidden_states), self.k(hidden_states),
                             self.v(hidden_states))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~self.allowed(q, attention_mask), float("-inf"))
        return self.merge(torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v)

    def heads(self, q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The projections split into (batch, heads, seq, head_dim), keys and values per group."""
        groups = self.n_heads // self.n_kv_heads
        split = [t.unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for t in (q, k, v)]
        return split[0], *(t.repeat_interleave(groups, dim=1) for t in split[1:])

    @staticmethod
    def allowed(q: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """(batch or 1, 1, seq, seq) bool: where a query may attend, causal and not to padding."""
        seq = q.shape[2]
        causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()[None, None]
        return causal if attention_mask is None else (
            causal & attention_mask.bool()[:, None, None, :])

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, heads, seq, head_dim) heads concatenated and put through the output layer."""
        return self.o(x.transpose(1, 2).flatten(2))


class FusedProjectionAttention(ThreeProjectionAttention):
    """The refactor: one fused projection and SDPA, weights from the original by ``fuse_qkv``."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None) -> None:
        super().__init__(d_model, n_heads, n_kv_heads)
        del self.q, self.k, self.v
        self.qkv = nn.Linear(d_model, sum(self.sizes), bias=False)

    def forward(self, hidden_states: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The same attention by one fused projection and ``scaled_dot_product_attention``."""
        q, k, v = self.heads(*self.qkv(hidden_states).split(self.sizes, dim=-1))
        allow = self.allowed(q, attention_mask)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allow)
        # SDPA gives a query with nothing to attend to NaN; the original gives it zeros.
        return self.merge(out.masked_fill(~allow.any(-1, keepdim=True), 0.0))


def fuse_qkv(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The original's state_dict in the fused layout (``--weight-map``)."""
    out = {name: t for name, t in state.items() if name.split(".")[0] not in "qkv"}
    out["qkv.weight"] = torch.cat([state[f"{p}.weight"] for p in "qkv"])
    return out
