"""Which module departs under ``torch.compile``: B compiled, localised module by module.

Compiling B whole and hooking its modules would trace the hooks into the graph, and replaying
one module would run it eagerly, where a branch taken only while compiling (a fused kernel, a
decomposition, ``torch.compiler.is_compiling()``) is not taken: its local error would read 0.
So B is compiled one level of its module tree at a time, each module of the level on its own
(:func:`~torchparity.subject.compiling.compiled_modules`: everything the module calls is inside
its graph, its hooks outside), and judged as in any diagnosis: its output in B's run against
A's float64 golden (propagated) and the compiled module replayed on A's recorded inputs (local;
the replay runs the compiled module, never an eager copy).

The search starts with the whole model compiled (the root, as users run it) and descends into
every module whose compiled local error (or local gradient error) breaks its budget, level by
level, until a level where none does: the deepest module that departs with none of its parts
departing on its own is where compiling changes the math (its own code, or the fusion of its
parts). Modules that stay within their budget are not opened, so the cost is the compiles of
the modules along the way, not of every module.

A B built compiled (``torch.compile(model)`` or ``model.compile()``) is diagnosed the same way,
from its eager module and the form it was compiled in.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from torch import nn

from torchparity.diagnosis.core.align import Alignment, NameMap, name_translator
from torchparity.diagnosis.stages.local import judge_local
from torchparity.diagnosis.core.progress import ProgressBar
from torchparity.diagnosis.stages.propagated import Propagated, judge_propagated
from torchparity.diagnosis.core.reference import Reference
from torchparity.diagnosis.core.results import Row
from torchparity.diagnosis.core.run import Options
from torchparity.errors import UsageError
from torchparity.subject.compiling import MODES, compiled_modules
from torchparity.subject.running import Inputs


def compile_form(model: nn.Module, requested: str | None) -> tuple[nn.Module, str | None]:
    """B's eager module and the compile form to diagnose it in: ``requested`` (``dynamic`` or
    ``static``), else the form B was compiled in when it was (``torch.compile(model)``: its
    original module; ``model.compile()``: an eager copy), else None (B is eager)."""
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
             name_map: NameMap | None, bar: ProgressBar) -> tuple[Propagated, int, str]:
    """Judge B compiled module by module (see the module docstring): one row per module
    judged, in the order A's calls finished (children before parents, so the deepest module
    that departs comes first), with the final output and loss of B compiled whole.

    Returns what :func:`~torchparity.diagnosis.stages.propagated.judge_propagated` returns for the
    rows of every level, how many modules were replayed, and a note saying how B ran."""
    translate = name_translator(name_map)
    b_modules = dict(model.named_modules())
    order = {call.key: call.order for call in reference.calls}
    level, seen, rows, matches, whole, replayed, levels = [""], set(), [], [], None, 0, 0
    while level:
        seen.update(level)
        judged, level_rows, compiler = _judge_level(reference, model, inputs, opts, name_map, bar,
                                          {name: b_modules[name] for name in level}, translate)
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
                 name_map: NameMap | None, bar: ProgressBar, modules: dict[str, nn.Module],
                 translate: Any) -> tuple[Propagated, list[Row], str]:
    """B run with ``modules`` compiled on their own and the rest eager, their outputs and
    gradients judged, and every one of them replayed compiled on A's inputs; and the compiler
    that compiled them."""
    names = set(modules)
    view = dataclasses.replace(
        reference, calls=[c for c in reference.calls if translate(c.name) in names])
    level_opts = dataclasses.replace(opts, include=lambda name: name in names, exclude=None,
                                     local="all")
    with compiled_modules(modules, opts.compile_b) as log:
        judged = judge_propagated(view, model, inputs, name_map, level_opts, bar)
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
