"""The sketched study (``calibrate --sketched``): the calibration's problems at the size
where goldens are sketched, judged full and sketched side by side.

Each draw is the random attention block of ``problems.draw_problem`` with its batch grown
until the output has 16 times :attr:`~torchparity.tolerance.SketchTolerance.size` elements;
the float64 golden is sketched as a golden file keeps it (the weights' gradients exact) and
measured for *false alarms* (every legitimate CPU backend passes sketched as full),
*spread* (the projection's estimate of each error against the true RMS, in units of
1 / sqrt(2k)) and *detection* (planted bugs and the softmax-scale change by their float64
effect in the kind's metric: max-abs for forward outputs shows what RMS outside the exact
slices gives up). Its section of docs/tolerance.md lies between :data:`BEGIN` and :data:`END`."""

from __future__ import annotations

import dataclasses
import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from torchparity import sketching, tolerance
from torchparity.calibration.problems import (
    BUGS,
    MEASURED_KINDS,
    MULTIPLES,
    SIZED_BUG,
    Problem,
    ProblemVariant,
    draw_problem,
    run_block,
)
from torchparity.calibration.sections import MarkedSection
from torchparity.comparison import compare
from torchparity.dtypes import DTYPES
from torchparity.errors import BackendUnavailable

BEGIN = "<!-- sketched study: written by `torchparity calibrate --sketched` -->"
END = "<!-- end of the sketched study -->"
#: The output of a grown draw has at least this many times k elements.
GROWTH = 16
#: Backends measured (flex recompiles on every CPU call: it is left to the main study).
BACKENDS = ("sdpa", "sdpa-math", "sdpa-flash")
SKETCHED_DTYPES = ("fp32", "bf16", "fp16")
FAMILIES = ("all bugs", "sized scale")


@dataclass
class Counts:
    """Changes of one family, dtype and kind by the size of their effect: for each multiple,
    how many, how many the full rule caught and how many the sketched one."""

    counts: dict[int, list[int]] = field(
        default_factory=lambda: {m: [0, 0, 0] for m in MULTIPLES})

    def add(self, multiple: float, full: bool, sketched: bool) -> None:
        for m in MULTIPLES:
            if multiple >= m:
                self.counts[m][0] += 1
                self.counts[m][1] += full
                self.counts[m][2] += sketched


@dataclass
class SketchedResults:
    """Everything the sketched study measured."""

    draws: int
    seed: int
    dtypes: tuple[str, ...] = SKETCHED_DTYPES
    elements: list[int] = field(default_factory=list)  # output elements per draw
    comparisons: dict[tuple[str, str], list[int]] = field(
        default_factory=lambda: defaultdict(lambda: [0, 0, 0]))  # dtype, kind: n, full, sketched
    budget_used: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    spread: list[float] = field(default_factory=list)  # |estimate / true - 1| / (1 / sqrt(2k))
    detection: dict[tuple[str, str, str], Counts] = field(
        default_factory=lambda: defaultdict(Counts))
    seconds: float = 0.0

    @property
    def false_alarms(self) -> int:
        """Legitimate comparisons the sketched rule failed."""
        return sum(n - sketched for n, _, sketched in self.comparisons.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "draws": self.draws, "seed": self.seed, "seconds": self.seconds,
            "sketch": dataclasses.asdict(tolerance.SKETCH), "elements": self.elements,
            "false_alarms": [{"dtype": d, "kind": k, "comparisons": n, "passed_full": f,
                              "passed_sketched": s, "max_budget_used": self.budget_used[d, k]}
                             for (d, k), (n, f, s) in sorted(self.comparisons.items())],
            "spread_in_sigmas": {"max": max(self.spread, default=0.0), "n": len(self.spread)},
            "detection": [{"family": f, "dtype": d, "kind": k,
                           "counts": {str(m): dict(zip(("changes", "full", "sketched"), c,
                                                       strict=True))
                                      for m, c in counts.counts.items()}}
                          for (f, d, k), counts in sorted(self.detection.items())],
        }


def calibrate_sketched(draws: int, *, seed: int = 0,
                       dtypes: tuple[str, ...] = SKETCHED_DTYPES,
                       on_draw: Callable[[], None] | None = None) -> SketchedResults:
    """Measure ``draws`` grown problems (seeds ``seed``, ``seed + 1``, ...) in ``dtypes``."""
    results = SketchedResults(draws=draws, seed=seed, dtypes=dtypes)
    start = time.perf_counter()
    for draw_seed in range(seed, seed + draws):
        problem = grown(draw_problem(draw_seed))
        results.elements.append(problem.batch * problem.heads * problem.seq * problem.head_dim)
        _measure(problem, results)
        if on_draw is not None:
            on_draw()
    results.seconds = time.perf_counter() - start
    return results


def grown(problem: Problem) -> Problem:
    """``problem`` with fresh sequences added to its batch until its output has at least
    :data:`GROWTH` times k elements; the weights, positions and mask pattern stay."""
    per_sequence = problem.heads * problem.seq * problem.head_dim
    copies = max(1, math.ceil(GROWTH * tolerance.SKETCH.size / (problem.batch * per_sequence)))
    if copies == 1:
        return problem
    gen = torch.Generator().manual_seed(problem.seed + 10**6)
    batch = problem.batch * copies
    x = problem.tensors["x"]
    fresh = torch.randn((batch, *x.shape[1:]), generator=gen, dtype=torch.float64)
    cotangent = torch.randn((batch, *problem.cotangent.shape[1:]), generator=gen,
                            dtype=torch.float64)
    return dataclasses.replace(
        problem, batch=batch, tensors={**problem.tensors, "x": fresh * problem.input_rms},
        cotangent=cotangent, positions=problem.positions.repeat(copies, 1),
        mask=None if problem.mask is None else problem.mask.repeat(copies, 1, 1, 1))


def _sketched(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | sketching.Sketch]:
    """The golden as a golden file keeps it."""
    return {name: sketching.sketch(t, name) if sketching.wants_sketch(t) else t
            for name, t in tensors.items()}


def _measure(problem: Problem, results: SketchedResults) -> None:
    golden = run_block(problem, torch.float64)
    sketched = {kind: _sketched(golden[kind]) for kind in MEASURED_KINDS}
    bugged = {name: run_block(problem, torch.float64, variant) for name, variant in BUGS.items()
              if not (variant.leak and problem.leak_at is None)
              and not (variant.drop_head and problem.heads == 1)}
    for dtype_name in results.dtypes:
        dtype = DTYPES[dtype_name]
        baseline = run_block(problem, dtype)
        noise = {kind: _error(baseline[kind], golden[kind], kind) for kind in MEASURED_KINDS}
        for backend in BACKENDS:
            try:
                candidate = run_block(problem, dtype, ProblemVariant(backend=backend))
            except BackendUnavailable:
                continue
            for kind in MEASURED_KINDS:
                full, short = _judge(candidate, golden, sketched, baseline, kind)
                counts = results.comparisons[dtype_name, kind]
                counts[0] += 1
                counts[1] += full.ok
                counts[2] += short.ok
                results.budget_used[dtype_name, kind] = max(
                    results.budget_used[dtype_name, kind], short.worst.headroom)
                results.spread += _spreads(candidate[kind], baseline[kind], golden[kind])
        changes = [("all bugs", run_block(problem, dtype, BUGS[name]), bugged64)
                   for name, bugged64 in bugged.items()]
        changes += _sized(problem, dtype, golden, noise)
        for family, candidate, bugged64 in changes:
            for kind in MEASURED_KINDS:
                full, short = _judge(candidate, golden, sketched, baseline, kind)
                multiple = max(_error(bugged64[kind], golden[kind], kind)[n] / noise[kind][n]
                               for n in golden[kind] if noise[kind][n] > 0)
                results.detection[family, dtype_name, kind].add(multiple, not full.ok,
                                                                not short.ok)


def _judge(candidate: dict, golden: dict, sketched: dict, baseline: dict, kind: str
           ) -> tuple[Any, Any]:
    return (compare(candidate[kind], golden[kind], baseline[kind], kind),
            compare(candidate[kind], sketched[kind], baseline[kind], kind))


def _sized(problem: Problem, dtype: torch.dtype, golden: dict, noise: dict
           ) -> list[tuple[str, dict, dict]]:
    """The softmax-scale change sized to each multiple of the baseline's forward error."""
    reference = run_block(problem, torch.float64, BUGS[SIZED_BUG])
    effect = max(_error(reference["forward"], golden["forward"], "forward")[n]
                 / noise["forward"][n] for n in golden["forward"] if noise["forward"][n] > 0)
    delta = BUGS[SIZED_BUG].scale_factor - 1
    changes = []
    for target in MULTIPLES:
        variant = ProblemVariant(scale_factor=1 + delta * target / effect)
        changes.append(("sized scale", run_block(problem, dtype, variant),
                        run_block(problem, torch.float64, variant)))
    return changes


def _error(tensors: dict[str, torch.Tensor], golden: dict[str, torch.Tensor], kind: str
           ) -> dict[str, float]:
    metric = tolerance.kind_tolerance(kind).metric
    return {n: tolerance.error(tensors[n], golden[n], metric) for n in golden}


def _spreads(candidate: dict, baseline: dict, golden: dict) -> list[float]:
    """For each sketched tensor, how far the estimates of the candidate's and the baseline's
    RMS errors stray from the true ones, in stated standard deviations."""
    sigma = tolerance.sketch_spread()
    found = []
    for name, g in golden.items():
        if not sketching.wants_sketch(g):
            continue
        reference = sketching.sketch(g, name)
        for side in (candidate[name], baseline[name]):
            true = tolerance.rms(side.double() - g)
            if true > 0:
                estimate = sketching.error_estimate(sketching.like(reference, side), reference)
                found.append(abs(estimate / true - 1) / sigma)
    return found


# --- the report ---------------------------------------------------------------------------


def sketched_section(results: SketchedResults, *, command: str) -> str:
    """The section of docs/tolerance.md, between :data:`BEGIN` and :data:`END`."""
    k, z = tolerance.SKETCH.size, tolerance.SKETCH.confidence
    alarms = ["| dtype | kind | comparisons | failed full | failed sketched | max sketched "
              "budget used |", "|---|---|---|---|---|---|"]
    alarms += [f"| {d} | {kind} | {n} | {n - f} | {n - s} | {results.budget_used[d, kind]:.0%} |"
               for (d, kind), (n, f, s) in sorted(results.comparisons.items())]
    curve = ["| dtype | kind | changes | " + " | ".join(f">= {m}x" for m in MULTIPLES) + " |",
             "|---|---|---|" + "---|" * len(MULTIPLES)]
    for (family, d, kind), counts in sorted(results.detection.items(),
                                            key=lambda item: (item[0][1], item[0][2],
                                                              item[0][0])):
        cells = [f"{full}/{n} full, {short} sketched" if n else "-"
                 for n, full, short in counts.counts.values()]
        curve.append(f"| {d} | {kind} | {family} | " + " | ".join(cells) + " |")
    spread = max(results.spread, default=0.0)
    smallest, largest = min(results.elements), max(results.elements)
    return f"""{BEGIN}
## Sketched goldens: the same draws at size

Tensors of {tolerance.SKETCH.min_elements} elements and more are kept as sketches
(`src/torchparity/sketching.py`): a CountSketch of k = {k} coordinates, exact RMS, absmax and
mean, and the exact first {tolerance.SKETCH.slice_elements} elements of the first and the last
row. A sketched tensor is judged in RMS from the projections, the baseline's estimated error
taken at its upper confidence bound (z = {z:g} standard deviations of the stated spread
1 / sqrt(2k) = {tolerance.sketch_spread():.2%}, a budget factor of
{tolerance.sketch_margin():.3f}), and its exact slices by the ordinary rule of its kind. A
forward output is therefore judged max-abs on its slices only: a change confined to elements
outside them counts by its RMS.

Here every draw of the study above is grown, with fresh sequences in its batch, to at least
{GROWTH} k output elements ({smallest} to {largest}); its golden is sketched as a golden file
keeps it (the output and the input's gradient; the weights' gradients, of at most 32768
elements, stay exact) and judged beside the full golden with the same candidates and baselines.

- False alarms (legitimate backends {", ".join(BACKENDS)}; {", ".join(results.dtypes)}):
  {results.false_alarms}.
- The projections' estimates of every legitimate error strayed from its true RMS by at most
  {spread:.2f} stated standard deviations over {len(results.spread)} estimates (the budget trusts
  up to {z:g}).
- Detection, full against sketched, by the size of the change's float64 effect in multiples of
  the baseline's error (the kind's own metric: max-abs for forward outputs):

{chr(10).join(curve)}

### Legitimate backends, sketched

{chr(10).join(alarms)}

Command: `{command}`; {results.draws} draws, {results.seconds / 60:.1f} minutes.
{END}
"""


#: docs/tolerance.md's section of this study: a main run keeps it.
SECTION = MarkedSection(BEGIN, END)
merged, section_of = SECTION.merged, SECTION.of
