"""``torchparity calibrate``: measure the tolerance model's false-alarm and detection rates.

Every draw is a random pre-norm attention block (RMSNorm, q/k/v projections, rotary, attention
with a random mask) computed three ways: the golden (float64, manual attention), the baseline
(manual attention in the candidate dtype) and candidates. Candidates are every legitimate CPU
backend, which must pass (a failure is a false alarm), and the manual path with one planted bug,
which must diverge whenever the bug is visible: when its effect on the float64 output exceeds
the fp32 noise (the fp32 baseline's error).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
from rich.table import Table

from torchparity import backends, tolerance
from torchparity.compare import Comparison, compare
from torchparity.errors import BackendUnavailable, UsageError
from torchparity.reference.norms import RMSNorm
from torchparity.reference.positions import apply_rotary

DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp64": torch.float64,
}
MEASURED_KINDS = ("forward", "grad")
NORM_EPS = 1e-6
# The model width is kept small: the projections are not under test and would dominate the time.
D_MODEL = 64
ROPE_THETA = 10000.0
DETECTION_GOAL = 0.99


@dataclass(frozen=True)
class Variant:
    """How one run departs from the plain reference: another backend, or one planted bug."""

    backend: str = "manual"
    scale_factor: float = 1.0
    norm_eps: float = NORM_EPS
    key_shift: int = 0
    softmax_dtype: torch.dtype | None = None
    leak: bool = False
    drop_head: bool = False


BUGS = {
    "softmax scale +1e-3": Variant(scale_factor=1 + 1e-3),
    "masked key leaks into one row": Variant(leak=True),
    "rotary keys shifted by one": Variant(key_shift=1),
    "norm eps 1e-6 -> 1e-5": Variant(norm_eps=1e-5),
    "softmax in bf16": Variant(softmax_dtype=torch.bfloat16),
    "one head dropped": Variant(drop_head=True),
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

    @property
    def shape(self) -> str:
        return f"{self.batch}x{self.heads}x{self.seq}x{self.head_dim}"


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
    problem: Problem, dtype: torch.dtype, variant: Variant = Variant(), *, grad: bool = True
) -> dict[str, dict[str, torch.Tensor]]:
    """Outputs of the block in ``dtype``: ``{"forward": {"out": ...}, "grad": {...}}``.

    The gradients are those of ``sum(out * cotangent)`` with respect to every input tensor;
    ``grad=False`` skips them (for backends without a backward pass).
    """
    inputs = {n: t.to(dtype, copy=True).requires_grad_(grad) for n, t in problem.tensors.items()}
    with torch.set_grad_enabled(grad):
        out = _block(problem, inputs, variant)
        results = {"forward": {"out": out.detach()}}
        if grad:
            out.backward(problem.cotangent.to(dtype))
            results["grad"] = {GRAD_NAMES[n]: t.grad for n, t in inputs.items()}
    return results


def _block(problem: Problem, inputs: dict[str, torch.Tensor], variant: Variant) -> torch.Tensor:
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
        mask = _leaked(problem)
        causal = False
    scale = variant.scale_factor / math.sqrt(problem.head_dim)
    if variant.softmax_dtype is not None:
        out = _attention_with_softmax_in(variant.softmax_dtype, q, k, v, mask, causal, scale)
    else:
        out = backends.attention(
            q, k, v, mask=mask, scale=scale, causal=causal, backend=variant.backend
        )
    if variant.drop_head:
        out = torch.cat((out[:, :-1], torch.zeros_like(out[:, -1:])), dim=1)
    return out


def _full_mask(problem: Problem) -> torch.Tensor:
    if problem.mask is not None:
        return problem.mask
    causal = torch.ones(problem.seq, problem.seq, dtype=torch.bool).tril()
    return causal.expand(problem.batch, 1, -1, -1)


def _leaked(problem: Problem) -> torch.Tensor:
    mask = _full_mask(problem).clone()
    b, row, key = problem.leak_at
    mask[b, :, row, key] = True
    return mask


def _attention_with_softmax_in(
    softmax_dtype: torch.dtype,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float,
) -> torch.Tensor:
    """Manual attention, except that the softmax runs in ``softmax_dtype``."""
    scores = (q @ k.transpose(-2, -1)).to(torch.promote_types(q.dtype, torch.float32)) * scale
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    probs = scores.to(softmax_dtype).softmax(dim=-1).to(q.dtype)
    if mask is not None:  # rows that see no key are zeros, as on every backend
        probs = probs.masked_fill(~mask.any(-1, keepdim=True), 0.0)
    return probs @ v


# --- the measurement ------------------------------------------------------------------------


@dataclass
class FalseAlarmStats:
    """Legitimate backend × dtype × kind: how its error relates to the baseline's."""

    ratios: list[float] = field(default_factory=list)
    headrooms: list[float] = field(default_factory=list)
    failures: list[int] = field(default_factory=list)  # seeds
    unavailable: str | None = None

    def summary(self) -> dict[str, Any]:
        calibration = tolerance.Calibration(
            "", len(self.headrooms), tuple(self.ratios), tuple(self.headrooms), tuple(self.failures)
        )
        return {
            "draws": len(self.headrooms),
            "failures": self.failures,
            "median_ratio": calibration.quantile(0.5),
            "p99_ratio": calibration.quantile(0.99),
            "max_ratio": calibration.max_ratio,
            "max_headroom": calibration.max_headroom,
            "unavailable": self.unavailable,
        }


@dataclass
class DetectionStats:
    """Planted bug × dtype × kind: how often it is visible and how often it is caught."""

    applicable: int = 0
    above_fp32_noise: int = 0  # the bug's effect on the float64 output exceeds fp32's error
    visible: int = 0  # ... exceeds the fp32 band: the budget a legitimate fp32 result may use
    caught_visible: int = 0  # ... and the candidate diverged
    above_own: int = 0  # the effect exceeds this dtype's own band
    caught_above_own: int = 0
    caught: int = 0  # diverged, visible or not
    missed_seeds: list[int] = field(default_factory=list)  # visible, not caught
    missed_below_own: int = 0  # ... with an effect inside this dtype's own band

    @property
    def goal_met(self) -> bool:
        """At least 99% of the visible draws were caught."""
        return self.caught_visible >= DETECTION_GOAL * self.visible

    def summary(self) -> dict[str, Any]:
        return {
            "applicable": self.applicable,
            "above_fp32_noise": self.above_fp32_noise,
            "visible": self.visible,
            "caught_visible": self.caught_visible,
            "rate_visible": _rate(self.caught_visible, self.visible),
            "above_own_band": self.above_own,
            "caught_above_own_band": self.caught_above_own,
            "rate_above_own_band": _rate(self.caught_above_own, self.above_own),
            "caught": self.caught,
            "missed_seeds": self.missed_seeds,
            "missed_below_own_band": self.missed_below_own,
        }


@dataclass
class Results:
    """Everything one calibration run measured."""

    draws: int
    seed: int
    dtypes: list[str]
    backends: list[str]
    false_alarms: dict[tuple[str, str, str], FalseAlarmStats]
    detection: dict[tuple[str, str, str], DetectionStats]
    problems: list[str]
    flex_every: int = 1
    seconds: float = 0.0

    @property
    def n_false_alarms(self) -> int:
        return sum(len(s.failures) for s in self.false_alarms.values())

    def detection_goal_met(self) -> bool:
        """Whether every bug was caught in >= 99% of the fp32 draws where it was visible."""
        return all(s.goal_met for (_, dtype, _), s in self.detection.items() if dtype == "fp32")

    def to_dict(self) -> dict[str, Any]:
        return {
            "draws": self.draws,
            "seed": self.seed,
            "dtypes": self.dtypes,
            "backends": self.backends,
            "seconds": self.seconds,
            "machine": machine(),
            "kinds": {k: vars(t) for k, t in tolerance.KINDS.items()},
            "false_alarms": [
                {"backend": b, "dtype": d, "kind": k, **s.summary()}
                for (b, d, k), s in self.false_alarms.items()
            ],
            "detection": [
                {"bug": b, "dtype": d, "kind": k, **s.summary()}
                for (b, d, k), s in self.detection.items()
            ],
            "problems": self.problems,
        }


def calibrate(
    draws: int,
    *,
    seed: int = 0,
    dtypes: list[str] | None = None,
    backend_names: list[str] | None = None,
    flex_every: int = 1,
    on_draw: Callable[[], None] | None = None,
) -> Results:
    """Measure ``draws`` problems (seeds ``seed``, ``seed + 1``, ...) and return the statistics.

    ``dtypes`` default to all of :data:`DTYPES`, ``backend_names`` to every CPU backend but
    manual (the baseline itself). flex, which recompiles on every CPU call, runs on every
    ``flex_every``-th draw only. ``on_draw`` is called after each draw (progress reporting).
    """
    results = Results(
        draws=draws,
        seed=seed,
        dtypes=dtypes or list(DTYPES),
        backends=backend_names or cpu_backends(),
        false_alarms=defaultdict(FalseAlarmStats),
        detection=defaultdict(DetectionStats),
        problems=[],
        flex_every=flex_every,
    )
    start = time.perf_counter()
    for draw_seed in range(seed, seed + draws):
        problem = draw_problem(draw_seed)
        results.problems.append(f"{problem.shape} {problem.mask_kind}")
        _measure(problem, results)
        if on_draw is not None:
            on_draw()
    results.seconds = time.perf_counter() - start
    return results


def _measure(problem: Problem, results: Results) -> None:
    golden = run_block(problem, torch.float64)
    bugged = {
        name: run_block(problem, torch.float64, variant)
        for name, variant in BUGS.items()
        if _applies(variant, problem)
    }
    # A float64 baseline is the golden itself: exact, so budgets use the analytic bound.
    baselines = {"fp64": golden, "fp32": run_block(problem, torch.float32)}
    fp32_noise = _noise(golden, baselines["fp32"], "fp32")
    for dtype_name in results.dtypes:
        dtype = DTYPES[dtype_name]
        if dtype_name not in baselines:
            baselines[dtype_name] = run_block(problem, dtype)
        baseline = baselines[dtype_name]
        for backend in results.backends:
            if backend == "flex" and (problem.seed - results.seed) % results.flex_every:
                continue
            _measure_backend(problem, dtype_name, backend, golden, baseline, results)
        own_noise = _noise(golden, baseline, dtype_name)
        for name, bugged64 in bugged.items():
            variant = BUGS[name]
            candidate = bugged64 if dtype == torch.float64 else run_block(problem, dtype, variant)
            for kind in MEASURED_KINDS:
                stats = results.detection[(name, dtype_name, kind)]
                result = compare(candidate[kind], golden[kind], baseline[kind], kind)
                effect = _effects(bugged64[kind], golden[kind], kind)
                _record_detection(stats, result, effect, fp32_noise[kind], own_noise[kind], problem)


def _applies(variant: Variant, problem: Problem) -> bool:
    if variant.leak:
        return problem.leak_at is not None
    return not (variant.drop_head and problem.heads == 1)  # the whole output, not one head


def _measure_backend(
    problem: Problem,
    dtype_name: str,
    backend: str,
    golden: dict[str, dict[str, torch.Tensor]],
    baseline: dict[str, dict[str, torch.Tensor]],
    results: Results,
) -> None:
    dtype = DTYPES[dtype_name]
    # flex has no CPU backward pass: its gradients cannot be measured there.
    grad = backend != "flex"
    try:
        candidate = run_block(problem, dtype, Variant(backend=backend), grad=grad)
    except BackendUnavailable as exc:
        for kind in MEASURED_KINDS:
            results.false_alarms[(backend, dtype_name, kind)].unavailable = str(exc)
        return
    for kind in MEASURED_KINDS:
        stats = results.false_alarms[(backend, dtype_name, kind)]
        if kind not in candidate:
            stats.unavailable = f"{backend} has no backward pass on the CPU"
            continue
        result = compare(candidate[kind], golden[kind], baseline[kind], kind)
        ratio = tolerance.baseline_ratio(result)
        stats.ratios.append(ratio if ratio is not None else _needed_factor(result))
        stats.headrooms.append(result.worst.headroom)
        if not result.ok:
            stats.failures.append(problem.seed)


def _needed_factor(result: Comparison) -> float:
    """For an exact baseline: the factor each tensor needed, err / (sqrt(K) * u * scale), at its
    largest. The budget grants analytic_factor + reorder_factor (u_acc = u for float64)."""
    return max(
        t.error / (math.sqrt(t.budget.reduction_length) * t.budget.unit_roundoff * t.budget.scale)
        for t in result.tensors
        if t.budget is not None and t.budget.baseline_error is None
    )


@dataclass(frozen=True)
class Noise:
    """What rounding alone does to one tensor in one dtype: its error and the budget it earns."""

    level: float  # err(baseline, golden), or the analytic budget when the baseline is exact
    budget: float


def _noise(
    golden: dict[str, dict[str, torch.Tensor]],
    baseline: dict[str, dict[str, torch.Tensor]],
    dtype_name: str,
) -> dict[str, dict[str, Noise]]:
    """The noise of ``dtype_name`` per kind and tensor."""
    noise: dict[str, dict[str, Noise]] = {}
    for kind in MEASURED_KINDS:
        metric = tolerance.KINDS[kind].metric
        noise[kind] = {}
        for name, g in golden[kind].items():
            error = tolerance.error(baseline[kind][name], g, metric)
            budget = tolerance.budget(
                g, baseline_error=error, compute_dtype=dtype_name, kind=kind
            ).value
            noise[kind][name] = Noise(level=error or budget, budget=budget)
    return noise


def _effects(
    bugged: dict[str, torch.Tensor], golden: dict[str, torch.Tensor], kind: str
) -> dict[str, float]:
    metric = tolerance.KINDS[kind].metric
    return {name: tolerance.error(bugged[name], golden[name], metric) for name in golden}


def _record_detection(
    stats: DetectionStats,
    result: Comparison,
    effect: dict[str, float],
    fp32_noise: dict[str, Noise],
    own_noise: dict[str, Noise],
    problem: Problem,
) -> None:
    caught = not result.ok
    visible = any(effect[n] > fp32_noise[n].budget for n in effect)
    above_own = any(effect[n] > own_noise[n].budget for n in effect)
    stats.applicable += 1
    stats.above_fp32_noise += any(effect[n] > fp32_noise[n].level for n in effect)
    stats.caught += caught
    stats.visible += visible
    stats.caught_visible += visible and caught
    stats.above_own += above_own
    stats.caught_above_own += above_own and caught
    if visible and not caught:
        stats.missed_seeds.append(problem.seed)
        stats.missed_below_own += not above_own


def _rate(caught: int, visible: int) -> float | None:
    return caught / visible if visible else None


# --- the command ----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--draws", type=int, default=200, help="random problems (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first draw (default 0)")
    parser.add_argument(
        "--dtype",
        action="append",
        choices=list(DTYPES),
        help="candidate dtype (repeatable; default: fp32, bf16, fp16, fp64)",
    )
    parser.add_argument(
        "--backend",
        action="append",
        help="legitimate backend to test (repeatable; default: every one available on the CPU)",
    )
    parser.add_argument(
        "--flex-every",
        type=int,
        default=4,
        metavar="N",
        help="run flex on every Nth draw only: it recompiles on each CPU call (default 4)",
    )
    parser.add_argument("--out", metavar="PATH", help="write the report as markdown to PATH")
    parser.add_argument("--json", metavar="PATH", help="write the measurements as JSON to PATH")


def run(args: argparse.Namespace) -> int:
    if args.draws < 1:
        raise UsageError(f"--draws must be at least 1, got {args.draws}")
    if args.flex_every < 1:
        raise UsageError(f"--flex-every must be at least 1, got {args.flex_every}")
    dtypes = args.dtype or list(DTYPES)
    backend_names = args.backend or cpu_backends()
    unknown = [b for b in backend_names if b not in backends.names()]
    if unknown:
        raise UsageError(
            f"unknown --backend {', '.join(unknown)}; choose from {', '.join(backends.names())}"
        )
    console = Console(stderr=True)
    with Progress(
        "calibrating", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as progress:
        task = progress.add_task("draws", total=args.draws)
        results = calibrate(
            args.draws,
            seed=args.seed,
            dtypes=dtypes,
            backend_names=backend_names,
            flex_every=args.flex_every,
            on_draw=lambda: progress.advance(task),
        )
    _print_tables(results, Console())
    if args.out:
        _write(Path(args.out), render_markdown(results, command=_command_line(args)))
    if args.json:
        _write(Path(args.json), json.dumps(_json_safe(results.to_dict()), indent=2) + "\n")
    return 0 if results.n_false_alarms == 0 and results.detection_goal_met() else 1


def cpu_backends() -> list[str]:
    """Every backend that runs on the CPU, except manual: the baseline itself."""
    available = backends.available("cpu", torch.float32)
    return [name for name, reason in available.items() if reason is None and name != "manual"]


def _command_line(args: argparse.Namespace) -> str:
    parts = ["torchparity calibrate", f"--draws {args.draws}", f"--seed {args.seed}"]
    parts += [f"--flex-every {args.flex_every}"]
    parts += [f"--dtype {d}" for d in args.dtype or []]
    parts += [f"--backend {b}" for b in args.backend or []]
    parts += [f"--out {args.out}"] if args.out else []
    return " ".join(parts)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    return {
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# --- rendering ------------------------------------------------------------------------------


def _false_alarm_rows(results: Results) -> Iterator[list[str]]:
    for (backend, dtype, kind), stats in sorted(results.false_alarms.items()):
        s = stats.summary()
        if s["draws"] == 0:
            yield [backend, dtype, kind, "-", "-", "-", "-", "-", "-", s["unavailable"] or ""]
            continue
        yield [
            backend,
            dtype,
            kind,
            str(s["draws"]),
            str(len(s["failures"])),
            _fmt(s["median_ratio"]),
            _fmt(s["p99_ratio"]),
            _fmt(s["max_ratio"]),
            f"{s['max_headroom']:.0%}",
            "ratio: factor needed" if dtype == "fp64" else "",
        ]


_FALSE_ALARM_HEADER = [
    "backend",
    "dtype",
    "kind",
    "draws",
    "failed",
    "median ratio",
    "p99 ratio",
    "max ratio",
    "max budget used",
    "note",
]
_DETECTION_HEADER = [
    "bug",
    "dtype",
    "kind",
    "applicable",
    "above fp32 noise",
    "visible",
    "caught",
    "rate",
    "above own band",
    "caught",
    "rate",
    "note",
]


def _detection_rows(results: Results) -> Iterator[list[str]]:
    order = {name: i for i, name in enumerate(BUGS)}
    for (bug, dtype, kind), stats in sorted(
        results.detection.items(), key=lambda item: (order[item[0][0]], item[0][1:])
    ):
        s = stats.summary()
        yield [
            bug,
            dtype,
            kind,
            str(s["applicable"]),
            str(s["above_fp32_noise"]),
            str(s["visible"]),
            str(s["caught_visible"]),
            _pct(s["rate_visible"]),
            str(s["above_own_band"]),
            str(s["caught_above_own_band"]),
            _pct(s["rate_above_own_band"]),
            _detection_note(stats, dtype),
        ]


def _detection_note(stats: DetectionStats, dtype: str) -> str:
    if stats.visible == 0:
        return "never outside the fp32 band"
    missed = stats.visible - stats.caught_visible
    if missed == 0:
        return ""
    hidden = stats.missed_below_own
    if stats.goal_met:
        return f"missed {missed}"
    if hidden == missed:
        return f"{dtype} cannot see it in {hidden} of {stats.visible} draws: inside its own band"
    return f"below goal: missed {missed}, {hidden} of them inside the {dtype} band"


def _print_tables(results: Results, console: Console) -> None:
    """Both tables, with notes as numbered footnotes so that the columns stay narrow."""
    notes: dict[str, int] = {}
    for title, header, rows in (
        ("legitimate backends: false alarms", _FALSE_ALARM_HEADER, _false_alarm_rows(results)),
        ("planted bugs: detection", _DETECTION_HEADER, _detection_rows(results)),
    ):
        table = Table(title=f"{title} over {results.draws} draws")
        for column in header:
            table.add_column(column)
        for *cells, note in rows:
            table.add_row(*cells, f"[{notes.setdefault(note, len(notes) + 1)}]" if note else "")
        console.print(table)
    for note, index in notes.items():
        console.print(f"[{index}] {note}", markup=False)


def _markdown_table(header: list[str], rows: Iterator[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def render_markdown(results: Results, *, command: str) -> str:
    """The report written to docs/tolerance.md: method, tables, command, machine and date."""
    m = machine()
    kinds = _markdown_table(
        [
            "kind",
            "metric",
            "fudge",
            "reorder factor",
            "analytic factor",
            "floor ulps",
            "per-step growth",
        ],
        (
            [
                k,
                t.metric,
                _num(t.fudge),
                _num(t.reorder_factor),
                _num(t.analytic_factor),
                _num(t.floor_ulps),
                _num(t.per_step_growth),
            ]
            for k, t in tolerance.KINDS.items()
        ),
    )
    return _REPORT.format(
        command=command,
        date=datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        cpu=m["cpu"],
        cpu_count=m["cpu_count"],
        threads=m["torch_threads"],
        torch=m["torch"],
        python=m["python"],
        platform=m["platform"],
        minutes=results.seconds / 60,
        draws=results.draws,
        kinds=kinds,
        false_alarms=_markdown_table(_FALSE_ALARM_HEADER, _false_alarm_rows(results)),
        n_false_alarms=results.n_false_alarms,
        detection=_markdown_table(_DETECTION_HEADER, _detection_rows(results)),
        problems=_problem_mix(results),
        summary=_summary(results),
    )


def _summary(results: Results) -> str:
    """The findings in words: the worst ratios against the constants, misses, blind spots."""
    lines = []
    for kind in MEASURED_KINDS:
        tol = tolerance.KINDS[kind]
        worst = {
            group: _worst_ratio(results, kind, dtypes)
            for group, dtypes in (
                ("low", ("bf16", "fp16")),
                ("fp32", ("fp32",)),
                ("fp64", ("fp64",)),
            )
        }
        parts = []
        if worst["low"]:
            parts.append(f"at most {_ratio_at(worst['low'])} in bf16/fp16")
        if worst["fp32"]:
            parts.append(f"{_ratio_at(worst['fp32'])} in fp32")
        text = f"- {kind}: err(candidate)/err(baseline) {' and '.join(parts)}; fudge {tol.fudge:g}."
        if worst["fp64"]:
            text += (
                f" float64 backends (exact baseline) needed a factor of at most"
                f" {_ratio_at(worst['fp64'])}; analytic + reorder factor"
                f" {tol.analytic_factor + tol.reorder_factor:g}."
            )
        lines.append(text)
    lines.append(f"- False alarms: {results.n_false_alarms}.")
    below = [
        f"{bug} ({kind}, {s.caught_visible}/{s.visible})"
        for (bug, dtype, kind), s in results.detection.items()
        if dtype == "fp32" and not s.goal_met
    ]
    lines.append(
        "- fp32 detection of visible bugs: "
        + ("below 99% for " + ", ".join(below) if below else ">= 99% for every bug and kind")
        + "."
    )
    for dtype in ("bf16", "fp16"):
        blind = [
            f"{bug} ({kind}: {s.visible - s.above_own} of {s.visible})"
            for (bug, d, kind), s in results.detection.items()
            if d == dtype and s.visible and s.visible > s.above_own
        ]
        if blind:
            lines.append(
                f"- {dtype} cannot see, in this many of the draws where fp32 can: "
                + ", ".join(blind)
                + "."
            )
    return "\n".join(lines)


def _worst_ratio(
    results: Results, kind: str, dtypes: tuple[str, ...]
) -> tuple[float, str, str] | None:
    candidates = [
        (max(s.ratios), backend, dtype)
        for (backend, dtype, k), s in results.false_alarms.items()
        if k == kind and dtype in dtypes and s.ratios
    ]
    return max(candidates, default=None)


def _ratio_at(worst: tuple[float, str, str]) -> str:
    ratio, backend, dtype = worst
    return f"{ratio:.2f} ({backend}, {dtype})"


def _problem_mix(results: Results) -> str:
    counts: dict[str, int] = defaultdict(int)
    longest = 0
    for description in results.problems:
        shape, mask = description.split(" ", 1)
        counts[mask] += 1
        longest = max(longest, int(shape.split("x")[2]))
    masks = ", ".join(f"{mask} {n}" for mask, n in sorted(counts.items()))
    return f"masks: {masks}; longest sequence {longest}"


_REPORT = """\
# Tolerance model: calibration evidence

This file is written by `torchparity calibrate`; do not edit it by hand. The rule it checks is
described in `src/torchparity/tolerance.py`: per tensor,
`err(candidate, golden) <= fudge * err(baseline, golden) + reordering + floor`, with
`reordering = reorder_factor * sqrt(K) * u_acc * scale'` (`u_acc`: fp32's unit roundoff for fp32
and narrower dtypes, whose kernels accumulate in fp32; `scale'`: the golden's scale, or the
larger one the baseline's error reveals, or for gradients the scale of the tensor's module,
whichever is largest). When the baseline is exact (float64) the analytic bound
`analytic_factor * sqrt(K) * u * scale` replaces the fudge term. `floor = floor_ulps * u * scale`
(for gradients at least the module's scale).

## Findings

{summary}

## How it was measured

- Command: `{command}`
- Date: {date}; {minutes:.1f} minutes
- Machine: {cpu}, {cpu_count} CPUs, {threads} torch threads; {platform}; torch {torch}, \
Python {python}

Each of the {draws} draws is a random pre-norm attention block: RMSNorm (eps 1e-6) of a
64-wide input, q/k/v projections, rotary positions on q and k, attention, output
(batch, heads, seq, head_dim). Shapes: batch 1-2, heads 1-4, head_dim 16-128, sequence 8-157 in
seven of eight draws and 256-1024 in the rest; logits with standard deviation 1-30 (large logits
make softmax nearly one-hot and amplify rounding); input RMS 3e-4 to 3 (small inputs make the
norm's eps matter); {problems}. Half of the causal draws let the kernel apply causality
(`is_causal`), the rest pass the mask.

- golden: float64, manual attention;
- baseline: manual attention (fp32 softmax) in the candidate dtype; for fp64 candidates the
  baseline is the golden itself, so the analytic bound and the reordering term are tested;
- forward: the attention output; grad: gradients of `sum(out * cotangent)` (random cotangent)
  with respect to the input, the three projections and the norm weight.

*Ratio* is err(candidate)/err(baseline) in the kind's metric, the largest over the draw's
tensors (for fp64, whose baseline is exact, it is the factor the draw needed,
err / (sqrt(K) * u * scale), to compare with analytic + reorder factor); *budget used* is
err(candidate)/budget, the largest over the draw's tensors. flex runs on a subset of the draws
(see the command): on the CPU it recompiles on every call, and it has no backward pass there.

## Current constants

{kinds}

## Legitimate backends: false alarms

Goal: none. {n_false_alarms} false alarm(s) in total.

{false_alarms}

## Planted bugs: detection

A bug's *effect* is its error in float64 (the same bug computed in float64, compared with the
golden). It is *above fp32 noise* when the effect exceeds, for some tensor, the fp32 baseline's
error, and *visible* when it exceeds the fp32 band: the budget a legitimate fp32 result may use.
The goal is that >= 99% of the visible draws are caught, in every dtype; where a narrower dtype
misses them, the *own band* columns say whether the effect was inside that dtype's own band (the
dtype cannot see the bug) or not (a real miss). The gap between *above fp32 noise* and *visible*
is the price of the budget. *Applicable* excludes draws where a bug cannot occur (a leaking mask
needs a masked key; dropping one head needs two).

- softmax scale +1e-3: the logits are scaled by 1.001 / sqrt(head_dim);
- masked key leaks into one row: one masked (batch, row, key) entry is unmasked;
- rotary keys shifted by one: keys are rotated at position + 1 (queries stay), an off-by-one;
- norm eps 1e-6 -> 1e-5: the RMSNorm epsilon;
- softmax in bf16: probabilities computed in bfloat16 instead of fp32;
- one head dropped: the last head's output is zero.

{detection}
"""


def _fmt(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.2f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _num(x: float) -> str:
    return f"{x:g}"


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    return x
