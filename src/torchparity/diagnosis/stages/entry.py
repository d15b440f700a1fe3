"""Stage 5b of a diagnosis: where a divergence enters the container it was found in.

Masks, positions and cache offsets built once by a parent make the *parent* the first
divergence while each layer computes right on what it is given. So B's parent is replayed on
A's inputs with every module inside captured, and the first (in start order) whose inputs
differ while every earlier output matched takes the change in, followed down to the deepest
module handed the same value. At a decoding step, the module's arguments and state are
compared with A's (:func:`argument_entry`)."""

from __future__ import annotations

import torch
from torch import nn

from torchparity.diagnosis.core.align import Match
from torchparity.diagnosis.core.arguments import (
    Difference,
    argument_difference,
    argument_path,
    convention_change,
    same_value,
)
from torchparity.diagnosis.core.capture import CallArgs, Capture, ModuleCall, signature
from torchparity.diagnosis.core.decode_reference import StepReference
from torchparity.diagnosis.core.judging import module_padding
from torchparity.diagnosis.core.reference import Reference
from torchparity.diagnosis.core.results import Entry, Row
from torchparity.diagnosis.core.run import Options, backend_context, fitting_masks, for_b
from torchparity.diagnosis.core.state import state_difference
from torchparity.diagnosis.core.trace import ReplayUnavailable
from torchparity.subject.running import seeded


def find_entry(reference: Reference, matches: list[Match], rows: list[Row], model: nn.Module,
               opts: Options, changing: set[str] = frozenset()) -> None:
    """Set ``entry`` on the first divergence when it contains modules and a differing input of
    one of them explains it (``changing``: B's modules that keep state across calls)."""
    first = next((r for r in rows if r.local is not None and not r.local.ok), None)
    if first is None:
        return
    match = matches[rows.index(first)]
    if not match.one_to_one:
        return
    inside = _calls_inside(match.b[0], matches)
    if not inside:
        return
    container = model.get_submodule(match.b[0].name)
    try:
        a_inputs = reference.store.get_inputs(match.a[0].key, placeholders=True)
        changed = convention_change(reference.signatures.get(match.a[0].name), a_inputs,
                                    signature(container), match.b[0])
        as_none = changed.argument if changed is not None and changed.b_none else None
        replayed = _replay_capturing(reference, match, container, opts, changing, as_none)
        first.entry = _first_differing_input(reference, replayed, inside, container)
    except ReplayUnavailable as exc:
        first.notes.append(f"where the divergence enters is unknown: {exc}")
    except Exception as exc:  # noqa: BLE001 - the search must not end the diagnosis
        first.notes.append("where the divergence enters is unknown: the replay failed "
                           f"({type(exc).__name__}: {exc})")


def argument_entry(reference: StepReference, row: Row, calls_b: list[ModuleCall],
                   model: nn.Module, label: str) -> Entry | None:
    """How the change gets into ``row``'s module at a decoding step: an argument that differs by
    meaning, else the first state read that holds other positions, else an argument one side
    alone passes; else the module's own code."""
    a = next((c for c in reference.calls if c.key == row.a_module), None)
    b = next((c for c in calls_b if c.key == row.module), None)
    if a is None or b is None:
        return None
    module_b = model.get_submodule(b.name)
    b_signature = signature(module_b)
    a_inputs = reference.store.get_inputs(a.key, placeholders=True)
    found = argument_difference(reference.signatures.get(a.name), a_inputs, b_signature,
                                (b.args, b.kwargs), b_module=module_b)
    held = state_difference(a.state, b.state)
    if found is not None and (held is None or not found.one_sided):
        return Entry(label, found.argument, found.detail)
    if held is None:
        return Entry(label, "", "its arguments and the state it reads are A's", via="code")
    path, detail = held
    if path.startswith("state."):
        return Entry(label, path.removeprefix("state."), detail, via="state")
    return Entry(label, argument_path(path, b_signature), detail)


def _calls_inside(container: ModuleCall, matches: list[Match]
                  ) -> dict[tuple[str, int], tuple[ModuleCall, Match]]:
    """B's calls made during ``container``'s call, keyed by (name relative to the container,
    occurrence among them), with their one-to-one match."""
    prefix = f"{container.name}." if container.name else ""
    inside = sorted(
        ((m.b[0], m) for m in matches if m.one_to_one
         and m.b[0].name.startswith(prefix) and m.b[0].name != container.name
         and container.start < m.b[0].start and m.b[0].order < container.order),
        key=lambda pair: pair[0].start)
    keyed, seen = {}, {}
    for call, match in inside:
        name = call.name[len(prefix):]
        seen[name] = seen.get(name, -1) + 1
        keyed[(name, seen[name])] = (call, match)
    return keyed


def _replay_capturing(reference: Reference, match: Match, container: nn.Module,
                      opts: Options, changing: set[str], as_none: str | None
                      ) -> list[ModuleCall]:
    """B's container run on A's recorded inputs (and state), every module inside it
    captured; the argument of its parameter ``as_none`` handed as None, as B hands it."""
    a, b = match.a[0], match.b[0]

    def handed(fit: bool) -> tuple[CallArgs, list[str]]:
        return for_b(reference.signatures.get(a.name), reference.store.get_inputs(a.key), b,
                     container, fit, as_none)

    def attempt(fit: bool) -> list[ModuleCall]:
        args, kwargs = handed(fit)[0]
        with reference.on_recorded_state(a, container, b.name, changing), \
                backend_context(opts.backend_b), seeded(), torch.no_grad(), \
                Capture(container, exclude="", what="tensors") as capture:
            container(*args, **kwargs)
        return capture.records

    return fitting_masks(attempt, lambda fit: handed(fit)[1])[0]


def _first_differing_input(reference: Reference, replayed: list[ModuleCall],
                           inside: dict[tuple[str, int], tuple[ModuleCall, Match]],
                           container: nn.Module) -> Entry | None:
    """In start order, the first call whose inputs differ while every earlier output matched;
    then the deepest call inside it handed the same value."""
    calls = sorted(replayed, key=lambda c: c.start)
    paired, seen = [], {}
    for call in calls:
        seen[call.name] = seen.get(call.name, -1) + 1
        found = inside.get((call.name, seen[call.name]))
        if found is not None:
            paired.append((call, found[0], found[1]))

    def difference(call: ModuleCall, match: Match) -> Difference | None:
        a = match.a[0]
        return argument_difference(reference.signatures.get(a.name),
                                   reference.store.get_inputs(a.key),
                                   signature(container.get_submodule(call.name)),
                                   (call.args, call.kwargs),
                                   module_padding(reference.padding, a.name),
                                   container.get_submodule(call.name))

    for index, (call, b_call, match) in enumerate(paired):
        found = difference(call, match)
        if found is None:
            continue
        earlier = [(c, m) for c, _, m in paired[:index] if not _contains(c, call)]
        if any(not reference.judge(m.a, c.outputs, "out", "golden_out", "forward").ok
               for c, m in earlier):
            return None  # an output differed first: the change is not handed down
        entry = (b_call, found)
        for inner, inner_b, inner_match in paired[index + 1:]:
            if not _contains(call, inner):
                break
            handed = difference(inner, inner_match)
            if handed is not None and same_value(handed.b_value, found.b_value) and \
                    inner_b.depth > entry[0].depth:
                entry = (inner_b, handed)
        return Entry(entry[0].name, entry[1].argument, entry[1].detail)
    return None


def _contains(outer: ModuleCall, inner: ModuleCall) -> bool:
    return outer.start < inner.start and inner.order < outer.order
