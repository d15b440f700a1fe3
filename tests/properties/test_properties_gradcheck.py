"""``torch.autograd.gradcheck`` in float64 on tiny configs for every custom piece: norms, MLPs,
self- and cross-attention on each backend that has a backward pass here (with rotary, ALiBi
and relative positions as the config draws them, causal and padding masks), and every twin.

Gradcheck compares autograd's gradients with finite differences, so it catches a wrong
backward pass that the forward-only properties cannot see. ``fast_mode`` checks a random
projection of the Jacobian, which keeps each example to a few dozen forward calls.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import torchparity as tp
from torchparity import strategies as tps
from torchparity.reference import build_model, variants
from torchparity.reference.attention import AttentionContext

# flex has no backward pass on the CPU; the others differentiate in float64.
BACKWARD_BACKENDS = [name for name, why in tp.backends.available("cpu", torch.float64).items()
                     if why is None and name != "flex"]
ATTENTION_TWINS = [n for n in variants.names()
                   if variants.get(n).twin is not None
                   and issubclass(variants.get(n).twin, variants.AttentionTwin)]


pytestmark = pytest.mark.usefixtures("single_thread")


def check_gradcheck(config, seed, piece, variant, backend, length):
    """Autograd's gradients of one piece of layer 0 (w.r.t. its inputs and parameters) match
    finite differences in float64. ``piece``: "norm", "mlp", "self-attention" or
    "cross-attention"; ``variant``: a twin swapped in first, or None."""
    model = build_model(config, seed, dtype=torch.float64)
    if variant is not None:
        model = variants.swap_in(model, variant)
    layer = model.decoder.layers[0]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, length, config.d_model, dtype=torch.float64, generator=gen)
    # Row 0 is full, row 1 is left-padded by half (at least one padded position).
    key_mask = torch.ones(2, length, dtype=torch.bool)
    key_mask[1, : (length + 1) // 2] = False
    positions = (key_mask.long().cumsum(-1) - 1).clamp(min=0)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    if piece == "norm":
        module, inputs, call = layer.attn_norm, (x,), lambda m, x: m(x)
    elif piece == "mlp":
        module, inputs, call = layer.mlp, (x,), lambda m, x: m(x)
    elif piece == "self-attention":
        ctx = AttentionContext(positions, positions, causal & key_mask[:, None, None, :], False)
        module, inputs, call = layer.attn, (x,), lambda m, x: m(x, ctx)
    else:
        memory = torch.randn(2, length + 1, config.d_model, dtype=torch.float64, generator=gen)
        memory_mask = torch.cat((key_mask, torch.ones(2, 1, dtype=torch.bool)), dim=1)
        ctx = AttentionContext(None, None, memory_mask[:, None, None, :], False)
        module, inputs, call = layer.cross_attn, (x, memory), lambda m, x, mem: m(x, ctx, mem)
    names = [name for name, _ in module.named_parameters()]
    params = [p.detach().clone().requires_grad_() for _, p in module.named_parameters()]
    inputs = [t.requires_grad_() for t in inputs]

    def function(*tensors):
        state = dict(zip(names, tensors[len(inputs):], strict=True))
        return call(lambda *args: torch.func.functional_call(module, state, args),
                    *tensors[: len(inputs)])

    with tp.backends.use(backend):
        assert torch.autograd.gradcheck(function, (*inputs, *params), fast_mode=True)


def _cases() -> list:
    cases = [pytest.param(piece, None, "manual", id=piece) for piece in ("norm", "mlp")]
    cases += [pytest.param(piece, None, backend, id=f"{piece}-{backend}")
              for piece in ("self-attention", "cross-attention") for backend in BACKWARD_BACKENDS]
    cases += [pytest.param("self-attention", name, "manual", id=f"{name}")
              for name in ATTENTION_TWINS]
    cases += [pytest.param("mlp", "fused-gate-up", "manual", id="fused-gate-up")]
    return cases


# What each piece needs from the config it is drawn with.
_PINS = {
    "cross-attention": dict(architecture="encoder-decoder"),
    "fused-gate-up": dict(activation=st.sampled_from(["gated-silu", "gated-gelu"])),
    **{name: dict(positions="rotary") for name in ATTENTION_TWINS if name.startswith("rotary")},
}
# sdpa-flash on the CPU takes no trainable bias, which relative positions are.
_NO_TRAINABLE_BIAS = dict(positions=st.sampled_from(["none", "rotary", "alibi", "learned"]))


@pytest.mark.parametrize(("piece", "variant", "backend"), _cases())
@given(data=st.data(), seed=st.integers(0, 2**16), length=st.integers(1, 5))
def test_gradcheck(piece, variant, backend, data, seed, length):
    pins = {**_PINS.get(piece, {}), **_PINS.get(variant, {}),
            **(_NO_TRAINABLE_BIAS if backend == "sdpa-flash" else {})}
    config = data.draw(tps.configs(max_d_model=8, max_layers=1, **pins))
    tps.note_reproducer(check_gradcheck, dict(
        config=config, seed=seed, piece=piece, variant=variant, backend=backend, length=length))
