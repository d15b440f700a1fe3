"""Beam search on the step protocol, the prompt expanded to its beams, and the built-in ``reorder``.

:class:`BeamSearch` decides for one side (A) and replays the same decisions along another side's
logits (B, the goldens): two revisions judged along one search.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from torchparity.errors import UsageError
from torchparity.subject import hf
from torchparity.subject.decoding import ReorderFn, recomputing
from torchparity.subject.trees import PyTree, map_tensors

#: Defaults of the command line and of :class:`BeamSettings` (those of ``generate``).
LENGTH_PENALTY = 1.0


@dataclass(frozen=True)
class BeamSettings:
    """``beams`` hypotheses per prompt; the n-best rank by score / length ** ``length_penalty``."""

    beams: int
    length_penalty: float = LENGTH_PENALTY
    eos: int | None = None  # the token that ends a hypothesis; None: every one runs every step

    def to_dict(self) -> dict[str, object]:
        """The settings as a report's JSON writes them."""
        return {"beams": self.beams, "length_penalty": self.length_penalty, "eos": self.eos}


def search_settings(given: object, label: str) -> BeamSettings | None:
    """The factory's ``search`` key (``{"beams": 4}``, optionally ``length_penalty``, ``eos``).

    Raises:
        UsageError: ``given`` is not such a dict, or ``beams`` is not a positive int.
    """
    if given is None:
        return None
    fields = ("beams", "length_penalty", "eos")
    if not (isinstance(given, dict) and "beams" in given and set(given) <= set(fields)) or \
            not isinstance(given["beams"], int) or given["beams"] < 1:
        raise UsageError(f"{label} is {given!r}; give a dict like {{'beams': 4}} (beams >= 1, "
                         "optionally 'length_penalty' and 'eos')")
    return BeamSettings(**given)


@dataclass
class BeamStep:
    """One step as one side scores it; a candidate is ``beam * vocab + token``."""

    scores: torch.Tensor  # (prompts, beams * vocab): every candidate's
    kept: torch.Tensor  # (prompts, beams): the live candidates kept, best first
    ended: list[list[int]]  # per prompt, the candidates that finished, best first


@dataclass
class Hypothesis:
    """A hypothesis of the n-best pool: the step it ended at (the last step for live ones)."""

    step: int
    prompt: int
    candidate: int
    tokens: tuple[int, ...]


@dataclass
class BeamSearch:
    """A beam search over ``prompts`` prompts: :meth:`decide` its own way or :meth:`follow`."""

    settings: BeamSettings
    prompts: int
    # history[s - 1] is step s as this side scored it
    history: list[BeamStep] = field(default_factory=list)
    sums: torch.Tensor | None = None  # (prompts, beams): each live row's summed log-probs

    def decide(self, step: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens fed next and the row each row continues, both (rows,), from ``logits``."""
        scored = self._score(logits)
        self._advance(scored, scored.kept)
        return self._fed(scored.kept, logits.shape[-1])

    def follow(self, logits: list[torch.Tensor], choices: list[BeamStep]) -> list[BeamStep]:
        """This side's scores and would-be choices at every step, along another side's."""
        # logits[s] is step s + 1's
        for step, chosen in enumerate(choices, 1):
            self._advance(self._score(logits[step - 1]), chosen.kept)
        return self.history

    def _score(self, logits: torch.Tensor) -> BeamStep:
        k, vocab = self.settings.beams, logits.shape[-1]
        if logits.shape[0] != self.prompts * k:
            raise ValueError(f"{logits.shape[0]} rows, not {self.prompts} prompts x {k} beams")
        if self.sums is None:  # beam 0 starts at 0, the others at -inf: step 1 grows one hypothesis
            self.sums = torch.full((self.prompts, k), float("-inf"), dtype=torch.float64)
            self.sums[:, 0] = 0.0
        logp = torch.log_softmax(logits.double(), -1).view(self.prompts, k, vocab)
        scores = (self.sums[:, :, None] + logp).view(self.prompts, k * vocab)
        ranked = scores.topk(min(2 * k, scores.shape[-1]), -1).indices
        # the k best that do not end continue; those ending in eos among the k best are finished
        kept, ended = [], []
        for row in ranked.tolist():
            ends = [c for c in row if self._ends(c, vocab)]
            going = [c for c in row if not self._ends(c, vocab)][:k]
            kept.append(going)
            ended.append([c for c in ends if row.index(c) < k])
        return BeamStep(scores, torch.tensor(kept, dtype=torch.long), ended)

    def _ends(self, candidate: int, vocab: int) -> bool:
        return self.settings.eos is not None and candidate % vocab == self.settings.eos

    def _advance(self, scored: BeamStep, kept: torch.Tensor) -> None:
        self.history.append(scored)
        self.sums = scored.scores.gather(1, kept)

    def _fed(self, kept: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        first_row = torch.arange(self.prompts)[:, None] * self.settings.beams
        return (kept % vocab).flatten(), (first_row + kept // vocab).flatten()


def pool(choices: list[BeamStep], tokens: torch.Tensor, parents: torch.Tensor, vocab: int
         ) -> list[list[Hypothesis]]:
    """Per prompt, every hypothesis a search ended or kept to the end, in the order they ended."""
    # tokens and parents are (rows, steps); a candidate is beam * vocab + token
    beams, steps = choices[0].kept.shape[1], len(choices)
    pools: list[list[Hypothesis]] = [[] for _ in choices[0].ended]
    for step, chosen in enumerate(choices, 1):
        held = lineage(tokens[:, :step - 1], parents[:, :step - 1])
        for prompt, hypotheses in enumerate(pools):
            ends = chosen.ended[prompt] + (chosen.kept[prompt].tolist() if step == steps else [])
            for candidate in ends:
                row = prompt * beams + candidate // vocab
                hypotheses.append(Hypothesis(step, prompt, candidate,
                                             (*held[row].tolist(), candidate % vocab)))
    return pools


def rescored(history: list[BeamStep], hypotheses: list[Hypothesis], length_penalty: float
             ) -> torch.Tensor:
    """The length-penalised scores of ``hypotheses`` (maybe another side's) in ``history``."""
    return torch.tensor([float(history[h.step - 1].scores[h.prompt, h.candidate])
                         / len(h.tokens) ** length_penalty for h in hypotheses],
                        dtype=torch.float64)


def lineage(tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """The tokens each row holds after the last step, (rows, steps)."""
    rows, steps = tokens.shape
    # a fed token was appended to a reordered row: trace the parents back
    held = torch.empty(rows, 0, dtype=torch.long)
    for step in range(steps):
        held = torch.cat((held[parents[:, step]], tokens[:, step:step + 1]), 1)
    return held


# --------------------------------------------------------------------------------------------
# The prompt and the state


def expand_prompt(inputs: PyTree, beams: int) -> PyTree:
    """The prompt with each sequence repeated ``beams`` times in a row, as ``generate`` does."""
    # only tensors with the batch's first dimension; a shared table stays
    batch = prompt_rows(inputs)
    return map_tensors(inputs, lambda t: t.repeat_interleave(beams, 0)
                       if t.dim() and t.shape[0] == batch else t)


def prompt_rows(inputs: PyTree) -> int | None:
    """The first dimension of the prompt's first tensor that has one, or None."""
    found: list[int] = []
    map_tensors(inputs, lambda t: found.append(t.shape[0]) if t.dim() else None)
    return found[0] if found else None


def reorder_rows(tree: PyTree, index: torch.Tensor) -> PyTree:
    """``tree`` with row ``index[r]`` of every tensor with ``len(index)`` rows as its row ``r``."""
    return map_tensors(tree, lambda t: t.index_select(0, index.to(t.device))
                       if t.dim() and t.shape[0] == len(index) else t)


def reorder_cache(cache: object, index: torch.Tensor) -> object:
    """A ``transformers`` cache with its rows reordered along the beams' parents."""
    if cache is None:
        return None
    # 5.x: a Cache object reordered in place; 4.x: (key, value) per layer
    if callable(getattr(cache, "reorder_cache", None)):
        cache.reorder_cache(index)
        return cache
    return tuple(tuple(t.index_select(0, index.to(t.device)) for t in layer) for layer in cache)


def reorderable(cache: object) -> bool:
    """Whether :func:`reorder_cache` can reorder ``cache``."""
    return cache is None or callable(getattr(cache, "reorder_cache", None)) or (
        isinstance(cache, tuple) and all(isinstance(layer, tuple) and all(
            isinstance(t, torch.Tensor) for t in layer) for layer in cache))


def builtin_reorder(model: nn.Module) -> ReorderFn | None:
    """The ``reorder`` of a reference or ``transformers`` model; None: the factory gives one."""
    if callable(getattr(model, "new_cache", None)) and hasattr(model, "config"):
        return reference_reorder
    if hf.generates(model):
        return functools.partial(hf_reorder, model)
    return None


def reference_reorder(state: PyTree, index: torch.Tensor) -> PyTree:
    """A reference model's step state with its ``KVCache`` (in place) and inputs reordered."""
    state["cache"].reorder(index)
    return {"cache": state["cache"], "inputs": reorder_rows(state["inputs"], index)}


def hf_reorder(model: nn.Module, state: PyTree, index: torch.Tensor) -> PyTree:
    """A ``transformers`` step's state reordered along the beams' parents, as ``generate`` does."""
    rest = reorder_rows({key: value for key, value in state.items() if key != "cache"}, index)
    if "cache" not in state:  # a full recompute's: tensors alone
        return rest
    # the cache's own reorder_cache, else the model's (XLNet's memories)
    cache, own = state["cache"], getattr(model, "_reorder_cache", None)
    if not reorderable(cache) and callable(own):
        return {**rest, "cache": own(cache, index)}
    # neither: the state keeps the whole sequence, so drop the cache and recompute
    if not reorderable(cache) and "input_ids" in state:
        recomputing(model, f"its cache ({type(cache).__name__}) cannot be reordered in a beam "
                           "search")
        return {**rest, "cache": None}
    return {**rest, "cache": reorder_cache(cache, index)}
