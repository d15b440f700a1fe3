"""Which module departs under ``torch.compile``: B compiled, localised module by module.

Hooks in a whole compiled B would be traced into the graph, and an eager replay misses what
only compiling does (a fused kernel, ``torch.compiler.is_compiling()``). So B is compiled
one level of its module tree at a time, each module on its own
(:func:`~torchparity.subject.compiling.compiled_modules`: its calls inside its graph, its
hooks outside), and judged as in any diagnosis, the replay running the compiled module.
From the whole model, the search descends into every module whose compiled local error
breaks its budget: the deepest one with no part departing on its own is where compiling
changes the math. A B built compiled is diagnosed alike, from its eager module."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

from torch import nn

from torchparity.diagnosis.core.align import Alignment, name_translator
from torchparity.diagnosis.core.progress import ProgressBar
from torchparity.diagnosis.core.reference import Reference
from torchparity.diagnosis.core.results import Row
from torchparity.diagnosis.core.run import Options
from torchparity.diagnosis.stages.local import judge_local
from torchparity.diagnosis.stages.propagated import Propagated, judge_propagated
from torchparity.errors import UsageError
from torchparity.subject.compiling import MODES, compiled_modules
from torchparity.subject.running import Inputs


def compile_form(model: nn.Module, requested: str | None) -> tuple[nn.Module, str | None]:
    """B's eager module and the form to diagnose it in: ``requested``, else the form B was
    compiled in, else None (eager)."""
    if requested is not None and requested not in MODES:
        raise UsageError(f"compile_b must be one of {', '.join(MODES)}; got {requested!r}")
    original = getattr(model, "_orig_mod", None)
    if isinstance(original, nn.Module):  # torch.compile(model): an OptimizedModule
        return original, requested or _form_of(model)
    if getattr(model, "_compiled_call_impl", None) is not None:  # model.compile()
        eager = copy.deepcopy(model)
        eager._compiled_call_impl = None
        return eager, requested or "dynamic"
    return model, requested


def _form_of(optimized: nn.Module) -> str:
    """``static`` when B was compiled with ``dynamic=False``, else ``dynamic`` (how dynamo
    treats shapes when it was not told: one recompile, then dynamic)."""
    dynamic = getattr(getattr(optimized, "dynamo_ctx", None), "_dynamic", None)
    return "static" if dynamic is False else "dynamic"


def localise(reference: Reference, model: nn.Module, inputs: Inputs, opts: Options,
             bar: ProgressBar) -> tuple[Propagated, int, str]:
    """Judge B compiled module by module: rows in the order A's calls finished (the deepest
    departure first), the final output and loss of B compiled whole, how many modules were
    replayed, and a note saying how B ran."""
    translate = name_translator(opts.name_map)
    b_modules = dict(model.named_modules())
    order = {call.key: call.order for call in reference.calls}
    level, seen, rows, matches, whole, replayed, levels = [""], set(), [], [], None, 0, 0
    while level:
        seen.update(level)
        judged, level_rows, compiler = _judge_level(reference, model, inputs, opts, bar,
                                                    {name: b_modules[name] for name in level},
                                                    translate)
        replayed += len(level_rows)
        whole = whole or judged
        rows += level_rows
        matches += judged.alignment.matches
        levels += 1
        departed = {match.b[0].name for row, match in zip(level_rows, judged.alignment.matches,
                                                          strict=True) if _departs(row)}
        level = [name for parent in level if parent in departed
                 for name in _parts(b_modules[parent], parent) if name not in seen]
    for row, match in zip(rows, matches, strict=True):
        row.start = match.a[0].start  # every level's run counts from 0: A's count is shared
    ranked = sorted(zip(rows, matches, strict=True), key=lambda pair: order.get(
        pair[1].a[0].key, len(order)))
    rows = [row for row, _ in ranked]
    alignment = Alignment(matches=[match for _, match in ranked])
    note = (f"B compiled ({opts.compile_b}, {compiler}): whole for the final output, then "
            f"{levels - 1} level(s) of its modules each compiled on its own (the rest eager), "
            "descending into those whose compiled local error broke its budget; local errors "
            "replay the compiled module")
    return Propagated(alignment, rows, whole.output, whole.loss, whole.changing), replayed, note


def _judge_level(reference: Reference, model: nn.Module, inputs: Inputs, opts: Options,
                 bar: ProgressBar, modules: dict[str, nn.Module],
                 translate: Callable[[str], str]) -> tuple[Propagated, list[Row], str]:
    """B with ``modules`` compiled on their own, judged and replayed compiled; and the
    compiler."""
    names = set(modules)
    view = dataclasses.replace(
        reference, calls=[c for c in reference.calls if translate(c.name) in names])
    level_opts = dataclasses.replace(opts, include=lambda name: name in names, exclude=None,
                                     local="all")
    with compiled_modules(modules, opts.compile_b) as log:
        judged = judge_propagated(view, model, inputs, level_opts, bar)
        judge_local(view, judged.alignment.matches, judged.rows, model, level_opts, bar,
                    judged.changing)
    return judged, judged.rows, log.compiler


def _departs(row: Row) -> bool:
    return any(result is not None and not result.ok for result in (row.local, row.grad_local))


def _parts(module: nn.Module, name: str) -> list[str]:
    """The modules ``module`` calls directly: its children, through containers that are never
    called themselves (``ModuleList``, ``ModuleDict``)."""
    parts = []
    for child_name, child in module.named_children():
        full = f"{name}.{child_name}" if name else child_name
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            parts += _parts(child, full)
        else:
            parts.append(full)
    return parts
