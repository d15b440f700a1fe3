"""The tolerance model: how far a candidate may be from the golden, given what the baseline shows.

Three results are computed from identical inputs and weights: the *golden* (reference math in
float64), the *baseline* (the plain reference in the candidate's dtype: the error that is
unavoidable at that precision) and the *candidate*. Per tensor the candidate passes when

    err(candidate, golden) <= fudge * noise + floor

``err`` is the kind's metric (max-abs or RMS of the difference, see :data:`KINDS`); ``scale`` is
the golden's magnitude in the same metric (absmax for max-abs kinds, RMS for RMS kinds; 1 for an
all-zero golden), ``u`` the unit roundoff of the compute dtype and K the reduction length (the
``reduction_length`` argument, by default the tensor's last dimension).

- ``noise`` is the rounding error legitimate computation at this precision makes on *this*
  problem, measured rather than bounded from above: the baseline's error ``err(baseline,
  golden)``, which already carries every amplification the problem has (large logits, long
  reductions, cancellation). One draw can be lucky, and a kernel can round where the plain
  computation does not, so the noise is the largest of:

  - the baseline's error;
  - the candidate's own rounding, ``err(candidate, rerun)``, where the caller reran the
    candidate on weights moved by one rounding (``compare(..., reruns=)``): FlashAttention's
    backward recomputes the probabilities from the saved logsumexp, off by ``u * |logit|``,
    where the plain softmax keeps its own; the rerun changes which way the candidate rounds,
    not what it computes, so a bug cancels in the difference. It counts up to
    :func:`baseline_bound`, so a kernel that lost precision is not excused by its own noise;
  - ``noise_floor_ulps * u * scale`` (more for tensors of few elements, see
    :func:`noise_floor`);
  - for a gradient, the *relative* noise of the whole backward pass, the largest of those
    errors over ``scale`` among the gradients compared together, times its group's scale (the
    gradients of one module): every gradient rounds through the same loss gradient, which
    itself cancels when a prediction is confident (p - onehot), and a member that cancels (the
    query gradient under near-uniform attention is a small difference of terms as large as the
    value gradient) carries rounding at its group's scale;
  - for a scalar computed from many values (a loss), the noise they carry into it
    (:func:`propagated_noise`, ``compare(..., noise=)``): one draw of a sum of roundings can
    cancel to almost nothing.

  ``torchparity calibrate`` measures how far legitimate kernels (other reduction orders,
  blocking, recomputation in the backward pass) stray from this noise: ``fudge`` covers it.
- A gradient below ``residue_share`` of its group's scale is a *residue* (:func:`residue`), a
  sum of terms at the group's scale that cancel: the query and key gradients of an attention
  whose rows see one key or saturate, which the plain baseline's fused softmax backward rounds
  exactly while another kernel rounds at the products' scale. Its allowance is at least the
  bound at its group's scale, ``(analytic_factor + reorder_factor) * sqrt(K) * u_acc *
  group scale``, and what the candidate erred on the residues of its pass (within their
  budgets) reaches every gradient formed from the same activation gradients upstream: it is
  added to the other gradients' budgets.
- Without a baseline, or when it is bit-exact to the golden (float64 compute), nothing is
  measured and the bound takes its place: ``analytic_factor * sqrt(K) * u * scale`` (the
  probabilistic rounding-error bound of a length-K reduction, Higham & Mary, 2019) plus
  ``reorder_factor * sqrt(K) * u_acc * scale'``, another kernel's reordering at the
  accumulation precision ``u_acc = min(u, u_fp32)`` (kernels accumulate in at least fp32), with
  ``scale'`` the larger of the tensor's and its group's scale.
- ``floor = floor_ulps * (u * scale' + s)``, ``s`` the subnormal spacing: a multiple of the
  error of merely rounding the golden to the compute dtype, so the budget is never zero.

The baseline itself is guarded (:func:`baseline_bound`): it may err at most as much as a plain
computation in its dtype can, or it would lower the bar for every candidate judged against it.
A baseline over its guard is *degraded*: it sets no budget (the bound without a baseline does,
and judges the candidate), and the comparison fails as the baseline's finding, never as a
divergence of a candidate within its budget.

A model may compute parts of itself in a narrower dtype whatever its own (*islands*:
``transformers``' Llama casts every RMSNorm's input and its rotary table to float32). Its
float64 golden is then as precise as float32 there, and a rerun whose weights moved by one
float64 rounding can turn one float32 rounding the other way, which the next island rounds
again until every output differs at float32 level. With ``islands`` (the narrowest such dtype)
the guard, the noise floor and the floor are at least that dtype's.
Each budget states its *sensitivity*, ``budget / scale``: the smallest change of the output,
relative to its scale, that the comparison would have flagged.

Trajectories (losses or weights after n training steps) accumulate error step by step: with
``step=n`` the whole budget is multiplied by ``1 + per_step_growth * n``.

All numbers live in :data:`KINDS`; ``torchparity calibrate`` measures false alarms and detection
under them and writes the evidence to ``docs/tolerance.md``.

Tensors too big to keep (goldens and traces of real-size models) are kept as sketches
(:mod:`torchparity.sketching`) and judged in RMS by the same rule, the errors estimated from
random projections: the baseline's at its upper confidence bound, which widens the budget by
:func:`sketch_margin`; max-abs kinds are judged exactly on the sketch's exact slices. Their
constants are :data:`SKETCH`; ``torchparity calibrate --sketched`` measures them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from torchparity.dtypes import ALIASES, dtype_name

Metric = Literal["max_abs", "rms"]
DtypeLike = torch.dtype | str


@dataclass(frozen=True)
class Precision:
    """The rounding model of one compute dtype."""

    name: str
    unit_roundoff: float  # u = 2**-p with p significand bits, the implicit one included
    min_exponent: int  # exponent of the smallest normal number; spacing is constant below it

    @property
    def min_spacing(self) -> float:
        """Spacing of the subnormal numbers: the absolute rounding error near zero."""
        return math.ldexp(2.0 * self.unit_roundoff, self.min_exponent)


_PRECISIONS = {
    p.name: p
    for p in (
        Precision("fp64", 2.0**-53, -1022),
        Precision("fp32", 2.0**-24, -126),
        Precision("tf32", 2.0**-11, -126),  # fp32 range, 10 stored significand bits
        Precision("fp16", 2.0**-11, -14),
        Precision("bf16", 2.0**-8, -126),
        Precision("fp8_e4m3", 2.0**-4, -6),
        Precision("fp8_e5m2", 2.0**-3, -14),
    )
}

#: Unit roundoff ``u`` per compute dtype, keyed by canonical name ("fp32", "bf16", "tf32", ...).
UNIT_ROUNDOFF: dict[str, float] = {name: p.unit_roundoff for name, p in _PRECISIONS.items()}


def precision(dtype: DtypeLike) -> Precision:
    """Resolve a torch dtype or a name ("fp32", "bfloat16", "tf32", ...) to its :class:`Precision`.

    Raises ``ValueError`` naming the accepted names when the dtype has no rounding model
    (integer, bool, complex or unknown).
    """
    name = dtype_name(dtype)
    if name not in _PRECISIONS:
        known = ", ".join(sorted(_PRECISIONS) + sorted(ALIASES))
        raise ValueError(f"no rounding model for dtype {dtype!r}; use one of: {known}")
    return _PRECISIONS[name]


def unit_roundoff(dtype: DtypeLike) -> float:
    """Unit roundoff ``u`` of ``dtype``: the largest relative error of rounding to it."""
    return precision(dtype).unit_roundoff


def accumulation_roundoff(dtype: DtypeLike) -> float:
    """Unit roundoff of the accumulators of ``dtype`` reductions: at least fp32's precision."""
    return min(unit_roundoff(dtype), UNIT_ROUNDOFF["fp32"])


def ulp(x: torch.Tensor, dtype: DtypeLike) -> torch.Tensor:
    """Spacing of ``dtype``'s numbers at the magnitude of each element of ``x`` (float64).

    Below the smallest normal number the spacing is the constant subnormal one, so the result
    is positive everywhere, zero included.
    """
    p = precision(dtype)
    # 2**floor(log2 |x|) is |x| with its float64 mantissa bits cleared (several times faster
    # than frexp and ldexp); the spacing is 2u times that, a power of two, so exact.
    magnitude = x.to(torch.float64).abs()
    binade = (magnitude.view(torch.int64) & _F64_EXPONENT_BITS).view(torch.float64)
    return binade.clamp(min=math.ldexp(1.0, p.min_exponent)) * (2.0 * p.unit_roundoff)


_F64_EXPONENT_BITS = 0x7FF0_0000_0000_0000


def all_finite(x: torch.Tensor) -> bool:
    """Whether every element of ``x`` is finite: one sum, with an elementwise check only when
    the sum is not finite (a NaN or inf, or an overflowing sum)."""
    return math.isfinite(x.sum().item()) or bool(x.isfinite().all())


@dataclass(frozen=True)
class KindTolerance:
    """Tolerance constants of one kind of output (forward, grad, loss, trajectory)."""

    fudge: float  # allowed multiple of the measured noise
    metric: Metric  # the error the pass/fail rule uses
    floor_ulps: float  # floor in units of roundoff of the golden's scale
    noise_floor_ulps: float  # the noise is taken to be at least this many roundoffs of the scale
    analytic_factor: float  # c in c * sqrt(K) * u * scale, used without an inexact baseline
    reorder_factor: float  # r in r * sqrt(K) * u_acc * scale': reordering, without a baseline
    guard_factor: float  # g in the baseline's bound g * sqrt(K) * u_acc * scale' (long reductions)
    per_step_growth: float = 0.0  # relative budget growth per training step
    # Kinds judged rather than calibrated keep the bounded reordering term beside the measured
    # noise: reorder_factor * sqrt(K) * u_acc * scale', scale' as large as the baseline's error
    # reveals (err(baseline) / (sqrt(K) * u)).
    bounded_reordering: bool = False
    # Gradients share the backward pass's relative noise, and those of one group (the parameters
    # of one module) its scale, which bounds the noise and the floor from below; a member whose
    # golden cancelled to below the group's rounding is judged at the group's scale.
    group_scale: bool = False
    # A member below this share of its group's scale is a residue (see :func:`residue`): it is
    # allowed at least the bound at its group's scale, and the rounding the candidate made on
    # it may reach the other members of the pass. 0: no residues.
    residue_share: float = 0.0
    # Trajectories judged by a measured noise band: its spread at a step is pooled (the maximum
    # taken) over this many steps on either side. 0: no pooling.
    pool_steps: int = 0


#: The one table of tolerance constants. ``torchparity calibrate`` measures them: false alarms
#: of every CPU attention backend and detection of planted bugs over random problems. The
#: numbers quoted below are from docs/tolerance.md (seed 0); the constants were chosen on a
#: separate run (seed 1000).
KINDS: dict[str, KindTolerance] = {
    # Outputs of a forward pass. Max-abs, because a bug confined to one row (a leaked mask
    # entry) must not be diluted. Fudge 6: legitimate kernels erred at most 4.0 times the
    # baseline in fp32 (sdpa-math, logits of std 30 over 128-dim heads), 1.7 in bf16 and fp16;
    # a change whose float64 effect is 8 times the baseline's error is then still caught (the
    # candidate errs about 7 times, the budget is 6). Noise floor 1 ulp: the rounding of the
    # largest output alone; a luckier baseline draw is luck. Floor 2 ulps: the output's own
    # rounding. Without a baseline: analytic factor 4 (the usual safe constant of the
    # probabilistic bound) and reorder factor 32 (float64 backends needed up to 14: logits up
    # to 30 amplify reordering). Guard factor 256: fp32 baselines over 727 keys erred 137
    # times sqrt(K) * u * scale more than the analytic part grants, K = 16 counting the head
    # dimension but not the keys the softmax sums over.
    "forward": KindTolerance(
        fudge=6.0,
        metric="max_abs",
        floor_ulps=2.0,
        noise_floor_ulps=1.0,
        analytic_factor=4.0,
        reorder_factor=32.0,
        guard_factor=256.0,
    ),
    # Parameter and input gradients. RMS, because the max-abs error of a gradient is dominated
    # by single outliers. Fudge 6, noise floor 1 ulp, as forward: with the pass's relative
    # noise, flash's backward (which recomputes the probabilities blockwise) erred at most 2.0
    # times the noise in fp32 (16.7 times the value gradient's own lucky baseline, whose
    # relative error was 8 times below the query and key gradients'). Group noise: the key
    # projection's bias gets exactly zero gradient (softmax ignores a shift of a whole score
    # row), but its computed value is a sum of terms as large as the key weight's gradient that
    # cancel, so its rounding noise is the module's, not the float64 residue (~1e-17); likewise
    # the query gradient under near-uniform attention, found at 900x the query weight's own
    # scale in fp32. Floor 4 ulps, analytic factor 8 and reorder factor 64: twice forward's,
    # for the backward pass's extra roundings and the token reduction of weight gradients
    # that the default K (the last dimension) undercounts (float64 backends needed up to 41).
    # Guard factor 256: fp32 baselines needed up to 99.
    "grad": KindTolerance(
        fudge=6.0,
        metric="rms",
        floor_ulps=4.0,
        noise_floor_ulps=1.0,
        analytic_factor=8.0,
        reorder_factor=64.0,
        guard_factor=256.0,
        group_scale=True,
        residue_share=1 / 8,
    ),
    # Scalar losses: forward-like, judged rather than calibrated. One sample per comparison, so
    # the baseline's error can be small by luck: the bounded reordering term (factor 32, as
    # forward's without a baseline) and a floor of 8 ulps carry the budget then.
    "loss": KindTolerance(
        fudge=4.0,
        metric="max_abs",
        floor_ulps=8.0,
        noise_floor_ulps=0.0,
        analytic_factor=4.0,
        reorder_factor=32.0,
        guard_factor=256.0,
        bounded_reordering=True,
    ),
    # Losses or weights after n training steps (tp.compare(..., kind="trajectory", step=n)):
    # grad-like noise that compounds, judged rather than calibrated, with the bounded reordering
    # term (factor 64, as grad's). The baseline is a run that differs in rounding only. The
    # budget grows by half of itself per step (a linear model of the early, pre-chaotic
    # divergence). torchparity's own trajectories are judged by a band: trajectory_band.
    "trajectory": KindTolerance(
        fudge=4.0,
        metric="rms",
        floor_ulps=8.0,
        noise_floor_ulps=0.0,
        analytic_factor=8.0,
        reorder_factor=64.0,
        guard_factor=256.0,
        per_step_growth=0.5,
        bounded_reordering=True,
    ),
    # Trajectories judged by a noise band: an ensemble of runs that differ only in rounding
    # (weights moved by one rounding, other instruction sets), its spread from the float64
    # trajectory measured at every step (train/ensemble.py). The band is measured, so no growth
    # per step and no reordering term. The maximum of a few members at one step is itself
    # noisy (a legitimate refactor pokes out of it at isolated steps by 2x): the spread is
    # pooled over 4 steps either side, and the fudge of 3 covers a draw beyond the largest of
    # the ensemble's (`torchparity calibrate --training`, docs/tolerance.md: five refactors
    # used at most 52% of their budgets in fp32 over 6 seeds, 41% in bf16 over 2, in 200
    # steps; none diverged). Noise floor 1 ulp (times 4 for a scalar, see
    # :func:`noise_floor`): members that round alike at one step (a loss before any update,
    # an update of a zero learning rate) claim at least that. Floor 8 ulps: the rounding of
    # the quantity itself, as the trajectory kind's. The analytic and reordering factors, as
    # trajectory's, serve only a budget asked without a band (band_budget always has one).
    "trajectory_band": KindTolerance(
        fudge=3.0,
        metric="max_abs",
        floor_ulps=8.0,
        noise_floor_ulps=1.0,
        analytic_factor=8.0,
        reorder_factor=64.0,
        guard_factor=256.0,
        pool_steps=4,
    ),
}


#: Members of a noise band beside the plain run and the other instruction sets: runs whose
#: initial weights moved by one rounding (train/ensemble.py). Four: with the plain run and the
#: CPU's other instruction sets (one or two more), a band of six or seven members, whose
#: pooled spread times the fudge of ``trajectory_band`` left no false alarm in 30 fp32 and 10
#: bf16 checks of rounding-only refactors at 20 and at 200 steps (`torchparity calibrate
#: --training`, docs/tolerance.md: a rate of at most 9.5% and 26% at 95% confidence); each
#: member costs one more training run at a golden update.
BAND_REROUNDINGS = 4

#: How far two values of an optimizer's hyper-parameter (a learning rate at a step, betas,
#: eps, weight decay) may differ, relative, and be the same value. They are computed in
#: Python's float64 by the recipe (a schedule's factor times the peak): arithmetic written
#: another way moves them by a few units of float64's roundoff (1.1e-16), a change of the
#: recipe by far more (a warm-up one step short: 11% at step 1). A thousand roundings.
HYPERPARAMETER_RTOL = 1e-13


class Summary(Protocol):
    """What a budget needs of a golden kept as a summary rather than a tensor (a sketch, see
    :mod:`torchparity.sketching`): its shape and exact magnitudes."""

    shape: tuple[int, ...]
    rms: float
    absmax: float

    def numel(self) -> int: ...

    def dim(self) -> int: ...


@dataclass(frozen=True)
class SketchTolerance:
    """Constants of sketched comparisons: how big tensors are summarised and how much the
    summary's spread costs (see :func:`sketch_margin`)."""

    size: int  # k: coordinates of the random projection
    confidence: float  # z: the projection's estimate is trusted to z standard deviations
    min_elements: int  # floating tensors of at least this many elements are sketched
    slice_elements: int  # exact elements kept of each of a sketch's rows (its first and last)


#: How tensors too big to keep are judged. A sketch is a CountSketch of k coordinates: each
#: element is added, with a random sign, to one of k buckets, so the squared norm of the
#: projection of an error estimates the error's squared norm without bias, with relative
#: standard deviation at most sqrt(2 / k) (half that for the norm itself). k = 8192: the norm
#: is estimated to 0.78% (one standard deviation); a sketch takes 64 KiB in float64, so 100
#: sketched gradients of a 1B model take 6.4 MiB. Confidence 6: both the candidate's and the
#: baseline's error are estimated, and the budget takes the baseline's at its upper and grants
#: for the candidate's at its lower bound, z standard deviations away (a chance below 1e-9
#: each for the spread-out errors rounding makes): the sketched budget is the full one times
#: (1 + z s) / (1 - z s) = 1.10 for s = 1 / sqrt(2k), and a change must be 1.10 times larger
#: again to be certain to be seen. Tensors of 2**17 elements and more are sketched: below, the
#: exact float64 tensor (at most 1 MiB) is cheap to keep, above it is at least 8 times the
#: sketch. 4096 elements of the first and the last row of each sketched tensor (for a logit
#: tensor, the first and the last position) are kept exactly: max-abs kinds judge those by the
#: ordinary rule, and the worst element is reported among them.
SKETCH = SketchTolerance(size=8192, confidence=6.0, min_elements=2**17, slice_elements=4096)


def sketch_spread(size: int | None = None) -> float:
    """Relative standard deviation of a sketch's estimate of a norm: 1 / sqrt(2k)."""
    return 1.0 / math.sqrt(2.0 * (size or SKETCH.size))


def sketch_margin(size: int | None = None) -> float:
    """What estimating both errors from sketches costs the budget: (1 + z s) / (1 - z s), s the
    :func:`sketch_spread`. A candidate within the full rule is within the sketched one unless
    one of the two estimates is off by more than z standard deviations."""
    zs = SKETCH.confidence * sketch_spread(size)
    if zs >= 1:
        raise ValueError(f"a sketch of {size} coordinates is too small for confidence "
                         f"{SKETCH.confidence:g}")
    return (1 + zs) / (1 - zs)


def kind_tolerance(kind: str) -> KindTolerance:
    """The :data:`KINDS` entry of ``kind``; ``ValueError`` naming the known kinds otherwise."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; use one of: {', '.join(KINDS)}")
    return KINDS[kind]


def error(candidate: torch.Tensor, golden: torch.Tensor, metric: Metric) -> float:
    """The ``metric`` of ``candidate - golden`` computed in float64 (0.0 for empty tensors)."""
    return magnitude(_float64(candidate) - _float64(golden), metric)


def magnitude(x: torch.Tensor, metric: Metric) -> float:
    """The max-abs or RMS of ``x`` in float64 (0.0 for empty tensors)."""
    if metric == "max_abs":
        return _float64(x).abs().max().item() if x.numel() else 0.0
    if metric == "rms":
        return rms(x)
    raise ValueError(f"unknown metric {metric!r}; use 'max_abs' or 'rms'")


# Norms in this range cannot have lost their sum of squares to underflow or overflow.
SAFE_NORMS = (1e-150, 1e150)


def rms(x: torch.Tensor) -> float:
    """Root mean square of ``x`` in float64, free of overflow and underflow (0.0 when empty)."""
    x = _float64(x)
    if x.numel() == 0:
        return 0.0
    norm = torch.linalg.vector_norm(x).item()
    if not SAFE_NORMS[0] < norm < SAFE_NORMS[1]:
        peak = x.abs().max().item()
        if peak == 0 or not math.isfinite(peak):
            return peak
        norm = peak * torch.linalg.vector_norm(x / peak).item()
    return norm / math.sqrt(x.numel())


#: Where the CPU allocator places every tensor it makes, in bytes.
_ALIGNMENT = 64


def dot(a: torch.Tensor, b: torch.Tensor) -> float:
    """The dot product of two flat tensors, the same wherever they sit in memory: a BLAS dot
    adds in an order that depends on where its operands start, and a tensor read from a trace
    sits wherever the file's layout put it, so one that starts elsewhere is copied to where
    the allocator would have put it."""
    a, b = (t if t.data_ptr() % _ALIGNMENT == 0 else t.clone() for t in (a, b))
    return torch.dot(a, b).item()


def finite_magnitude(x: torch.Tensor, metric: Metric) -> float:
    """Magnitude of the finite elements of ``x`` in ``metric`` (absmax or RMS)."""
    x = _float64(x)
    return magnitude(x if all_finite(x) else x[x.isfinite()], metric)


def own_magnitude(golden: torch.Tensor | Summary, metric: Metric) -> float:
    """Magnitude of the golden's finite elements in ``metric`` (absmax or RMS). A golden kept
    as a :class:`Summary` (a sketch) gives its exact stored magnitude."""
    if not isinstance(golden, torch.Tensor):
        return golden.rms if metric == "rms" else golden.absmax
    return finite_magnitude(golden, metric)


def cancelled(scale: float, group_scale: float) -> bool:
    """Whether a golden of magnitude ``scale`` (0 included) cancelled within a group of
    magnitude ``group_scale``: smaller than one fp32 rounding of the group's values, so no
    computation below float64 can resolve it and its error is the group's rounding noise."""
    return scale < UNIT_ROUNDOFF["fp32"] * group_scale


def residue(scale: float, group_scale: float | None, share: float) -> bool:
    """Whether a golden of magnitude ``scale`` (0 included) is a residue of its group: below
    ``share`` of ``group_scale`` (the kind's ``residue_share``). A plain baseline can round such
    a member luckily by structure: the fused softmax backward of a row that sees one key, or
    whose probabilities saturate, subtracts a product from itself and gets exactly the zero the
    math gives, where a kernel that forms the row term otherwise (FlashAttention's
    rowsum(dO * O), a decomposed softmax) rounds at the scale of the products."""
    return group_scale is not None and scale < share * group_scale


def _float64(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to("cpu", torch.float64)


@dataclass(frozen=True)
class Budget:
    """The error a candidate tensor may have, with every number that went into it."""

    kind: str
    metric: Metric
    compute_dtype: str
    unit_roundoff: float
    scale: float  # golden's magnitude in the metric (the group's when it cancelled)
    group_scale: float | None  # magnitude of the tensor's group, when it belongs to one
    reduction_length: int
    fudge: float
    baseline_error: float | None  # None when there is no inexact baseline
    noise: float | None  # the measured noise the fudge multiplies (None without a baseline)
    noise_source: str | None  # which estimate set the noise: see :func:`budget`
    analytic_factor: float
    analytic: float | None  # the analytic bound, used when baseline_error is None
    reorder_factor: float
    reordering: float  # 0 when the noise is measured
    reordering_scale: float  # scale' of the reordering term (see the module docstring)
    floor: float
    step_factor: float
    value: float
    atol: float = 0.0  # added by hand (``compare(..., atol=)``), never by the model
    rtol: float = 0.0  # likewise, times ``scale``
    residue: bool = False  # a residue of its group (see :func:`residue`)
    # The bound at the group's scale that replaced a residue's smaller allowance (None when
    # the tensor is no residue or its allowance was larger).
    residue_bound: float | None = None
    # Rounding the candidate showed on the residues of its pass, which reaches this tensor.
    inherited: float = 0.0

    @property
    def source(self) -> Literal["baseline", "analytic"]:
        """Whether the allowance scales the measured noise or is the analytic bound."""
        return "analytic" if self.baseline_error is None else "baseline"

    @property
    def sensitivity(self) -> float:
        """The smallest change, relative to the golden's scale, that this budget would flag: a
        candidate that moves the output by more than ``sensitivity * scale`` (in the metric)
        beyond the rounding it shares with the baseline cannot pass."""
        return self.value / self.scale

    def formula(self) -> str:
        """The budget written out with its numbers."""
        root_k = f"√{self.reduction_length}"
        if self.baseline_error is None:
            allowance = (
                f"analytic {self.analytic:.3g} ({_num(self.analytic_factor)} × {root_k}"
                f" × u {self.unit_roundoff:.3g} × scale {self.scale:.3g})"
            )
        else:
            allowance = f"{_num(self.fudge)} × {self.noise_source} {self.noise:.3g}"
        if self.reordering:
            if self.reordering_scale == self.scale:
                seen = "scale"
            elif self.reordering_scale == self.group_scale:
                seen = "scale of its group"
            else:
                seen = "scale seen by the baseline"
            allowance += (
                f" + reordering {self.reordering:.3g} ({_num(self.reorder_factor)} × {root_k}"
                f" × u_acc {accumulation_roundoff(self.compute_dtype):.3g}"
                f" × {seen} {self.reordering_scale:.3g})"
            )
        if self.residue_bound is not None:
            allowance = (
                f"bound of a residue {self.residue_bound:.3g}"
                f" ({_num(self.analytic_factor + self.reorder_factor)} × {root_k} × u_acc"
                f" {accumulation_roundoff(self.compute_dtype):.3g} × scale of its group"
                f" {self.group_scale:.3g})"
            )
        if self.inherited:
            allowance += f" + rounding that entered at a residue {self.inherited:.3g}"
        text = f"{allowance} + floor {self.floor:.3g}"
        if self.step_factor != 1.0:
            text = f"({text}) × step factor {_num(self.step_factor)}"
        if self.atol or self.rtol:
            text += (
                f" + atol {_num(self.atol)} + rtol {_num(self.rtol)} × scale {self.scale:.3g}"
                " (added by hand)"
            )
        return text


@dataclass(frozen=True)
class Measurement:
    """What was measured of one tensor: everything :func:`budget` computes its allowance from.

    Attributes:
        golden: the golden tensor (float64), or a :class:`Summary` of it.
        baseline_error: err(baseline, golden) in the kind's metric, or None without a
            baseline; 0.0 (an exact baseline) also selects the analytic bound.
        compute_dtype: the dtype the candidate computes in (its unit roundoff).
        kind: a name of :data:`KINDS`.
        reduction_length: K of the analytic bound; None: the golden's last dimension (1 for
            scalars).
        step: the step of a trajectory (budgets grow by ``per_step_growth`` per step).
        group_scale: the magnitude of the group the tensor belongs to, in the kind's metric
            (see :func:`cancelled`).
        group_noise: the largest relative baseline error ``err(baseline) / scale`` among the
            tensors compared with it.
        spread: the candidate's own rounding, its difference from a rerun on weights moved
            by one rounding.
        input_noise: the noise propagated from what it is computed from (see
            :func:`propagated_noise`).
        inherited: the rounding the candidate showed on the residues of its pass.
        atol: a user's hand-set absolute loosening, added last and recorded.
        rtol: likewise, times the scale.
        metric: replaces the kind's own metric (a sketched tensor is judged in RMS, see
            :data:`SKETCH`).
        islands: the narrowest dtype the model computes in whatever its own (transformers'
            float32 norms and rotary table).
    """

    golden: torch.Tensor | Summary
    baseline_error: float | None
    compute_dtype: DtypeLike
    kind: str = "forward"
    reduction_length: int | None = None
    step: int | None = None
    group_scale: float | None = None
    group_noise: float | None = None
    spread: float | None = None
    input_noise: float | None = None
    inherited: float = 0.0
    atol: float = 0.0
    rtol: float = 0.0
    metric: Metric | None = None
    islands: DtypeLike | None = None


def budget(measured: Measurement) -> Budget:
    """The budget for one tensor, following the rule in this module's docstring.

    Where ``islands`` is coarser than ``compute_dtype``, the noise floor and the floor are
    its, since one rounding there that falls the other way reaches every output (the next
    island rounds the difference again). The noise is the largest of the baseline's error
    ("baseline error"), the noise floor ("noise floor"), the candidate's own rounding
    (``spread``: "spread of a rerun"), the noise propagated from what it is computed from
    (``input_noise``: "noise of its inputs") and the relative noise times the group's scale
    ("noise of its group"). For kinds judged by group, a :func:`residue` is allowed at least
    the bound at its group's scale, and ``inherited`` is added. ``atol + rtol * scale``, a
    user's hand-set loosening, is added last and recorded.

    Args:
        measured: what was measured of the tensor (see :class:`Measurement`).

    Returns:
        The :class:`Budget`, whose ``value`` is always positive.

    Raises:
        ValueError: for an unknown kind or dtype, a reduction length below 1 or a negative
            step.
    """
    golden, baseline_error, kind = measured.golden, measured.baseline_error, measured.kind
    compute_dtype, islands, metric = measured.compute_dtype, measured.islands, measured.metric
    reduction_length, step = measured.reduction_length, measured.step
    group_scale, group_noise = measured.group_scale, measured.group_noise
    spread, input_noise, inherited = measured.spread, measured.input_noise, measured.inherited
    atol, rtol = measured.atol, measured.rtol
    tol = kind_tolerance(kind)
    metric = metric or tol.metric
    p = precision(compute_dtype)
    least = precision(coarser(compute_dtype, islands))  # what the model's rounding can claim
    own_scale = own_magnitude(golden, metric)
    scale = own_scale or 1.0
    if group_scale is not None and cancelled(own_scale, group_scale):
        scale = group_scale
    if reduction_length is None:
        reduction_length = golden.shape[-1] if golden.dim() > 0 else 1
    if reduction_length < 1:
        raise ValueError(f"reduction_length must be >= 1, got {reduction_length}")
    if step is not None and step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    root_k = math.sqrt(reduction_length)
    # A member of a group carries the rounding of the group's values it is computed from.
    outer_scale = max(scale, group_scale or 0.0)
    noise, noise_source, analytic, reordering = None, None, None, 0.0
    reordering_scale = outer_scale
    if baseline_error:
        noise, noise_source = max(
            (baseline_error, "baseline error"),
            (spread or 0.0, "spread of a rerun"),
            (input_noise or 0.0, "noise of its inputs"),
            (noise_floor(golden, least.unit_roundoff, tol) * scale, "noise floor"),
            ((group_noise or 0.0) * outer_scale, "noise of its group"),
        )
        allowance = tol.fudge * noise
        if tol.bounded_reordering:
            # A length-K reduction that errs by e at roundoff u summed terms of magnitude
            # e / (sqrt(K) u): when that exceeds the golden, the problem amplifies rounding.
            reordering_scale = max(outer_scale, baseline_error / (root_k * p.unit_roundoff))
            reordering = tol.reorder_factor * root_k * accumulation_roundoff(p.name)
            reordering *= reordering_scale
            allowance += reordering
    else:
        baseline_error = None
        analytic = tol.analytic_factor * root_k * p.unit_roundoff * scale
        reordering = tol.reorder_factor * root_k * accumulation_roundoff(p.name) * outer_scale
        allowance = analytic + reordering
    residue_bound = None
    is_residue = residue(own_scale, group_scale, tol.residue_share)
    if is_residue:
        # What the measured noise cannot promise for a residue, the bound does: the rounding
        # of the products it cancels, which kernels accumulate in at least fp32, at the scale
        # of its group (the rounding of the inputs to the dtype is the same on both sides).
        bound = (tol.analytic_factor + tol.reorder_factor) * root_k * outer_scale
        bound *= accumulation_roundoff(p.name)
        if bound > allowance:
            allowance, residue_bound = bound, bound
    allowance += inherited
    # Rounding to the dtype errs by up to u * |x| plus the subnormal spacing (which keeps the
    # floor of subnormal goldens positive).
    floor = tol.floor_ulps * (least.unit_roundoff * outer_scale + least.min_spacing)
    step_factor = 1.0 + tol.per_step_growth * (step or 0)
    return Budget(
        kind=kind,
        metric=metric,
        compute_dtype=p.name,
        unit_roundoff=p.unit_roundoff,
        scale=scale,
        group_scale=group_scale,
        reduction_length=reduction_length,
        fudge=tol.fudge,
        baseline_error=baseline_error,
        noise=noise,
        noise_source=noise_source,
        analytic_factor=tol.analytic_factor,
        analytic=analytic,
        reorder_factor=tol.reorder_factor,
        reordering=reordering,
        reordering_scale=reordering_scale,
        floor=floor,
        step_factor=step_factor,
        value=(allowance + floor) * step_factor + atol + rtol * scale,
        atol=atol,
        rtol=rtol,
        residue=is_residue,
        residue_bound=residue_bound,
        inherited=inherited,
    )


def band_budget(reference: float, spread: float, compute_dtype: DtypeLike) -> Budget:
    """The budget of one quantity of a trajectory at one step, judged by a noise band: the
    kind ``trajectory_band``'s fudge times ``spread`` (the ensemble's pooled spread, at least
    the kind's noise floor) plus its floor, at the scale of ``reference`` (the float64 value;
    1 where it is 0, an update of a zero learning rate)."""
    tol = KINDS["trajectory_band"]
    value = torch.tensor(reference, dtype=torch.float64)
    least = noise_floor(value, unit_roundoff(compute_dtype), tol) * (abs(reference) or 1.0)
    return budget(Measurement(value, baseline_error=max(spread, least),
                              compute_dtype=compute_dtype, kind="trajectory_band"))


def propagated_noise(
    sensitivities: Mapping[str, torch.Tensor], errors: Mapping[str, torch.Tensor]
) -> float:
    """The noise of a scalar computed from tensors whose errors are ``errors``, to first order:
    ``sqrt(sum((dL/dx * error)**2))`` over every element of every tensor both mappings hold,
    ``sensitivities`` being the scalar's gradient with respect to them.

    The scalar's own error is ``sum(dL/dx * error)``, a sum of many roundings of either sign
    that one draw can cancel to almost nothing (a loss's baseline erring a fiftieth of its
    usual); this is the size of that sum when the signs are independent, which no single lucky
    draw can shrink. Elements the scalar does not read (zero sensitivity: padded positions a
    loss leaves out, whose values may be NaN) and non-finite products count for nothing. 0.0
    when the mappings share no tensor.
    """
    total = 0.0
    for name, sensitivity in sensitivities.items():
        if name in errors:
            product = _float64(sensitivity) * _float64(errors[name])
            read = (_float64(sensitivity) != 0) & product.isfinite()
            total += float(product[read].square().sum())
    return math.sqrt(total)


#: Entries at or below this are *masked*, not computed: a banned token's logit or a padded
#: position written as a large negative constant. -65504 is the most negative finite fp16
#: value, the constant of generators that must stay fp16-safe; others write ``finfo.min`` or
#: ``-inf``, both below it. Computed values do not come near it (the largest activations of
#: trained LLMs reach a few thousand, and fp16 kernels would overflow beyond it), so such an
#: entry carries no rounding to measure: the comparison judges it as masked or not, never by
#: value, and it never sets the scale of a budget.
MASKED_BELOW = -65504.0


#: Below this many elements the largest of a baseline's roundings is a poor estimate of the
#: noise: one rounding can land near zero (an angle of exactly 0 rotates exactly), and a
#: candidate's independent one need not. The noise floor grows as sqrt(FEW_ELEMENTS / n).
FEW_ELEMENTS = 16


#: Once a model's float64 outputs changed, a cell is judged against the stored goldens and
#: against this revision's own float64. Both use the same baseline, so where the two goldens
#: agree to float64 rounding the budgets agree to within the baseline's own rounding; a budget
#: against the stored goldens more than this many times the other was set by the model's
#: change, not by rounding, and is named as grown.
BUDGET_GROWTH = 2.0


def noise_floor(golden: torch.Tensor | Summary, unit_roundoff: float,
                tol: KindTolerance) -> float:
    """The least noise, relative to the scale, that a baseline of ``golden``'s size may claim:
    ``noise_floor_ulps * u``, times ``sqrt(FEW_ELEMENTS / n)`` for fewer than FEW_ELEMENTS
    elements."""
    few = math.sqrt(FEW_ELEMENTS / max(golden.numel(), 1))
    return tol.noise_floor_ulps * unit_roundoff * max(1.0, few)


def baseline_bound(
    golden: torch.Tensor | Summary,
    *,
    compute_dtype: DtypeLike,
    kind: str = "forward",
    reduction_length: int | None = None,
    group_scale: float | None = None,
    metric: Metric | None = None,
) -> float:
    """The most error a plain computation in ``compute_dtype`` may have: the guard of the
    baseline, which has no baseline of its own to lean on.

    It is the budget without a baseline with every rounding counted at the dtype's own
    roundoff, as float64 backends are calibrated (large logits and cancellation amplify the
    rounding of stored values alike), plus ``guard_factor * sqrt(K) * u_acc * scale'`` for the
    long reductions the default K does not count (the softmax's sum over keys):
    ``(analytic_factor + reorder_factor) * sqrt(K) * u * scale + guard_factor * sqrt(K) * u_acc
    * scale' + floor``. A baseline over it lost precision its dtype does not excuse (a
    reduction accumulated in a narrower dtype, a lost upcast, reduced-precision matmuls) and
    would lower the bar for every candidate judged against it.
    """
    tol = kind_tolerance(kind)
    bound = budget(Measurement(
        golden,
        baseline_error=None,
        compute_dtype=compute_dtype,
        kind=kind,
        reduction_length=reduction_length,
        group_scale=group_scale,
        metric=metric,
    ))
    root_k = math.sqrt(bound.reduction_length)
    stored = tol.reorder_factor * root_k * bound.unit_roundoff * bound.reordering_scale
    accumulated = tol.guard_factor * root_k * accumulation_roundoff(bound.compute_dtype)
    return bound.analytic + stored + accumulated * bound.reordering_scale + bound.floor


def baseline_headroom(baseline_error: float, bound: float, error: float, kind: str) -> float:
    """The share of its guard a baseline's error uses: over 1 the baseline is degraded. The
    guard is the larger of :func:`baseline_bound` and ``fudge`` times the candidate's
    ``error``: a problem that amplifies rounding (a gradient that cancels to 1e-5 of the terms
    it sums) may take any baseline past the bound; only a candidate in the same dtype doing
    fudge times better shows that the baseline lost precision the problem does not cost."""
    return baseline_error / max(bound, kind_tolerance(kind).fudge * error)


def coarser(dtype: DtypeLike, other: DtypeLike | None) -> str:
    """The name of the less precise of two dtypes (``dtype``'s when ``other`` is None)."""
    mine = precision(dtype)
    if other is None:
        return mine.name
    theirs = precision(other)
    return theirs.name if theirs.unit_roundoff > mine.unit_roundoff else mine.name


def _num(x: float) -> str:
    return f"{x:g}"
