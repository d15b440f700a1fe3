"""A user's model file in the versions a refactor gives it (:func:`source`): for ``check
--model`` of weights whose names changed, and for ``diagnose`` of changes to its arithmetic.

The base: a one-block language model with q, k and v projections, an MLP ``up`` and ``down``
with ``F.gelu``, and a head tied to the embedding (an ``nn.Linear`` sharing its weight). Each
version's factory builds the base's weights, by meaning, in its own layout: the base's
``tp.init_weights`` draws, renamed or concatenated as its layout asks.

Versions (:data:`VERSIONS`):

- ``tied``: the head reads the embedding directly, ``x @ self.embed.weight.t()`` (Megatron's
  tied output layer), so the state dict has no ``head.weight``;
- ``fused``: one ``qkv`` projection for q, k and v;
- ``gelu``: the GELU written out exactly, ``0.5 * x * (1 + erf(x / sqrt 2))``;
- ``fused-k-changed``: ``fused`` with the k part's weights moved by 1%;
- ``fused-k-grad-doubled``: ``fused`` whose gradient of the k part is doubled (a hook on the
  parameter), the forward as it was;
- ``k-changed``, ``k-grad-scaled``: the base with ``attn.k``'s weights moved by 1%, or its
  weight's gradient scaled by 1.01 (against ``fused``'s goldens: a fused projection undone);
  ``q-changed``: the base with ``attn.q``'s weights moved by 1%;
- ``gated``: a gated MLP, ``down(silu(gate(x)) * up(x))``; ``gated-fused``: the same with one
  ``gate_up`` projection; ``gated-up-grad-scaled``: ``gated`` with ``mlp.up``'s weight's
  gradient scaled by 1.01; ``gated-up-changed``: ``gated`` with ``mlp.up``'s weights moved by 1%;
- ``swapped``: the MLP's modules renamed ``fc1``/``fc2`` and registered in the other order,
  which order and shape cannot pair (``mlp.up`` is ``mlp.fc1``, ``mlp.down`` ``mlp.fc2``);
- ``eps``: ``norm2`` built with ``eps=1e-3``;
- ``scale``: the attention's scale 0.9 of SDPA's default;
- ``tanh``: the tanh approximation of GELU;
- ``backward``: the GELU as a ``torch.autograd.Function`` whose forward is exact and whose
  backward is 2% off.

Each changed line carries ``# changed`` in every version, so a test finds it in the text.
"""

from __future__ import annotations

VERSIONS = ("base", "tied", "fused", "gelu", "fused-k-changed", "fused-k-grad-doubled",
            "k-changed", "k-grad-scaled", "q-changed", "gated", "gated-fused",
            "gated-up-grad-scaled", "gated-up-changed", "swapped", "eps", "scale", "tanh",
            "backward")

_MODEL = '''\
import math

import torch
import torch.nn.functional as F
from torch import nn

import torchparity as tp

VERSION = {version!r}
FUSED = VERSION.startswith("fused")
GATED = VERSION.startswith("gated")
VOCAB, DIM, HEADS = 16, 16, 2
SCALE = 0.9 / math.sqrt(DIM // HEADS) if VERSION == "scale" else None
EPS = 1e-3 if VERSION == "eps" else 1e-5


class ScaledGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return F.gelu(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        cdf = 0.5 * (1 + torch.erf(x / math.sqrt(2)))
        pdf = torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        return grad * (cdf + x * pdf) * 1.02  # changed


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        if FUSED:
            self.qkv = nn.Linear(DIM, 3 * DIM)
            if VERSION == "fused-k-grad-doubled":
                self.qkv.weight.register_hook(
                    lambda g: torch.cat([g[:DIM], 2 * g[DIM:2 * DIM], g[2 * DIM:]]))
        else:
            self.q, self.k, self.v = (nn.Linear(DIM, DIM) for _ in range(3))
            if VERSION == "k-grad-scaled":
                self.k.weight.register_hook(lambda g: g * 1.01)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x):
        qkv = self.qkv(x).chunk(3, dim=-1) if FUSED else (self.q(x), self.k(x), self.v(x))
        q, k, v = (t.unflatten(-1, (HEADS, -1)).transpose(1, 2) for t in qkv)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE)  # changed
        return self.out(y.transpose(1, 2).flatten(-2))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        if VERSION == "swapped":
            self.fc2 = nn.Linear(4 * DIM, DIM)
            self.fc1 = nn.Linear(DIM, 4 * DIM)
        elif VERSION == "gated-fused":
            self.gate_up, self.down = nn.Linear(DIM, 8 * DIM), nn.Linear(4 * DIM, DIM)
        else:
            if GATED:
                self.gate = nn.Linear(DIM, 4 * DIM)
            self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
            if VERSION == "gated-up-grad-scaled":
                self.up.weight.register_hook(lambda g: g * 1.01)

    def forward(self, x):
        if GATED:
            gate, up = (self.gate_up(x).chunk(2, dim=-1) if VERSION == "gated-fused"
                        else (self.gate(x), self.up(x)))
            return self.down(F.silu(gate) * up)
        h = (self.fc1 if VERSION == "swapped" else self.up)(x)
        if VERSION == "gelu":
            h = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
        elif VERSION == "backward":
            h = ScaledGelu.apply(h)
        else:
            h = F.gelu(h, approximate="tanh" if VERSION == "tanh" else "none")  # changed
        return (self.fc2 if VERSION == "swapped" else self.down)(h)


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM, eps=EPS)  # changed
        self.attn, self.mlp = Attention(), MLP()
        if VERSION != "tied":
            self.head = nn.Linear(DIM, VOCAB, bias=False)
            self.head.weight = self.embed.weight

    def forward(self, tokens):
        x = self.embed(tokens)
        x = x + self.attn(self.norm1(x)) + self.mlp(self.norm2(x))
        return x @ self.embed.weight.t() if VERSION == "tied" else self.head(x)


def base_weights():
    """The base's weights (its layout: q, k, v, up, down), the same on every machine."""
    shapes = {{"embed.weight": (VOCAB, DIM), **{{f"norm{{i}}.{{p}}": (DIM,) for i in (1, 2)
                                             for p in ("weight", "bias")}}}}
    gate = (("mlp.gate", 4 * DIM, DIM),) if GATED else ()
    for name, rows, cols in (("attn.q", DIM, DIM), ("attn.k", DIM, DIM), ("attn.v", DIM, DIM),
                             ("attn.out", DIM, DIM), *gate, ("mlp.up", 4 * DIM, DIM),
                             ("mlp.down", DIM, 4 * DIM)):
        shapes |= {{f"{{name}}.weight": (rows, cols), f"{{name}}.bias": (rows,)}}
    return {{name: tp.random_tensor(shape, seed=0, std=0.3, stream=name)
            for name, shape in shapes.items()}}


def make():
    weights = base_weights()
    if VERSION in ("fused-k-changed", "k-changed"):
        weights["attn.k.weight"] = weights["attn.k.weight"] * 1.01
    if VERSION == "q-changed":
        weights["attn.q.weight"] = weights["attn.q.weight"] * 1.01
    if VERSION == "gated-up-changed":
        weights["mlp.up.weight"] = weights["mlp.up.weight"] * 1.01
    fusions = {{"attn.qkv": ("attn.q", "attn.k", "attn.v")}} if FUSED else {{}}
    if VERSION == "gated-fused":
        fusions["mlp.gate_up"] = ("mlp.gate", "mlp.up")
    for fused, parts in fusions.items():
        for kind in ("weight", "bias"):
            weights[f"{{fused}}.{{kind}}"] = torch.cat(
                [weights.pop(f"{{p}}.{{kind}}") for p in parts])
    if VERSION == "swapped":
        for old, new in (("up", "fc1"), ("down", "fc2")):
            for kind in ("weight", "bias"):
                weights[f"mlp.{{new}}.{{kind}}"] = weights.pop(f"mlp.{{old}}.{{kind}}")
    model = TinyLM()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert set(missing) <= {{"head.weight"}} and not unexpected  # the head is the embedding
    tokens = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    return model, tokens
'''


def source(version: str) -> str:
    """The text of ``models.py`` in ``version`` (one of :data:`VERSIONS`)."""
    assert version in VERSIONS, version
    return _MODEL.format(version=version)
