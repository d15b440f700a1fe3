"""The calibration's attention blocks: random pre-norm attention blocks (RMSNorm, q/k/v,
rotary, a random mask) computed as the float64 golden, the baseline and each candidate
(legitimate backends, or a planted bug), reaching long sequences, wide heads and large
logits that the tiny models (``.models``) do not."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from torchparity import backends, tolerance
from torchparity.dtypes import DTYPES
from torchparity.reference import rng
from torchparity.reference.norms import RMSNorm
from torchparity.reference.positions import apply_rotary

#: The dtypes calibrated, in the order of the study's tables.
CALIBRATED = ("fp32", "bf16", "fp16", "fp64")
MEASURED_KINDS = ("forward", "grad")
NORM_EPS = 1e-6
# The model width is kept small: the projections are not under test and would dominate the time.
D_MODEL = 64
ROPE_THETA = 10000.0
DETECTION_GOAL = 0.99
#: Sizes of a planted change's float64 effect, in multiples of the baseline's error, at which
#: detection is published; the goal applies at ``GOAL_MULTIPLE[kind]`` and above in fp32.
MULTIPLES = (1, 2, 4, 8, 16, 32)
GOAL_MULTIPLE = {"forward": 8, "grad": 16}
#: The bug sized to each multiple: its softmax-scale change is shrunk or grown in proportion
#: (the effect is linear in the change for changes this small).
SIZED_BUG = "softmax scale +1e-3"


@dataclass(frozen=True)
class ProblemVariant:
    """How one run departs from the plain reference: another backend, or one planted bug."""

    backend: str = "manual"
    scale_factor: float = 1.0
    norm_eps: float = NORM_EPS
    key_shift: int = 0
    softmax_dtype: torch.dtype | None = None
    leak: bool = False
    drop_head: bool = False


#: The plain reference: no other backend, no bug.
PLAIN = ProblemVariant()

BUGS = {
    "softmax scale +1e-3": ProblemVariant(scale_factor=1 + 1e-3),
    "masked key leaks into one row": ProblemVariant(leak=True),
    "rotary keys shifted by one": ProblemVariant(key_shift=1),
    "norm eps 1e-6 -> 1e-5": ProblemVariant(norm_eps=1e-5),
    "softmax in bf16": ProblemVariant(softmax_dtype=torch.bfloat16),
    "one head dropped": ProblemVariant(drop_head=True),
}


@dataclass
class Problem:
    """One random attention block: shapes, mask, inputs and weights (all float64)."""

    seed: int
    batch: int
    heads: int
    seq: int
    head_dim: int
    mask_kind: str  # "none", "causal", "causal+left-padding" or "right-padding"
    logit_scale: float  # rough standard deviation of the attention logits
    input_rms: float  # RMS of x: small values make the norm's eps matter
    tensors: dict[str, torch.Tensor]  # x, wq, wk, wv, norm: the inputs gradients are taken of
    cotangent: torch.Tensor
    positions: torch.Tensor  # (batch, seq)
    mask: torch.Tensor | None  # bool (batch, 1, seq, seq), True = may attend
    causal: bool  # causality applied by the kernel rather than the mask
    leak_at: tuple[int, int, int] | None  # (batch, row, key) a leaking bug unmasks

    family = "blocks"

    @property
    def shape(self) -> str:
        return f"{self.batch}x{self.heads}x{self.seq}x{self.head_dim}"

    @property
    def description(self) -> str:
        return f"{self.shape} {self.mask_kind}"

    def dtypes(self, requested: list[str]) -> list[str]:
        """The dtypes this problem runs in: every requested one."""
        return requested

    def applies(self, variant: ProblemVariant) -> bool:
        """Whether a planted bug can occur here (a leak needs a masked key, dropping a head two)."""
        if variant.leak:
            return self.leak_at is not None
        return not (variant.drop_head and self.heads == 1)

    def compares_gradients(self, backend: str, dtype: str) -> bool:
        """Every backend's gradients are compared (flex has no backward pass on the CPU)."""
        return True

    def run(self, dtype: str, variant: ProblemVariant = ProblemVariant(), *, grad: bool = True,
            rerun: bool = False) -> dict[str, dict[str, torch.Tensor]]:
        """:func:`run_block` in the dtype named ``dtype``."""
        return run_block(self, DTYPES[dtype], variant, grad=grad, rerun=rerun)


def draw_problem(seed: int) -> Problem:
    """The problem of draw ``seed``: mostly short sequences, one in eight up to 1024 tokens."""
    gen = torch.Generator().manual_seed(seed)

    def uniform(low: float, high: float) -> float:
        return low + (high - low) * torch.rand((), generator=gen, dtype=torch.float64).item()

    def choice(options: list[Any]) -> Any:
        return options[int(torch.randint(len(options), (), generator=gen))]

    long = uniform(0, 1) < 1 / 8
    seq = int(2 ** uniform(8, 10)) if long else int(2 ** uniform(3, 7.3))
    batch, heads = (1, choice([1, 2])) if long else (choice([1, 2]), choice([1, 2, 3, 4]))
    head_dim = choice([16, 32, 64] if long else [16, 32, 64, 128])
    width = heads * head_dim
    logit_scale = 10 ** uniform(0, 1.5)
    input_rms = 10 ** uniform(-3.5, 0.5)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    tensors = {
        "x": randn(batch, seq, D_MODEL) * input_rms,
        # After the norm h has unit RMS, so q.k / sqrt(head_dim) has std logit_scale.
        "wq": randn(D_MODEL, width) * logit_scale / math.sqrt(D_MODEL),
        "wk": randn(D_MODEL, width) / math.sqrt(D_MODEL),
        "wv": randn(D_MODEL, width) / math.sqrt(D_MODEL),
        "norm": 1 + 0.1 * randn(D_MODEL),
    }
    mask_kind = choice(["none", "causal", "causal+left-padding", "right-padding"])
    lengths = torch.randint(max(1, seq // 2), seq + 1, (batch,), generator=gen)
    positions, mask = _positions_and_mask(mask_kind, lengths, seq)
    leak_at = _pick_leak(mask, gen) if mask is not None else None
    if mask_kind == "causal" and uniform(0, 1) < 0.5:
        mask = None  # half the causal draws let the kernel apply causality itself
    return Problem(
        seed=seed,
        batch=batch,
        heads=heads,
        seq=seq,
        head_dim=head_dim,
        mask_kind=mask_kind,
        logit_scale=logit_scale,
        input_rms=input_rms,
        tensors=tensors,
        cotangent=randn(batch, heads, seq, head_dim),
        positions=positions,
        mask=mask,
        causal=mask_kind == "causal" and mask is None,
        leak_at=leak_at,
    )


def _positions_and_mask(
    mask_kind: str, lengths: torch.Tensor, seq: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    index = torch.arange(seq)
    if mask_kind == "none":
        return index.expand(len(lengths), seq), None
    if mask_kind == "right-padding":
        keys = index[None, :] < lengths[:, None]
        return index.expand(len(lengths), seq), keys[:, None, None, :].expand(-1, 1, seq, seq)
    pad = seq - lengths
    keys = index[None, :] >= pad[:, None]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    if mask_kind == "causal":
        return index.expand(len(lengths), seq), causal.expand(len(lengths), 1, seq, seq)
    # Left padding: a token's position is its index among the real tokens.
    positions = (index[None, :] - pad[:, None]).clamp(min=0)
    return positions, causal & keys[:, None, None, :]


def _pick_leak(mask: torch.Tensor, gen: torch.Generator) -> tuple[int, int, int] | None:
    """A masked (batch, row, key) whose row sees at least one key, or None if there is none."""
    candidates = (~mask[:, 0] & mask[:, 0].any(-1, keepdim=True)).nonzero()
    if len(candidates) == 0:
        return None
    return tuple(int(i) for i in candidates[int(torch.randint(len(candidates), (), generator=gen))])


# The gradients carry the names a model's parameters would have, so that the comparison groups
# them by module as it groups a model's (the projections share the attention's reductions).
GRAD_NAMES = {"x": "input", "norm": "attn_norm.weight", "wq": "attn.q_proj.weight",
              "wk": "attn.k_proj.weight", "wv": "attn.v_proj.weight"}


def run_block(
    problem: Problem, dtype: torch.dtype, variant: ProblemVariant = ProblemVariant(), *,
    grad: bool = True, rerun: bool = False,
) -> dict[str, dict[str, torch.Tensor]]:
    """Outputs of the block in ``dtype``: ``{"forward": {"out": ...}, "grad": {...}}``, gradients
    of ``sum(out * cotangent)`` for every input (``grad=False`` skips them); ``rerun`` moves the
    inputs by one rounding first."""
    inputs = {n: t.to(dtype, copy=True) for n, t in problem.tensors.items()}
    if rerun:
        u = tolerance.unit_roundoff(dtype)
        for name, t in inputs.items():
            d = rng.uniform(problem.seed, f"rounding.{name}", t.shape) * 2.0 - 1.0
            inputs[name] = (t.double() * (1.0 + u * d)).to(dtype)
    inputs = {n: t.requires_grad_(grad) for n, t in inputs.items()}
    with torch.set_grad_enabled(grad):
        out = _block(problem, inputs, variant)
        results = {"forward": {"out": out.detach()}}
        if grad:
            out.backward(problem.cotangent.to(dtype))
            results["grad"] = {GRAD_NAMES[n]: t.grad for n, t in inputs.items()}
    return results


def _block(problem: Problem, inputs: dict[str, torch.Tensor], variant: ProblemVariant
           ) -> torch.Tensor:
    norm = RMSNorm(D_MODEL, variant.norm_eps)
    h = torch.func.functional_call(norm, {"weight": inputs["norm"]}, (inputs["x"],))

    def heads(w: torch.Tensor) -> torch.Tensor:
        return (h @ w).unflatten(-1, (problem.heads, problem.head_dim)).transpose(1, 2)

    def rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return apply_rotary(
            x, positions, rotary_dim=problem.head_dim, theta=ROPE_THETA, layout="half"
        )

    q = rotate(heads(inputs["wq"]), problem.positions)
    k = rotate(heads(inputs["wk"]), problem.positions + variant.key_shift)
    v = heads(inputs["wv"])
    mask, causal = problem.mask, problem.causal
    if variant.leak:
        mask = leaked_mask(mask, causal, problem.batch, problem.seq, problem.seq,
                           at=problem.leak_at)
        causal = False
    scale = variant.scale_factor / math.sqrt(problem.head_dim)
    if variant.softmax_dtype is not None:
        out = attention_with_softmax_in(variant.softmax_dtype, q, k, v, mask, causal, scale)
    else:
        out = backends.attention(
            q, k, v, mask=mask, scale=scale, causal=causal, backend=variant.backend
        )
    if variant.drop_head:
        out = torch.cat((out[:, :-1], torch.zeros_like(out[:, -1:])), dim=1)
    return out


def leaked_mask(
    mask: torch.Tensor | None,
    causal: bool,
    batch: int,
    q_len: int,
    k_len: int,
    *,
    at: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """The mask (batch, 1, q_len, k_len) with one masked entry let through (``at``, else the first
    a row has); unchanged when there is none."""
    if mask is None:
        causal_mask = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
        mask = causal_mask if causal else torch.ones(q_len, k_len, dtype=torch.bool)
    mask = mask.expand(batch, 1, q_len, k_len).clone()
    if at is None:
        candidates = (~mask[:, 0] & mask[:, 0].any(-1, keepdim=True)).nonzero()
        if len(candidates) == 0:
            return mask
        at = tuple(int(i) for i in candidates[0])
    b, row, key = at
    mask[b, :, row, key] = True
    return mask


def attention_with_softmax_in(
    softmax_dtype: torch.dtype,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Manual attention, except that the softmax runs in ``softmax_dtype``."""
    scores = (q @ k.transpose(-2, -1)).to(torch.promote_types(q.dtype, torch.float32)) * scale
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
    empty = None
    if mask is not None:
        # Rows that see no key see every key and are zeroed after, as on every backend.
        empty = ~mask.any(-1, keepdim=True)
        scores = scores.masked_fill(~(mask | empty), -math.inf)
    probs = scores.to(softmax_dtype).softmax(dim=-1).to(q.dtype)
    if empty is not None:
        probs = probs.masked_fill(empty, 0.0)
    return probs @ v
