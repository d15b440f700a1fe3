"""Operations without a float64 kernel run in float64 inside a float64 run: the grouped matmul
of mixture-of-experts layers is the float64 products of each group, with their gradients, and
follows the layout torch's own kernel gives in the dtypes it has."""

from __future__ import annotations

import copy

import pytest
import torch

from torchparity.subject.float64_ops import Float64Ops, grouped_mm

#: Group ends along the grouped dimension: an empty group, and rows past the last group.
OFFS = torch.tensor([4, 4, 12, 14], dtype=torch.int32)
#: Multiples of 16 bytes in float32, as torch's kernel needs its strides.
GROUPS, M, K, N, ROWS = 4, 8, 16, 8, 16


def _random(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _operands(case: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    if case == "2d x 3d":  # a mixture-of-experts forward: each expert's tokens
        return _random(ROWS, K, seed=1), _random(GROUPS, K, N, seed=2), OFFS
    if case == "3d x 2d":
        return _random(GROUPS, M, K, seed=3), _random(K, ROWS, seed=4), OFFS
    if case == "2d x 2d":  # its weights' gradient: groups along the shared dimension
        return _random(M, ROWS, seed=5), _random(ROWS, N, seed=6), OFFS
    return _random(GROUPS, M, K, seed=7), _random(GROUPS, K, N, seed=8), None


def _row_groups() -> torch.Tensor:
    """Each row's group, -1 past the last one."""
    group = torch.full((ROWS,), -1)
    start = 0
    for g, end in enumerate(OFFS.tolist()):
        group[start:end] = g
        start = end
    return group


def _experts(tokens: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each token times its own group's weights, gathered row by row: no grouping at all."""
    group = _row_groups()
    chosen = weights[group.clamp(min=0)]  # (ROWS, K, N)
    out = torch.einsum("sk,skn->sn", tokens, chosen)
    return out * (group >= 0).unsqueeze(1)


def test_grouped_mm_in_float64_equals_each_token_times_its_expert():
    tokens, weights, offs = _operands("2d x 3d")
    tokens, weights = tokens.double().requires_grad_(), weights.double().requires_grad_()
    with Float64Ops():
        out = torch.nn.functional.grouped_mm(tokens, weights, offs=offs)
    expected = _experts(tokens, weights)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, expected)
    projection = _random(ROWS, N, seed=9).double()
    grads = torch.autograd.grad((out * projection).sum(), (tokens, weights))
    expected_grads = torch.autograd.grad((expected * projection).sum(), (tokens, weights))
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad)


@pytest.mark.parametrize("case", ["2d x 3d", "3d x 2d", "2d x 2d", "3d x 3d"])
def test_grouped_mm_fallback_follows_torch_s_kernel_within_its_rounding(case):
    a, b, offs = _operands(case)
    kernel = torch._grouped_mm(a, b, offs=offs).double()
    exact = grouped_mm(a.double(), b.double(), offs=offs)
    magnitude = grouped_mm(a.double().abs(), b.double().abs(), offs=offs)
    # A float32 dot product of K terms errs by at most K u times the sum of |terms|.
    unit = torch.finfo(torch.float32).eps / 2
    bound = K * unit * magnitude + unit * exact.abs()
    assert kernel.shape == exact.shape
    # The kernel leaves rows (columns) past the last group as it found them: not compared.
    defined = {"2d x 3d": (slice(0, OFFS[-1]),), "3d x 2d": (..., slice(0, OFFS[-1]))}
    where = defined.get(case, (...,))
    assert ((kernel - exact)[where].abs() <= bound[where]).all()


def test_operations_in_other_dtypes_run_their_own_kernel():
    tokens, weights, offs = _operands("2d x 3d")
    with Float64Ops():
        inside = torch._grouped_mm(tokens, weights, offs=offs)
    outside = torch._grouped_mm(tokens, weights, offs=offs)
    assert torch.equal(inside[:OFFS[-1]], outside[:OFFS[-1]])


@pytest.mark.transformers
def test_a_mixture_of_experts_model_runs_in_float64_as_its_eager_experts_do():
    transformers = pytest.importorskip("transformers")
    from torchparity.subject.blockwise import Float64Run

    config = transformers.Qwen3MoeConfig(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        vocab_size=64, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).eval()  # grouped_mm experts
    eager = copy.deepcopy(model).double()
    eager.set_experts_implementation("eager")  # a loop over the experts: plain float64 math
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    expected = eager(input_ids=ids).logits
    expected_grads = torch.autograd.grad(expected.square().sum(), list(eager.parameters()))
    grads = {}
    with Float64Run(model, on_grad=grads.__setitem__) as run:
        logits = model(input_ids=ids).logits
        run.backward(logits.square().sum())
    assert logits.dtype == torch.float64
    torch.testing.assert_close(logits, expected)
    for (name, _), expected_grad in zip(eager.named_parameters(), expected_grads, strict=True):
        torch.testing.assert_close(grads[name], expected_grad)


class _RoutesInFloat32(torch.nn.Module):
    """Casts its input to float32 and multiplies it by its own weight, as the routers of
    transformers' Inkling 2 do: float64 and float32 meet in a float64 run."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(_random(4, 8, seed=10))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden.float(), self.weight)


def test_a_model_s_own_float32_cast_meets_its_float64_weight_in_float64():
    from torchparity.subject.blockwise import Float64Run
    from torchparity.subject.islands import Islands

    model, hidden = _RoutesInFloat32(), _random(3, 8, seed=11).double() / 3
    with Float64Run(model), Islands(model) as islands:
        out = model(hidden)
    # The float64 product of the values the model rounded to float32.
    expected = torch.nn.functional.linear(hidden.float().double(), model.weight.double())
    assert out.dtype == torch.float64 and torch.equal(out, expected)
    assert islands.found == {"float32": ["_RoutesInFloat32"]}
