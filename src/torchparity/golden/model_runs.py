"""A user's model run in a cell: forward, loss, gradients and decoding, big tensors sketched.

No more copies of the model than dtypes; float64 cells cast it module by module
(:class:`~torchparity.subject.blockwise.Float64Run`), noting where it computes narrower.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from torchparity import backends
from torchparity.dtypes import DTYPES
from torchparity.errors import BackendUnavailable
from torchparity.golden.cells import Cell, CellRun, matmul_precision
from torchparity.golden.compiled_cells import decode_phases
from torchparity.golden.renamed import Renaming
from torchparity.sketching import Sketch, kept, seed_of
from torchparity.subject import Subject, hf
from torchparity.subject.beams import BeamSearch, expand_prompt, prompt_rows, reorder_rows
from torchparity.subject.blockwise import BlockProgress, Float64Run, stream_grads
from torchparity.subject.compiling import CompileLog, compiled
from torchparity.subject.decoding import Fed, recompute_step, teacher_forced
from torchparity.subject.islands import Islands
from torchparity.subject.padding import Padding
from torchparity.subject.running import Inputs, cast_inputs, in_cache
from torchparity.subject.trees import flatten_tensors

#: Output name -> kind of the tolerance model it is judged with.
OUTPUT_KINDS = {"outputs": "forward", "loss": "loss", "grads": "grad", "decode": "forward",
                "decode-cache": "forward"}
#: The attention implementation of ``transformers`` models as one more backend.
HF_EAGER = "hf-eager"
#: New tokens of the default decode of ``transformers`` generative models.
DECODE_STEPS = 4
_ROOT = "output"


#: ``status(text)``: where a cell is in its run ("backward: block 3 of 16").
Status = Callable[[str], None]


class CellModels:
    """The models a check's cells run, without more copies than dtypes."""

    # float64 cells and those of the model's own dtype and device run the factory's model; any other
    # gets one converted copy, shared by its dtype's backends and dropped when another dtype asks
    def __init__(self, subject: Subject) -> None:
        self.subject = subject
        self._key: tuple[str, str] | None = None
        self._copy: tuple[nn.Module, Inputs] | None = None

    def get(self, cell: Cell, attention: str | None) -> tuple[nn.Module, Inputs]:
        """The eval-mode model and inputs of ``cell`` on ``attention``, copied only if needed."""
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
            hf.set_attention(model, attention or subject.attention)
        return model, inputs


def cell_attention(subject: Subject, backend: str) -> str | None:
    """A transformers model's attention on ``backend``: manual as built, hf-eager eager, or sdpa."""
    if backend == HF_EAGER:
        return hf.EAGER
    return subject.attention if backend == "manual" else hf.SDPA


def _own_dtype(model: nn.Module) -> torch.dtype:
    floating = [t.dtype for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()]
    return floating[0] if floating and len(set(floating)) == 1 else torch.float64


def run_in_cell(subject: Subject, cell: Cell, loss_paths: list[str] | None, *,
                perturb: bool = False, tokens: Fed | None = None,
                models: CellModels | None = None, status: Status | None = None,
                renamed: Renaming | None = None) -> CellRun:
    """Run the model in ``cell``: its outputs by name, and why others are absent.

    Tensors of :func:`~torchparity.sketching.threshold` elements or more are kept as sketches,
    each gradient as soon as it is complete; SDPA calls intercepted are counted (None for
    ``hf-eager``); a compiled cell runs all of it compiled.

    Args:
        subject: the user's model.
        cell: the cell.
        loss_paths: the outputs the default loss projects (None: all floating ones).
        perturb: float64 cells: every weight moved by one float64 rounding.
        tokens: what a step-by-step decoding is fed (None: its own choices or beam search).
        models: the cells' shared models (default: a fresh :class:`CellModels`).
        status: hears where a long run is (which block of how many).
        renamed: gives the gradients the goldens' names (a fused parameter's as its parts).

    Raises:
        CompileFailed: a compiled cell that does not compile.
    """
    try:
        model, inputs = (models or CellModels(subject)).get(cell, cell_attention(subject,
                                                                                 cell.backend))
    except BackendUnavailable as exc:  # a family without that attention implementation
        return CellRun({}, dict.fromkeys(OUTPUT_KINDS, str(exc)))
    report = None if status is None else (
        lambda phase, done, total: status(f"{phase}: block {done} of {total}"))
    with compiled(model, cell.compile) as compile_log, \
            attention_backend(cell.backend) as intercepted, matmul_precision(cell.dtype):
        try:
            if cell.dtype == "fp64":
                grads: dict[str, Any] = {}
                with Float64Run(model, on_grad=_keeper(grads, renamed), perturb=perturbation
                                if perturb else None, progress=report) as run64, \
                        Islands(model) as islands:
                    run = forward_backward(subject, model, inputs, loss_paths,
                                            lambda loss: (run64.backward(loss), grads)[1])
                    run.compile_log = compile_log
                    decode_into(subject, model, inputs, run, tokens)
                run.islands = islands.found
            else:
                with BlockProgress(model, report) as blocks:
                    run = forward_backward(subject, model, inputs, loss_paths,
                                            lambda loss: _streamed(model, loss, blocks, renamed))
                run.compile_log = compile_log
                decode_into(subject, model, inputs, run, tokens)
        except BackendUnavailable as exc:
            return CellRun({}, dict.fromkeys(OUTPUT_KINDS, str(exc)))
    run.sdpa_calls = None if intercepted is None else intercepted.calls
    return run


def perturbation(name: str, value: torch.Tensor) -> torch.Tensor:
    """``value`` times 1 + d, |d| <= 2**-52 fixed per element and name: one rounding away."""
    # the factors repeat with a period of 2**20 from an offset of the name, so the float64 run
    # recomputes them at every cast cheaply
    perturb_stretch(name, value.view(-1), 0)
    return value


def perturb_stretch(name: str, flat: torch.Tensor, start: int) -> None:
    """Move a rank's stretch ``flat`` from ``start`` in place, as ``perturbation`` does."""
    factors = _factors_from((seed_of(f"perturb.{name}") + start) % _PERIOD,
                            min(flat.numel(), _PERIOD))
    for first in range(0, flat.numel(), _PERIOD):
        part = flat[first:first + _PERIOD]
        part.mul_(factors[:part.numel()])


_PERIOD = 1 << 20


def _factors_from(offset: int, n: int) -> torch.Tensor:
    """``n`` factors of the period from ``offset`` on, wrapping (a slice, not all rolled)."""
    factors = _perturbation_factors()
    end = offset + n
    if end <= _PERIOD:
        return factors[offset:end]
    return torch.cat([factors[offset:], factors[:end - _PERIOD]])


@functools.cache
def _perturbation_factors() -> torch.Tensor:
    generator = np.random.Generator(np.random.PCG64(0))
    return 1.0 + torch.from_numpy(generator.random(_PERIOD) * 2.0 - 1.0) * 2.0**-52


def _keeper(found: dict[str, Any], renamed: Renaming | None = None
            ) -> Callable[[str, torch.Tensor], None]:
    """Keep each gradient under the name it is judged by (``renamed``: a fused one's parts)."""
    def keep(name: str, tensor: torch.Tensor) -> None:
        found[name] = kept(name, tensor)
    return renamed.gradient_keeper(keep) if renamed else keep


def _streamed(model: nn.Module, loss: torch.Tensor, blocks: BlockProgress,
              renamed: Renaming | None) -> dict[str, Any]:
    grads: dict[str, Any] = {}
    stream_grads(model, loss, _keeper(grads, renamed), blocks)
    return grads


@contextlib.contextmanager
def attention_backend(name: str) -> Iterator[backends.Intercepted | None]:
    """Every SDPA call in the block on backend ``name``; yields the interceptor (hf-eager: None)."""
    if name == HF_EAGER:
        yield None
    else:
        with backends.use(name) as intercepted:
            yield intercepted


def forward_backward(subject: Subject, model: nn.Module, inputs: Inputs,
                     loss_paths: list[str] | None,
                     backward: Callable[[torch.Tensor], dict[str, torch.Tensor | Sketch]]
                     ) -> CellRun:
    """The run's ``output``, ``loss`` and ``grads``, with the loss's sensitivity to each output."""
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
        "outputs": {path: kept(path, t, padded_positions(subject, "outputs", path, t))
                    for path, t in flat.items() if not in_cache(path)}}
    # The loss's gradient with respect to each floating output, heard as the backward passes.
    sensitivity: dict[str, torch.Tensor] = {}
    if "grads" not in missing and not isinstance(loss, str):
        for path, t in flat.items():
            if t.is_floating_point() and t.requires_grad:
                t.register_hook(functools.partial(_heard, sensitivity, path))
    del output, flat  # the kept outputs are enough: the graph lives on in the loss
    if isinstance(loss, str):
        return CellRun(outputs, missing, not_compared={"loss": loss, "grads": loss})
    outputs["loss"] = {"loss": loss.detach()}
    if "grads" not in missing:
        try:
            outputs["grads"] = backward(loss)
        except BackendUnavailable as exc:
            missing["grads"] = str(exc)
    return CellRun(outputs, missing, sensitivity)


def _heard(found: dict[str, torch.Tensor], path: str, grad: torch.Tensor) -> None:
    found[path] = grad.detach()


def decode_into(subject: Subject, model: nn.Module, inputs: Inputs, run: CellRun,
                tokens: Fed | None) -> None:
    """Put ``model``'s decoding in ``run.outputs["decode"]`` (or why missing), if it decodes."""
    if not subject.generates:
        return
    try:
        # Both decodings are sketched alike, so that decode-cache can compare them.
        with torch.no_grad():
            run.outputs["decode"] = {
                path: kept(path.partition(".")[2] or path, tensor,
                           padded_positions(subject, "decode", path, tensor))
                for path, tensor in (
                    _stepped(subject, model, inputs, tokens, run.compile_log) if subject.steps
                    else _decoded(subject, model, inputs)).items()}
    except BackendUnavailable as exc:
        run.missing["decode"] = str(exc)


def _stepped(subject: Subject, model: nn.Module, inputs: Inputs, fed: Fed | None,
             compile_log: CompileLog | None = None) -> dict[str, torch.Tensor]:
    """The step protocol's decoding, cached and, where a built-in step offers, recomputed."""
    # fed tokens (and parents), else greedy or the factory's beam search; a compiled model's calls
    # recorded by step
    search = subject.search
    if search is not None:
        inputs = expand_prompt(inputs, search.beams)
    searcher = (BeamSearch(search, prompt_rows(inputs) // search.beams)
                if search and not fed else None)
    cached = teacher_forced(subject.stepper(model), model, inputs, DECODE_STEPS,
                            fed,
                            reorder=subject.reorderer(model),
                            decide=searcher and searcher.decide,
                            during=decode_phases(compile_log, "cached"))
    outputs = {"tokens": cached.tokens,
               **({} if cached.parents is None else {"parents": cached.parents}),
               **{f"cached.logits.{s}": t for s, t in enumerate(cached.logits)}}
    recompute = recompute_step(model) if subject.step is None else None
    if recompute is not None:  # its state holds tensors alone: their rows are reordered
        recomputed = teacher_forced(recompute, model, inputs, DECODE_STEPS,
                                    Fed(cached.tokens, cached.parents), reorder=reorder_rows,
                                    during=decode_phases(compile_log, "recomputed"))
        outputs.update({f"recomputed.logits.{s}": t for s, t in enumerate(recomputed.logits)})
    return outputs


def _decoded(subject: Subject, model: nn.Module, inputs: Inputs) -> dict[str, torch.Tensor]:
    """The factory's own ``decode``, with the cache and by full recompute."""
    return {path: tensor for label, cache in (("cached", True), ("recomputed", False))
            for path, tensor in flatten_tensors(subject.decoded(model, inputs, cache),
                                                label).items()}


def padded_positions(subject: Subject, output: str, path: str, tensor: torch.Tensor
            ) -> torch.Tensor | None:
    """The padded positions of a tensor of ``output`` (bool, leading dimensions), or None."""
    padding = output_padding(subject, output)
    left_out = padding(path, tensor) if padding else None
    return None if left_out is None else left_out.mask


def output_padding(subject: Subject, output: str) -> Padding | None:
    """The padding of an output's tensors, or None where positions are not the inputs'."""
    # outputs and a model's own decoding have a value per input position; gradients and stepped
    # decoding do not
    if output == "outputs" or (output.startswith("decode") and subject.decode is not None):
        return subject.padding
    return None
