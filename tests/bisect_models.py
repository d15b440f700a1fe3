"""Tiny attention blocks and Inductor customisations planted in them, for ``diagnose
--compile --bisect``.

``Block`` calls ``scaled_dot_product_attention``; ``HandBlock`` writes its attention by hand,
``softmax(q @ k.transpose(-2, -1) * s) @ v``, as half of real models do. Two kinds of plant
change the math by more than float32's noise. A custom post-grad pass
(``torch._inductor.config.post_grad_custom_post_pass``): ``mm`` rewrites the forward graph's
first ``mm`` onto an input scaled by 1 + 2**-8 (a bfloat16 rounding's size), ``gelu`` swaps
the erf GELU for its tanh approximation, ``backward_mm`` rewrites the backward graph's first
``mm`` the same way, so only gradients move. A lowering (an entry of
``torch._inductor.lowering.lowerings``) replaced: ``hand_exp`` lowers the forward graph's
``exp`` (the softmax's) on its input scaled by 1 + 2**-8, ``hand_backward_bmm`` the backward
graph's ``bmm`` on its first input scaled so. ``clean`` and ``hand_clean`` are the models
under default Inductor. Passes and lowerings are process-wide: these factories are loaded only
in the bisection's own process. :func:`write` puts them in a file.
"""

from __future__ import annotations

from pathlib import Path

MODELS = '''
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor import config
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.lowering import lowerings
from torch._inductor.virtualized import V

aten = torch.ops.aten


class Block(nn.Module):
    """Attention (two heads of 4) and a GELU MLP, each with its residual."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24, bias=False)
        self.up = nn.Linear(8, 16, bias=False)
        self.down = nn.Linear(16, 8, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)  # QKV_LINE
        q, k, v = (t.unflatten(-1, (2, 4)).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + y.transpose(1, 2).flatten(-2)
        h = F.gelu(self.up(x))  # GELU_LINE
        return x + self.down(h)  # DOWN_LINE


class HandBlock(Block):
    """The same block with its causal attention written by hand."""

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)  # HAND_QKV_LINE
        q, k, v = (t.unflatten(-1, (2, 4)).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) * 4**-0.5
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)  # SOFTMAX_LINE
        y = weights @ v  # VALUES_LINE
        x = x + y.transpose(1, 2).flatten(-2)
        h = F.gelu(self.up(x))
        return x + self.down(h)  # HAND_DOWN_LINE


def _backward(graph):
    return any(n.op == "placeholder" and n.target.startswith("tangents") for n in graph.nodes)


class ScaledMm(CustomGraphPass):
    """The first mm of the forward (or backward) graph, on an input scaled by 1 + 2**-8."""

    def __init__(self, backward):
        self.backward = backward

    def __call__(self, graph):
        if _backward(graph) != self.backward:
            return
        mm = next(n for n in graph.nodes if n.target is aten.mm.default)
        with graph.inserting_before(mm):
            scaled = graph.call_function(aten.mul.Tensor, (mm.args[0], 1 + 2**-8))
        scaled.meta.update(mm.args[0].meta)
        mm.args = (scaled, mm.args[1])

    def uuid(self):
        return f"scaled-mm-{self.backward}"


class TanhGelu(CustomGraphPass):
    """The forward graph's erf GELU, x/2 (1 + erf(x/sqrt 2)), with tanh in place of erf."""

    def __call__(self, graph):
        if _backward(graph):
            return
        erf = next(n for n in graph.nodes if n.target is aten.erf.default)
        x = erf.args[0].args[0]  # erf(x * 1/sqrt(2))
        with graph.inserting_before(erf):
            cube = graph.call_function(aten.mul.Tensor, (
                graph.call_function(aten.mul.Tensor, (x, x)), x))
            inner = graph.call_function(aten.add.Tensor, (
                x, graph.call_function(aten.mul.Tensor, (cube, 0.044715))))
            tanh = graph.call_function(aten.tanh.default, (
                graph.call_function(aten.mul.Tensor, (inner, math.sqrt(2 / math.pi))),))
        for node in (cube, inner, tanh, *cube.args, *inner.args, *tanh.args):
            if isinstance(node, torch.fx.Node):
                node.meta.setdefault("val", erf.meta["val"])
        erf.replace_all_uses_with(tanh)
        graph.erase_node(erf)

    def uuid(self):
        return "tanh-gelu"


#: Inductor's own lowerings, as this process found them.
LOWERINGS = dict(lowerings)


def scaled_input_lowering(op, backward):
    """``op`` lowered as Inductor lowers it, on its first input scaled by 1 + 2**-8 in the
    forward (or backward) graph only."""
    lower = LOWERINGS[op]

    def planted(first, *rest, **kwargs):
        if V.graph.is_backward == backward:
            first = LOWERINGS[aten.mul.Tensor](first, 1 + 2**-8)
        return lower(first, *rest, **kwargs)

    return planted


def make(plant=None, block=Block, lowered=None):
    config.post_grad_custom_post_pass = plant
    lowerings.update(LOWERINGS)
    if lowered:
        lowerings[lowered[0]] = scaled_input_lowering(*lowered)
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    return block(), (x,)


def clean():
    return make()


def mm():
    return make(ScaledMm(backward=False))


def gelu():
    return make(TanhGelu())


def backward_mm():
    return make(ScaledMm(backward=True))


def hand_clean():
    return make(block=HandBlock)


def hand_mm():
    return make(ScaledMm(backward=False), HandBlock)


def hand_backward_mm():
    return make(ScaledMm(backward=True), HandBlock)


def hand_exp():
    return make(block=HandBlock, lowered=(aten.exp.default, False))


def hand_backward_bmm():
    return make(block=HandBlock, lowered=(aten.bmm.default, True))
'''


def write(folder: Path, name: str = "bisect_models") -> Path:
    """``folder/<name>.py`` with the factories; returns its path."""
    path = folder / f"{name}.py"
    path.write_text(MODELS)
    return path


def line_of(path: Path, marker: str) -> int:
    """The line of the written file marked ``# <marker>_LINE`` (``QKV``: the first matmul of
    the forward, ``GELU``, ``DOWN``: the last matmul, whose gradient is the backward's
    first; ``HAND_QKV``, ``SOFTMAX``, ``VALUES``, ``HAND_DOWN``: the hand-written block's)."""
    return next(number for number, line in enumerate(path.read_text().splitlines(), 1)
                if f"# {marker}_LINE" in line)
