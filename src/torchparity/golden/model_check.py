"""The check of a user's model against its goldens (``check --model``, ``tp.check_model``).

Cells are the zoo check's; a non-reference cell runs a copy of the model in its dtype with every
SDPA call on its backend (``n/a`` for a model making none); ``transformers`` models run their
``sdpa`` implementation there and get one more backend, ``hf-eager``. Outputs one run has and
another lacks (eager's attention weights against sdpa's ``None``) are structure differences,
never divergences. A failing decode row names the first step that leaves its budget.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from torchparity import backends, machine
from torchparity.comparison import Comparison, compare
from torchparity.dtypes import DTYPES, dtype_name
from torchparity.errors import UsageError
from torchparity.golden import check_loop
from torchparity.golden.cells import REFERENCE, Cell, CellRun, CheckResult
from torchparity.golden.changed_weights import changed_rows, changed_sentence
from torchparity.golden.compiled_cells import stepped_logits
from torchparity.golden.model_runs import (
    HF_EAGER,
    OUTPUT_KINDS,
    CellModels,
    cell_attention,
    output_padding,
    run_in_cell,
)
from torchparity.golden.renamed import Renaming, renaming, state_layout
from torchparity.golden.store import GoldenStore
from torchparity.golden.user_models import (
    golden_islands,
    load_goldens,
    loss_paths,
    model_checksums,
    model_store,
    no_decode_golden,
    user_golden_dir,
    weight_state,
)
from torchparity.sketching import Sketch
from torchparity.subject import Subject
from torchparity.subject.compiling import check_mode
from torchparity.subject.decoding import Fed
from torchparity.subject.hf_families import is_hf_entry
from torchparity.subject.names import NameMap
from torchparity.tolerance import coarser

#: How a factory builds the same weights and inputs on every machine.
_SAME_EVERYWHERE = {
    "weights": "initialise the model with tp.init_weights(model, seed)",
    "inputs": "draw floating inputs with tp.random_tensor(shape, seed)",
}


def backend_names(models: list[Subject] | None = None) -> list[str]:
    """Every attention backend, and ``hf-eager`` for a ``transformers`` model (or unknown)."""
    eager = models is None or any(m.is_transformers for m in models)
    return [*backends.names(), *([HF_EAGER] if eager else [])]


def check_subject(subject: Subject, store: GoldenStore, cells: list[Cell],
                  advance: Callable[[str], None] = lambda label: None,
                  status: Callable[[str, str], None] | None = None,
                  name_map: NameMap | None = None) -> list[CheckResult]:
    """Check ``subject`` in every cell against its goldens: one result per cell and output.

    The cells share the model (no more copies than dtypes); weights named otherwise than in the
    goldens are found by :mod:`~torchparity.golden.renamed`. ``advance`` gets each cell's label
    when done, ``status`` ``(label, text)`` while one runs, ``name_map`` maps the goldens' module
    names.

    Raises:
        GoldenError: a golden is missing or damaged, naming the command that makes it.
    """
    return check_loop.check_cells(ModelFeed(subject, store, status, name_map), cells, advance)


class ModelFeed:
    """A user's model as the check loop runs and judges it (see :class:`check_loop.Feed`)."""

    kinds = OUTPUT_KINDS
    noise_from = "outputs"

    def __init__(self, subject: Subject, store: GoldenStore,
                 status: Callable[[str, str], None] | None = None,
                 name_map: NameMap | None = None) -> None:
        self.goldens = load_goldens(subject, store)
        self.renamed = golden_renaming(self.goldens, subject, name_map)
        self.unjudged: dict[str, str] = {}
        if subject.generates and "decode" not in self.goldens:
            self.unjudged["decode"] = no_decode_golden(subject, store)
            subject = dataclasses.replace(subject, decoding=False)
        self.subject, self.store, self.name, self.status = subject, store, subject.name, status
        self.outputs = list(self.goldens)
        self.loss_paths = loss_paths(self.goldens)
        self.islands = golden_islands(self.goldens)
        self.models = CellModels(subject)
        # Step by step, every cell but the reference decodes along the golden's tokens.
        decoded = self.goldens["decode"].tensors if subject.steps else None
        self.tokens = decoded and Fed(decoded["tokens"], decoded.get("parents"))

    def changed(self) -> dict[str, tuple[str, str]]:
        """Weights or inputs other than the goldens', each with the hint of its cause."""
        fix = f"if the change is intended run `{self.store.update_command}`"
        # causes: names pairing with nothing, changed values, or torch's own draws on another
        # instruction set
        if self.renamed is not None and not self.renamed.complete:
            reason = f"{self.renamed.unmatched_sentence(self.subject.entry)}, or {fix}"
            return dict.fromkeys(self.goldens, ("init changed", reason))
        made_on = self.goldens["grads"].summary.get("produced_by", {}).get("cpu_capability")
        here = machine.describe()["cpu_capability"]
        renamed = self.renamed and self.renamed.summary()
        by_meaning = f" (compared by meaning: {renamed})" if renamed else ""

        def advice(what: str) -> str:
            told = f"the {what} the factory {self.subject.entry} builds{by_meaning} {{differ}}"
            if made_on == here:
                return (f"{told}, on a machine of the instruction set that made them "
                        f"(cpu {here}): their values changed, not the machine; {fix}")
            return (f"{told}; the goldens were made on cpu {made_on or 'unrecorded'}, this "
                    f"run is on cpu {here}, whose torch random draws round otherwise: "
                    f"{_SAME_EVERYWHERE[what]}, or {fix}")

        return check_loop.checksum_changes(
            self.goldens, model_checksums(self.subject, self.renamed, by_tensor=False), advice,
            functools.cache(self.changed_tensors))  # a set's goldens share their checksums

    def changed_tensors(self) -> str | None:
        """The model's weight tensors differing from the goldens', in words; None if unrecorded."""
        stored = self.goldens["grads"].summary.get("checksums", {}).get("weight_blocks")
        weights = weight_state(self.subject, self.renamed)
        if stored is None or weights is None:
            return None
        return changed_sentence(changed_rows(stored, weights), self.renamed,
                                state_layout(self.subject.model))

    def refused(self, cell: Cell) -> str | None:
        """Refuses ``hf-eager`` for a model not of ``transformers`` (:meth:`Feed.refused`)."""
        if cell.backend == HF_EAGER and not self.subject.is_transformers:
            return "not a transformers model: it has no attention implementation to switch"
        return None

    def fed(self, cell: Cell, perturb: bool) -> Fed | None:
        """What a stepped decoding in ``cell`` is fed: the golden's, None for the reference."""
        # the reference decodes greedily or searches; its tokens are judged
        return None if cell == REFERENCE and not perturb else self.tokens

    def run(self, cell: Cell, *, perturb: bool = False) -> CellRun:
        # A compiled cell compiles a model of its own.
        """The model run in ``cell`` (:meth:`Feed.run`); a compiled cell compiles its own copy."""
        status = None if self.status is None or cell.compile else (
            lambda text: self.status(cell.label, text))
        return run_in_cell(self.subject, cell, self.loss_paths, perturb=perturb,
                           tokens=self.fed(cell, perturb),
                           models=None if cell.compile else self.models, status=status,
                           renamed=self.renamed)

    def golden(self, output: str) -> dict[str, Any] | None:
        """The stored tensors of ``output``'s golden, or None (see :meth:`Feed.golden`)."""
        golden = self.goldens.get(output)
        if golden and output == "grads" and self.renamed is not None:
            return self.renamed.judged_goldens(golden.tensors)
        return golden and golden.tensors

    def judge(self, cell: Cell, output: str, candidate: dict[str, Any],
              golden: dict[str, Any], baseline: dict[str, Any] | None,
              noise: float | None = None) -> CheckResult:
        """The row of ``output`` in ``cell``, knowing the model's islands (:meth:`Feed.judge`)."""
        return self._judge(cell, output, candidate, golden, baseline, noise, self.islands)

    def self_checks(self, fresh: CellRun) -> list[CheckResult]:
        """The ``decode-cache`` row: the reference's cached decoding against its full recompute."""
        # catches a KV-cache bug in the very run that made the goldens; none for a factory's own
        # step
        decoded = fresh.outputs.get("decode")
        if decoded is None:
            return []
        cached, recomputed = ({p.partition(".")[2] or "value": t for p, t in decoded.items()
                               if p.partition(".")[0] == label}
                              for label in ("cached", "recomputed"))
        if not recomputed:  # a step of the factory's own has no recompute to judge it by
            return []
        # Both sides compute the model's own islands (a state-space scan in float32) each its
        # way, the cache by recurrence and the recompute by a scan: two runs in that dtype.
        return [self._judge(REFERENCE, "decode-cache", cached, recomputed, None,
                            islands=self.islands,
                            compute_dtype=coarser(REFERENCE.dtype, self.islands))]

    def steps(self, decoded: dict[str, Any] | None) -> list[dict[str, Any]]:
        """A decoding's logits step by step (see :meth:`Feed.steps`)."""
        return stepped_logits(decoded)

    def _judge(self, cell: Cell, output: str, candidate: dict[str, Any],
               golden: dict[str, Any], baseline: dict[str, Any] | None,
               noise: float | None = None, islands: str | None = None,
               compute_dtype: str | None = None) -> CheckResult:
        """Judge the tensors both sides share; paths one side lacks are structure differences."""
        subject = self.subject
        comparison = compare(candidate, golden, baseline, OUTPUT_KINDS[output],
                             compute_dtype=compute_dtype or cell.dtype,
                             noise=noise if baseline else None,
                             padding=output_padding(subject, output), islands=islands)
        # per-position outputs judged unpadded; islands: the narrowest dtype the model computes in,
        # where a baseline may err as it does
        fields = check_loop.judged_fields(comparison, cell)
        if output == "loss" and subject.loss_fn is None and subject.padding:
            fields["left_out"] = (f"the default loss leaves the padding out: "
                                  f"{subject.padding.summary()}.")
        step = first_step(comparison) if output.startswith("decode") and subject.steps else None
        if step is not None:
            fields["explain"] = f"first step that differs: {step} (0 is the prompt); " \
                                f"{fields['explain']}"
        if output == "grads" and self.renamed is not None:
            fields["renamed"] = self.renamed.summary() or None
        if not fields["ok"] and (other := self._other_implementation(cell)):
            fields["explain"] = f"{fields['explain']}; {other}"
        return check_loop.row(self, cell, output, **fields,
                              structure=[str(d) for d in comparison.structure] or None)


    def _other_implementation(self, cell: Cell) -> str | None:
        """What a failure means where ``cell`` runs another attention, and the command to run."""
        subject = self.subject
        runs = cell_attention(subject, cell.backend)
        if not subject.is_transformers or runs in (None, subject.attention):
            return None
        entry = subject.entry.split(",")[0] if is_hf_entry(subject.entry) else None
        command = (f"`torchparity diagnose {entry},attn={subject.attention} {entry},attn={runs}`"
                   if entry else f"`torchparity diagnose` of the model built {subject.attention} "
                   f"against it built {runs}")
        return (f"this cell runs the library's {runs} implementation, the goldens its "
                f"{subject.attention} one, which the model was built with; where the two "
                f"differ, {command} names the op and both lines")


def golden_renaming(goldens: dict[str, Any], subject: Subject, name_map: NameMap | None
                    ) -> Renaming | None:
    """How the goldens' weights (``grads`` records the layout) are found in ``subject``'s model."""
    layout = goldens["grads"].summary.get("layout")
    # None: the goldens' names, no recorded layout, or a sharded model
    if layout is None or subject.shards is not None:
        return None
    now = state_layout(subject.model)
    if now == layout:
        return None
    sketched = frozenset(name for name, tensor in goldens["grads"].tensors.items()
                         if isinstance(tensor, Sketch))
    return renaming(layout, now, name_map, sketched)


def first_step(comparison: Comparison) -> int | None:
    """The first decoding step over its budget, or whose greedy token differs; None when none."""
    steps = []
    for t in comparison.tensors:
        if t.verdict != "diverged":
            continue
        found = re.search(r"logits\.(\d+)", t.path)
        if found:
            steps.append(int(found.group(1)))
        elif ("tokens" in t.path or "parents" in t.path) and t.worst_index is not None:
            steps.append(t.worst_index[-1])
    return min(steps, default=None)


# --- the Python API -------------------------------------------------------------------------


@dataclass
class ModelReport:
    """What :func:`check_model` found: one :class:`CheckResult` per cell and output."""

    results: list[CheckResult]

    @property
    def ok(self) -> bool:
        """True when no output diverged and the weights and inputs are the golden's."""
        return all(r.ok for r in self.results)

    @property
    def failures(self) -> list[CheckResult]:
        """The results that failed, in order."""
        return [r for r in self.results if not r.ok]

    def explain(self) -> str:
        """One line per failed output, for a test's failure; ``OK`` and the count if none."""
        if self.ok:
            return f"OK: {len(self.results)} outputs within their budgets or n/a"
        return "\n".join(f"FAIL {r.case} {r.cell.label} {r.output}: "
                         f"{r.explain or r.reason}" for r in self.failures)

    def to_dict(self) -> dict[str, Any]:
        """The report as ``check --json`` writes it: ``{"ok", "results": [row, ...]}``."""
        return {"ok": self.ok, "results": [r.to_dict() for r in self.results]}


def model_cells(backends: list[str] | None = None,
                dtypes: list[str | torch.dtype] | None = None,
                device: str = "cpu", compile: list[str] | None = None) -> list[Cell]:
    """The cells of :func:`check_model`, for a ``pytest.mark.parametrize`` of one test per cell.

    Args:
        backends: default: every attention backend and ``hf-eager`` (n/a for a model that is
            not a ``transformers`` one).
        dtypes: short or torch names; default fp32 and bf16.
        device: where the cells run.
        compile: ``dynamic`` or ``static``: each dtype's cells compiled in those forms too.

    Returns:
        The reference cell, then every (dtype, backend) on ``device``.

    Raises:
        UsageError: an unknown backend, dtype or compile form.
    """
    known = backend_names()
    for name in backends or []:
        if name not in known:
            raise UsageError(f"unknown attention backend {name!r}; choose from "
                             f"{', '.join(known)}")
    names = [dtype_name(d) for d in dtypes or ("fp32", "bf16")]
    for name in names:
        if name not in DTYPES or name == "fp64":
            raise UsageError(f"unknown dtype {name!r}; choose from fp32, tf32, bf16, fp16 "
                             "(the fp64 reference always runs)")
    forms = [None, *(check_mode(form) for form in compile or [])]
    return [REFERENCE, *(Cell(b, d, device, form) for d in names for form in forms
                         for b in backends or known)]


def check_model(factory: str | Callable[[], object], *, backends: list[str] | None = None,
                dtypes: list[str | torch.dtype] | None = None,
                golden_dir: str | os.PathLike | None = None,
                cells: list[Cell] | None = None, compile: list[str] | None = None,
                name_map: NameMap | None = None) -> ModelReport:
    """Check a user's model against its goldens, as ``torchparity check --model`` does.

    Args:
        factory: an entry (``file.py:name``, ``pkg.mod:name``) or the callable itself,
            returning ``(model, inputs)``, ``(model, inputs, loss_fn)`` or a dict with those
            keys and ``decode``.
        backends: as :func:`model_cells` takes them.
        dtypes: as :func:`model_cells` takes them.
        golden_dir: default ``$TORCHPARITY_GOLDEN_DIR``, else ``golden/`` in the working
            directory.
        cells: from :func:`model_cells`; they replace ``backends``, ``dtypes`` and ``compile``.
        compile: adds the cells compiled by ``torch.compile`` (docs/compile.md).
        name_map: the goldens' module names to the model's, where they were renamed.

    Returns:
        One result per cell and output.

    Raises:
        GoldenError: missing or damaged goldens, the message naming the ``torchparity golden
            update --model`` command that creates them.
        UsageError: a bad factory or option, in one line.
    """
    subject = Subject.load(factory)
    store = model_store(subject, user_golden_dir(golden_dir))
    cells = cells or model_cells(backends, dtypes, compile=compile)
    return ModelReport(check_subject(subject, store, cells, name_map=name_map))
