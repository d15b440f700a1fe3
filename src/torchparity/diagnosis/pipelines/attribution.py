"""Attribution: which of B's changes (modules, attention backend) carries the output difference.

Per unit of change two hybrids run: A with only this unit from B (*swap in*: its error's
share of B's is what the unit causes alone) and B with only this unit from A (*leave out*:
one minus its share is what its absence removes). Errors are mean squared differences of the
floating outputs from A's, which add for independent units, so shares sum to about one."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from torchparity.diagnosis.core.align import NameMap, align
from torchparity.diagnosis.core.progress import ProgressBar, progress_bar
from torchparity.diagnosis.core.run import (
    BackendSpec,
    Options,
    backend_context,
    backend_name,
    backend_pair,
    run_model,
    shown,
)
from torchparity.diagnosis.pipelines.forward import diagnose
from torchparity.diagnosis.reports.diagnosis import AttributionReport, Unit
from torchparity.diagnosis.reports.meta import AttributionMeta
from torchparity.errors import UsageError
from torchparity.subject.running import Inputs, call_model, check_models, seeded
from torchparity.subject.trees import flatten_tensors

__all__ = ["attribute"]


def attribute(
    model_a: nn.Module,
    model_b: nn.Module,
    inputs: Inputs,
    *,
    modules: Sequence[str] | None = None,
    name_map: NameMap | None = None,
    backends: tuple[BackendSpec, BackendSpec] | None = None,
    progress: bool | None = None,
) -> AttributionReport:
    """Share of the final output error between A and B that each of B's changes explains.

    Models are restored after each swap (temporary attribute changes, never copies); every run
    is seeded alike; a unit that cannot be swapped (a fused group) is listed with the reason.

    Args:
        model_a: the reference implementation.
        model_b: the changed one.
        inputs: a tuple of positional arguments or a dict of keyword arguments.
        modules: B's modules taken as units (None: the deepest aligned modules whose local
            output is not bit-identical).
        name_map: A's module names mapped to B's, for the pairing.
        backends: A's and B's attention backends; the backend becomes a unit.
        progress: show a progress bar on stderr (None: when stderr is a terminal).

    Returns:
        The :class:`~torchparity.diagnosis.reports.diagnosis.AttributionReport`.
    """
    backend_a, backend_b = backend_pair(backends)
    opts = Options(backward=False, backend_a=backend_a, backend_b=backend_b,
                   progress=shown(progress), name_map=name_map)
    check_models(model_a=model_a, model_b=model_b)
    with progress_bar(opts.progress) as bar:
        pairs, skipped = _units(model_a, model_b, inputs, modules, opts, bar)
        runs = _Runs(inputs, bar, total=2 + 2 * (len(pairs) + _has_backend_unit(opts)))
        reference = runs.output(model_a, opts.backend_a)
        total = runs.error(model_b, opts.backend_b, reference)
        units = []
        if _has_backend_unit(opts):
            label = f"backend {backend_name(opts.backend_a)} -> {backend_name(opts.backend_b)}"
            units.append(Unit(label, "backend", total,
                              swap_in=runs.error(model_a, opts.backend_b, reference),
                              leave_out=runs.error(model_b, opts.backend_a, reference)))
        for a_name, b_name in pairs:
            with _swapped(model_a, a_name, model_b.get_submodule(b_name)) as hybrid:
                swap_in = runs.error(hybrid, opts.backend_a, reference)
            with _swapped(model_b, b_name, model_a.get_submodule(a_name)) as hybrid:
                leave_out = runs.error(hybrid, opts.backend_b, reference)
            units.append(Unit(b_name or "(model)", "module", total, swap_in=swap_in,
                              leave_out=leave_out))
    return AttributionReport(units=units, total=total, skipped=skipped, meta=AttributionMeta(
        backends=[backend_name(opts.backend_a), backend_name(opts.backend_b)],
        error="mean squared difference of all floating outputs from A's",
    ))


def _has_backend_unit(opts: Options) -> bool:
    return opts.backend_a != opts.backend_b


def _units(model_a: nn.Module, model_b: nn.Module, inputs: Inputs, modules: Sequence[str] | None,
           opts: Options, bar: ProgressBar
           ) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """(A name, B name) of each module unit, and units that cannot be swapped with the reason."""
    if modules is None:
        return _differing_modules(model_a, model_b, inputs, opts)
    done = bar.phase("aligning modules")
    structure = [run_model(m, inputs, opts, None, backward=False, what="shapes").calls
                 for m in (model_a, model_b)]
    alignment = align(*structure, opts.name_map)
    done()
    by_b_name = {m.b[0].name: m for m in alignment.matches if len(m.b) == 1}
    pairs, skipped = [], {}
    for name in modules:
        match = by_b_name.get(name)
        if match is None:
            raise UsageError(f"attribute(modules=...): {name!r} is not an aligned module of "
                             f"model_b; aligned: {', '.join(sorted(by_b_name)) or 'none'}")
        if len(match.a) != 1:
            skipped[name] = f"fused with {match.a_name} in A: no single module to swap"
        else:
            pairs.append((match.a[0].name, name))
    return pairs, skipped


def _differing_modules(model_a: nn.Module, model_b: nn.Module, inputs: Inputs,
                       opts: Options
                       ) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """The deepest aligned modules whose local output is not bit-identical, both models run
    under A's backend so that backend effects are not attributed to modules."""
    report = diagnose(model_a, model_b, inputs, name_map=opts.name_map, backward=False,
                      backends=(opts.backend_a, opts.backend_a), progress=opts.progress)
    differing = [r for r in report.rows if r.local is not None and r.local.verdict != "identical"]
    skipped = {r.module: f"fused with {r.a_module} in A: no single module to swap"
               for r in differing if r.how == "fused"}
    candidates = [r for r in differing if r.how != "fused" and "#" not in r.module]
    deepest = [r for r in candidates
               if not any(_inside(other.module, r.module) for other in differing)]
    return [(r.a_module, r.module) for r in deepest], skipped


def _inside(name: str, ancestor: str) -> bool:
    return name != ancestor and (ancestor == "" or name.startswith(ancestor + "."))


@contextlib.contextmanager
def _swapped(host: nn.Module, name: str, part: nn.Module) -> Iterator[nn.Module]:
    """``host`` with its submodule ``name`` temporarily replaced by ``part`` (the root: ``part``
    itself)."""
    if name == "":
        yield part
        return
    parent_name, _, child = name.rpartition(".")
    parent = host.get_submodule(parent_name)
    original = getattr(parent, child)
    setattr(parent, child, part)
    try:
        yield host
    finally:
        setattr(parent, child, original)


class _Runs:
    """Seeded forward runs of whole models and their mean squared error against A's output."""

    def __init__(self, inputs: Inputs, bar: ProgressBar, total: int) -> None:
        self.inputs = inputs
        self.advance = bar.phase("attribution runs", total=total)

    def output(self, model: nn.Module, backend: BackendSpec) -> torch.Tensor:
        with backend_context(backend), seeded(), torch.no_grad():
            output = call_model(model, self.inputs)
        self.advance()
        floats = [t.detach().to("cpu", torch.float64).flatten()
                  for t in flatten_tensors(output).values() if t.is_floating_point()]
        if not floats:
            raise UsageError("the model output has no floating tensor to attribute errors in")
        return torch.cat(floats)

    def error(self, model: nn.Module, backend: BackendSpec, reference: torch.Tensor) -> float:
        output = self.output(model, backend)
        if output.shape != reference.shape:
            raise UsageError(f"outputs of A and B differ in size ({reference.numel()} vs "
                             f"{output.numel()} floating elements): nothing to attribute")
        return (output - reference).square().mean().item()
