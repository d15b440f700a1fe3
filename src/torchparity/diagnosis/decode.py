"""Incremental decoding: the first step, and the module, where B's cached decoding parts from A.

Both models are teacher-forced with the same tokens (A's greedy choices unless given), so a
difference in one step cannot change the inputs of the next: each step's logits are compared
with a float64 golden decoding of A, under the budget A's own rounding earns. At the first step
that breaks its budget, all three decodings run again with every module captured during that
step only, and the first module whose output leaves its budget is reported: where a cache slot
or a position offset went wrong. With ``model_b=None`` a model's cached decoding is compared
with its own full recompute (no cache): the check for cache bugs.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from torch import nn

from torchparity.diagnosis.align import NameMap, align
from torchparity.diagnosis.capture import Capture, ModuleCall, PatternSpec
from torchparity.diagnosis.golden import golden_copy
from torchparity.diagnosis.judging import joined, judge
from torchparity.diagnosis.progress import progress_bar
from torchparity.diagnosis.report import DecodeReport, Mismatch, Result, Row
from torchparity.diagnosis.run import (
    GOLDEN_DTYPE,
    BackendSpec,
    Options,
    backend_context,
    backend_name,
    make_options,
)
from torchparity.errors import UsageError
from torchparity.subject.running import check_models, seeded, upcast

__all__ = ["Decoding", "HFDecoding", "ReferenceDecoding", "diagnose_decode"]


class Decoding(Protocol):
    """How to call a family of models one decoding step at a time.

    ``keys(model)`` names the inputs holding token ids and their 1/0 mask; ``new_cache(model)``
    gives an empty cache; ``call(model, inputs, cache)`` runs one step with the keyword
    ``inputs`` (ids of the new tokens only when ``cache`` is not None) and returns the logits
    (batch, new tokens, vocab) and the cache to pass next time.
    """

    def keys(self, model: nn.Module) -> tuple[str, str]: ...

    def new_cache(self, model: nn.Module) -> Any: ...

    def call(self, model: nn.Module, inputs: dict[str, Any], cache: Any
             ) -> tuple[torch.Tensor, Any]: ...


class ReferenceDecoding:
    """torchparity's reference models: ``model(**inputs, cache=model.new_cache())``."""

    def keys(self, model: nn.Module) -> tuple[str, str]:
        if model.config.is_encoder_decoder:
            return "tgt_ids", "tgt_mask"
        return "input_ids", "attention_mask"

    def new_cache(self, model: nn.Module) -> Any:
        return model.new_cache()

    def call(self, model: nn.Module, inputs: dict[str, Any], cache: Any
             ) -> tuple[torch.Tensor, Any]:
        return model(**inputs, cache=cache), cache


class HFDecoding:
    """Hugging Face causal LMs: the cache goes in and comes out as ``cache`` (transformers 5)
    or ``past_key_values`` (earlier versions)."""

    def keys(self, model: nn.Module) -> tuple[str, str]:
        return "input_ids", "attention_mask"

    def new_cache(self, model: nn.Module) -> Any:
        return None  # the model makes its own on the first call with use_cache=True

    def call(self, model: nn.Module, inputs: dict[str, Any], cache: Any
             ) -> tuple[torch.Tensor, Any]:
        name = "cache" if "cache" in inspect.signature(model.forward).parameters else \
            "past_key_values"
        out = model(**inputs, **{name: cache}, use_cache=True)
        return out.logits, out[name]


class _Recompute:
    """Any family, without a cache: every step feeds the whole sequence so far."""

    def __init__(self, family: Decoding) -> None:
        self.family = family
        self.keys = family.keys

    def new_cache(self, model: nn.Module) -> Any:
        return None

    def call(self, model: nn.Module, inputs: dict[str, Any], cache: Any
             ) -> tuple[torch.Tensor, Any]:
        if isinstance(self.family, HFDecoding):
            return model(**inputs, use_cache=False).logits, None
        return model(**inputs), None


def diagnose_decode(
    model_a: nn.Module,
    model_b: nn.Module | None,
    inputs: dict[str, Any],
    *,
    steps: int = 8,
    tokens: torch.Tensor | None = None,
    reference: Literal["cached", "recompute"] = "cached",
    decoding: Decoding | None = None,
    name_map: NameMap | None = None,
    include: PatternSpec = None,
    exclude: PatternSpec = None,
    backends: tuple[BackendSpec, BackendSpec] | None = None,
    progress: bool | None = None,
) -> DecodeReport:
    """Compare step-by-step decoding of B (cached) with A and report where they part.

    ``inputs`` are the prompt as keyword arguments (token ids and optionally their 1/0 mask,
    plus anything else the model takes, e.g. the source of an encoder-decoder). Step 0 runs the
    prompt; step ``s`` feeds token ``s - 1`` of ``tokens`` (batch, steps - 1), by default A's
    greedy choices. A decodes with its cache (``reference="cached"``) or by full recompute;
    ``model_b=None`` compares ``model_a``'s cached decoding with its own recompute.
    ``decoding`` says how to call the model family (reference models and Hugging Face causal
    LMs are recognised).

    Guarantees: A, B and the golden see identical token sequences; ``report.first_step`` is
    None or the first step whose logits break the budget, and then ``report.rows`` compare
    every aligned module's output at that step (the last positions of a recompute are compared
    with a cached step's new positions) and ``report.first_module`` is the first that breaks it.
    """
    if model_b is None:
        model_b, reference = model_a, "recompute"
    if reference not in ("cached", "recompute"):
        raise UsageError(f"reference={reference!r}: use 'cached' or 'recompute'")
    if steps < 1:
        raise UsageError(f"steps={steps}: decode at least one step")
    if not isinstance(inputs, dict):
        raise UsageError("diagnose_decode takes the prompt as a dict of keyword arguments")
    if tokens is not None and (tokens.dim() != 2 or tokens.shape[1] < steps - 1):
        raise UsageError(f"tokens must be (batch, steps - 1) = (batch, {steps - 1}) token ids; "
                         f"got shape {tuple(tokens.shape)}")
    check_models(model_a=model_a, model_b=model_b)
    opts = make_options(False, None, include, exclude, backends, progress)
    family = decoding or _family(model_a)
    family_a = family if reference == "cached" else _Recompute(family)
    golden, golden_note = golden_copy(model_a)
    sides = [_Side(model_a, inputs, family_a, opts.backend_a),
             _Side(model_b, inputs, family, opts.backend_b)]
    if golden is not None:
        sides.append(_Side(golden, upcast(inputs, GOLDEN_DTYPE, "cpu"), family_a, opts.backend_a))
    with torch.no_grad(), progress_bar(opts.progress) as bar:
        advance = bar.phase("decoding A, B and the golden", total=len(sides))
        logits_a, tokens, _ = _decode(sides[0], steps, tokens)
        advance()
        logits = [logits_a] + [_decode(side, steps, tokens)[0] for side in sides[1:]]
        advance()
        step_results = [_judge_step(step, logits) for step in range(steps)]
        first_step = next((s for s, r in enumerate(step_results) if not r.ok), None)
        rows = []
        if first_step is not None:
            calls = [_decode(side, first_step + 1, tokens, capture_at=first_step, opts=opts)[2]
                     for side in sides]
            rows = _module_rows(calls, name_map)
        advance()
    return DecodeReport(steps=step_results, first_step=first_step, rows=rows, tokens=tokens,
                        meta={"reference": reference, "golden": golden_note,
                              "backends": [backend_name(opts.backend_a),
                                           backend_name(opts.backend_b)]})


def _family(model: nn.Module) -> Decoding:
    if callable(getattr(model, "new_cache", None)):
        return ReferenceDecoding()
    if hasattr(model, "config") and callable(getattr(model, "generate", None)):
        return HFDecoding()
    raise UsageError(f"don't know how to decode {type(model).__name__} step by step; pass "
                     "decoding= (see torchparity.diagnosis.decode.Decoding)")


@dataclass
class _Side:
    model: nn.Module
    inputs: dict[str, Any]
    family: Decoding
    backend: BackendSpec


def _decode(side: _Side, steps: int, tokens: torch.Tensor | None, *, capture_at: int = -1,
            opts: Options | None = None
            ) -> tuple[list[torch.Tensor], torch.Tensor, list[ModuleCall]]:
    """Teacher-forced decoding: last-position logits per step (CPU), the tokens fed, and the
    module calls of step ``capture_at``."""
    ids_key, mask_key = side.family.keys(side.model)
    if ids_key not in side.inputs:
        raise UsageError(f"the prompt has no {ids_key!r}; inputs have {', '.join(side.inputs)}")
    ids = side.inputs[ids_key]
    mask = side.inputs.get(mask_key)
    mask = torch.ones_like(ids) if mask is None else mask
    cache = side.family.new_cache(side.model)
    chosen = [] if tokens is None else list(tokens.unbind(1))
    logits, calls = [], []
    with backend_context(side.backend), seeded():
        for step in range(steps):
            if step > 0:
                token = chosen[step - 1].to(ids.device)[:, None]
                ids, mask = torch.cat((ids, token), 1), torch.cat((mask, torch.ones_like(token)), 1)
            fed = ids if cache is None or step == 0 else ids[:, -1:]
            step_inputs = {**side.inputs, ids_key: fed, mask_key: mask}
            if step == capture_at:
                with Capture(side.model, opts.selects()) as cap:
                    out, cache = side.family.call(side.model, step_inputs, cache)
                calls = cap.records
            else:
                out, cache = side.family.call(side.model, step_inputs, cache)
            logits.append(out[:, -1].detach().cpu())
            if tokens is None and step < steps - 1:
                chosen.append(logits[-1].argmax(-1))
    fed = torch.stack(chosen[:steps - 1], 1) if steps > 1 else torch.empty(0, 0, dtype=torch.long)
    return logits, fed, calls


def _judge_step(step: int, logits: list[list[torch.Tensor]]) -> Result:
    a, b, *golden = (side[step] for side in logits)
    return judge({"logits": b}, {"logits": golden[0]} if golden else {}, {"logits": a}, "forward")


def _module_rows(calls: list[list[ModuleCall]], name_map: NameMap | None) -> list[Row]:
    """Each aligned module's inputs and outputs at the captured step: B against the golden,
    with A as the baseline."""
    calls_a, calls_b, *calls_golden = calls
    golden = {c.key: c for c in calls_golden[0]} if calls_golden else {}
    rows = []
    for match in align(calls_a, calls_b, name_map).matches:
        golden_calls = [golden.get(c.key) for c in match.a]
        first_b = min(match.b, key=lambda c: c.start)
        row = Row(module=match.b_name, a_module=match.a_name, how=match.how,
                  module_type="+".join(c.module_type for c in match.b), depth=first_b.depth,
                  start=first_b.start)
        row.propagated = _compare_step(
            joined([c.outputs for c in match.b]), joined([c.outputs for c in match.a]),
            joined([c.outputs for c in golden_calls]) if all(golden_calls) else {})
        if len(match.a) == len(match.b) == 1:
            row.inputs = _compare_step(match.b[0].inputs, match.a[0].inputs,
                                       golden_calls[0].inputs if golden_calls[0] else {},
                                       common_only=True)
        rows.append(row)
    return rows


def _compare_step(candidate: dict[str, torch.Tensor], baseline: dict[str, torch.Tensor],
                  golden: dict[str, torch.Tensor], *, common_only: bool = False) -> Result:
    """Judge one step's tensors; the baseline and golden are cut to the candidate's positions.
    With ``common_only`` tensors present on one side only (a mask a recompute leaves to the
    kernel) are ignored."""
    candidate = {p: t.cpu() for p, t in candidate.items()}
    baseline, golden = _trailing(baseline, candidate), _trailing(golden, candidate)
    for cut in (baseline, golden):
        if isinstance(cut, Mismatch):
            return cut
    if common_only:
        paths = candidate.keys() & baseline.keys() & (golden.keys() if golden else baseline.keys())
        candidate, baseline = _only(candidate, paths), _only(baseline, paths)
        golden = _only(golden, paths) if golden else {}
    return judge(candidate, golden, baseline, "forward")


def _only(tensors: dict[str, torch.Tensor], paths: set[str]) -> dict[str, torch.Tensor]:
    return {p: t for p, t in tensors.items() if p in paths}


def _trailing(tensors: dict[str, torch.Tensor], like: dict[str, torch.Tensor]
              ) -> dict[str, torch.Tensor] | Mismatch:
    """``tensors`` cut to ``like``'s shapes by keeping the last positions of the one dimension
    in which they are longer (a recompute's whole sequence against a cached step's new tokens)."""
    out = {}
    for path, tensor in tensors.items():
        target = like.get(path)
        if target is None or target.shape == tensor.shape:
            out[path] = tensor.cpu()
            continue
        longer = [d for d in range(tensor.dim()) if tensor.shape[d] != target.shape[d]]
        if tensor.dim() != target.dim() or len(longer) != 1 or \
                tensor.shape[longer[0]] < target.shape[longer[0]]:
            return Mismatch("forward", f"{path}: shape {tuple(tensor.shape)} cannot be cut to "
                                       f"{tuple(target.shape)}")
        dim = longer[0]
        out[path] = tensor.narrow(dim, tensor.shape[dim] - target.shape[dim], target.shape[dim])
    return out

