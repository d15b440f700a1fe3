"""One-line changes planted inside the zoo's modules, each line marked ``# planted``.

Each plant is a subclass whose method is the original with one line changed; the test finds
the marked line itself (its path and number), independently of the diagnosis.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchparity import backends
from torchparity.reference import build_model, sequence_loss, zoo
from torchparity.reference.attention import Attention
from torchparity.reference.layers import TransformerLayer
from torchparity.reference.mlp import MLP
from torchparity.reference.norms import LayerNorm, RMSNorm
from torchparity.reference.positions import apply_rotary
from torchparity.reference.variants import PreallocatedKVCache


class RMSNormEps(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps * 1000)  # planted
        return self.weight * h.to(x.dtype)


class RMSNormNoWeight(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.detach() * h.to(x.dtype) * 1.001  # planted


class LayerNormEps(LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, 1e-3)  # planted


class MLPActivation(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is None:
            return self.down_proj(self.act(self.up_proj(x)))
        return self.down_proj(F.gelu(self.gate_proj(x)) * self.up_proj(x))  # planted


class MLPSwapped(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is None:
            return self.down_proj(self.act(self.up_proj(x)))
        return self.down_proj(self.act(self.up_proj(x)) * self.gate_proj(x))  # planted


class AttentionScale(Attention):
    def attend(self, q, k, v, ctx, bias):
        backend = backends.current(self.config.attention_backend)
        q = q * 1.01  # planted
        return backends.attention(q, k, v, mask=ctx.mask, bias=bias, scale=self.scale,
                                  causal=ctx.causal, backend=backend)


class AttentionMergeHeads(Attention):
    def merge_heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.permute(0, 2, 3, 1).flatten(-2)  # planted


class AttentionValuesFromKeys(Attention):
    def project_kv(self, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.split_heads(self.k_proj(source), self.n_kv_heads)
        return k, self.split_heads(self.k_proj(source), self.n_kv_heads)  # planted


class AttentionPartialRotary(Attention):
    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return apply_rotary(x, positions, rotary_dim=self.config.rotary_dims // 2,  # planted
                            theta=self.config.rope_theta, layout=self.config.rotary_layout)


class AttentionFutureKeys(Attention):
    """Lets every query see the keys after it (needs an explicit mask: a padded batch)."""

    def attend(self, q, k, v, ctx, bias):
        backend = backends.current(self.config.attention_backend)
        mask = ctx.mask | torch.ones_like(ctx.mask).triu(1)  # planted
        return backends.attention(q, k, v, mask=mask, bias=bias, scale=self.scale,
                                  causal=ctx.causal, backend=backend)


class LayerResidual(TransformerLayer):
    def residual(self, x: torch.Tensor, norm, sublayer) -> torch.Tensor:
        if self.pre_norm:
            return x + 0.5 * self.dropout(sublayer(norm(x)))  # planted
        return norm(x + self.dropout(sublayer(x)))


# Changes that compute the same thing: no op may be called divergent.


class ResidualReordered(TransformerLayer):
    def residual(self, x: torch.Tensor, norm, sublayer) -> torch.Tensor:
        if self.pre_norm:
            return self.dropout(sublayer(norm(x))) + x
        return norm(self.dropout(sublayer(x)) + x)


class FusedProjection(Attention):
    """Queries, keys and values from one fused matmul of the three weights."""

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        weight = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
        bias = None if self.q_proj.bias is None else torch.cat(
            [self.q_proj.bias, self.k_proj.bias, self.v_proj.bias])
        q, k, v = F.linear(x, weight, bias).split(
            [self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features], -1)
        return (self.split_heads(q, self.n_heads), self.split_heads(k, self.n_kv_heads),
                self.split_heads(v, self.n_kv_heads))


# Factories for the command line (docs/diagnose.md): llama-tiny, and the same weights with a
# plant in B.


def make_a() -> tuple:
    config = zoo.get("llama-tiny").config
    batch = zoo.make_batch(config, batch_size=2, seq_len=12, seed=0)
    return build_model(config, seed=0), batch, sequence_loss


def make_b_activation() -> tuple:
    model, batch, loss = make_a()
    model.decoder.layers[0].mlp.__class__ = MLPActivation
    return model, batch, loss


def make_b_scale() -> tuple:
    model, batch, loss = make_a()
    model.decoder.layers[1].attn.__class__ = AttentionScale
    return model, batch, loss


class SeedlessDropout(torch.nn.Module):
    """Draws a new dropout mask on every call: no generator, no seed."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(self.proj(x), p=0.5, training=True)  # planted
        return h.sum(-1)


def make_seedless() -> tuple:
    torch.manual_seed(0)
    return SeedlessDropout(), (torch.randn(4, 8, generator=torch.Generator().manual_seed(0)),)


class GeneratorNoise(torch.nn.Module):
    """A projection, then a scale. With ``noisy``, the projection is perturbed by one part in
    1e4, drawn from a generator the module keeps and never reseeds: every call draws anew, as
    a scatter whose order atomics decide sums anew. ``scale`` other than 2 is a real change."""

    def __init__(self, noisy: bool = False, scale: float = 2.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)
        self.noisy, self.scale = noisy, scale
        self.generator = torch.Generator().manual_seed(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        if self.noisy:
            noise = torch.randn(h.shape, generator=self.generator, dtype=h.dtype)
            h = h * (1 + 1e-4 * noise)  # nondeterministic
        return (h.relu() * self.scale).sum(-1)  # planted


class CacheWrittenOneOff(PreallocatedKVCache):
    """The ``preallocated-cache`` twin's cache with its key written one slot further than read."""

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.lengths.get(layer, 0)
        stop = start + k.shape[-2]
        if stop + 1 > self.capacity(layer):
            self._grow(layer, k, v, -(-(stop + 1) // self.chunk) * self.chunk)
        buf_k, buf_v = self.buffers[layer]
        buf_k[..., start + 1:stop + 1, :] = k  # planted
        buf_v[..., start:stop, :] = v
        self.lengths[layer] = stop
        return buf_k[..., :stop, :], buf_v[..., :stop, :]  # read


class RMSNormHalfGradient(RMSNorm):
    """The same forward; the statistics' gradient halved (one factor of the square detached)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt((h * h.detach()).mean(-1, keepdim=True) + self.eps)  # planted
        return self.weight * h.to(x.dtype)
