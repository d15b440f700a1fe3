"""Divergence diagnosis: which module, which step, which change makes model B differ from A.

How a diagnosis works (``diagnose`` and ``diagnose_against`` share every step after 1):

1. **Reference side.** A runs once with every selected module's inputs and outputs recorded
   (and the gradients reaching each output, with ``backward=True``); a float64 copy of A on the
   CPU (the *golden*) runs the same. Each recorded call is then replayed: the golden module fed
   A's recorded inputs gives the local golden, and with gradients A's and the golden's module
   are also replayed backward from A's recorded output gradient.
2. **Alignment** of A's and B's calls by name, ``name_map``, call order and output shapes
   (:mod:`torchparity.diagnosis.align`).
3. **Propagated errors.** B runs in full; each aligned output (and output gradient) is compared,
   as it is produced, with the golden's under the budget A's own rounding error earns
   (:func:`torchparity.compare`).
4. **Local errors.** Each of B's aligned modules is fed A's recorded inputs (and output
   gradient) and compared with the local golden, again with A's replay as the baseline. By
   default only modules whose propagated error diverged are replayed (on both sides): a module
   that agrees in the full run has nothing to localise, and replaying every module of a deep
   model costs many times the runs themselves. ``local="all"`` replays every one.

The first module whose local error breaks its budget is where B starts to compute something
else; everything after it inherits the error. ``record`` runs step 1 on one revision and writes
it to disk; ``diagnose_against`` runs steps 2-4 on another.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchparity.diagnosis.align import Alignment, Match, NameMap, align
from torchparity.diagnosis.attribution import attribute
from torchparity.diagnosis.capture import (
    ModuleCall,
    PatternSpec,
    call_key,
    flatten_tensors,
    map_tensors_with_paths,
)
from torchparity.diagnosis.decode import diagnose_decode
from torchparity.diagnosis.report import DiagnosisReport, Result, Row
from torchparity.diagnosis.run import (
    GOLDEN_DTYPE,
    BackendSpec,
    Inputs,
    Local,
    LossFn,
    Options,
    ProgressBar,
    Run,
    backend_name,
    check_models,
    golden_copy,
    joined,
    judge,
    make_options,
    merged,
    progress_bar,
    replay,
    run_model,
)
from torchparity.diagnosis.trace import (
    FINAL,
    SCHEMA,
    MemoryStore,
    ReplayUnavailable,
    TraceWriter,
    call_from_json,
    call_to_json,
    changed_weights,
    inputs_digest,
    module_tree,
    open_trace,
    upcast,
    weight_digests,
)
from torchparity.errors import UsageError

__all__ = ["DiagnosisReport", "Row", "attribute", "diagnose", "diagnose_against",
           "diagnose_decode", "record"]

# --------------------------------------------------------------------------------------------
# Public API


def diagnose(
    model_a: nn.Module,
    model_b: nn.Module,
    inputs: Inputs,
    loss_fn: LossFn | None = None,
    name_map: NameMap | None = None,
    backward: bool = True,
    *,
    include: PatternSpec = None,
    exclude: PatternSpec = None,
    backends: tuple[BackendSpec, BackendSpec] | None = None,
    stream: bool = False,
    local: Local = "diverged",
    progress: bool | None = None,
) -> DiagnosisReport:
    """Localise where ``model_b`` starts to compute something other than ``model_a``.

    ``inputs`` is a tuple of positional arguments or a dict of keyword arguments (a single
    tensor is taken as one positional argument); both models get the same. ``loss_fn(output,
    inputs)`` gives the scalar that gradients are taken of; by default a fixed random projection
    of the first floating output (so every output element gets a distinct gradient).
    ``name_map`` maps A's module names to B's (dict, or ``(regex, replacement)`` pairs);
    unmapped renamed or fused modules are aligned by call order and output shapes.
    ``include``/``exclude`` select modules by glob or ``re:`` regex; ``backends=(a, b)`` runs A
    and B under those attention backends. ``stream=True`` keeps the reference side on disk
    (a temporary trace) so memory stays bounded on big models. ``local`` says which modules get
    a local error: ``"diverged"`` (those whose propagated output or gradient diverged, or could
    not be judged) or ``"all"``. ``progress`` shows a progress bar on stderr (default: when
    stderr is a terminal).

    Guarantees: both models, their gradients and the global RNG state are left as they were;
    every run is seeded identically; each row's verdicts come from
    :func:`torchparity.compare` with a float64 golden when A can run in float64 (see
    ``report.meta["golden"]``); unmatched modules are listed, never dropped.
    """
    opts = make_options(backward, loss_fn, include, exclude, backends, progress, local)
    check_models(model_a=model_a, model_b=model_b)
    with progress_bar(opts.progress) as bar:
        if stream:
            with tempfile.TemporaryDirectory(prefix="torchparity-") as tmp:
                writer = TraceWriter(Path(tmp) / "reference.tptrace")
                reference = _build_reference(model_a, inputs, writer.store, opts, bar)
                return _diagnose_candidate(reference, model_b, inputs, opts, name_map, bar)
        reference = _build_reference(model_a, inputs, MemoryStore(), opts, bar)
        return _diagnose_candidate(reference, model_b, inputs, opts, name_map, bar)


def record(
    model: nn.Module,
    inputs: Inputs,
    path: str | Path,
    *,
    loss_fn: LossFn | None = None,
    backward: bool = True,
    include: PatternSpec = None,
    exclude: PatternSpec = None,
    backend: BackendSpec = None,
    progress: bool | None = None,
) -> Path:
    """Write the reference side of a diagnosis of ``model`` on ``inputs`` to the trace ``path``.

    Run it on the base revision; on the changed revision :func:`diagnose_against` compares a
    model with it. The trace is a directory of safetensors files plus ``trace.json`` (module
    tree, parameter and input checksums, settings, each call's input structure). It is written
    call by call (bounded memory) into a temporary directory that replaces ``path`` only when
    complete. ``backend`` must be a name here (it is stored in the trace). Returns the path.
    """
    if backend is not None and not isinstance(backend, str):
        raise UsageError("record(backend=...) takes a backend name, which the trace stores")
    opts = make_options(backward, loss_fn, include, exclude, (backend, None), progress)
    check_models(model=model)
    writer = TraceWriter(path)
    try:
        with progress_bar(opts.progress) as bar:
            reference = _build_reference(model, inputs, writer.store, opts, bar)
            # The trace must serve any later candidate: every call is replayed now.
            reference.replay_all(bar)
        return writer.commit(_trace_meta(reference, model, inputs, opts))
    except BaseException:
        writer.abort()
        raise


def diagnose_against(
    path: str | Path,
    model: nn.Module,
    inputs: Inputs,
    *,
    loss_fn: LossFn | None = None,
    name_map: NameMap | None = None,
    backward: bool | None = None,
    backend: BackendSpec = None,
    local: Local = "diverged",
    progress: bool | None = None,
) -> DiagnosisReport:
    """Diagnose ``model`` (the changed revision) against the trace :func:`record` wrote.

    ``inputs`` must be the recorded ones (checked by checksum). Propagated errors compare the
    live run with the recorded golden; local errors replay the recorded module inputs into this
    model's modules. ``backward`` defaults to whether the trace has gradients; module selection
    is the recorded one; ``local`` is as in :func:`diagnose`. Weights that differ from the
    recorded ones are listed in ``report.meta["weights"]`` (a changed initialisation is not a
    changed computation).
    """
    meta, store = open_trace(path)
    if backward and not meta["backward"]:
        raise UsageError(f"trace {path} has no gradients; record it with backward=True or pass "
                         "backward=False")
    digest = inputs_digest(inputs)
    if digest != meta["inputs_digest"]:
        raise UsageError(f"inputs differ from the ones recorded in {path} (checksum {digest} vs "
                         f"{meta['inputs_digest']}); pass the same inputs to both revisions")
    opts = make_options(meta["backward"] if backward is None else backward, loss_fn,
                        meta["include"], meta["exclude"], (meta["backend"], backend), progress,
                        local)
    check_models(model=model)
    reference = _Reference(
        calls=[call_from_json(c) for c in meta["calls"]], store=store,
        golden=meta["golden"], notes=meta["notes"], source=str(path))
    weights = changed_weights(meta["weights"], model)
    with progress_bar(opts.progress) as bar:
        report = _diagnose_candidate(reference, model, inputs, opts, name_map, bar)
    report.meta["weights"] = weights
    if weights["changed"]:
        report.meta["notes"].append(
            f"{len(weights['changed'])} parameter(s)/buffer(s) differ from the recorded ones, "
            f"e.g. {weights['changed'][0]}")
    return report


# --------------------------------------------------------------------------------------------
# Reference side


@dataclass
class _Reference:
    """A's recorded calls and where their tensors are; ``golden`` says which golden was used
    (it starts with "none" when there is none); ``notes`` why some calls cannot be replayed.
    ``replayer`` replays a call of A and the golden on demand (None when every call was
    replayed already, as in a trace)."""

    calls: list[ModuleCall]
    store: Any
    golden: str
    notes: dict[str, str] = field(default_factory=dict)
    source: str = "in-process"
    replayer: Callable[[ModuleCall], None] | None = None
    replayed: set[str] = field(default_factory=set)

    def ensure_replayed(self, call: ModuleCall) -> None:
        """The local golden (and local gradients) of ``call`` are in the store after this."""
        if self.replayer is not None and call.key not in self.replayed:
            self.replayer(call)
            self.replayed.add(call.key)

    def replay_all(self, bar: ProgressBar) -> None:
        advance = bar.phase("A and golden: module replays", total=len(self.calls))
        for call in self.calls:
            self.ensure_replayed(call)
            advance()

    @property
    def has_golden(self) -> bool:
        return not self.golden.startswith("none")

    def tensors(self, calls: tuple[ModuleCall, ...], group: str) -> dict[str, torch.Tensor]:
        return joined([self.store.get(c.key, group) for c in calls])

    def judge(self, calls: tuple[ModuleCall, ...], candidate: dict[str, torch.Tensor],
              baseline_group: str, golden_group: str, kind: str) -> Result:
        golden = self.tensors(calls, golden_group) if self.has_golden else {}
        return judge(candidate, golden, self.tensors(calls, baseline_group), kind)


def _build_reference(model: nn.Module, inputs: Inputs, store: Any, opts: Options,
                     bar: ProgressBar) -> _Reference:
    def keep_call(call: ModuleCall) -> None:
        store.put_inputs(call.key, call.args, call.kwargs)
        store.put(call.key, "out", call.outputs)

    done = bar.phase("A: forward" + (" and backward" if opts.backward else ""))
    run = run_model(model, inputs, opts, opts.backend_a, backward=opts.backward, what="tensors",
                    keep=False, on_call=keep_call, on_grad=_grad_keeper(store, "grad_out"))
    _keep_run_results(store, run, "out", "param_grad")
    done()
    golden, description = golden_copy(model)
    if golden is not None:
        done = bar.phase("golden (float64): forward" + (" and backward" if opts.backward else ""))
        try:
            golden_run = run_model(
                golden, upcast(inputs, GOLDEN_DTYPE, "cpu"), opts, opts.backend_a,
                backward=opts.backward, what="outputs", keep=False,
                on_call=lambda c: store.put(c.key, "golden_out", c.outputs),
                on_grad=_grad_keeper(store, "golden_grad_out"))
            _keep_run_results(store, golden_run, "golden_out", "golden_param_grad")
        except Exception as exc:  # noqa: BLE001 - e.g. an op without a float64 kernel
            reason = f"{type(exc).__name__}: {exc}"
            golden, description = None, f"none: the float64 run failed ({reason})"
        done()
    reference = _Reference(calls=run.calls, store=store, golden=description)
    reference.replayer = _Replayer(store, reference.notes, model, golden, opts)
    return reference


def _grad_keeper(store: Any, group: str) -> Callable[[ModuleCall, str, torch.Tensor], None]:
    return lambda call, path, grad: store.put(call.key, group, {path: grad})


def _keep_run_results(store: Any, run: Run, out_group: str, param_group: str) -> None:
    final = flatten_tensors(run.output)
    if run.loss is not None:
        final["loss"] = run.loss
    store.put(FINAL, out_group, final)
    for name, grads in run.param_grads.items():
        if grads:
            store.put(call_key(name, 0), param_group, grads)


class _Replayer:
    """Local goldens (and local gradients of A and the golden) of A's recorded calls."""

    def __init__(self, store: Any, notes: dict[str, str], model: nn.Module,
                 golden: nn.Module | None, opts: Options) -> None:
        self.store, self.notes, self.opts = store, notes, opts
        self.modules = dict(model.named_modules())
        self.golden_modules = dict(golden.named_modules()) if golden is not None else None

    def __call__(self, call: ModuleCall) -> None:
        store, opts = self.store, self.opts
        grad_out = store.get(call.key, "grad_out") if opts.backward else {}
        try:
            if grad_out:
                _, grads = replay(self.modules[call.name],
                                  _placed(store.get_inputs(call.key), call), opts.backend_a,
                                  grad_out=grad_out, requires_grad=call.inputs_requiring_grad)
                store.put(call.key, "local_grad", grads)
            if self.golden_modules is not None:
                outputs, grads = replay(
                    self.golden_modules[call.name],
                    upcast(store.get_inputs(call.key), GOLDEN_DTYPE, "cpu"), opts.backend_a,
                    grad_out=upcast(grad_out, GOLDEN_DTYPE, "cpu"),
                    requires_grad=call.inputs_requiring_grad)
                store.put(call.key, "local_golden", outputs)
                store.put(call.key, "local_golden_grad", grads)
        except ReplayUnavailable as exc:
            self.notes[call.key] = f"not replayed: {exc}"
        except Exception as exc:  # noqa: BLE001 - report it on the row, keep diagnosing
            self.notes[call.key] = f"replay failed: {type(exc).__name__}: {exc}"


def _trace_meta(reference: _Reference, model: nn.Module, inputs: Inputs,
                opts: Options) -> dict[str, Any]:
    import torchparity

    return {
        "schema": SCHEMA,
        "torchparity": torchparity.__version__,
        "torch": torch.__version__,
        "model": type(model).__name__,
        "golden": reference.golden,
        "backward": opts.backward,
        "backend": opts.backend_a,
        "include": _pattern_json(opts.include),
        "exclude": _pattern_json(opts.exclude),
        "inputs_digest": inputs_digest(inputs),
        "weights": weight_digests(model),
        "modules": module_tree(model),
        "calls": [call_to_json(c) for c in reference.calls],
        "notes": reference.notes,
    }


def _pattern_json(spec: PatternSpec) -> Any:
    if spec is None or isinstance(spec, str):
        return spec
    if isinstance(spec, (list, tuple)) and all(isinstance(p, str) for p in spec):
        return list(spec)
    raise UsageError("record() stores the module selection in the trace: pass include/exclude "
                     "as glob or 're:' strings, not compiled patterns or callables")


# --------------------------------------------------------------------------------------------
# Candidate side


def _diagnose_candidate(reference: _Reference, model: nn.Module, inputs: Inputs, opts: Options,
                        name_map: NameMap | None, bar: ProgressBar) -> DiagnosisReport:
    done = bar.phase("B: call structure")
    structure = run_model(model, inputs, opts, opts.backend_b, backward=False, what="shapes")
    alignment = align(reference.calls, structure.calls, name_map)
    done()
    done = bar.phase("B: forward" + (" and backward" if opts.backward else ""))
    tracker = _PropagatedTracker(reference, alignment)
    run = run_model(model, inputs, opts, opts.backend_b, backward=opts.backward, what="outputs",
                    keep=False, on_call=tracker.on_call, on_grad=tracker.on_grad)
    tracker.finish(run.param_grads)
    done()
    rows = []
    for match in alignment.matches:
        row = _new_row(match)
        row.propagated = tracker.forward.get(id(match))
        row.grad_propagated = tracker.grads.get(id(match))
        rows.append(row)
    to_replay = [(match, row) for match, row in zip(alignment.matches, rows, strict=True)
                 if opts.local == "all" or _needs_local(row)]
    modules = dict(model.named_modules())
    advance = bar.phase("A, golden and B: module replays", total=len(to_replay))
    for match, row in to_replay:
        for call in match.a:
            reference.ensure_replayed(call)
        row.notes += [reference.notes[c.key] for c in match.a if c.key in reference.notes]
        row.local, row.grad_local, note = _local(reference, match, modules, opts)
        if note:
            row.notes.append(note)
        advance()
    meta = _report_meta(reference, model, opts, alignment)
    if opts.local != "all":
        meta["notes"].append(
            f"local errors of {len(to_replay)} of {len(rows)} module(s): those whose propagated "
            "error diverged or could not be judged (local='all' computes every one)")
    return DiagnosisReport(
        rows=rows,
        output=_final(reference, run, "output"),
        loss=_final(reference, run, "loss") if run.loss is not None else None,
        unmatched_a=[c.key for c in alignment.unmatched_a],
        unmatched_b=[c.key for c in alignment.unmatched_b],
        meta=meta,
    )


def _needs_local(row: Row) -> bool:
    """Whether a row's propagated results leave something to localise: one diverged, or the
    forward one is missing."""
    return row.propagated is None or any(
        result is not None and not result.ok for result in (row.propagated, row.grad_propagated))


def _new_row(match: Match) -> Row:
    first_b = min(match.b, key=lambda c: c.start)
    return Row(module=match.b_name, a_module=match.a_name, how=match.how,
               module_type="+".join(c.module_type for c in match.b), depth=first_b.depth,
               start=first_b.start)


class _PropagatedTracker:
    """Compares B's outputs and output gradients with the reference while B runs, so only the
    tensors of calls still in flight are held."""

    def __init__(self, reference: _Reference, alignment: Alignment) -> None:
        self.reference = reference
        self.by_b_key = {c.key: m for m in alignment.matches for c in m.b}
        self.forward: dict[int, Result] = {}
        self.grads: dict[int, Result] = {}
        self._parts: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
        self._pending_grads: dict[int, dict[str, torch.Tensor]] = {}
        self._expected_grads = {
            id(m): set(reference.store.get(m.a[0].key, "grad_out"))
            for m in alignment.matches if _one_to_one(m)
        }

    def on_call(self, call: ModuleCall) -> None:
        match = self.by_b_key.get(call.key)
        if match is None:
            return
        parts = self._parts.setdefault(id(match), {})
        parts[call.key] = {p: t.cpu() for p, t in call.outputs.items()}
        if len(parts) == len(match.b):  # a fused group is complete with its last member
            candidate = joined([parts[c.key] for c in match.b])
            self.forward[id(match)] = self.reference.judge(match.a, candidate, "out",
                                                           "golden_out", "forward")
            del self._parts[id(match)]

    def on_grad(self, call: ModuleCall, path: str, grad: torch.Tensor) -> None:
        match = self.by_b_key.get(call.key)
        if match is None or not _one_to_one(match):
            return
        pending = self._pending_grads.setdefault(id(match), {})
        pending[path] = grad.cpu()
        if set(pending) >= self._expected_grads[id(match)]:
            self._judge_output_grads(match)

    def _judge_output_grads(self, match: Match) -> None:
        candidate = self._pending_grads.pop(id(match))
        self.grads[id(match)] = self.reference.judge(match.a, candidate, "grad_out",
                                                     "golden_grad_out", "grad")

    def finish(self, param_grads: dict[str, dict[str, torch.Tensor]]) -> None:
        """Judge gradients still pending (outputs some of whose parts got none) and add the
        parameter gradients of each one-to-one match."""
        for match in self.by_b_key.values():
            if id(match) in self._pending_grads:
                self._judge_output_grads(match)
        for match in {id(m): m for m in self.by_b_key.values()}.values():
            b = match.b[0]
            if not _one_to_one(match) or b.call != 0 or not param_grads.get(b.name):
                continue
            candidate = {p: g.cpu() for p, g in param_grads[b.name].items()}
            params = self.reference.judge(match.a, candidate, "param_grad", "golden_param_grad",
                                          "grad")
            self.grads[id(match)] = merged(self.grads.get(id(match)), params)


def _one_to_one(match: Match) -> bool:
    return len(match.a) == 1 and len(match.b) == 1


def _local(reference: _Reference, match: Match, modules: dict[str, nn.Module], opts: Options
           ) -> tuple[Result | None, Result | None, str | None]:
    """B's module(s) fed A's recorded inputs (and output gradient), judged against the local
    golden with A's replay as the baseline."""
    a = match.a[0]
    if a.key in reference.notes:
        return None, None, None
    store = reference.store
    try:
        outputs = [replay(modules[b.name], _placed(store.get_inputs(a.key), b),
                          opts.backend_b)[0] for b in match.b]
        local = reference.judge(match.a, joined(outputs), "out", "local_golden", "forward")
        grad_out = store.get(a.key, "grad_out") if opts.backward and _one_to_one(match) else {}
        if not grad_out:
            return local, None, None
        b = match.b[0]
        _, grads = replay(modules[b.name], _placed(store.get_inputs(a.key), b), opts.backend_b,
                          grad_out=grad_out, requires_grad=a.inputs_requiring_grad)
        grad_local = reference.judge(match.a, grads, "local_grad", "local_golden_grad", "grad")
        return local, grad_local, None
    except ReplayUnavailable as exc:
        return None, None, f"not replayed: {exc}"
    except Exception as exc:  # noqa: BLE001 - report it on the row, keep diagnosing
        return None, None, f"replay of B's module failed: {type(exc).__name__}: {exc}"


def _placed(inputs: tuple[tuple, dict], call: ModuleCall) -> tuple[tuple, dict]:
    """A's recorded inputs with each tensor moved to the device, and floating ones cast to the
    dtype, that B's module saw at the same input in its own run."""
    def place(path: str, tensor: torch.Tensor) -> torch.Tensor:
        dtype, device = call.input_placement.get(path, (tensor.dtype, tensor.device))
        if not (tensor.is_floating_point() and dtype.is_floating_point):
            dtype = tensor.dtype
        return tensor.to(device=device, dtype=dtype)

    args, kwargs = inputs
    return (map_tensors_with_paths(args, place, "args"),
            map_tensors_with_paths(kwargs, place, "kwargs"))


def _final(reference: _Reference, run: Run, which: str) -> Result:
    final = flatten_tensors(run.output)
    if which == "loss":
        final = {"loss": run.loss}
    final = {p: t.cpu() for p, t in final.items()}
    golden = reference.store.get(FINAL, "golden_out") if reference.has_golden else {}
    baseline = reference.store.get(FINAL, "out")
    def pick(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {p: t for p, t in tensors.items() if (p == "loss") == (which == "loss")}

    return judge(final, pick(golden), pick(baseline), "loss" if which == "loss" else "forward")


def _report_meta(reference: _Reference, model: nn.Module, opts: Options,
                 alignment: Alignment) -> dict[str, Any]:
    return {
        "reference": reference.source,
        "model_b": type(model).__name__,
        "golden": reference.golden,
        "backward": opts.backward,
        "backends": [backend_name(opts.backend_a), backend_name(opts.backend_b)],
        "alignment": alignment.counts(),
        "notes": [] if reference.has_golden else [f"golden: {reference.golden}"],
    }
