"""Goldens of the reference zoo, and the cell-by-cell check of the code against them.

Per zoo case, five goldens computed in float64 on the CPU (``manual`` backend, the case's
standard batch, ``build_model(config, seed=0)``):

============  ==========  ========================================================= output
kind        tensors ============  ==========
========================================================= ``logits``    forward     the logits
``hidden``    forward     every layer's output, encoder and decoder ``loss``      loss
``sequence_loss`` of the logits ``grads``     grad        the gradient of every parameter
``decode``    forward     ``DECODE_STEPS`` greedy tokens (KV cache) and their log-probs
============  ==========  =========================================================

Logits and hidden states are judged on the batch's unpadded positions (the loss ignores padded
targets itself). Cells: see :mod:`~torchparity.golden.cells`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from torchparity import backends
from torchparity.comparison import StructureMismatch, compare
from torchparity.dtypes import DTYPES
from torchparity.errors import BackendUnavailable
from torchparity.golden import check_loop
from torchparity.golden.cells import (
    REFERENCE,
    Cell,
    CellRun,
    CheckResult,
    matmul_precision,
)
from torchparity.golden.compiled_cells import decode_phases, logprobs_by_step
from torchparity.golden.store import Golden, GoldenStale, GoldenStore, checksum
from torchparity.reference import build_model, greedy_decode, rng, sequence_loss, zoo
from torchparity.reference.layers import TransformerLayer
from torchparity.reference.models import Model
from torchparity.subject.compiling import compiled
from torchparity.subject.padding import Padding, from_inputs
from torchparity.threads import single_thread

#: Output name -> kind of the tolerance model it is judged with.
OUTPUT_KINDS = {"logits": "forward", "hidden": "forward", "loss": "loss", "grads": "grad",
                "decode": "forward"}
#: Outputs with a value per input position, judged on the unpadded ones (the loss ignores
#: padded targets itself; gradients are the parameters'; decoding has a value per step).
PER_POSITION = ("logits", "hidden")
DECODE_STEPS = 4
WEIGHT_SEED = 0
#: The standard batch of every case (its padding comes from the case).
INPUTS = {"batch_size": 2, "seq_len": 12, "seed": 0}

# --- running a case -------------------------------------------------------------------------


def golden_batch(case: zoo.ZooCase, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The model's keyword arguments every golden of ``case`` is computed from."""
    batch = zoo.case_batch(case, **INPUTS)
    return {name: tensor.to(device) for name, tensor in batch.items()}


def current_checksums(case: zoo.ZooCase) -> dict[str, str]:
    """``weights`` and ``inputs`` checksums of what today's code builds for ``case`` in float64."""
    model = build_model(case.config, WEIGHT_SEED, dtype=torch.float64)
    return {"weights": checksum(dict(model.named_parameters())),
            "inputs": checksum(golden_batch(case))}


def recipe(case: zoo.ZooCase) -> dict[str, object]:
    """How a case's goldens are made, as JSON; a golden recording another recipe is stale."""
    return {
        "description": case.description,
        "seeds": {"weights": WEIGHT_SEED, "inputs": INPUTS["seed"]},
        "inputs": {"batch_size": INPUTS["batch_size"], "seq_len": INPUTS["seq_len"],
                   "padding": case.padding},
        "decode_steps": DECODE_STEPS,
        "config": case.config.to_dict(),
    }


def case_padding(case: zoo.ZooCase) -> Padding:
    """The padding of the case's standard batch: what its masks say."""
    return from_inputs(golden_batch(case), encoder_decoder=case.config.is_encoder_decoder)


def case_meta(case: zoo.ZooCase) -> dict[str, object]:
    """What a case's golden JSON records about how it was made: the recipe and checksums."""
    meta = recipe(case)
    config = meta.pop("config")
    return {**meta, "checksums": current_checksums(case), "config": config}


@contextlib.contextmanager
def _layer_outputs(model: Model) -> Iterator[dict[str, torch.Tensor]]:
    """Collect the output of every transformer layer during the block, keyed by module name."""
    found: dict[str, torch.Tensor] = {}

    def hook(name: str) -> Callable:
        return lambda module, args, output: found.__setitem__(name, output.detach())

    handles = [module.register_forward_hook(hook(name)) for name, module in model.named_modules()
               if isinstance(module, TransformerLayer)]
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()


def nudge_weights_by_2_52(model: torch.nn.Module) -> None:
    """Multiply every weight by 1 + d (|d| <= 2**-52, fixed per element): the reference's rerun."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = rng.uniform(WEIGHT_SEED, f"perturb.{name}", param.shape) * 2.0 - 1.0
            param.mul_(1.0 + noise.to(param) * 2.0**-52)


def _forward_backward(model: Model, batch: dict[str, torch.Tensor], *, backward: bool,
                      ) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """The outputs, and the loss's gradient with respect to the logits (when ``backward``)."""
    with _layer_outputs(model) as hidden, torch.set_grad_enabled(backward):
        logits = model(**batch)
        loss = sequence_loss(logits, batch)
    outputs = {"logits": {"logits": logits.detach()}, "hidden": dict(hidden),
               "loss": {"loss": loss.detach()}}
    if not backward:
        return outputs, {}
    logits.retain_grad()
    loss.backward()
    outputs["grads"] = {name: p.grad if p.grad is not None else torch.zeros_like(p)
                        for name, p in model.named_parameters()}
    return outputs, {"logits": logits.grad}


@torch.no_grad()
def forced_logprobs(model: Model, batch: dict[str, torch.Tensor], tokens: torch.Tensor,
                    during: Callable[[int], contextlib.AbstractContextManager] | None = None
                    ) -> torch.Tensor:
    """(batch, steps) log-probabilities of ``tokens`` fed one per step through the KV cache."""
    during = during or (lambda step: contextlib.nullcontext())
    # greedy_decode's steps with the given token, not the argmax: a low-precision near-tie may flip
    # the argmax, where the log-probs stay comparable
    ids_key, mask_key = (("tgt_ids", "tgt_mask") if model.config.is_encoder_decoder
                         else ("input_ids", "attention_mask"))
    inputs = dict(batch)
    step_ids = batch[ids_key]
    mask = batch.get(mask_key)
    mask = torch.ones_like(step_ids) if mask is None else mask
    cache = model.new_cache()
    logprobs = []
    for step in range(tokens.shape[1]):
        inputs[ids_key], inputs[mask_key] = step_ids, mask
        with during(step):
            logits = model(**inputs, cache=cache)[:, -1]
        logp = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1)
        step_ids = tokens[:, step:step + 1].to(logits.device)
        logprobs.append(logp.gather(-1, step_ids)[:, 0])
        mask = torch.cat((mask, torch.ones_like(step_ids)), dim=1)
    return torch.stack(logprobs, 1)


def run_case(case: zoo.ZooCase, cell: Cell, *, tokens: torch.Tensor | None = None,
             perturb: bool = False) -> CellRun:
    """Run ``case`` in ``cell``: its outputs by name, and why others are absent.

    A backend without a backward pass (flex on the CPU, a trainable bias on sdpa-flash) runs the
    forward without gradients and lists ``grads`` in ``missing``: nothing falls back to another
    backend. Without ``tokens`` decoding is greedy, with them forced (:func:`forced_logprobs`);
    ``perturb`` applies :func:`nudge_weights_by_2_52`.

    Raises:
        CompileFailed: a compiled cell that does not compile.
    """
    model = build_model(case.config, WEIGHT_SEED, dtype=DTYPES[cell.dtype], device=cell.device)
    if perturb:
        nudge_weights_by_2_52(model)
    batch = golden_batch(case, cell.device)
    missing: dict[str, str] = {}
    # Zoo models reach SDPA through backends.attention alone: no interception needed.
    with backends.use(cell.backend, intercept=False), matmul_precision(cell.dtype), \
            compiled(model, cell.compile) as compile_log:
        try:
            outputs, sensitivity = _forward_backward(model, batch, backward=True)
        except BackendUnavailable as exc:
            missing["grads"] = str(exc)
            model.zero_grad(set_to_none=True)
            try:
                outputs, sensitivity = _forward_backward(model, batch, backward=False)
            except BackendUnavailable as exc_forward:
                return CellRun({}, dict.fromkeys(OUTPUT_KINDS, str(exc_forward)))
        try:
            if tokens is None:
                decoded = greedy_decode(model, batch, DECODE_STEPS)
                outputs["decode"] = {"tokens": decoded.tokens, "logprobs": decoded.logprobs}
            else:
                outputs["decode"] = {"logprobs": forced_logprobs(
                    model, batch, tokens, decode_phases(compile_log, "cached"))}
        except BackendUnavailable as exc:
            missing["decode"] = str(exc)
    return CellRun(outputs, missing, sensitivity, compile_log)


# --- writing and reading a case's goldens ---------------------------------------------------


def write_case(store: GoldenStore, case: zoo.ZooCase) -> dict[str, str]:
    """Write ``case``'s goldens: ``created``, ``updated``, ``replaced`` or ``unchanged`` each."""
    with store.replacing(case.name):  # all of its files, or none if interrupted
        # unchanged: the file is left untouched, so a rerun elsewhere does not churn the repository
        with single_thread():
            run = run_case(case, REFERENCE)
        meta = case_meta(case)
        return {output: store.update(case.name, output, run.outputs[output],
                                     {"kind": kind, **meta})
                for output, kind in OUTPUT_KINDS.items()}


def load_case(store: GoldenStore, case: zoo.ZooCase) -> dict[str, Golden]:
    """Read and validate every golden of ``case``, by output.

    Changed weight or input checksums are not errors here: :func:`check_case` reports them as
    verdicts.

    Raises:
        GoldenError: a missing, damaged or foreign golden.
        GoldenStale: it was made from another config or input settings than the code has now.
    """
    goldens = {output: store.read(case.name, output) for output in OUTPUT_KINDS}
    expected = recipe(case)
    fix = f"if the change is intended, run `torchparity golden update {case.name}`"
    for output, golden in goldens.items():
        changed = _config_changes(golden.summary.get("config"), expected["config"])
        if changed:
            raise GoldenStale(f"golden {golden.path.with_suffix('.json')} was produced from a "
                              f"different config ({changed}); {fix}")
        for key in ("seeds", "inputs", "decode_steps"):
            if golden.summary.get(key) != expected[key]:
                raise GoldenStale(
                    f"golden {golden.path.with_suffix('.json')} was made with {key} "
                    f"{golden.summary.get(key)!r}, the code now uses {expected[key]!r}; {fix}")
        if golden.summary.get("kind") != OUTPUT_KINDS[output]:
            raise GoldenStale(f"golden {golden.path.with_suffix('.json')} has kind "
                              f"{golden.summary.get('kind')!r}, expected "
                              f"{OUTPUT_KINDS[output]!r}; {fix}")
    store.check_set(case.name, goldens)
    return goldens


def _config_changes(stored: object, current: dict[str, Any]) -> str:
    if not isinstance(stored, dict):
        return "the golden records no config"
    fields = sorted(set(stored) | set(current))
    changes = [f"{f}: {stored.get(f, '<absent>')!r} in the golden, "
               f"{current.get(f, '<absent>')!r} now" for f in fields
               if stored.get(f, "<absent>") != current.get(f, "<absent>")]
    return "; ".join(changes)


# --- checking -------------------------------------------------------------------------------


def check_case(store: GoldenStore, case: zoo.ZooCase, cells: list[Cell],
               advance: Callable[[str], None] = lambda label: None,
               model_changed: bool = False) -> list[CheckResult]:
    """Check ``case`` in every cell against its goldens: one result per cell and output.

    The reference cell judges today's float64 outputs against a rerun on weights moved by one
    float64 rounding; other cells use ``manual`` in their dtype and device as baseline and decode
    by forcing the golden's tokens. ``model_changed``: the reference cell diverged, so the cells
    are judged against today's float64 outputs as well. ``advance`` gets each cell's label when
    done.

    Raises:
        GoldenError: a golden is missing or damaged.
    """
    return check_loop.check_cells(ZooFeed(store, case), cells, advance, model_changed)


class ZooFeed:
    """A zoo case as the check loop runs and judges it (see :class:`check_loop.Feed`)."""

    kinds = OUTPUT_KINDS
    outputs = tuple(OUTPUT_KINDS)
    unjudged: dict[str, str] = {}
    noise_from = "logits"

    def __init__(self, store: GoldenStore, case: zoo.ZooCase) -> None:
        self.store, self.case, self.name = store, case, case.name
        self.goldens = load_case(store, case)
        self.tokens = self.goldens["decode"].tensors["tokens"]

    def changed(self) -> dict[str, tuple[str, str]]:
        """The outputs made from other weights or inputs than today's (:meth:`Feed.changed`)."""
        return check_loop.checksum_changes(
            self.goldens, current_checksums(self.case), lambda what: (
                f"the {what} built for {self.name} {{differ}}; if that is intended, run "
                f"`torchparity golden update {self.name}`"))

    def refused(self, cell: Cell) -> str | None:
        """None: a backend that cannot run an output says so in the run's ``missing``."""
        return None  # a backend that cannot run an output says so in the run's ``missing``

    def run(self, cell: Cell, *, perturb: bool = False) -> CellRun:
        # The reference decodes greedily; every other cell is forced along the golden's tokens.
        """The case run in ``cell`` (:meth:`Feed.run`): greedy in the reference, else forced."""
        return run_case(self.case, cell, tokens=None if cell == REFERENCE else self.tokens,
                        perturb=perturb)

    def golden(self, output: str) -> dict[str, torch.Tensor]:
        """The stored tensors of ``output``'s golden (see :meth:`Feed.golden`)."""
        return self.goldens[output].tensors

    def judge(self, cell: Cell, output: str, candidate: dict[str, torch.Tensor],
              golden: dict[str, torch.Tensor], baseline: dict[str, torch.Tensor] | None,
              noise: float | None = None) -> CheckResult:
        """The row of ``output`` in ``cell``; forced tokens are not judged (:meth:`Feed.judge`)."""
        if output == "decode" and cell != REFERENCE:
            # forced decoding reproduces the golden's tokens by design
            golden = {name: t for name, t in golden.items() if name != "tokens"}
        padding = case_padding(self.case) if output in PER_POSITION else None
        try:
            comparison = compare(candidate, golden, baseline, OUTPUT_KINDS[output],
                                 compute_dtype=cell.dtype, noise=noise if baseline else None,
                                 padding=padding)
        except StructureMismatch as exc:
            return check_loop.row(self, cell, output, "diverged", ok=False, headroom=math.inf,
                                  explain=f"diverged: the outputs no longer have the golden's "
                                          f"structure: {exc}")
        if comparison.structure_differs:
            return check_loop.row(self, cell, output, "diverged", ok=False, headroom=math.inf,
                                  explain=f"diverged: the outputs no longer have the golden's "
                                          f"structure. {comparison.explain()}")
        return check_loop.row(self, cell, output, **check_loop.judged_fields(comparison, cell))

    def self_checks(self, fresh: CellRun) -> list[CheckResult]:
        """None: a zoo case's cached decoding is judged against its goldens in every cell."""
        return []

    def steps(self, decoded: dict[str, torch.Tensor] | None) -> list[dict[str, torch.Tensor]]:
        """A decoding's log-probs step by step (see :meth:`Feed.steps`)."""
        return logprobs_by_step(decoded)
