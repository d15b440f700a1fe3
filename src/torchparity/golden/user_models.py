"""Goldens of users' models, and the cell-by-cell check of a model against them.

A user's model comes from a factory (:class:`torchparity.subject.Subject`). Its goldens,
computed in float64 on the CPU with every SDPA call on the ``manual`` backend, live in
``<golden dir>/<entry name>/``:

============  ==========  =============================================================
output        kind        tensors
============  ==========  =============================================================
``outputs``   forward     every tensor of the model's output, keyed by its path, but those
                          its cache holds (``past_key_values``, ``cache``: see ``decode``)
``loss``      loss        ``loss_fn(output, inputs)``, or the default loss (below)
``grads``     grad        the gradient of every parameter that requires one
``decode``    forward     a teacher-forced decoding of ``DECODE_STEPS`` steps through the
                          model's step (the factory's ``step``, or the built-in one of
                          reference models and ``transformers`` generators): the greedy
                          ``tokens`` of the float64 run and each step's next-token logits
                          (``cached.logits.<step>``, and ``recomputed.logits.<step>`` by full
                          recompute where a built-in step offers one); with the factory's
                          ``search`` key a beam search instead, its ``tokens`` and
                          ``parents`` (the prompt expanded to its beams); or, for a factory with
                          the older ``decode(model, inputs, use_cache)``, what it returns with
                          the cache (``cached.*``) and by full recompute (``recomputed.*``)
============  ==========  =============================================================

Every cell decodes along the golden's tokens (and parents), so a near tie that another dtype or
backend breaks the other way changes no later step: each step's logits are judged in every
cell, and a failure names the first step that leaves its budget. The reference cell decodes
greedily, or searches: its tokens (and parents) must be the golden's. It also judges
``decode-cache``: the cached decoding against the full recompute of the same run, so a
KV-cache bug is caught even in the run that made the goldens.

The default loss is a fixed pseudo-random projection of the floating outputs the golden has:
its gradient reaches every element of them, and the same weights are used in every cell.

Padded positions (the factory's ``padding``, else the inputs' 1/0 ``attention_mask`` and
``decoder_attention_mask``; see :mod:`torchparity.subject.padding`) are left out of the judged
outputs (and of a factory's own decoding) and of the default loss, so the gradients do not
carry them either: a padded query may attend to nothing, and what two implementations write
there is arbitrary. Every row says how many positions it left out.

Cells are those of the zoo's check: the reference cell (manual, fp64) recomputes the goldens
with a baseline of one float64 rounding of the weights; every other cell runs a copy of the
model in its dtype with every ``scaled_dot_product_attention`` call on its backend, judged by
the tolerance model against the ``manual`` backend in the same dtype. A model that makes no
SDPA call has its backend cells ``n/a`` with that reason. ``transformers`` models run their
``sdpa`` attention implementation there and get one more backend, ``hf-eager``: their own
eager implementation. Outputs that one run has and another lacks (eager's attention weights
against sdpa's ``None``) are reported as structure differences, never as divergences; the
tensors both have are judged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from torchparity import backends, sketching, tolerance
from torchparity.comparison import NOT_COMPARED, compare
from torchparity.dtypes import DTYPES, dtype_name
from torchparity.errors import BackendUnavailable, UsageError
from torchparity.golden.cases import checksum_changes, judged_fields, write_status
from torchparity.golden.cells import REFERENCE, Cell, CheckResult, Run, matmul_precision
from torchparity.golden.compiled import (
    annotate,
    decode_phases,
    step_verdicts,
    stepped_logits,
    unavailable_reason,
)
from torchparity.golden.store import GOLDEN_DIR_ENV, Golden, GoldenStale, GoldenStore, checksum
from torchparity.sketching import Sketch, kept, seed_of
from torchparity.subject import Subject, hf
from torchparity.subject.beams import BeamSearch, expand_prompt, reorder_rows
from torchparity.subject.blockwise import BlockProgress, Float64Run, stream_grads
from torchparity.subject.compiling import CompileFailed, CompileLog, check_mode, compiled
from torchparity.subject.decoding import Fed, recompute_step, teacher_forced
from torchparity.subject.islands import Islands, narrowest, summary
from torchparity.subject.padding import Padding
from torchparity.subject.running import cast_inputs, default_loss_paths, in_cache
from torchparity.subject.trees import flatten_tensors

#: Output name -> kind of the tolerance model it is judged with.
OUTPUT_KINDS = {"outputs": "forward", "loss": "loss", "grads": "grad", "decode": "forward",
                "decode-cache": "forward"}
#: The attention implementation of ``transformers`` models as one more backend.
HF_EAGER = "hf-eager"
#: New tokens of the default decode of ``transformers`` generative models.
DECODE_STEPS = 4
_ROOT = "output"


def user_golden_dir(explicit: str | os.PathLike | None = None) -> Path:
    """Where users' goldens live: ``explicit``, else ``$TORCHPARITY_GOLDEN_DIR``, else
    ``golden/`` in the working directory (the folder need not exist yet)."""
    return Path(explicit or os.environ.get(GOLDEN_DIR_ENV) or "golden")


def backend_names(models: list[Subject] | None = None) -> list[str]:
    """The backends of a user-model check: every attention backend, and ``hf-eager`` when one
    of ``models`` is a ``transformers`` model (always when ``models`` is None)."""
    eager = models is None or any(m.is_transformers for m in models)
    return [*backends.names(), *([HF_EAGER] if eager else [])]


def model_store(subject: Subject, root: Any) -> GoldenStore:
    """The golden store under ``root`` whose messages name this model's update command."""
    return GoldenStore(root, update_command=f"torchparity golden update --model {subject.entry}")


def model_checksums(subject: Subject) -> dict[str, str]:
    """Checksums of the float64 state dict and of the input tensors the factory gave."""
    return {"weights": checksum(subject.model.state_dict(), dtype=torch.float64),
            "inputs": checksum(flatten_tensors(subject.inputs, "inputs"))}


# --- running --------------------------------------------------------------------------------


#: ``status(text)``: where a cell is in its run ("backward: block 3 of 16").
Status = Callable[[str], None]


class CellModels:
    """The models a check's cells run, without more copies than dtypes.

    The float64 cells and the cells of the model's own dtype and device run the factory's
    model itself (float64 cells cast it module by module, :class:`Float64Run`); any other
    dtype or device gets one converted copy, shared by the backends of that dtype and dropped
    when a cell of another one asks for its model."""

    def __init__(self, subject: Subject) -> None:
        self.subject = subject
        self._key: tuple[str, str] | None = None
        self._copy: tuple[nn.Module, Any] | None = None

    def get(self, cell: Cell, attention: str) -> tuple[nn.Module, Any]:
        """The model (in eval mode, on ``attention``) and the inputs of ``cell``."""
        subject = self.subject
        if cell.dtype == "fp64":
            return subject.placed(cell.device, _own_dtype(subject.model), attention,
                                  share=True)[0], cast_inputs(subject.inputs, cell.device,
                                                              torch.float64)
        key = (cell.dtype, cell.device)
        if key != self._key:
            self._copy = None  # the previous dtype's copy goes before the next one is made
            self._copy = subject.placed(cell.device, DTYPES[cell.dtype], attention, share=True)
            self._key = key
        model, inputs = self._copy
        if subject.is_transformers:
            hf.set_attention(model, attention)
        return model, inputs


def _own_dtype(model: nn.Module) -> torch.dtype:
    floating = [t.dtype for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()]
    return floating[0] if floating and len(set(floating)) == 1 else torch.float64


def run_in_cell(subject: Subject, cell: Cell, loss_paths: list[str] | None, *,
                perturb: bool = False, tokens: Fed | None = None,
                models: CellModels | None = None, status: Status | None = None
                ) -> tuple[Run, int | None]:
    """Run the model in ``cell``: forward, loss, gradients and decoding.

    ``loss_paths`` are the outputs the default loss projects (None: all floating ones);
    ``tokens`` are what a step-by-step decoding is fed (None: its own greedy choices, or its
    beam search).
    ``models`` shares the cells' models (default: a fresh :class:`CellModels`); ``status``
    hears where a long run is (which block of how many). Tensors of
    :func:`~torchparity.sketching.threshold` elements or more are kept as sketches, each
    gradient as soon as it is complete. ``perturb`` (float64 cells) moves every weight by one
    float64 rounding. Returns the run and the number of SDPA calls intercepted (None for
    ``hf-eager``). A compiled cell runs all of it compiled, each decoding step recorded in its
    compile log; a failure to compile raises
    :class:`~torchparity.subject.compiling.CompileFailed`.
    """
    attention = hf.EAGER if cell.backend == HF_EAGER else hf.SDPA
    model, inputs = (models or CellModels(subject)).get(cell, attention)
    report = None if status is None else (
        lambda phase, done, total: status(f"{phase}: block {done} of {total}"))
    with compiled(model, cell.compile) as compile_log, _backend(cell.backend) as intercepted, \
            matmul_precision(cell.dtype):
        try:
            if cell.dtype == "fp64":
                grads: dict[str, Any] = {}
                with Float64Run(model, on_grad=_keeper(grads), perturb=perturbation
                                if perturb else None, progress=report) as run64, \
                        Islands(model) as islands:
                    run = _forward_backward(subject, model, inputs, loss_paths,
                                            lambda loss: (run64.backward(loss), grads)[1])
                    run.compile_log = compile_log
                    _decode(subject, model, inputs, run, tokens)
                run.islands = islands.found
            else:
                with BlockProgress(model, report) as blocks:
                    run = _forward_backward(subject, model, inputs, loss_paths,
                                            lambda loss: _streamed(model, loss, blocks))
                run.compile_log = compile_log
                _decode(subject, model, inputs, run, tokens)
        except BackendUnavailable as exc:
            return Run({}, dict.fromkeys(OUTPUT_KINDS, str(exc))), None
    calls = None if intercepted is None else intercepted.calls
    return run, calls


def perturbation(name: str, value: torch.Tensor) -> torch.Tensor:
    """``value`` (float64) times 1 + d, |d| <= 2**-52 fixed per element and parameter name:
    the reference cell's weights moved by one float64 rounding. The factors repeat with a
    period of 2**20 elements from an offset of the name, so that the float64 run can recompute
    them at every cast for a few operations per element."""
    factors = _perturbation_factors().roll(-(seed_of(f"perturb.{name}") % _PERIOD))
    flat = value.view(-1)
    for start in range(0, flat.numel(), _PERIOD):
        part = flat[start:start + _PERIOD]
        part.mul_(factors[:part.numel()])
    return value


_PERIOD = 1 << 20


@functools.cache
def _perturbation_factors() -> torch.Tensor:
    generator = np.random.Generator(np.random.PCG64(0))
    return 1.0 + torch.from_numpy(generator.random(_PERIOD) * 2.0 - 1.0) * 2.0**-52


def _keeper(found: dict[str, Any]) -> Callable[[str, torch.Tensor], None]:
    return lambda name, tensor: found.__setitem__(name, kept(name, tensor))


def _streamed(model: nn.Module, loss: torch.Tensor, blocks: BlockProgress) -> dict[str, Any]:
    grads: dict[str, Any] = {}
    stream_grads(model, loss, _keeper(grads), blocks)
    return grads


@contextlib.contextmanager
def _backend(name: str) -> Iterator[Any]:
    if name == HF_EAGER:
        yield None
    else:
        with backends.use(name) as intercepted:
            yield intercepted


def _forward_backward(subject: Subject, model: nn.Module, inputs: Any,
                      loss_paths: list[str] | None,
                      backward: Callable[[torch.Tensor], dict[str, Any]]) -> Run:
    missing: dict[str, str] = {}
    try:
        output = subject.forward(model, inputs)
        flat = flatten_tensors(output, _ROOT)
        loss = subject.loss(output, inputs, flat, loss_paths)
    except BackendUnavailable as exc:  # no backward here: the forward still runs
        missing["grads"] = str(exc)
        with torch.no_grad():
            output = subject.forward(model, inputs)
            flat = flatten_tensors(output, _ROOT)
            loss = subject.loss(output, inputs, flat, loss_paths)
    # A cache is state for the next call, judged by the decoding that reads it.
    outputs: dict[str, dict[str, Any]] = {
        "outputs": {path: kept(path, t, _padded(subject, "outputs", path, t))
                    for path, t in flat.items() if not in_cache(path)}}
    # The loss's gradient with respect to each floating output, heard as the backward passes.
    sensitivity: dict[str, torch.Tensor] = {}
    if "grads" not in missing and not isinstance(loss, str):
        for path, t in flat.items():
            if t.is_floating_point() and t.requires_grad:
                t.register_hook(functools.partial(_heard, sensitivity, path))
    del output, flat  # the kept outputs are enough: the graph lives on in the loss
    if isinstance(loss, str):
        return Run(outputs, missing, not_compared={"loss": loss, "grads": loss})
    outputs["loss"] = {"loss": loss.detach()}
    if "grads" not in missing:
        try:
            outputs["grads"] = backward(loss)
        except BackendUnavailable as exc:
            missing["grads"] = str(exc)
    return Run(outputs, missing, sensitivity)


def _heard(found: dict[str, torch.Tensor], path: str, grad: torch.Tensor) -> None:
    found[path] = grad.detach()


def _decode(subject: Subject, model: nn.Module, inputs: Any, run: Run,
            tokens: Fed | None) -> None:
    if not subject.generates:
        return
    try:
        # Both decodings are sketched alike, so that decode-cache can compare them.
        with torch.no_grad():
            run.outputs["decode"] = {
                path: kept(path.partition(".")[2] or path, tensor,
                           _padded(subject, "decode", path, tensor))
                for path, tensor in (
                    _stepped(subject, model, inputs, tokens, run.compile_log) if subject.steps
                    else _decoded(subject, model, inputs)).items()}
    except BackendUnavailable as exc:
        run.missing["decode"] = str(exc)


def _stepped(subject: Subject, model: nn.Module, inputs: Any, fed: Fed | None,
             compile_log: CompileLog | None = None) -> dict[str, torch.Tensor]:
    """The step protocol's decoding: tokens (and parents) fed, else the greedy choices or the
    factory's beam search, and each step's logits cached and, where a built-in step offers it,
    by full recompute along the same tokens; a compiled model's calls recorded by step in
    ``compile_log``."""
    search = subject.search
    if search is not None:
        inputs = expand_prompt(inputs, search.beams)
    searcher = BeamSearch(search, _rows(inputs) // search.beams) if search and not fed else None
    cached = teacher_forced(subject.stepper(model), model, inputs, DECODE_STEPS,
                            fed and fed.tokens, parents=fed and fed.parents,
                            reorder=subject.reorderer(model),
                            decide=searcher and searcher.decide,
                            during=decode_phases(compile_log, "cached"))
    outputs = {"tokens": cached.tokens,
               **({} if cached.parents is None else {"parents": cached.parents}),
               **{f"cached.logits.{s}": t for s, t in enumerate(cached.logits)}}
    recompute = recompute_step(model) if subject.step is None else None
    if recompute is not None:  # its state holds tensors alone: their rows are reordered
        recomputed = teacher_forced(recompute, model, inputs, DECODE_STEPS, cached.tokens,
                                    parents=cached.parents, reorder=reorder_rows,
                                    during=decode_phases(compile_log, "recomputed"))
        outputs.update({f"recomputed.logits.{s}": t for s, t in enumerate(recomputed.logits)})
    return outputs


def _rows(inputs: Any) -> int:
    return next(iter(flatten_tensors(inputs, "inputs").values())).shape[0]


def _decoded(subject: Subject, model: nn.Module, inputs: Any) -> dict[str, torch.Tensor]:
    """The factory's own ``decode``, with the cache and by full recompute."""
    return {path: tensor for label, cache in (("cached", True), ("recomputed", False))
            for path, tensor in flatten_tensors(subject.decoded(model, inputs, cache),
                                                label).items()}


def first_step(comparison: Any) -> int | None:
    """The first decoding step a comparison of step-protocol decodings finds diverged: a
    step's logits over their budget, or a greedy token (chosen at the step before it is fed)
    that differs."""
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


# --- writing and reading goldens ------------------------------------------------------------


def write_goldens(subject: Subject, store: GoldenStore,
                  status: Status | None = None) -> dict[str, str]:
    """Compute and write the goldens of ``subject``; output -> what happened to its file
    (``created``, ``updated``, ``replaced`` or ``unchanged``, as for the zoo). ``status``
    hears where the float64 run is (which block of how many)."""
    run, _ = run_in_cell(subject, REFERENCE, None, status=status)
    if run.missing:
        output, reason = next(iter(run.missing.items()))
        raise UsageError(f"{subject.entry}: the float64 golden run cannot compute {output}: "
                         f"{reason}")
    loss_paths = None if subject.loss_fn else default_loss_paths(run.outputs["outputs"])
    if status is not None:
        status("checksums of the weights and inputs")
    meta = {"entry": subject.entry, "model": type(subject.model).__name__,
            "loss": "loss_fn" if loss_paths is None else _default_loss(subject, loss_paths),
            "checksums": model_checksums(subject)}
    if subject.generates:
        meta["decoding"] = _decoding(subject)
    if run.islands:
        meta["islands"] = {dtype: summary(modules) for dtype, modules in run.islands.items()}
    statuses = {}
    for output, tensors in run.outputs.items():
        output_meta = {"kind": OUTPUT_KINDS[output], **meta}
        status = write_status(store, subject.name, output, tensors, output_meta)
        if status != "unchanged":
            store.write(subject.name, output, tensors, output_meta)
        statuses[output] = status
    return statuses


def load_goldens(subject: Subject, store: GoldenStore) -> dict[str, Golden]:
    """Read and validate the goldens of ``subject``; a golden made with another kind of loss is
    :class:`GoldenStale`, and so are goldens with decoding when the factory no longer decodes.
    Goldens made without decoding are read as they are: a factory that decodes since (a
    library upgrade) is checked on what they hold (see :func:`_no_decode_golden`). (Changed
    weights or inputs are verdicts of :func:`check_subject`.)"""
    goldens = {output: store.read(subject.name, output) for output in ("outputs", "loss",
                                                                       "grads")}
    fix = f"if the change is intended, run `{store.update_command}`"
    if store.exists(subject.name, "decode"):
        goldens["decode"] = store.read(subject.name, "decode")
    decodes = "decode" in goldens
    if decodes and not subject.generates:
        raise GoldenStale(f"the goldens of {subject.name} in {store.root} were made with "
                          f"decoding, the factory now does not; {fix}")
    padding = subject.padding.summary()
    made = goldens["decode"].summary.get("decoding") if decodes else None
    if decodes and made != _decoding(subject):
        raise GoldenStale(f"the decode golden of {subject.name} in {store.root} was made "
                          f"{f'by {made}' if made else 'by greedy generate'}, the factory now "
                          f"decodes {_decoding(subject)}; {fix}")
    for golden in goldens.values():
        loss = golden.summary.get("loss")
        uses_fn = loss == "loss_fn"
        if uses_fn != (subject.loss_fn is not None):
            raise GoldenStale(f"golden {golden.path.with_suffix('.json')} was made "
                              f"{'with' if uses_fn else 'without'} a loss_fn, the factory now "
                              f"returns {'none' if uses_fn else 'one'}; {fix}")
        if not uses_fn and isinstance(loss, dict) and loss.get("padding") != padding:
            made = loss.get("padding") or "no padding left out"
            raise GoldenStale(f"golden {golden.path.with_suffix('.json')} was made with a "
                              f"default loss over other positions ({made}; now "
                              f"{padding or 'no padding left out'}); {fix}")
    return goldens


def _no_decode_golden(subject: Subject, store: GoldenStore) -> str:
    """Why a factory that decodes gets no decode verdict from goldens made without decoding."""
    return (f"the goldens of {subject.name} in {store.root} have no decoding (made when the "
            f"factory did not decode); run `{store.update_command}` to add it")


def _default_loss(subject: Subject, loss_paths: list[str]) -> dict[str, Any]:
    """What a golden records of its default loss: the outputs projected and, when there is
    padding, which positions it leaves out."""
    padding = subject.padding.summary()
    return {"default projection of": loss_paths, **({"padding": padding} if padding else {})}


#: How a factory builds the same weights and inputs on every machine.
_SAME_EVERYWHERE = {
    "weights": "initialise the model with tp.init_weights(model, seed)",
    "inputs": "draw floating inputs with tp.random_tensor(shape, seed)",
}


def _decoding(subject: Subject) -> str:
    """How the subject decodes, as its goldens record it."""
    if not subject.steps:
        return "its decode"
    search = subject.search
    return "step by step" if search is None else (
        f"step by step, a beam search of {search.beams} beams (length penalty "
        f"{search.length_penalty:g}, end of sequence "
        f"{'none' if search.eos is None else search.eos})")


def _loss_paths(goldens: dict[str, Golden]) -> list[str] | None:
    loss = goldens["loss"].summary.get("loss")
    return loss["default projection of"] if isinstance(loss, dict) else None


# --- checking -------------------------------------------------------------------------------


def check_subject(subject: Subject, store: GoldenStore, cells: list[Cell],
                  advance: Callable[[str], None] = lambda label: None,
                  status: Callable[[str, str], None] | None = None) -> list[CheckResult]:
    """Check ``subject`` in every cell against its goldens; one result per cell and output.

    The cells share the model (:class:`CellModels`): no more copies than dtypes.
    ``advance(label)`` is called after each cell, ``status(label, text)`` while one runs."""
    goldens = load_goldens(subject, store)
    undecoded = None
    if subject.generates and "decode" not in goldens:
        undecoded = _no_decode_golden(subject, store)
        subject = dataclasses.replace(subject, decoding=False)
    changed = checksum_changes(goldens, model_checksums(subject), lambda what: (
        f"the {what} the factory {subject.entry} builds {{differ}}; {_SAME_EVERYWHERE[what]}"
        f" (torch's own random draws differ between machines), or if the change is intended"
        f" run `{store.update_command}`"))
    results: list[CheckResult] = []
    if changed:
        for cell in cells:
            results += [_result(subject, cell, output, verdict, ok=False, reason=reason)
                        for output, (verdict, reason) in changed.items()]
            advance(cell.label)
        return results
    loss_paths = _loss_paths(goldens)
    models = CellModels(subject)
    # Step by step, every cell but the reference decodes along the golden's tokens.
    decoded = goldens["decode"].tensors if subject.steps else None
    tokens = decoded and Fed(decoded["tokens"], decoded.get("parents"))
    baselines: dict[tuple[str, str], Run] = {}
    for cell in cells:
        cell_status = None if status is None else (
            lambda text, label=cell.label: status(label, text))
        if cell == REFERENCE:
            results += _check_reference(subject, store, goldens, loss_paths, tokens, models,
                                        cell_status)
        else:
            key = (cell.dtype, cell.device)
            if key not in baselines:
                baselines[key] = run_in_cell(subject, Cell("manual", *key), loss_paths,
                                             tokens=tokens, models=models,
                                             status=cell_status)[0]
            results += _check_cell(subject, cell, goldens, baselines[key], loss_paths, tokens,
                                   models, cell_status)
        if undecoded:
            results.append(_result(subject, cell, "decode", "n/a", ok=True, reason=undecoded))
        advance(cell.label)
    return results


def _check_reference(subject: Subject, store: GoldenStore, goldens: dict[str, Golden],
                     loss_paths: list[str] | None, tokens: Fed | None,
                     models: CellModels, status: Status | None) -> list[CheckResult]:
    # The reference decodes greedily, or searches: its tokens (and parents) are judged.
    fresh, _ = run_in_cell(subject, REFERENCE, loss_paths, models=models, status=status)
    perturbed, _ = run_in_cell(subject, REFERENCE, loss_paths, perturb=True, tokens=tokens,
                               models=models, status=status)
    results = []
    for output, golden in goldens.items():
        if output in fresh.not_compared:
            results.append(_not_compared(subject, REFERENCE, output, fresh))
            continue
        candidate = fresh.outputs.get(output, {})
        shared = {p: t for p, t in candidate.items()
                  if p in golden.tensors and p in perturbed.outputs.get(output, {})}
        baseline = {p: sketching.shifted(golden.tensors[p], perturbed.outputs[output][p], t)
                    if t.is_floating_point() else golden.tensors[p] for p, t in shared.items()}
        result = _judge(subject, REFERENCE, output, candidate, golden.tensors, baseline,
                        islands=golden_islands(goldens))
        if not result.ok:
            store.write_obtained(subject.name, output, candidate)
        results.append(result)
    if "decode" in fresh.outputs:
        decoded = fresh.outputs["decode"]
        cached, recomputed = ({p.partition(".")[2] or "value": t for p, t in decoded.items()
                               if p.partition(".")[0] == label}
                              for label in ("cached", "recomputed"))
        if recomputed:  # a step of the factory's own has no recompute to judge it by
            results.append(_judge(subject, REFERENCE, "decode-cache", cached, recomputed, None))
    return results


def _check_cell(subject: Subject, cell: Cell, goldens: dict[str, Golden], baseline: Run,
                loss_paths: list[str] | None, tokens: Fed | None,
                models: CellModels, status: Status | None) -> list[CheckResult]:
    if cell.backend == HF_EAGER and not subject.is_transformers:
        reason = "not a transformers model: it has no attention implementation to switch"
        return [_result(subject, cell, output, "n/a", ok=True, reason=reason)
                for output in goldens]
    if cell.compile:
        run, calls = _compiled_run(subject, cell, loss_paths, tokens)
    elif cell.backend == "manual":
        run, calls = baseline, None
    else:
        run, calls = run_in_cell(subject, cell, loss_paths, tokens=tokens, models=models,
                                 status=status)
    if calls == 0:
        return [_result(subject, cell, output, "n/a", ok=True,
                        reason=backends.NO_SDPA_CALLS_REASON) for output in goldens]
    results = []
    for output, golden in goldens.items():
        if output in run.not_compared:
            results.append(_not_compared(subject, cell, output, run))
            continue
        if output in run.missing:
            results.append(_result(subject, cell, output, "n/a", ok=True,
                                   reason=run.missing[output]))
            continue
        noise = _loss_noise(baseline, goldens["outputs"].tensors) if output == "loss" else None
        results.append(_judge(subject, cell, output, run.outputs.get(output, {}),
                              golden.tensors, baseline.outputs.get(output), noise,
                              islands=golden_islands(goldens)))
    if cell.compile:
        decode = goldens.get("decode")
        annotate(results, run.compile_log, step_verdicts(
            *(stepped_logits(tensors) for tensors in (run.outputs.get("decode"),
                                                      decode and decode.tensors,
                                                      baseline.outputs.get("decode"))),
            cell.dtype))
    return results


def _compiled_run(subject: Subject, cell: Cell, loss_paths: list[str] | None,
                  tokens: Fed | None) -> tuple[Run, int | None]:
    """The compiled cell's run; every output n/a with the reason where it cannot compile."""
    reason = unavailable_reason(cell)
    if reason is None:
        try:
            return run_in_cell(subject, cell, loss_paths, tokens=tokens)
        except CompileFailed as exc:
            reason = str(exc)
    return Run({}, dict.fromkeys(OUTPUT_KINDS, reason)), None


def _loss_noise(baseline: Run, golden: dict[str, Any]) -> float | None:
    """The noise the baseline's outputs carry into the loss (None without its gradients);
    sketched outputs, whose errors are known only in RMS, carry none."""
    outputs = baseline.outputs.get("outputs", {})
    errors = {path: outputs[path].double() - golden[path].double()
              for path in baseline.sensitivity if path in outputs and path in golden
              and not isinstance(outputs[path], Sketch) and not isinstance(golden[path], Sketch)}
    return tolerance.propagated_noise(baseline.sensitivity, errors) if errors else None


def golden_islands(goldens: dict[str, Golden]) -> str | None:
    """The narrowest dtype the float64 golden run computed in (None: float64 throughout)."""
    return narrowest(goldens["outputs"].summary.get("islands"))


def islands_sentence(goldens: dict[str, Golden]) -> str | None:
    """Where the float64 golden computed in a narrower dtype, as a sentence (None: nowhere)."""
    islands = goldens["outputs"].summary.get("islands")
    if not islands:
        return None
    where = "; ".join(f"{dtype} at {', '.join(modules)}" for dtype, modules in islands.items())
    return (f"the float64 golden computes in {where} (the model's own casts): it is as "
            f"precise as {narrowest(islands)} there, and every budget allows for it")


def _judge(subject: Subject, cell: Cell, output: str, candidate: dict[str, Any],
           golden: dict[str, Any], baseline: dict[str, Any] | None,
           noise: float | None = None, islands: str | None = None) -> CheckResult:
    """Judge the tensors candidate and golden share; paths that one side lacks (eager's
    attention weights against sdpa's None) are structure differences, not divergences.
    Outputs with a value per input position are judged on the unpadded ones; ``islands``
    is the narrowest dtype the model computes in (a baseline may err as it does)."""
    comparison = compare(candidate, golden, baseline, OUTPUT_KINDS[output],
                         compute_dtype=cell.dtype, noise=noise if baseline else None,
                         padding=_padding(subject, output), islands=islands)
    fields = judged_fields(comparison, cell)
    if output == "loss" and subject.loss_fn is None and subject.padding:
        fields["left_out"] = (f"the default loss leaves the padding out: "
                              f"{subject.padding.summary()}.")
    step = first_step(comparison) if output.startswith("decode") and subject.steps else None
    if step is not None:
        fields["explain"] = f"first step that differs: {step} (0 is the prompt); " \
                            f"{fields['explain']}"
    return _result(subject, cell, output, **fields,
                   structure=[str(d) for d in comparison.structure] or None)


def _not_compared(subject: Subject, cell: Cell, output: str, run: Run) -> CheckResult:
    return _result(subject, cell, output, NOT_COMPARED, ok=False,
                   reason=run.not_compared[output])


def _padded(subject: Subject, output: str, path: str, tensor: torch.Tensor
            ) -> torch.Tensor | None:
    """The padded positions of one tensor of ``output`` as its judgement reads them: a sketch
    of it is made with them at 0."""
    padding = _padding(subject, output)
    left_out = padding(path, tensor) if padding else None
    return None if left_out is None else left_out.mask


def _padding(subject: Subject, output: str) -> Padding | None:
    """The padding of an output's tensors: the model's outputs and its own decoding have a
    value per input position; gradients are the parameters', and step-by-step decoding has a
    value per step."""
    if output == "outputs" or (output.startswith("decode") and subject.decode is not None):
        return subject.padding
    return None


def _result(subject: Subject, cell: Cell, output: str, verdict: str, *, ok: bool,
            **details: Any) -> CheckResult:
    return CheckResult(case=subject.name, backend=cell.backend, dtype=cell.dtype,
                       device=cell.device, output=output, kind=OUTPUT_KINDS[output],
                       verdict=verdict, headroom=details.pop("headroom", None), ok=ok,
                       compile=cell.compile, **details)


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
        return [r for r in self.results if not r.ok]

    def explain(self) -> str:
        """One line per failed output (``OK`` and the count when there is none)."""
        if self.ok:
            return f"OK: {len(self.results)} outputs within their budgets or n/a"
        return "\n".join(f"FAIL {r.case} {r.cell.label} {r.output}: "
                         f"{r.explain or r.reason}" for r in self.failures)

    def to_dict(self) -> dict[str, Any]:
        """``{"ok", "results": [row, ...]}``, the rows of ``torchparity check --json``."""
        return {"ok": self.ok, "results": [r.to_dict() for r in self.results]}


def model_cells(backends: list[str] | None = None, dtypes: list[Any] | None = None,
                device: str = "cpu", compile: list[str] | None = None) -> list[Cell]:
    """The reference cell, then every (dtype, backend) on ``device``: the cells of
    :func:`check_model`, for a ``pytest.mark.parametrize`` of one test per cell.

    ``backends`` default to every attention backend and ``hf-eager`` (n/a for a model that is
    not a ``transformers`` one), ``dtypes`` (short or torch names) to fp32 and bf16;
    ``compile`` (``dynamic``, ``static``) adds each dtype's cells compiled in those forms.
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


def check_model(factory: str | Callable[[], Any], *, backends: list[str] | None = None,
                dtypes: list[Any] | None = None, golden_dir: str | os.PathLike | None = None,
                cells: list[Cell] | None = None, compile: list[str] | None = None
                ) -> ModelReport:
    """Check a user's model against its goldens, as ``torchparity check --model`` does.

    ``factory`` is an entry (``file.py:name``, ``pkg.mod:name``) or the callable itself,
    returning ``(model, inputs)``, ``(model, inputs, loss_fn)`` or a dict with those keys and
    ``decode``. ``golden_dir`` defaults to ``$TORCHPARITY_GOLDEN_DIR``, else ``golden/`` in the
    working directory; ``compile`` (``dynamic``, ``static``) adds the cells compiled by
    ``torch.compile`` (docs/compile.md); ``cells`` (from :func:`model_cells`) replace
    ``backends``/``dtypes``/``compile``.
    Missing or damaged goldens raise their :class:`~torchparity.golden.GoldenError`, whose
    message names the ``torchparity golden update --model`` command that creates them.
    """
    subject = Subject.load(factory)
    store = model_store(subject, user_golden_dir(golden_dir))
    cells = cells or model_cells(backends, dtypes, compile=compile)
    return ModelReport(check_subject(subject, store, cells))


def update_model_goldens(factory: str | Callable[[], Any],
                         golden_dir: str | os.PathLike | None = None) -> dict[str, str]:
    """Write the goldens of ``factory`` (see :func:`check_model`); output -> what happened."""
    subject = Subject.load(factory)
    return write_goldens(subject, model_store(subject, user_golden_dir(golden_dir)))
