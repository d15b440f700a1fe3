"""Judging a beam search: where the hypotheses B would keep differ from A's, the final n-best,
and whether a reorder is where a change gets in.

Every side follows A's parents and tokens, so each scores the same candidates. A *beam
swap* is a step where B, by its own scores, would keep another candidate than A (A's lowest
kept against A's highest dropped), judged as a token flip
(:func:`~torchparity.diagnosis.pipelines.decoding.judging.flip_verdict`); scores are judged
like logits, in their dtype; the final n-best alike. A reorder that leaves a row of the
state without its parent's positions shows in the state: :func:`reorder_entry`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchparity.diagnosis.core.decode_reference import DecodeReference, Side
from torchparity.diagnosis.core.judging import judge
from torchparity.diagnosis.core.results import Entry, Result
from torchparity.diagnosis.core.state import own_state
from torchparity.diagnosis.pipelines.decoding.judging import FlipKind, flip_verdict, step_budget
from torchparity.subject.beams import BeamSearch, BeamStep, Hypothesis, pool, rescored
from torchparity.subject.trees import PyTree, flatten_tensors


@dataclass(frozen=True)
class BeamSwap:
    """Where B would keep another hypothesis than A at ``step`` of one prompt (None: the final
    n-best, at ``rank``): the candidates, A's margin, B's score error, the budget, the verdict."""

    step: int | None
    prompt: int
    a_keeps: str
    b_keeps: str
    margin: float
    change: float
    budget: float | None
    verdict: FlipKind
    rank: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class Sides:
    """The search as every side scores it along A's choices (golden: A without one; B64: None)."""

    a: list[BeamStep]
    golden: list[BeamStep]
    b: list[BeamStep]
    b64: list[BeamStep] | None

    @classmethod
    def follow(cls, reference: DecodeReference, logits_b: list[torch.Tensor],
               logits64: list[torch.Tensor] | None = None) -> Sides:
        def along(logits: list[torch.Tensor]) -> list[BeamStep]:
            prompts = reference.tokens.shape[0] // reference.beams.beams
            return BeamSearch(reference.beams, prompts).follow(logits, reference.choices)

        a = along(reference.logits)
        golden = along(reference.golden_logits) if reference.has_golden else a
        return cls(a, golden, along(logits_b), None if logits64 is None else along(logits64))


def keeps_differ(reference: DecodeReference, logits_b: list[torch.Tensor]) -> bool:
    """Whether B would keep other candidates than A at any step, or rank the n-best apart."""
    sides = Sides.follow(reference, logits_b)
    return any(_kept(a, p) != _kept(b, p) for a, b in zip(sides.a, sides.b, strict=True)
               for p in range(a.kept.shape[0])) or bool(nbest_swaps(reference, sides))


def step_swaps(reference: DecodeReference, sides: Sides) -> list[BeamSwap]:
    """Per step, the first prompt whose candidates B would keep are not A's, judged."""
    swaps = []
    dtype = reference.logits[0].dtype
    for step, (a, g, b) in enumerate(zip(sides.a, sides.golden, sides.b, strict=True), 1):
        prompt = next((p for p in range(a.kept.shape[0]) if _kept(a, p) != _kept(b, p)), None)
        if prompt is None:
            continue
        budget = step_budget(_judged(a.scores, g.scores, b.scores, dtype))
        a_only, b_only = _kept(a, prompt) - _kept(b, prompt), _kept(b, prompt) - _kept(a, prompt)
        row = a.scores[prompt]
        x, y = min(a_only, key=lambda c: row[c]), max(b_only, key=lambda c: row[c])
        vocab = row.shape[0] // a.kept.shape[1]
        swaps.append(_swap(step, prompt, (x, y), (f"{x // vocab}:{x % vocab}",
                                                  f"{y // vocab}:{y % vocab}"),
                           (row, g.scores[prompt], b.scores[prompt],
                            None if sides.b64 is None else sides.b64[step - 1].scores[prompt]),
                           budget))
    return swaps


def nbest_swaps(reference: DecodeReference, sides: Sides) -> list[BeamSwap]:
    """Per prompt, the first n-best rank where B ranks another hypothesis than A, judged."""
    k, penalty = reference.beams.beams, reference.beams.length_penalty
    vocab = reference.logits[0].shape[-1]
    pools = pool(sides.a, reference.tokens, reference.parents, vocab)
    dtype = reference.logits[0].dtype
    swaps = []
    for prompt, hypotheses in enumerate(pools):
        scores = [None if history is None else rescored(history, hypotheses, penalty)
                  for history in (sides.a, sides.golden, sides.b, sides.b64)]
        a_scores, _, b_scores, _ = scores
        a_rank, b_rank = (s.argsort(descending=True, stable=True)[:k].tolist()
                          for s in (a_scores, b_scores))
        rank = next((i for i, (x, y) in enumerate(zip(a_rank, b_rank, strict=True)) if x != y),
                    None)
        if rank is None:
            continue
        budget = step_budget(_judged(a_scores, scores[1], b_scores, dtype))
        x, y = a_rank[rank], b_rank[rank]
        swaps.append(_swap(None, prompt, (x, y), (_tokens(hypotheses[x]), _tokens(hypotheses[y])),
                           scores, budget, rank=rank))
    return swaps


def _swap(step: int | None, prompt: int, pair: tuple[int, int], names: tuple[str, str],
          scores: tuple, budget: float | None, rank: int | None = None) -> BeamSwap:
    """A swap of ``pair[0]`` (A keeps) for ``pair[1]`` (B keeps), by the sides' ``scores``."""
    a, golden, b, b64 = scores
    x, y = pair
    change = max(abs(float(b[c]) - float(golden[c])) for c in pair)
    return BeamSwap(step=step, prompt=prompt, a_keeps=names[0], b_keeps=names[1],
                    margin=float(a[x] - a[y]), change=change, budget=budget,
                    verdict=flip_verdict(a, golden, x, y, budget, b64, among=pair), rank=rank)


def _kept(scored: BeamStep, prompt: int) -> set[int]:
    return set(scored.kept[prompt].tolist()) | set(scored.ended[prompt])


def _judged(a: torch.Tensor, golden: torch.Tensor, b: torch.Tensor, dtype: torch.dtype
            ) -> Result:
    """B's scores against the golden's with A's as the baseline, in the logits' ``dtype``."""
    return judge({"scores": b.to(dtype)}, {"scores": golden}, {"scores": a.to(dtype)},
                 "forward")


def _tokens(hypothesis: Hypothesis) -> str:
    return " ".join(map(str, hypothesis.tokens))


# --------------------------------------------------------------------------------------------
# The reorder


def reorder_entry(side: Side, reference: DecodeReference, step: int, module: str
                  ) -> tuple[Entry | None, list[str]]:
    """B's state reordered before ``step`` along A's parents: the first tensor whose rows do
    not hold their parents' afterwards (``module``'s first), and a note per such tensor."""
    stale: list[tuple[str, str]] = []
    reorder, calls = side.reorder, 0

    def checking(state: PyTree, index: torch.Tensor) -> PyTree:
        nonlocal calls
        calls += 1
        if calls != step:
            return reorder(state, index)
        before = {p: t.clone() for p, t in state_tensors(side.model, state).items()}
        state = reorder(state, index)
        stale.extend(_stale(before, state_tensors(side.model, state), index))
        return state

    dataclasses.replace(side, reorder=checking).decode(step, reference.tokens,
                                                       reference.parents)
    if not stale:
        return None, []
    own = [s for s in stale if s[0].startswith(f"{module}.")] or stale
    path, detail = own[0]
    notes = [f"the reorder before step {step}: {p}: {d}" for p, d in stale]
    return Entry(f"{module} @ step {step}", path, detail, via="reorder"), notes


def state_tensors(model: nn.Module, state: PyTree) -> dict[str, torch.Tensor]:
    """Every tensor of a decoding's state by path: in what the step returned (``state.…``)
    and on the model's modules (buffers left out)."""
    found = {p: t for p, t in _walk_objects(state, "state")}
    for name, module in model.named_modules():
        for attribute, value in own_state(module).items():
            if attribute not in module._buffers:
                prefix = f"{name}.{attribute}" if name else attribute
                found.update(flatten_tensors(value, prefix))
    return found


def _walk_objects(value: PyTree, path: str, depth: int = 0):
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, nn.Module) or depth > 4:
        return
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _walk_objects(item, f"{path}.{key}", depth + 1)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _walk_objects(item, f"{path}.{index}", depth + 1)
    elif hasattr(value, "__dict__"):
        for key, item in vars(value).items():
            if not key.startswith("_"):
                yield from _walk_objects(item, f"{path}.{key}", depth + 1)


def _stale(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor],
           index: torch.Tensor) -> list[tuple[str, str]]:
    """Per tensor with a row per hypothesis, the rows that do not hold their parent's."""
    rows = len(index)
    found = []
    for path, old in before.items():
        new = after.get(path)
        if new is None or old.dim() == 0 or old.shape[0] != rows or new.shape != old.shape:
            continue
        wanted = old.index_select(0, index.to(old.device))
        wrong = (new != wanted).flatten(1).any(1).nonzero().flatten().tolist()
        if not wrong:
            continue
        parents = index.cpu()[wrong].tolist()
        kept = "; not reordered at all" if torch.equal(new, old) else ""
        found.append((path, f"rows {_listed(wrong)} of {rows} do not hold their parents' "
                            f"positions (their parents: rows {_listed(parents)}){kept}"))
    return found


def _listed(numbers: list[int], most: int = 6) -> str:
    shown = ", ".join(map(str, numbers[:most]))
    return shown + (f" and {len(numbers) - most} more" if len(numbers) > most else "")
