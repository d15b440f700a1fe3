"""Outputs that differ only in structure: eager attention returns its weights, SDPA ``None``.

A refactor to ``F.scaled_dot_product_attention`` that stops returning attention weights must read
as "structure differs" at the path that changed, with no numeric divergence and a within final
verdict. The expectation (no module computes anything else) is known independently: the two
models share their weights and both paths compute the same attention.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchparity as tp
from tiny_transformers import FAMILIES
from torchparity.subject import hf

# tiny models: one thread is faster
pytestmark = [pytest.mark.transformers, pytest.mark.usefixtures("single_thread")]


class SelfAttention(nn.Module):
    """Multi-head self-attention: the manual path returns ``(out, probs)``, SDPA ``(out, None)``."""

    def __init__(self, d_model: int, n_heads: int, *, sdpa: bool) -> None:
        super().__init__()
        self.n_heads, self.sdpa = n_heads, sdpa
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        b, t, d = x.shape
        q, k, v = (y.view(b, t, self.n_heads, -1).transpose(1, 2)
                   for y in self.qkv(x).chunk(3, -1))
        if self.sdpa:
            y, probs = F.scaled_dot_product_attention(q, k, v, is_causal=True), None
        else:
            scores = q @ k.transpose(-1, -2) / (d // self.n_heads) ** 0.5
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
            y = probs @ v
        return self.out(y.transpose(1, 2).reshape(b, t, d)), probs


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, *, sdpa: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, n_heads, sdpa=sdpa)
        self.mlp = nn.Sequential(nn.Linear(d_model, 2 * d_model), nn.GELU(),
                                 nn.Linear(2 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        attended, probs = self.attn(self.norm(x))
        x = x + attended
        return x + self.mlp(x), probs


class TinyDecoder(nn.Module):
    """Its output carries every layer's attention weights (None on the SDPA path)."""

    def __init__(self, *, sdpa: bool, vocab: int = 32, d_model: int = 16, n_layers: int = 2
                 ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(Block(d_model, 4, sdpa=sdpa) for _ in range(n_layers))
        self.head = nn.Linear(d_model, vocab)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        x, weights = self.embed(ids), []
        for block in self.blocks:
            x, probs = block(x)
            weights.append(probs)
        return self.head(x), tuple(weights)


def tiny_pair(dtype: torch.dtype) -> tuple[nn.Module, nn.Module, tuple]:
    torch.manual_seed(0)
    manual = TinyDecoder(sdpa=False).to(dtype).eval()
    sdpa = TinyDecoder(sdpa=True).to(dtype).eval()
    sdpa.load_state_dict(manual.state_dict())
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    return manual, sdpa, (ids,)


def assert_structure_only(report, paths: dict[str, list[str]]) -> None:
    """No numeric divergence anywhere; exactly ``paths`` (module -> output paths) differ in
    structure; a within final verdict."""
    assert report.first_divergence is None, report.render()
    assert report.first_grad_divergence is None, report.render()
    assert all(r.propagated is not None and r.propagated.ok for r in report.rows), report.render()
    assert {r.module: [d.path for d in r.structure] for r in report.rows if r.structure} == paths
    assert report.output.ok, report.render()
    assert "structure differs" in report.summary()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_manual_vs_sdpa_differs_in_structure_only(dtype: torch.dtype) -> None:
    manual, sdpa, inputs = tiny_pair(dtype)
    report = tp.diagnose(manual, sdpa, inputs, local="all")
    layers = {f"blocks.{i}": ["output.1"] for i in range(2)}
    attn = {f"blocks.{i}.attn": ["output.1"] for i in range(2)}
    assert_structure_only(report, {**attn, **layers, "": ["output.1.0", "output.1.1"]})
    # The local gradient replays seed only what both sides return.
    assert all(r.grad_local is not None and r.grad_local.ok
               for r in report.rows if r.module.endswith("attn")), report.render()
    difference = report.row("blocks.0.attn").structure[0]
    assert "Tensor" in difference.golden and "None" in difference.candidate  # A, B
    assert "blocks.0.attn" in report.render() and "output.1" in report.render()


# --- transformers: eager (A) against sdpa (B) ----------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_eager_vs_sdpa_differs_in_structure_only(family: str,
                                                              dtype: torch.dtype) -> None:
    build, first_attention, fields = FAMILIES[family]
    torch.manual_seed(0)
    eager = build().to(dtype).eval()
    sdpa = copy.deepcopy(eager)
    hf.set_attention(eager, "eager")
    hf.set_attention(sdpa, "sdpa")
    ids = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0  # padding: the mask reaches both paths
    inputs = {"input_ids": ids, "attention_mask": mask, "output_attentions": True}
    if family != "bert":
        inputs["use_cache"] = False
    if family == "bart":
        inputs["decoder_input_ids"] = ids
    report = tp.diagnose(eager, sdpa, inputs)
    assert report.first_divergence is None, report.render()
    assert report.first_grad_divergence is None, report.render()
    assert all(r.propagated is not None and r.propagated.ok for r in report.rows), report.render()
    assert report.output.ok, report.render()
    expected = {f"output.{field}.{layer}" for field in fields for layer in range(2)}
    assert {d.path for d in report.output.structure} == expected
    assert all("Tensor" in d.golden and d.candidate in ("None", "missing")
               for r in report.rows for d in r.structure)
    assert report.structure_only[0].module == first_attention
    assert "structure differs" in report.summary()
