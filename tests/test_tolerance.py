"""Properties of the tolerance model: precisions, the KINDS table, budgets and calibration."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays

from torchparity import tolerance
from torchparity.calibration.draws import calibrate_draws
from torchparity.tolerance import KINDS, UNIT_ROUNDOFF, Measurement, budget, unit_roundoff

TORCH_FLOATS = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]
# Most to least precise. tf32 and fp16 share u; fp16's coarser subnormals put it second.
BY_PRECISION = ["fp64", "fp32", "tf32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2"]

goldens = arrays(
    np.float64,
    array_shapes(min_dims=1, max_dims=3, max_side=6),
    elements=st.floats(-1e4, 1e4, allow_nan=False),
).map(torch.from_numpy)


def subnormal_spacing(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).tiny * torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", TORCH_FLOATS, ids=str)
def test_unit_roundoff_is_half_of_torch_machine_epsilon(dtype: torch.dtype) -> None:
    assert unit_roundoff(dtype) == torch.finfo(dtype).eps / 2


@pytest.mark.parametrize(
    ("alias", "name"),
    [("float32", "fp32"), ("half", "fp16"), ("bfloat16", "bf16"), ("double", "fp64")],
)
def test_names_and_aliases_resolve_to_one_precision(alias: str, name: str) -> None:
    assert unit_roundoff(alias) == UNIT_ROUNDOFF[name] == unit_roundoff(name.upper())


def test_tf32_has_ten_stored_significand_bits() -> None:
    assert unit_roundoff("tf32") == 2.0**-11


@pytest.mark.parametrize("dtype", ["fp12", torch.int64, torch.bool, torch.complex64])
def test_unknown_dtype_raises_value_error_naming_the_choices(dtype: object) -> None:
    with pytest.raises(ValueError, match=r"no rounding model .* use one of: .*bf16"):
        unit_roundoff(dtype)


@given(
    arrays(np.float32, st.integers(1, 20), elements=st.floats(-(2.0**127), 2.0**127, width=32)),
)
def test_ulp_matches_the_distance_to_the_next_float(x: np.ndarray) -> None:
    t = torch.from_numpy(x)
    up = torch.nextafter(t.abs(), torch.tensor(math.inf)) - t.abs()
    assert torch.equal(tolerance.ulp(t, torch.float32), up.double())


def test_ulp_below_the_normal_range_is_the_subnormal_spacing() -> None:
    tiny = torch.finfo(torch.float16).tiny
    spacing = tolerance.ulp(torch.tensor([0.0, tiny / 4]), "fp16")
    assert torch.equal(spacing, torch.full((2,), tiny * torch.finfo(torch.float16).eps).double())


@pytest.mark.parametrize("n", [640, 4096, 10007])
def test_a_dot_product_is_the_same_wherever_its_operands_sit(n: int) -> None:
    # A BLAS dot (MKL's here) may add in an order set by where its operands start; a cosine
    # of a tensor read from a trace must not depend on where the file's layout put it.
    generator = torch.Generator().manual_seed(n)
    x, y = (torch.randn(n, dtype=torch.float64, generator=generator) for _ in range(2))
    expected = tolerance.dot(x, y)
    for offset_x in range(4):
        for offset_y in range(4):
            placed = []
            for values, offset in ((x, offset_x), (y, offset_y)):
                buffer = torch.empty(n + offset, dtype=torch.float64)
                buffer[offset:] = values
                placed.append(buffer[offset:])
            assert tolerance.dot(*placed) == expected


def test_every_kind_defines_a_usable_rule() -> None:
    assert set(KINDS) == {"forward", "grad", "loss", "trajectory", "trajectory_band"}
    for tol in KINDS.values():
        assert tol.metric in ("max_abs", "rms")
        assert tol.fudge >= 1 and tol.floor_ulps > 0
        # A measured noise needs a floor against lucky draws, or the bounded reordering term.
        assert tol.noise_floor_ulps > 0 or tol.bounded_reordering
        assert tol.analytic_factor > 0 and tol.reorder_factor > 0 and tol.guard_factor > 0
    assert KINDS["trajectory"].per_step_growth > 0


def test_a_band_budget_is_the_fudged_spread_plus_the_floor_without_growth() -> None:
    tol = KINDS["trajectory_band"]
    u = 2.0**-24
    b = tolerance.band_budget(2.0, 1e-5, "fp32")
    assert b.noise == 1e-5 and b.step_factor == 1.0 and b.reordering == 0.0
    assert b.value == pytest.approx(tol.fudge * 1e-5 + tol.floor_ulps * (u * 2.0 + 2.0**-149))
    # members that rounded alike (zero spread) still claim the noise floor: 4 ulps of a scalar
    lucky = tolerance.band_budget(2.0, 0.0, "fp32")
    assert lucky.noise == pytest.approx(tol.noise_floor_ulps * u * 4 * 2.0)


def test_unknown_kind_names_the_known_kinds() -> None:
    with pytest.raises(ValueError, match="forward, grad, loss, trajectory"):
        budget(Measurement(torch.ones(3), baseline_error=None, compute_dtype="fp32", kind="logits"))


def test_budget_with_a_baseline_follows_the_formula() -> None:
    golden = torch.tensor([1.0, -2.0], dtype=torch.float64)
    tol = KINDS["forward"]
    b = budget(Measurement(golden, baseline_error=2.0**-20, compute_dtype=torch.float32))
    # forward uses max-abs, so scale = absmax = 2; the baseline erred 8 ulps of it
    floor = tol.floor_ulps * (2.0**-24 * 2.0 + subnormal_spacing(torch.float32))
    assert b.source == "baseline" and b.analytic is None and b.reordering == 0.0
    assert b.noise == 2.0**-20 and b.floor == floor
    assert b.value == tol.fudge * 2.0**-20 + floor
    assert b.sensitivity == b.value / 2.0
    assert f"{tol.fudge:g} × baseline error" in b.formula() and "reordering" not in b.formula()


def test_a_lucky_baseline_draw_is_lifted_to_the_noise_floor() -> None:
    golden = torch.linspace(-1.0, 3.5, tolerance.FEW_ELEMENTS, dtype=torch.float64)
    tol = KINDS["forward"]
    lucky = 0.1 * 2.0**-8 * 3.5  # a tenth of a bf16 roundoff of the largest value
    b = budget(Measurement(golden, baseline_error=lucky, compute_dtype="bf16"))
    assert b.noise == tol.noise_floor_ulps * 2.0**-8 * 3.5 > lucky
    assert "noise floor" in b.formula()


def test_the_noise_floor_rises_for_tensors_of_few_elements() -> None:
    # The largest of n roundings is a poor estimate of the noise when n is small: one score
    # whose baseline happened to round exactly may not set a budget of zero width.
    u, tol = unit_roundoff("fp32"), KINDS["forward"]
    one = budget(Measurement(torch.tensor([[0.5]], dtype=torch.float64), baseline_error=1e-12,
                             compute_dtype="fp32"))
    many = budget(Measurement(torch.full((4, 16), 0.5, dtype=torch.float64), baseline_error=1e-12,
                              compute_dtype="fp32"))
    assert one.noise == tol.noise_floor_ulps * u * 0.5 * math.sqrt(tolerance.FEW_ELEMENTS)
    assert many.noise == tol.noise_floor_ulps * u * 0.5


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_group_member_takes_the_relative_noise_of_its_group(dtype: str) -> None:
    golden = torch.full((4, 16), 1e-3, dtype=torch.float64)  # RMS 1e-3, in a group of RMS 1
    own_error = 1e-3 * unit_roundoff(dtype)  # one roundoff of its own scale: a lucky draw
    group_noise = 50 * unit_roundoff(dtype)  # another member erred 50 roundoffs of its scale
    b = budget(Measurement(golden, baseline_error=own_error, compute_dtype=dtype, kind="grad",
                           group_scale=1.0, group_noise=group_noise))
    assert b.noise == group_noise * 1.0 and "noise of its group" in b.formula()
    alone = budget(Measurement(golden, baseline_error=own_error, compute_dtype=dtype, kind="grad"))
    assert alone.noise == own_error and alone.value < b.value


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "tf32", "fp8_e4m3"])
def test_reordering_is_bounded_at_fp32_accumulation_precision(dtype: str) -> None:
    golden = torch.ones(16, dtype=torch.float64)
    narrow = budget(Measurement(golden, baseline_error=None, compute_dtype=dtype))
    fp32 = budget(Measurement(golden, baseline_error=None, compute_dtype="fp32"))
    assert narrow.reordering == fp32.reordering
    assert tolerance.accumulation_roundoff(dtype) == UNIT_ROUNDOFF["fp32"]


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_the_baseline_bound_admits_what_the_analytic_budget_admits(kind: str, dtype: str) -> None:
    golden = torch.linspace(-3, 2, 64, dtype=torch.float64).reshape(4, 16)
    analytic = budget(Measurement(golden, baseline_error=None, compute_dtype=dtype, kind=kind))
    bound = tolerance.baseline_bound(golden, compute_dtype=dtype, kind=kind)
    assert bound > analytic.value
    # ... but not a computation that lost its dtype: an fp32 baseline rounded to bf16
    if dtype == "fp32":
        assert bound < unit_roundoff("bf16") * analytic.scale


def test_rms_kinds_scale_the_floor_by_the_golden_rms() -> None:
    golden = torch.tensor([3.0, -4.0, 0.0, 0.0], dtype=torch.float64)  # RMS 2.5
    b = budget(Measurement(golden, baseline_error=1e-3, compute_dtype="bf16", kind="grad"))
    assert b.scale == 2.5
    assert b.floor == KINDS["grad"].floor_ulps * (2.0**-8 * 2.5 + subnormal_spacing(torch.bfloat16))


@pytest.mark.parametrize("baseline_error", [None, 0.0])
@pytest.mark.parametrize("dtype", ["fp64", "bf16"])
def test_without_an_inexact_baseline_the_analytic_bound_applies(
    baseline_error: float | None, dtype: str
) -> None:
    golden = torch.full((3, 64), -0.5, dtype=torch.float64)
    tol = KINDS["forward"]
    b = budget(Measurement(golden, baseline_error=baseline_error, compute_dtype=dtype))
    u, u_acc = unit_roundoff(dtype), tolerance.accumulation_roundoff(dtype)
    assert b.source == "analytic" and b.baseline_error is None
    assert b.analytic == tol.analytic_factor * math.sqrt(64) * u * 0.5
    assert b.reordering == tol.reorder_factor * math.sqrt(64) * u_acc * 0.5
    floor = tol.floor_ulps * (u * 0.5 + tolerance.precision(dtype).min_spacing)
    assert b.value == b.analytic + b.reordering + floor
    short = budget(Measurement(golden, baseline_error=baseline_error, compute_dtype=dtype,
                               reduction_length=4))
    assert short.analytic == b.analytic / 4 and short.reordering == b.reordering / 4


@pytest.mark.parametrize("kind", list(KINDS))
def test_budget_of_an_all_zero_golden_is_never_zero(kind: str) -> None:
    b = budget(Measurement(torch.zeros(2, 2), baseline_error=None, compute_dtype="fp32", kind=kind))
    assert b.scale == 1.0
    assert b.floor == KINDS[kind].floor_ulps * (2.0**-24 + subnormal_spacing(torch.float32))


@given(goldens, st.sampled_from(list(KINDS)))
def test_budgets_order_by_dtype_precision(golden: torch.Tensor, kind: str) -> None:
    # Near zero the subnormal spacing rules instead, and fp8_e4m3 and fp16 have coarse ones.
    assume(tolerance.own_magnitude(golden, "rms") >= 0.1)
    values = [
        budget(Measurement(golden, baseline_error=None, compute_dtype=d,
                           kind=kind)).value for d in BY_PRECISION
    ]
    assert all(v > 0 for v in values)
    assert values == sorted(values)
    assert values[0] < values[1] < values[2]


@given(goldens, st.integers(0, 50))
def test_trajectory_budget_grows_with_step_and_other_kinds_ignore_it(
    golden: torch.Tensor, step: int
) -> None:
    def value(kind: str, step: int) -> float:
        return budget(Measurement(golden, baseline_error=1e-3, compute_dtype="fp32", kind=kind,
                                  step=step)).value

    assert value("trajectory", step + 1) > value("trajectory", step)
    assert value("forward", step) == value("forward", 0)


def test_negative_step_and_reduction_length_are_rejected() -> None:
    with pytest.raises(ValueError, match="step"):
        budget(Measurement(torch.ones(2), baseline_error=None, compute_dtype="fp32", step=-1))
    with pytest.raises(ValueError, match="reduction_length"):
        budget(Measurement(torch.ones(2), baseline_error=None, compute_dtype="fp32",
                           reduction_length=0))


def _problem(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(8, 32, generator=gen, dtype=torch.float64), torch.randn(
        32, 16, generator=gen, dtype=torch.float64
    )


def _matmul(seed: int, dtype: torch.dtype) -> torch.Tensor:
    a, b = _problem(seed)
    return a.to(dtype) @ b.to(dtype)


def test_calibrate_reports_ratio_one_for_a_candidate_equal_to_the_baseline() -> None:
    result = calibrate_draws(
        lambda s: _matmul(s, torch.bfloat16),
        lambda s: _matmul(s, torch.bfloat16),
        lambda s: _matmul(s, torch.float64),
        draws=5,
    )
    assert result.ratios == (1.0,) * 5 and result.failures == ()
    assert result.quantiles[0.5] == result.max_ratio == 1.0


def test_calibrate_lists_the_draws_a_wrong_candidate_fails() -> None:
    result = calibrate_draws(
        lambda s: _matmul(s, torch.float32) * 1.01,
        lambda s: _matmul(s, torch.float32),
        lambda s: _matmul(s, torch.float64),
        draws=4,
        seed=10,
    )
    assert result.failures == (10, 11, 12, 13)
    assert result.max_headroom > 1 and result.quantile(0.0) > KINDS["forward"].fudge


# --- gradients judged together: residues, their rounding, more draws ------------------------


def test_a_gradient_that_is_exactly_zero_is_judged_at_its_groups_scale() -> None:
    # Every key the same token: the query projection gets no gradient at all. Its budget is
    # taken at the module's scale, as for any cancelled member, not at an arbitrary scale of 1.
    b = budget(Measurement(torch.zeros(4, 8, dtype=torch.float64), baseline_error=0.0,
                           compute_dtype="fp32",
                           kind="grad", group_scale=0.1))
    assert b.scale == 0.1 and b.sensitivity == b.value / 0.1
    assert b.value < 1e-4 * 0.1


def test_a_residue_is_allowed_the_bound_at_its_groups_scale() -> None:
    # The query gradient of an attention whose rows saturate: 1/1000 of its module, and the
    # plain baseline's fused softmax backward rounds it almost exactly.
    golden = torch.full((4, 16), 1e-3, dtype=torch.float64)
    lucky = 1e-3 * unit_roundoff("fp32")
    b = budget(Measurement(golden, baseline_error=lucky, compute_dtype="fp32", kind="grad",
                           group_scale=1.0))
    tol = KINDS["grad"]
    bound = (tol.analytic_factor + tol.reorder_factor) * math.sqrt(16) * unit_roundoff("fp32")
    assert b.residue and b.residue_bound == pytest.approx(bound)
    assert b.value == pytest.approx(bound + b.floor) and "bound of a residue" in b.formula()
    # A member at a quarter of its module is no residue: its measured noise rules.
    quarter = budget(Measurement(torch.full((4, 16), 0.25, dtype=torch.float64),
                                 baseline_error=lucky,
                                 compute_dtype="fp32", kind="grad", group_scale=1.0))
    assert not quarter.residue and quarter.residue_bound is None and quarter.value < b.value


def test_a_residues_bound_is_taken_at_the_accumulators_precision() -> None:
    # The products a residue cancels are accumulated in at least fp32, and the rounding of the
    # inputs to bf16 is the same on both sides of the difference: a bf16 residue is granted
    # the fp32 bound, not a bf16 rounding of its whole module.
    golden = torch.full((4, 16), 1e-3, dtype=torch.float64)
    b = budget(Measurement(golden, baseline_error=1e-9, compute_dtype="bf16", kind="grad",
                           group_scale=1.0))
    assert b.residue and b.value - b.floor < 0.01 * unit_roundoff("bf16") * 1.0


def _attention_pass(q_error: float, embed_error: float) -> tuple[dict, dict, dict]:
    """Candidate, golden and baseline gradients of a pass whose query projection is a residue
    (1e-6 of its module) that the baseline rounded exactly."""
    g = torch.Generator().manual_seed(0)
    golden = {
        "embed.tokens.weight": 0.03 * torch.randn(8, 16, dtype=torch.float64, generator=g),
        "layers.0.attn.q_proj.weight": 1e-6 * torch.randn(16, 16, dtype=torch.float64,
                                                          generator=g),
        "layers.0.attn.v_proj.weight": 0.08 * torch.randn(16, 16, dtype=torch.float64,
                                                          generator=g),
    }
    baseline = {name: t.float() for name, t in golden.items()}
    baseline["layers.0.attn.q_proj.weight"] = golden["layers.0.attn.q_proj.weight"].float()
    noise = {name: torch.randn(t.shape, dtype=torch.float64, generator=g)
             for name, t in golden.items()}
    candidate = {
        **baseline,
        "layers.0.attn.q_proj.weight": (golden["layers.0.attn.q_proj.weight"]
                                        + q_error * noise["layers.0.attn.q_proj.weight"]).float(),
        "embed.tokens.weight": (golden["embed.tokens.weight"]
                                + embed_error * noise["embed.tokens.weight"]).float(),
    }
    return candidate, golden, baseline


def test_rounding_that_entered_at_a_residue_reaches_the_other_gradients() -> None:
    # Seed 510's mechanism: a kernel that takes the softmax backward's row term from the output
    # rounds the residue at its module's scale, and the embedding upstream carries that
    # rounding, in absolute terms, 12 times its own baseline's noise.
    from torchparity.comparison import compare

    candidate, golden, baseline = _attention_pass(q_error=2.5e-7, embed_error=1e-7)
    result = compare(candidate, golden, baseline, kind="grad")
    assert result.ok, result.explain()
    embed = next(t for t in result.tensors if "embed" in t.path)
    query = next(t for t in result.tensors if "q_proj" in t.path)
    assert embed.budget.inherited == query.error and query.budget.residue
    assert "rounding that entered at a residue" in embed.budget.formula()
    # Where the residue rounded like the baseline, nothing entered: the same embedding error
    # is no rounding of this pass.
    exact, _, _ = _attention_pass(q_error=0.0, embed_error=1e-7)
    assert not compare(exact, golden, baseline, kind="grad").ok
    # A residue over its own bound diverges and lends nothing to the others.
    wrong, _, _ = _attention_pass(q_error=1e-3, embed_error=1e-7)
    result = compare(wrong, golden, baseline, kind="grad")
    assert not result.ok
    assert next(t for t in result.tensors if "embed" in t.path).budget.inherited == 0.0


def test_a_residue_lends_its_rounding_also_where_masked_entries_hide_it() -> None:
    # A masked entry (<= MASKED_BELOW, on every side) counts in no magnitude the budget takes,
    # so the query projection stays a residue, whatever the raw tensor's largest entry.
    from torchparity.comparison import compare

    sides = _attention_pass(q_error=2.5e-7, embed_error=1e-7)
    for side in sides:
        side["layers.0.attn.q_proj.weight"][0, 0] = -1e5
    result = compare(*sides, kind="grad")
    assert result.ok, result.explain()
    embed = next(t for t in result.tensors if "embed" in t.path)
    query = next(t for t in result.tensors if "q_proj" in t.path)
    assert query.budget.residue and embed.budget.inherited == query.error > 0


def test_a_candidates_own_rounding_is_measured_by_its_rerun() -> None:
    # A kernel that recomputes the attention probabilities from the saved logsumexp errs by
    # u * |logit| where the plain softmax's stored probabilities do not: the baseline's noise
    # does not show it, the candidate's difference from its rerun on moved weights does.
    from torchparity.comparison import compare

    g = torch.Generator().manual_seed(0)
    golden = torch.randn(32, 32, dtype=torch.float64, generator=g)
    u = unit_roundoff("fp32")

    def off_by(center: torch.Tensor, ulps: float) -> torch.Tensor:
        return (center + ulps * u * torch.randn(32, 32, dtype=torch.float64, generator=g)).float()

    baseline, candidate = golden.float(), off_by(golden, 12)
    rerun = off_by(golden, 12)
    assert not compare(candidate, golden, baseline).ok
    result = compare(candidate, golden, baseline, reruns=[rerun])
    assert result.ok and result.tensors[0].budget.noise_source == "spread of a rerun"
    # A systematic change is in both runs and cancels in the spread.
    shift = 1000 * u * golden.abs().max()  # 50 times the candidate's own rounding
    assert not compare(candidate + shift, golden, baseline, reruns=[rerun + shift]).ok
    # A kernel that rounds far worse than fp32 allows any plain computation (here to bf16) is
    # excused only up to that bound.
    lost, lost_rerun = off_by(golden, 0).bfloat16().float(), off_by(golden, 3e4).float()
    assert not compare(lost, golden, baseline, reruns=[lost_rerun]).ok
    with pytest.raises(ValueError, match="pass the baseline too"):
        compare(candidate, golden, reruns=[rerun])


def test_a_rerun_is_judged_on_the_unpadded_elements_alone() -> None:
    # A padded query attends to nothing: the candidate and its rerun hold anything there, and
    # their spread must come from the real positions only.
    from torchparity.comparison import compare

    g = torch.Generator().manual_seed(1)
    golden = torch.randn(2, 8, 16, dtype=torch.float64, generator=g)
    pad = torch.zeros(2, 8, dtype=torch.bool)
    pad[1, :3] = True
    u = unit_roundoff("fp32")
    candidate, rerun = (
        (golden + 12 * u * torch.randn(golden.shape, dtype=torch.float64, generator=g)).float()
        for _ in range(2))
    candidate[pad], rerun[pad] = float("nan"), 1e30
    padded = compare(candidate, golden, golden.float(), reruns=[rerun], padding=pad)
    keep = ~pad
    alone = compare(candidate[keep], golden[keep], golden.float()[keep], reruns=[rerun[keep]],
                    reduction_length=16)
    (t,), (v,) = padded.tensors, alone.tensors
    assert t.budget.value == v.budget.value and t.budget.noise_source == "spread of a rerun"
    assert padded.ok and t.verdict == v.verdict


def test_propagated_noise_is_the_independent_sum_of_the_inputs_errors() -> None:
    sensitivity = {"logits": torch.tensor([1.0, 2.0]), "hidden": torch.tensor([5.0])}
    errors = {"logits": torch.tensor([3.0, -4.0]), "absent": torch.tensor([1e9])}
    assert tolerance.propagated_noise(sensitivity, errors) == math.sqrt(9.0 + 64.0)
    assert tolerance.propagated_noise(sensitivity, {}) == 0.0


def test_propagated_noise_leaves_out_what_the_scalar_does_not_read() -> None:
    # A padded position's output may be NaN (a query that attends to nothing); a loss that
    # leaves the padding out has zero gradient there and takes no noise from it.
    sensitivity = {"logits": torch.tensor([[1.0, 0.0], [2.0, 0.0]])}
    errors = {"logits": torch.tensor([[3.0, math.nan], [-4.0, math.inf]])}
    assert tolerance.propagated_noise(sensitivity, errors) == math.sqrt(9.0 + 64.0)


def test_a_loss_is_judged_by_the_noise_of_what_it_is_computed_from() -> None:
    # A projection of 4096 bf16 outputs that nearly cancelled (the default loss of a user's
    # model): the baseline's draw of its error cancelled to a fiftieth of its usual size, the
    # candidate's, from the same roundings in another order, did not.
    from torchparity.comparison import compare

    g = torch.Generator().manual_seed(0)
    outputs = torch.randn(4096, dtype=torch.float64, generator=g)
    weights = torch.randn(4096, dtype=torch.float64, generator=g) / 64
    errors = outputs.bfloat16().double() - outputs
    noise = tolerance.propagated_noise({"out": weights}, {"out": errors})
    golden = torch.tensor(1e-3, dtype=torch.float64)
    lucky, usual = (golden + noise / 50).float(), (golden + 2 * noise).float()
    assert not compare(usual, golden, lucky, kind="loss", compute_dtype="bf16").ok
    result = compare(usual, golden, lucky, kind="loss", compute_dtype="bf16", noise=noise)
    assert result.ok and result.tensors[0].budget.noise_source == "noise of its inputs"
    # A change of the loss ten times its noise still fails.
    changed = (golden + 10 * noise).float()
    assert not compare(changed, golden, lucky, kind="loss", compute_dtype="bf16",
                       noise=noise).ok
