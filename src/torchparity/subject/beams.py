"""Beam search on the step protocol: the search itself, the prompt expanded to its beams, and
the built-in ``reorder`` of the models torchparity decodes by itself.

A search of ``K`` beams decodes ``batch * K`` rows: the prompt is repeated ``K`` times row by
row (as ``generate`` expands it), beam 0 of every prompt starts with score 0 and the others
with ``-inf``, so the first step picks ``K`` tokens of one hypothesis. At every step each
live row ``r`` extends by every token, the candidate ``(beam, token)`` scoring the row's summed
log-probability plus the token's (in float64, from the logits a side returned); the ``K`` best
candidates that do not end the sequence continue, those ending in ``eos`` among the ``K`` best
are finished hypotheses. The n-best list ranks finished and live hypotheses by their sum over
``length ** length_penalty`` (``length``: tokens after the prompt).

:class:`BeamSearch` decides for one side (A) and replays the same decisions along another
side's logits (B, the goldens), giving that side's scores of every candidate and what it would
have kept: two revisions judged along one search.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

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
    """``beams`` hypotheses per prompt; ``eos``: the token that ends a hypothesis (None: every
    hypothesis runs every step); the n-best rank by score / length ** ``length_penalty``."""

    beams: int
    length_penalty: float = LENGTH_PENALTY
    eos: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The settings as a report's JSON writes them.

        Returns:
            ``beams``, ``length_penalty`` and ``eos`` by name.
        """
        return {"beams": self.beams, "length_penalty": self.length_penalty, "eos": self.eos}


def search_settings(given: object, label: str) -> BeamSettings | None:
    """The factory's ``search`` key as settings, checked so a typo fails before any run.

    Args:
        given: ``{"beams": 4, "length_penalty": 1.0, "eos": None}`` (the last two optional),
            or None for no beam search.
        label: what a message calls the key (``the search of factory m.py:make``).

    Returns:
        The settings, or None when ``given`` is None.

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
    """One step of a search as one side scores it: ``scores`` (prompts, beams * vocab) of every
    candidate ``beam * vocab + token``, and the candidates that side keeps, ``kept`` (prompts,
    beams) live and ``ended[p]`` finished, best first."""

    scores: torch.Tensor
    kept: torch.Tensor
    ended: list[list[int]]


@dataclass
class Hypothesis:
    """A hypothesis of the n-best pool: the step it ended at (the last step for live ones),
    the prompt, the candidate at that step, and its tokens after the prompt."""

    step: int
    prompt: int
    candidate: int
    tokens: tuple[int, ...]


@dataclass
class BeamSearch:
    """A beam search over ``prompts`` prompts; :meth:`decide` is the ``decide`` of
    :func:`~torchparity.subject.decoding.teacher_forced` (own choices), :meth:`follow` the
    same search along given choices. ``history[s - 1]`` is step ``s`` as this side scored it."""

    settings: BeamSettings
    prompts: int
    history: list[BeamStep] = field(default_factory=list)
    sums: torch.Tensor | None = None  # (prompts, beams): each live row's summed log-probs

    def decide(self, step: int, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens and parent rows of ``step`` chosen from this side's own ``logits``.

        Args:
            step: the step, from 1.
            logits: the step's logits, (rows, vocab), rows being prompts x beams.

        Returns:
            The tokens fed next and, for each row, the row it continues, both (rows,).
        """
        scored = self._score(logits)
        self._advance(scored, scored.kept)
        return self._fed(scored.kept, logits.shape[-1])

    def follow(self, logits: list[torch.Tensor], choices: list[BeamStep]) -> list[BeamStep]:
        """This side's scores and would-be choices at every step, along another side's choices.

        Args:
            logits: this side's logits, ``logits[s]`` at step ``s + 1``.
            choices: the other side's ``history``, whose kept candidates are followed.

        Returns:
            This side's ``history``: what it scored, and would have kept, at each step.
        """
        for step, chosen in enumerate(choices, 1):
            self._advance(self._score(logits[step - 1]), chosen.kept)
        return self.history

    def _score(self, logits: torch.Tensor) -> BeamStep:
        k, vocab = self.settings.beams, logits.shape[-1]
        if logits.shape[0] != self.prompts * k:
            raise ValueError(f"{logits.shape[0]} rows, not {self.prompts} prompts x {k} beams")
        if self.sums is None:
            self.sums = torch.full((self.prompts, k), float("-inf"), dtype=torch.float64)
            self.sums[:, 0] = 0.0
        logp = torch.log_softmax(logits.double(), -1).view(self.prompts, k, vocab)
        scores = (self.sums[:, :, None] + logp).view(self.prompts, k * vocab)
        ranked = scores.topk(min(2 * k, scores.shape[-1]), -1).indices
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
    """Per prompt, every hypothesis a search ended or kept to the end: the n-best candidates.

    Args:
        choices: the search's history, one :class:`BeamStep` per step.
        tokens: the tokens it fed, (rows, steps).
        parents: the parent row of each fed token, (rows, steps).
        vocab: the vocabulary size, to split a candidate into beam and token.

    Returns:
        One list of hypotheses per prompt, in the order they ended.
    """
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
    """The length-penalised scores of ``hypotheses`` as a side's ``history`` scored them.

    Args:
        history: one side's scores at every step.
        hypotheses: hypotheses of the pool, maybe found by another side.
        length_penalty: the exponent of the length divided by.

    Returns:
        One float64 score per hypothesis, in order.
    """
    return torch.tensor([float(history[h.step - 1].scores[h.prompt, h.candidate])
                         / len(h.tokens) ** length_penalty for h in hypotheses],
                        dtype=torch.float64)


def lineage(tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """The tokens each row holds after the last step.

    The tokens fed were appended to reordered rows, so a row's history is its parents'
    tokens, traced back step by step.

    Args:
        tokens: the tokens fed, (rows, steps).
        parents: each fed token's parent row, (rows, steps).

    Returns:
        Each row's tokens after the prompt, (rows, steps).
    """
    rows, steps = tokens.shape
    held = torch.empty(rows, 0, dtype=torch.long)
    for step in range(steps):
        held = torch.cat((held[parents[:, step]], tokens[:, step:step + 1]), 1)
    return held


# --------------------------------------------------------------------------------------------
# The prompt and the state


def expand_prompt(inputs: PyTree, beams: int) -> PyTree:
    """The prompt with each sequence repeated ``beams`` times in a row, as ``generate`` does.

    Args:
        inputs: the prompt's inputs.
        beams: the hypotheses per prompt.

    Returns:
        The inputs with every tensor whose first dimension is the batch's (that of the first
        tensor) repeated along it; others (a shared table) as they were.
    """
    batch = prompt_rows(inputs)
    return map_tensors(inputs, lambda t: t.repeat_interleave(beams, 0)
                       if t.dim() and t.shape[0] == batch else t)


def prompt_rows(inputs: PyTree) -> int | None:
    """The rows (sequences) of a prompt.

    Args:
        inputs: the prompt's inputs.

    Returns:
        The first dimension of its first tensor that has one, or None.
    """
    found: list[int] = []
    map_tensors(inputs, lambda t: found.append(t.shape[0]) if t.dim() else None)
    return found[0] if found else None


def reorder_rows(tree: PyTree, index: torch.Tensor) -> PyTree:
    """``tree`` with row ``index[r]`` of every batched tensor as its row ``r``.

    Args:
        tree: a step's state or inputs.
        index: the parent row of each row.

    Returns:
        The tree with tensors whose first dimension is ``len(index)`` reordered; others, such as
        a shared table, as they were.
    """
    return map_tensors(tree, lambda t: t.index_select(0, index.to(t.device))
                       if t.dim() and t.shape[0] == len(index) else t)


def reorder_cache(cache: Any, index: torch.Tensor) -> Any:
    """A ``transformers`` cache with its rows reordered along the beams' parents.

    Args:
        cache: a cache object with ``reorder_cache`` (5.x, reordered in place), the (key,
            value) tuples per layer of 4.x, or None.
        index: the parent row of each row.

    Returns:
        The reordered cache (the same object for 5.x), or None.
    """
    if cache is None:
        return None
    if callable(getattr(cache, "reorder_cache", None)):
        cache.reorder_cache(index)
        return cache
    return tuple(tuple(t.index_select(0, index.to(t.device)) for t in layer) for layer in cache)


def reorderable(cache: Any) -> bool:
    """Whether :func:`reorder_cache` can reorder ``cache``."""
    return cache is None or callable(getattr(cache, "reorder_cache", None)) or (
        isinstance(cache, tuple) and all(isinstance(layer, tuple) and all(
            isinstance(t, torch.Tensor) for t in layer) for layer in cache))


def builtin_reorder(model: nn.Module) -> ReorderFn | None:
    """The ``reorder`` of a model whose step torchparity provides, or None.

    Reference models reorder their ``KVCache``; ``transformers`` generators their cache,
    masks, positions and encoder outputs (see ``subject.decoding.builtin_step``).

    Args:
        model: the model decoded.

    Returns:
        :func:`reference_reorder`, :func:`hf_reorder`, or None: the factory must give one.
    """
    if callable(getattr(model, "new_cache", None)) and hasattr(model, "config"):
        return reference_reorder
    if hf.generates(model):
        return functools.partial(hf_reorder, model)
    return None


def reference_reorder(state: dict[str, Any], index: torch.Tensor) -> dict[str, Any]:
    """A reference model's step state reordered along the beams' parents.

    Args:
        state: its ``KVCache`` (reordered in place) and the inputs every step passes on.
        index: the parent row of each row.

    Returns:
        The state with the same cache and the inputs reordered.
    """
    state["cache"].reorder(index)
    return {"cache": state["cache"], "inputs": reorder_rows(state["inputs"], index)}


def hf_reorder(model: nn.Module, state: dict[str, Any], index: torch.Tensor
               ) -> dict[str, Any]:
    """A ``transformers`` step's state reordered along the beams' parents: the cache by its own
    ``reorder_cache``, else by the model's ``_reorder_cache`` (XLNet's memories), as
    ``generate`` reorders it.

    A cache neither can reorder is dropped where the state keeps the whole sequence: the next
    step then runs it again (full recomputation, said once on stderr).

    Args:
        model: the model decoded.
        state: the cache and every tensor beside it (attention masks, position ids, the
            encoder's outputs).
        index: the parent row of each row.

    Returns:
        The state with each of them reordered.
    """
    rest = reorder_rows({key: value for key, value in state.items() if key != "cache"}, index)
    if "cache" not in state:  # a full recompute's: tensors alone
        return rest
    cache, own = state["cache"], getattr(model, "_reorder_cache", None)
    if not reorderable(cache) and callable(own):
        return {**rest, "cache": own(cache, index)}
    if not reorderable(cache) and "input_ids" in state:
        recomputing(model, f"its cache ({type(cache).__name__}) cannot be reordered in a beam "
                           "search")
        return {**rest, "cache": None}
    return {**rest, "cache": reorder_cache(cache, index)}
