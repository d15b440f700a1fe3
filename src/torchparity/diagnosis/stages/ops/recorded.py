"""A's side of an op drill-down kept in a trace, for a diagnosis against it.

``record --ops`` keeps with each call A's and the golden's steps on A's inputs: each step's
op, kind, dataflow, stack and non-tensor arguments (``repr``), its input tensors and the
golden op's output on them exact (B's op is fed them for its local error), and its outputs
(sketched past a size). A diagnosis against the trace replays only B's module."""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from torchparity.diagnosis.core.capture import ModuleCall
from torchparity.diagnosis.core.trace import ReplayUnavailable, Store
from torchparity.diagnosis.stages.ops.capture import Frame, Step

__all__ = ["ASide", "keep_ops", "missing_ops", "put_side", "recorded_side"]


@dataclass
class ASide:
    """A's steps of one module call; ``golden``: A's step index -> the golden's partner step
    (only its outputs are read); ``notes``: why a part is missing."""

    steps: list[Step]
    golden: dict[int, Step]
    notes: list[str] = field(default_factory=list)


class Shown(str):
    """A recorded non-tensor argument: its ``repr``, which reads back as itself."""

    def __repr__(self) -> str:
        return str(self)


def keep_ops(store: Store, calls: list[ModuleCall], backward: bool,
             side_of: Callable[[ModuleCall, bool], ASide]) -> list[str]:
    """Put into ``store`` A's side of each call's forward (and with ``backward`` its
    backward) steps, made by ``side_of(call, backward)``; one line per call that has none."""
    skipped = []
    for call in calls:
        for direction in (False, True) if backward else (False,):
            try:
                put_side(store, call.key, side_of(call, direction), direction)
            except Exception as exc:  # noqa: BLE001 - the trace stands without it, said so
                skipped.append(f"no ops of {call.key}: {type(exc).__name__}: {exc}")
    return skipped


def recorded_side(store: Store, key: str, backward: bool) -> ASide | None:
    """A's side of call ``key`` as :func:`keep_ops` put it, or None when it is not there."""
    okey = _key(key, backward)
    try:
        (described,), _ = store.get_inputs(okey, placeholders=True)
    except ReplayUnavailable:
        return None
    outputs, goldens = (_by_step(store.get(okey, group)) for group in ("ops_out", "ops_golden"))
    steps, partners = [], {}
    for index, step in enumerate(described):
        kept = Step(index, step["name"], step["kind"], None, tuple(step["args"]),
                    dict(step["kwargs"]), outputs.get(index, {}), tuple(step["producers"]),
                    tuple(Frame(*frame) for frame in step["stack"]),
                    {name: Shown(text) for name, text in step["scalars"].items()},
                    step["returned"], local_golden=step["local_golden"])
        steps.append(kept)
        if index in goldens:
            partners[index] = replace(kept, outputs=goldens[index], local_golden=None)
    return ASide(steps, partners)


def put_side(store: Store, key: str, side: ASide, backward: bool = False) -> None:
    """Put A's side of call ``key`` (its backward steps with ``backward``) into ``store``."""
    okey = _key(key, backward)
    described = [{"name": s.name, "kind": s.kind, "args": s.args, "kwargs": s.kwargs,
                  "producers": list(s.producers),
                  "stack": [[f.path, f.line, f.text] for f in s.stack],
                  "scalars": {name: repr(value) for name, value in s.scalars.items()},
                  "returned": s.returned, "local_golden": s.local_golden}
                 for s in side.steps]
    store.put_inputs(okey, (described,), {})
    for group, tensors in (("ops_out", {s.index: s.outputs for s in side.steps}),
                           ("ops_golden", {i: g.outputs for i, g in side.golden.items()})):
        store.put(okey, group, {f"{index}/{path}": t for index, outs in tensors.items()
                                for path, t in outs.items()})


def _by_step(flat: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    found: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in flat.items():
        index, _, path = name.partition("/")
        found.setdefault(int(index), {})[path] = tensor
    return found


def _key(key: str, backward: bool) -> str:
    """Where a call's ops are kept: a key of their own beside the call's."""
    return f"{key}:{'grad_ops' if backward else 'ops'}"


def missing_ops(recorded_by: str | None, module: str, decode: bool = False) -> str:
    """Why a drill-down against a trace stops at ``module``, and the way on: the trace's record
    command with ``--ops``, or the Python API's argument."""
    why = f"no op drill-down: the trace does not hold A's ops of {module}"
    if recorded_by is None:
        call = "record_decode" if decode else "record"
        return f"{why}; record it again with tp.{call}(..., ops={module!r})"
    return f"{why}; `{recorded_by} --ops {shlex.quote(module)}` on A's code adds them"
