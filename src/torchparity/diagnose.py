"""Divergence diagnosis: which module, which step, which change makes model B differ from A.

How a diagnosis works (``diagnose`` and ``diagnose_against`` share every step after 1):

1. **Reference side.** A runs once with every selected module's inputs and outputs recorded
   (and the gradients reaching each output, with ``backward=True``); a float64 copy of A on the
   CPU (the *golden*) runs the same. Each recorded call is then replayed: the golden module fed
   A's recorded inputs gives the local golden, and with gradients A's and the golden's module
   are also replayed backward from A's recorded output gradient.
2. **Alignment** of A's and B's calls by name, ``name_map``, call order and output shapes
   (:mod:`torchparity.align`).
3. **Propagated errors.** B runs in full; each aligned output (and output gradient) is compared,
   as it is produced, with the golden's under the budget A's own rounding error earns
   (:func:`torchparity.compare.compare`).
4. **Local errors.** Each of B's aligned modules is fed A's recorded inputs (and output
   gradient) and compared with the local golden, again with A's replay as the baseline.

The first module whose local error breaks its budget is where B starts to compute something
else; everything after it inherits the error. ``record`` runs step 1 on one revision and writes
it to disk; ``diagnose_against`` runs steps 2-4 on another.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchparity.align import Alignment, Match, NameMap, align
from torchparity.capture import (
    Capture,
    ModuleCall,
    PatternSpec,
    call_key,
    flatten_tensors,
    map_tensors,
    module_filter,
)
from torchparity.diagnose_report import DiagnosisReport, Mismatch, Result, Row
from torchparity.diagnose_trace import (
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

__all__ = ["DiagnosisReport", "Row", "diagnose", "diagnose_against", "record"]

Inputs = tuple[Any, ...] | dict[str, Any] | torch.Tensor
#: ``loss_fn(output, inputs) -> scalar tensor``; ``inputs`` are the model inputs as given
#: (upcast to float64 for the golden run), so ``torchparity.reference.sequence_loss`` fits.
LossFn = Callable[[Any, Any], torch.Tensor]
#: An attention backend name for :func:`torchparity.backends.use`, or a function returning a
#: context manager that selects it (for models the registry does not drive), or None.
BackendSpec = str | Callable[[], contextlib.AbstractContextManager] | None

GOLDEN_DTYPE = torch.float64
_SEED = 0


@dataclass(frozen=True)
class Options:
    """Settings shared by the reference and the candidate side of one diagnosis."""

    include: PatternSpec = None
    exclude: PatternSpec = None
    backward: bool = True
    loss_fn: LossFn | None = None
    backend_a: BackendSpec = None
    backend_b: BackendSpec = None
    progress: bool | None = None

    def selects(self) -> Callable[[str], bool]:
        return module_filter(self.include, self.exclude)


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
    (a temporary trace) so memory stays bounded on big models. ``progress`` shows a progress bar
    on stderr (default: when stderr is a terminal).

    Guarantees: both models, their gradients and the global RNG state are left as they were;
    every run is seeded identically; each row's verdicts come from
    :func:`torchparity.compare.compare` with a float64 golden when A can run in float64 (see
    ``report.meta["golden"]``); unmatched modules are listed, never dropped.
    """
    opts = _options(backward, loss_fn, include, exclude, backends, progress)
    _check_models(model_a=model_a, model_b=model_b)
    with _progress(opts.progress) as bar:
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
    opts = _options(backward, loss_fn, include, exclude, (backend, None), progress)
    _check_models(model=model)
    writer = TraceWriter(path)
    try:
        with _progress(opts.progress) as bar:
            reference = _build_reference(model, inputs, writer.store, opts, bar)
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
    progress: bool | None = None,
) -> DiagnosisReport:
    """Diagnose ``model`` (the changed revision) against the trace :func:`record` wrote.

    ``inputs`` must be the recorded ones (checked by checksum). Propagated errors compare the
    live run with the recorded golden; local errors replay the recorded module inputs into this
    model's modules. ``backward`` defaults to whether the trace has gradients; module selection
    is the recorded one. Weights that differ from the recorded ones are listed in
    ``report.meta["weights"]`` (a changed initialisation is not a changed computation).
    """
    meta, store = open_trace(path)
    if backward and not meta["backward"]:
        raise UsageError(f"trace {path} has no gradients; record it with backward=True or pass "
                         "backward=False")
    digest = inputs_digest(inputs)
    if digest != meta["inputs_digest"]:
        raise UsageError(f"inputs differ from the ones recorded in {path} (checksum {digest} vs "
                         f"{meta['inputs_digest']}); pass the same inputs to both revisions")
    opts = _options(meta["backward"] if backward is None else backward, loss_fn,
                    meta["include"], meta["exclude"], (meta["backend"], backend), progress)
    _check_models(model=model)
    reference = _Reference(
        calls=[call_from_json(c) for c in meta["calls"]], store=store,
        golden=meta["golden"], notes=meta["notes"], source=str(path))
    weights = changed_weights(meta["weights"], model)
    with _progress(opts.progress) as bar:
        report = _diagnose_candidate(reference, model, inputs, opts, name_map, bar)
    report.meta["weights"] = weights
    if weights["changed"]:
        report.meta["notes"].append(
            f"{len(weights['changed'])} parameter(s)/buffer(s) differ from the recorded ones, "
            f"e.g. {weights['changed'][0]}")
    return report


# --------------------------------------------------------------------------------------------
# Checking arguments


def _options(backward: bool, loss_fn: LossFn | None, include: PatternSpec, exclude: PatternSpec,
             backends: tuple[BackendSpec, BackendSpec] | None, progress: bool | None) -> Options:
    if loss_fn is not None and not callable(loss_fn):
        raise UsageError(f"loss_fn must be callable(output, inputs); got {type(loss_fn).__name__}")
    if backends is not None and not (isinstance(backends, (tuple, list)) and len(backends) == 2):
        raise UsageError("backends must be a pair (backend of A, backend of B); "
                         f"got {backends!r}")
    backend_a, backend_b = backends if backends is not None else (None, None)
    if progress is None:
        progress = sys.stderr.isatty()
    return Options(include, exclude, bool(backward), loss_fn, backend_a, backend_b, progress)


def _check_models(**models: Any) -> None:
    for label, model in models.items():
        if not isinstance(model, nn.Module):
            raise UsageError(f"{label} is not a torch.nn.Module (got {type(model).__name__})")
        active = [name for name, m in model.named_modules()
                  if isinstance(m, nn.modules.dropout._DropoutNd) and m.training and m.p > 0]
        if active:
            raise UsageError(f"{label} has active dropout ({active[0] or 'root'}); call "
                             "model.eval() so that both runs are deterministic")


def _call_model(model: nn.Module, inputs: Inputs) -> Any:
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    if isinstance(inputs, torch.Tensor):
        return model(inputs)
    raise UsageError(f"inputs must be a tuple of positional arguments or a dict of keyword "
                     f"arguments; got {type(inputs).__name__}")


# --------------------------------------------------------------------------------------------
# Running a model


@contextlib.contextmanager
def _backend(spec: BackendSpec) -> Iterator[None]:
    if spec is None:
        yield
    elif isinstance(spec, str):
        from torchparity import backends

        with backends.use(spec):
            yield
    else:
        with spec():
            yield


@contextlib.contextmanager
def _seeded() -> Iterator[None]:
    """Same CPU RNG stream for every run and replay; the caller's CPU RNG state is restored.
    (CUDA generators are left alone: seeding them is costly, and active dropout is refused.)"""
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(_SEED)
        yield


def default_loss(output: Any, inputs: Any = None) -> torch.Tensor:
    """A scalar whose gradient reaches every element of the first floating output: its dot
    product with a fixed pseudo-random tensor (same values on every machine, scaled so the loss
    is O(1)). Uses the output's own ``loss`` field when it has one."""
    flat = flatten_tensors(output)
    if "output.loss" in flat and flat["output.loss"].numel() == 1:
        return flat["output.loss"].reshape(())
    floats = [t for t in flat.values() if t.is_floating_point()]
    if not floats:
        raise UsageError("the model output has no floating tensor to take gradients of; pass "
                         "loss_fn or backward=False")
    first = floats[0]
    weights = torch.randn(first.shape, generator=torch.Generator().manual_seed(_SEED),
                          dtype=torch.float64) / max(first.numel(), 1) ** 0.5
    return (first * weights.to(first)).sum()


@dataclass
class _Run:
    calls: list[ModuleCall]
    output: Any
    loss: torch.Tensor | None
    param_grads: dict[str, dict[str, torch.Tensor]]  # module name -> direct param name -> grad


def _run(model: nn.Module, inputs: Inputs, opts: Options, backend: BackendSpec, *,
         backward: bool, **capture: Any) -> _Run:
    """One seeded forward (and backward via ``torch.autograd.grad``, so ``.grad`` is untouched)
    with the selected modules captured."""
    loss = None
    grads: dict[int, torch.Tensor] = {}
    with _backend(backend), _seeded(), Capture(model, opts.selects(), grads=backward,
                                                **capture) as cap:
        with torch.set_grad_enabled(backward):
            output = _call_model(model, inputs)
            if backward:
                loss = (opts.loss_fn or default_loss)(output, inputs)
                params = _trainable(model)
                found = torch.autograd.grad(loss, params, allow_unused=True)
                grads = {id(p): g for p, g in zip(params, found) if g is not None}
    param_grads = {
        name: {pn: grads[id(p)] for pn, p in module.named_parameters(recurse=False)
               if id(p) in grads}
        for name, module in cap.modules.items()
    }
    output = _detached(output)
    return _Run(cap.records, output, None if loss is None else loss.detach(), param_grads)


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise UsageError(f"{type(model).__name__} has no parameter that requires grad; pass "
                         "backward=False")
    return params


def _detached(tree: Any) -> Any:
    return map_tensors(tree, lambda t: t.detach())


def _replay(module: nn.Module, inputs: tuple[tuple, dict], backend: BackendSpec, *,
            grad_out: Mapping[str, torch.Tensor] | None = None,
            requires_grad: frozenset[str] = frozenset()
            ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Run one module on recorded inputs; with ``grad_out``, also backward from it.

    Returns the output tensors by path and, with ``grad_out``, the gradients of the inputs
    that required grad in the recorded run (``input.<path>``) and of the module's direct
    parameters (``param.<name>``).
    """
    args, kwargs = inputs
    with _backend(backend), _seeded():
        if not grad_out:
            with torch.no_grad():
                return flatten_tensors(module(*args, **kwargs)), {}
        leaves = {f"input.{path}": t.requires_grad_()
                  for path, t in {**flatten_tensors(args, "args"),
                                  **flatten_tensors(kwargs, "kwargs")}.items()
                  if path in requires_grad}
        params = {f"param.{n}": p for n, p in module.named_parameters(recurse=False)
                  if p.requires_grad}
        with torch.enable_grad():
            outputs = flatten_tensors(module(*args, **kwargs))
        seeds = [(outputs[p], g.to(outputs[p])) for p, g in grad_out.items()
                 if p in outputs and outputs[p].requires_grad]
        targets = {**leaves, **params}
        grads = {}
        if seeds and targets:
            found = torch.autograd.grad([o for o, _ in seeds], list(targets.values()),
                                        [g for _, g in seeds], allow_unused=True)
            grads = {name: g for name, g in zip(targets, found) if g is not None}
    return {p: t.detach() for p, t in outputs.items()}, grads


def _module_placement(module: nn.Module) -> tuple[torch.dtype | None, torch.device | None]:
    """The floating dtype and device of a module's parameters/buffers (None when it has none)."""
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.is_floating_point():
            return tensor.dtype, tensor.device
    return None, None


def _golden_copy(model: nn.Module) -> tuple[nn.Module | None, str]:
    """A float64 CPU copy of ``model`` and a description of the golden used."""
    dtype, _ = _module_placement(model)
    if dtype == GOLDEN_DTYPE:
        return None, "none: A already runs in float64; budgets use the analytic bound"
    try:
        golden = copy.deepcopy(model).to(device="cpu", dtype=GOLDEN_DTYPE)
    except Exception as exc:  # noqa: BLE001 - any failure means: no golden, say why
        return None, f"none: copying A to float64 failed ({type(exc).__name__}: {exc})"
    return golden, "float64 copy of A on the CPU"


# --------------------------------------------------------------------------------------------
# Reference side


@dataclass
class _Reference:
    """A's recorded calls and where their tensors are; ``golden`` says which golden was used
    (it starts with "none" when there is none); ``notes`` why some calls cannot be replayed."""

    calls: list[ModuleCall]
    store: Any
    golden: str
    notes: dict[str, str] = field(default_factory=dict)
    source: str = "in-process"

    @property
    def has_golden(self) -> bool:
        return not self.golden.startswith("none")

    def tensors(self, calls: tuple[ModuleCall, ...], group: str) -> dict[str, torch.Tensor]:
        return _joined([self.store.get(c.key, group) for c in calls])

    def judge(self, calls: tuple[ModuleCall, ...], candidate: dict[str, torch.Tensor],
              baseline_group: str, golden_group: str, kind: str) -> Result:
        golden = self.tensors(calls, golden_group) if self.has_golden else {}
        return judge(candidate, golden, self.tensors(calls, baseline_group), kind)


def _build_reference(model: nn.Module, inputs: Inputs, store: Any, opts: Options,
                     bar: _Bar) -> _Reference:
    def keep_call(call: ModuleCall) -> None:
        store.put_inputs(call.key, call.args, call.kwargs)
        store.put(call.key, "out", call.outputs)

    done = bar.phase("A: forward" + (" and backward" if opts.backward else ""))
    run = _run(model, inputs, opts, opts.backend_a, backward=opts.backward, what="tensors",
               keep=False, on_call=keep_call, on_grad=_grad_keeper(store, "grad_out"))
    _keep_run_results(store, run, "out", "param_grad")
    done()
    golden, description = _golden_copy(model)
    if golden is not None:
        done = bar.phase("golden (float64): forward" + (" and backward" if opts.backward else ""))
        try:
            golden_run = _run(
                golden, upcast(inputs, GOLDEN_DTYPE, "cpu"), opts, opts.backend_a,
                backward=opts.backward, what="outputs", keep=False,
                on_call=lambda c: store.put(c.key, "golden_out", c.outputs),
                on_grad=_grad_keeper(store, "golden_grad_out"))
            _keep_run_results(store, golden_run, "golden_out", "golden_param_grad")
        except Exception as exc:  # noqa: BLE001 - e.g. an op without a float64 kernel
            golden, description = None, f"none: the float64 run failed ({type(exc).__name__}: {exc})"
        done()
    reference = _Reference(calls=run.calls, store=store, golden=description)
    _replay_reference(reference, model, golden, opts, bar)
    return reference


def _grad_keeper(store: Any, group: str) -> Callable[[ModuleCall, str, torch.Tensor], None]:
    return lambda call, path, grad: store.put(call.key, group, {path: grad})


def _keep_run_results(store: Any, run: _Run, out_group: str, param_group: str) -> None:
    final = flatten_tensors(run.output)
    if run.loss is not None:
        final["loss"] = run.loss
    store.put(FINAL, out_group, final)
    for name, grads in run.param_grads.items():
        if grads:
            store.put(call_key(name, 0), param_group, grads)


def _replay_reference(reference: _Reference, model: nn.Module, golden: nn.Module | None,
                      opts: Options, bar: _Bar) -> None:
    """Local goldens (and local gradients of A and the golden) for every recorded call."""
    modules = dict(model.named_modules())
    golden_modules = dict(golden.named_modules()) if golden is not None else {}
    store = reference.store
    advance = bar.phase("A and golden: module replays", total=len(reference.calls))
    for call in reference.calls:
        grad_out = store.get(call.key, "grad_out") if opts.backward else {}
        try:
            if grad_out:
                _, grads = _replay(modules[call.name], store.get_inputs(call.key),
                                   opts.backend_a, grad_out=grad_out,
                                   requires_grad=call.inputs_requiring_grad)
                store.put(call.key, "local_grad", grads)
            if golden is not None:
                outputs, grads = _replay(
                    golden_modules[call.name],
                    upcast(store.get_inputs(call.key), GOLDEN_DTYPE, "cpu"), opts.backend_a,
                    grad_out=upcast(grad_out, GOLDEN_DTYPE, "cpu"),
                    requires_grad=call.inputs_requiring_grad)
                store.put(call.key, "local_golden", outputs)
                store.put(call.key, "local_golden_grad", grads)
        except ReplayUnavailable as exc:
            reference.notes[call.key] = f"not replayed: {exc}"
        except Exception as exc:  # noqa: BLE001 - report it on the row, keep diagnosing
            reference.notes[call.key] = f"replay failed: {type(exc).__name__}: {exc}"
        advance()


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
                        name_map: NameMap | None, bar: _Bar) -> DiagnosisReport:
    done = bar.phase("B: call structure")
    structure = _run(model, inputs, opts, opts.backend_b, backward=False, what="shapes")
    alignment = align(reference.calls, structure.calls, name_map)
    done()
    done = bar.phase("B: forward" + (" and backward" if opts.backward else ""))
    tracker = _PropagatedTracker(reference, alignment)
    run = _run(model, inputs, opts, opts.backend_b, backward=opts.backward, what="outputs",
               keep=False, on_call=tracker.on_call, on_grad=tracker.on_grad)
    tracker.finish(run.param_grads)
    done()
    rows = []
    modules = dict(model.named_modules())
    advance = bar.phase("B: module replays", total=len(alignment.matches))
    for match in alignment.matches:
        row = _new_row(match, reference)
        row.propagated = tracker.forward.get(id(match))
        row.grad_propagated = tracker.grads.get(id(match))
        row.local, row.grad_local, note = _local(reference, match, modules, opts)
        if note:
            row.notes.append(note)
        rows.append(row)
        advance()
    return DiagnosisReport(
        rows=rows,
        output=_final(reference, run, "output"),
        loss=_final(reference, run, "loss") if run.loss is not None else None,
        unmatched_a=[c.key for c in alignment.unmatched_a],
        unmatched_b=[c.key for c in alignment.unmatched_b],
        meta=_report_meta(reference, model, opts, alignment),
    )


def _new_row(match: Match, reference: _Reference) -> Row:
    first_b = min(match.b, key=lambda c: c.start)
    notes = [reference.notes[c.key] for c in match.a if c.key in reference.notes]
    return Row(module=match.b_name, a_module=match.a_name, how=match.how,
               module_type="+".join(c.module_type for c in match.b), depth=first_b.depth,
               start=first_b.start, notes=notes)


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
            candidate = _joined([parts[c.key] for c in match.b])
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
            self.grads[id(match)] = _merged(self.grads.get(id(match)), params)


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
        outputs = [_replay(modules[b.name], _placed(store.get_inputs(a.key), modules[b.name]),
                           opts.backend_b)[0] for b in match.b]
        local = reference.judge(match.a, _joined(outputs), "out", "local_golden", "forward")
        grad_out = store.get(a.key, "grad_out") if opts.backward and _one_to_one(match) else {}
        if not grad_out:
            return local, None, None
        module = modules[match.b[0].name]
        _, grads = _replay(module, _placed(store.get_inputs(a.key), module), opts.backend_b,
                           grad_out=grad_out, requires_grad=a.inputs_requiring_grad)
        grad_local = reference.judge(match.a, grads, "local_grad", "local_golden_grad", "grad")
        return local, grad_local, None
    except ReplayUnavailable as exc:
        return None, None, f"not replayed: {exc}"
    except Exception as exc:  # noqa: BLE001 - report it on the row, keep diagnosing
        return None, None, f"replay of B's module failed: {type(exc).__name__}: {exc}"


def _placed(inputs: tuple[tuple, dict], module: nn.Module) -> tuple[tuple, dict]:
    """Recorded inputs moved to the module's device and cast to its floating dtype."""
    dtype, device = _module_placement(module)
    return upcast(inputs, dtype, device) if device is not None else inputs


def _final(reference: _Reference, run: _Run, which: str) -> Result:
    final = flatten_tensors(run.output)
    if which == "loss":
        final = {"loss": run.loss}
    final = {p: t.cpu() for p, t in final.items()}
    golden = reference.store.get(FINAL, "golden_out") if reference.has_golden else {}
    baseline = reference.store.get(FINAL, "out")
    pick = (lambda d: {p: t for p, t in d.items() if (p == "loss") == (which == "loss")})
    return judge(final, pick(golden), pick(baseline), "loss" if which == "loss" else "forward")


def _report_meta(reference: _Reference, model: nn.Module, opts: Options,
                 alignment: Alignment) -> dict[str, Any]:
    return {
        "reference": reference.source,
        "model_b": type(model).__name__,
        "golden": reference.golden,
        "backward": opts.backward,
        "backends": [_backend_name(opts.backend_a), _backend_name(opts.backend_b)],
        "alignment": alignment.counts(),
        "notes": [] if reference.has_golden else [f"golden: {reference.golden}"],
    }


def _backend_name(spec: BackendSpec) -> str | None:
    return spec if spec is None or isinstance(spec, str) else getattr(spec, "__name__", repr(spec))


# --------------------------------------------------------------------------------------------
# Judgement


def judge(candidate: dict[str, torch.Tensor], golden: dict[str, torch.Tensor],
          baseline: dict[str, torch.Tensor], kind: str) -> Result:
    """Compare under the tolerance model; without a golden, the baseline serves as golden and
    the analytic bound as budget. A baseline in another dtype than the candidate's (B runs in
    another precision than A) cannot earn a budget and is dropped."""
    from torchparity.compare import StructureMismatch, compare

    if not golden:
        golden, baseline = baseline, {}
    same_dtypes = all(p in candidate and candidate[p].dtype == t.dtype
                      for p, t in baseline.items())
    try:
        return compare(candidate, golden, baseline if baseline and same_dtypes else None, kind)
    except StructureMismatch as exc:
        return Mismatch(kind, str(exc))


def _merged(first: Result | None, second: Result) -> Result:
    from torchparity.compare import Comparison

    if first is None or isinstance(second, Mismatch):
        return second
    if isinstance(first, Mismatch):
        return first
    return Comparison(kind=first.kind, tensors=first.tensors + second.tensors)


def _joined(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One call's tensors as they are; several calls' single outputs concatenated along the
    last dimension (the output of the fused module they correspond to)."""
    if len(parts) == 1:
        return parts[0]
    if any(len(p) != 1 for p in parts):
        return {}
    return {"output": torch.cat([next(iter(p.values())) for p in parts], dim=-1)}


# --------------------------------------------------------------------------------------------
# Progress


class _Bar:
    """Progress on stderr through rich; a no-op when disabled."""

    def __init__(self, progress: Any) -> None:
        self._progress = progress

    def phase(self, description: str, total: int | None = None) -> Callable[[], None]:
        """Start a phase; the returned function advances it (or ends it, without a total)."""
        if self._progress is None:
            return lambda: None
        task = self._progress.add_task(description, total=total or 1)
        return lambda: self._progress.advance(task)


@contextlib.contextmanager
def _progress(enabled: bool | None) -> Iterator[_Bar]:
    if not enabled:
        yield _Bar(None)
        return
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True) as progress:
        yield _Bar(progress)


# --------------------------------------------------------------------------------------------
# ``tp.diagnose`` names both this module and its main function. Importing the submodule rebinds
# the package attribute to the module, so the module forwards calls to the function.


class _CallableModule(type(sys)):
    def __call__(self, *args: Any, **kwargs: Any) -> DiagnosisReport:
        return diagnose(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
