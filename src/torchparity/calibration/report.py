"""The calibration report: console tables and the markdown of ``docs/tolerance.md``."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator
from datetime import datetime, timezone

from rich.console import Console
from rich.table import Table

from torchparity import tolerance
from torchparity.calibration.problems import (
    BUGS,
    DETECTION_GOAL,
    GOAL_MULTIPLE,
    MEASURED_KINDS,
    MULTIPLES,
)
from torchparity.calibration.study import DetectionStats, Results, machine


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


_CURVE_HEADER = ["dtype", "kind", "changes", *(f">= {m}x" for m in MULTIPLES), "goal"]


def _curve_rows(results: Results) -> Iterator[list[str]]:
    for (dtype, kind, family), stats in sorted(results.curve.items()):
        cells = []
        for m in MULTIPLES:
            changes, caught = stats.counts[m]
            cells.append(f"{caught}/{changes}" if changes else "-")
        goal = GOAL_MULTIPLE[kind]
        note = ""
        if dtype == "fp32":
            rate = stats.rate(goal)
            met = rate is None or rate >= DETECTION_GOAL
            note = f"goal >= 99% at {goal}x: {_pct(rate)}, {'met' if met else 'NOT met'}"
        yield [dtype, kind, family, *cells, note]


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


def print_tables(results: Results, console: Console) -> None:
    """Both tables, with notes as numbered footnotes so that the columns stay narrow."""
    notes: dict[str, int] = {}
    for title, header, rows in (
        ("legitimate backends: false alarms", _FALSE_ALARM_HEADER, _false_alarm_rows(results)),
        ("planted bugs: detection", _DETECTION_HEADER, _detection_rows(results)),
        ("detection against the size of the change", _CURVE_HEADER, _curve_rows(results)),
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
            "noise floor ulps",
            "floor ulps",
            "analytic factor",
            "reorder factor",
            "guard factor",
            "per-step growth",
            "residue share",
        ],
        (
            [
                k,
                t.metric,
                _num(t.fudge),
                _num(t.noise_floor_ulps),
                _num(t.floor_ulps),
                _num(t.analytic_factor),
                _num(t.reorder_factor),
                _num(t.guard_factor),
                _num(t.per_step_growth),
                _num(t.residue_share),
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
        curve=_markdown_table(_CURVE_HEADER, _curve_rows(results)),
        blocks=_problem_mix(results, "blocks"),
        models=_problem_mix(results, "models"),
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
        text = f"- {kind}: err(candidate)/err(baseline) {' and '.join(parts)}; fudge {tol.fudge:g}"
        used = max((max(s.headrooms) for (_, d, k), s in results.false_alarms.items()
                    if k == kind and d != "fp64" and s.headrooms), default=None)
        if used is not None:
            # A member of a module is judged against the module's noise, not its own draw.
            text += f"; the most of a budget a legitimate backend used: {used:.0%}"
        text += "."
        if worst["fp64"]:
            text += (
                f" float64 backends (exact baseline) needed a factor of at most"
                f" {_ratio_at(worst['fp64'])}; analytic + reorder factor"
                f" {tol.analytic_factor + tol.reorder_factor:g}."
            )
        lines.append(text)
    lines.append(f"- False alarms: {results.n_false_alarms}.")
    for (dtype, kind, family), stats in sorted(results.curve.items()):
        goal = GOAL_MULTIPLE[kind]
        changes, caught = stats.counts[goal]
        if dtype == "fp32" and changes:
            lines.append(
                f"- fp32 {kind}, {family}: {caught} of {changes} caught with an effect"
                f" >= {goal}x the baseline's error ({_pct(stats.rate(goal))})."
            )
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


def _problem_mix(results: Results, family: str) -> str:
    """How many draws of ``family`` had each mask or padding, and its longest sequence."""
    counts: dict[str, int] = defaultdict(int)
    longest = 0
    for drawn, description in results.problems:
        if drawn != family:
            continue
        shape, mask = description.rsplit(" ", 1) if family == "models" else description.split(
            " ", 1)
        counts[mask] += 1
        dims = shape.split()[-1].split("x")
        longest = max(longest, int(dims[2] if family == "blocks" else dims[1]))
    if not counts:
        return "none drawn"
    masks = ", ".join(f"{mask} {n}" for mask, n in sorted(counts.items()))
    return f"{sum(counts.values())} draws; {masks}; longest sequence {longest}"


_REPORT = """\
# Tolerance model: calibration evidence

This file is written by `torchparity calibrate`; do not edit it by hand. The rule it checks is
described in `src/torchparity/tolerance.py` and argued for below: per tensor,
`err(candidate, golden) <= fudge * noise + floor`, where the noise is *measured*, the largest
of: the baseline's error `err(baseline, golden)`; the candidate's own rounding
`err(candidate, rerun)`, the candidate recomputed on inputs moved by one rounding (counted up to
what the dtype allows a plain computation); `noise_floor_ulps * u * scale` (one draw can round
luckily); for gradients, the largest relative noise of any gradient of the pass times the
module's scale; for a loss, the noise its outputs carry into it,
`sqrt(sum((dL/dy * err(baseline y))^2))`. A gradient below 1/8 of its module's scale (a residue:
a sum of terms at the module's scale that cancel) is allowed at least `(analytic_factor +
reorder_factor) * sqrt(K) * u_acc * module scale`, and the other gradients of the pass may carry
the error the candidate made on its residues. `floor = floor_ulps * u * scale` (for gradients at
least the module's scale). When the baseline is exact (float64) the bound replaces the noise:
`analytic_factor * sqrt(K) * u * scale + reorder_factor * sqrt(K) * u_acc * scale'`. The
baseline itself must stay within `(analytic_factor + reorder_factor) * sqrt(K) * u * scale +
guard_factor * sqrt(K) * u_acc * scale' + floor`.

## Findings

{summary}

## Why the rule is sound

- *No false alarm by construction of the noise.* A legitimate candidate computes the same math
  at the same precision as the baseline; its error differs from the baseline's by rounding in
  another order. The baseline's error on *this* problem already contains every amplification
  the problem has (large logits, long reductions, cancellation), which no a-priori bound can
  know; what is left is the spread between two legitimate orders, and the fudge covers the
  largest spread measured below over every CPU backend, dtype and kind. Where one draw can be
  lucky the noise is taken from what does not depend on luck: one roundoff of the scale (the
  rounding of the output alone), for gradients the largest relative error among all of them,
  which round through the same loss gradient (itself cancelling when a prediction is
  confident), and for a loss the rounding of the many outputs it sums, whose signs one draw can
  cancel but whose sizes it cannot.
- *A kernel's own rounding is measured where the baseline cannot show it.* FlashAttention's
  backward recomputes the probabilities from the saved logsumexp (off by `u * |logit|`) and
  takes the softmax backward's row term from the output, `rowsum(dO * O)`, where the plain
  fused softmax backward keeps its probabilities and subtracts a product from itself: on the
  property suite's tiny models (post-norm attention over scaled embeddings, one query that sees
  one key) the plain baseline erred 12 times less than the flash kernel. Rerunning the
  candidate on weights moved by one rounding changes which way it rounds, not what it computes:
  the difference is its rounding, and a bug, the same in both runs, cancels in it. Where the
  plain baseline rounds a gradient exactly by structure, the gradient is a residue of its
  module and takes the bound; the rounding the candidate made there reaches the gradients
  upstream, which may carry it.
- *Detection as sharp as the noise allows.* The budget is a small multiple of the noise, so a
  change whose own effect is a few times the noise leaves it: the curve below shows the rate
  against the size of the change. Peers anchor the same way (flash-attention's tests allow 2x
  the baseline's error, PyTorch's `test_transformers` 5x).
- *The baseline is guarded.* A baseline that rounds worse than its dtype allows would lower the
  bar for every candidate; it is judged against the bound float64 backends are calibrated
  against, at its own dtype, plus long reductions in the accumulators, and fails with its own
  message. A rerun's spread counts only up to the same bound, so a kernel that lost precision
  (a softmax in bf16) is not excused by its own noise.
- *What the rule does not promise.* Changes smaller than the budget pass: every verdict states
  its sensitivity, budget / scale, the smallest relative change it would have flagged.

## How it was measured

- Command: `{command}`
- Date: {date}; {minutes:.1f} minutes
- Machine: {cpu}, {cpu_count} CPUs, {threads} torch threads; {platform}; torch {torch}, \
Python {python}

Two families of {draws} draws each:

- *Attention blocks* reach what the tiny models do not. Each is a random pre-norm attention
  block: RMSNorm (eps 1e-6) of a 64-wide input, q/k/v projections, rotary positions on q and
  k, attention, output (batch, heads, seq, head_dim). Shapes: batch 1-2, heads 1-4, head_dim
  16-128, sequence 8-157 in seven of eight draws and 256-1024 in the rest; logits with
  standard deviation 1-30 (large logits make softmax nearly one-hot and amplify rounding);
  input RMS 3e-4 to 3 (small inputs make the norm's eps matter); half of the causal draws let
  the kernel apply causality (`is_causal`), the rest pass the mask. Forward: the attention
  output; grad: gradients of `sum(out * cotangent)` (random cotangent) with respect to the
  input, the three projections and the norm weight. Drawn: {blocks}.
- *Models* are the property suite's space: hypothesis, seeded, draws from
  `torchparity.strategies` what the suite's backend property draws (`configs()` with every
  field the reference supports, `batches()` unpadded or padded on either side with fully
  padded rows, a model seed, `dtypes()`), with the suite's pins: no ReLU below fp32, the CPU
  flash kernel's gradients compared in fp32 only. Each runs in the dtype drawn for it and in
  fp64. Forward: the logits; grad: the gradients of the sequence loss. The bugs are planted in
  every attention module (the leak into the decoder's first self-attention), keys shifted by one
  in the blocks only. Drawn: {models}.

- golden: float64, manual attention;
- baseline: manual attention (fp32 softmax) in the candidate dtype; for fp64 candidates the
  baseline is the golden itself, so the analytic bound and the reordering term are tested;
- every candidate below fp64, legitimate or bugged, is run a second time on inputs moved by one
  rounding and judged with that rerun, as the property suite judges it.

*Ratio* is err(candidate)/err(baseline) in the kind's metric, the largest over the draw's
tensors (for fp64, whose baseline is exact, it is the factor the draw needed,
err / (sqrt(K) * u * scale), a residue's at its module's scale, to compare with analytic +
reorder factor); *budget used* is
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
The goal is stated on the curve below; where a narrower dtype misses visible draws, the
*own band* columns say whether the effect was inside that dtype's own band (the
dtype cannot see the bug) or not (a real miss). The gap between *above fp32 noise* and *visible*
is the price of the budget. *Applicable* excludes draws where a bug cannot occur (a leaking mask
needs a masked key; dropping one head needs two; keys are shifted in the blocks only).

- softmax scale +1e-3: the logits are scaled by 1.001 / sqrt(head_dim);
- masked key leaks into one row: one masked (batch, row, key) entry is unmasked;
- rotary keys shifted by one: keys are rotated at position + 1 (queries stay), an off-by-one;
- norm eps 1e-6 -> 1e-5: the RMSNorm epsilon;
- softmax in bf16: probabilities computed in bfloat16 instead of fp32;
- one head dropped: the last head's output is zero.

{detection}

## Detection against the size of the change

The power of the rule as a curve: per dtype and kind, caught/changes among the planted changes
whose float64 effect is at least 1, 2, ... 32 times the baseline's error (for some tensor, each
against its own baseline error). *all bugs* pools the bugs above; *sized scale* plants the
softmax-scale change at each of the six sizes on every draw (shrunk or grown so that its
forward effect is that multiple; the gradients' effect is measured, not set). The goal is
>= 99% in fp32 at 8x for forward outputs and 16x for gradients. In bf16 and fp16 the
baseline's error is mostly the rounding to 16 bits that every candidate shares, so a change of
a few times that error is a few roundings of each value.

{curve}
"""


def _fmt(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.2f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _num(x: float) -> str:
    return f"{x:g}"
