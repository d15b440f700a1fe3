"""Decoding one step at a time: the protocol torchparity's decoding loop drives.

A *step* is ``step(model, tokens, state) -> (logits, state)``. The first call gets the
factory's ``inputs`` (the prompt, in whatever form the model takes) and ``state=None``; each
later call gets a LongTensor ``(batch, 1)`` of the next token ids and the state the previous
call returned. ``logits`` is ``(batch, vocab)`` or ``(batch, positions, vocab)``, the last
position being the next token's. torchparity owns the loop (:func:`teacher_forced`), so two
revisions, or a model and its float64 copy, are fed the same tokens: a difference at one step
cannot change what the next step sees. A beam search also reorders the state between steps:
``reorder(state, index) -> state`` keeps row ``index[r]`` of the state as row ``r`` (the parent
of every new row, :mod:`~torchparity.subject.beams`), and the loop calls it before every step
that has parents, so two revisions reorder exactly where the search did.

Models that need no step of their own (:func:`builtin_step`): torchparity's reference models
(``DecoderLM``, ``EncoderDecoder``, with their ``KVCache``), ``transformers`` causal LMs (their
cache object, the attention mask growing by one per step, position ids of left-padded prompts
as ``generate`` computes them) and ``transformers`` encoder-decoders (the encoder run once,
``decoder_input_ids``, the cache).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchparity.errors import UsageError
from torchparity.subject import hf
from torchparity.text import wrapped

#: ``step(model, tokens, state) -> (logits, state)``: one decoding step of a model.
StepFn = Callable[[nn.Module, Any, Any], tuple[torch.Tensor, Any]]
#: ``reorder(state, index) -> state``: the state with row ``index[r]`` as its row ``r``.
ReorderFn = Callable[[Any, torch.Tensor], Any]
#: ``decide(step, logits) -> (tokens, parents)``: what a search feeds at ``step`` given the
#: logits of the step before: the token of every row and the row it continues (None: its own).
DecideFn = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]
#: The help every "needs a step" message ends with.
STEP_HINT = ("return a dict from the factory with a 'step' key: step(model, tokens, state) -> "
             "(logits, state), called first with the inputs and state=None, then with (batch, 1) "
             "token ids")


# --------------------------------------------------------------------------------------------
# The loop


@dataclass
class Decoding:
    """What a teacher-forced decoding saw: ``logits[s]`` is step ``s``'s next-token logits
    ``(batch, vocab)`` (step 0 is the prompt), ``tokens[:, s - 1]`` the tokens fed at step
    ``s`` and ``parents[:, s - 1]`` the rows they continue (None when no row changed its
    parent: greedy or given tokens)."""

    logits: list[torch.Tensor]
    tokens: torch.Tensor
    parents: torch.Tensor | None = None

    @property
    def steps(self) -> int:
        """Decoding steps after the prompt."""
        return len(self.logits) - 1


@dataclass(frozen=True)
class Fed:
    """What a decoding is fed: ``tokens`` (batch, steps) and, in a beam search, the rows they
    continue, ``parents`` (batch, steps)."""

    tokens: torch.Tensor
    parents: torch.Tensor | None = None


def teacher_forced(step: StepFn, model: nn.Module, inputs: Any, steps: int,
                   fed: torch.Tensor | Fed | None = None, *, reorder: ReorderFn | None = None,
                   decide: DecideFn | None = None,
                   during: Callable[[int], contextlib.AbstractContextManager] | None = None,
                   ) -> Decoding:
    """Run the prompt and ``steps`` further steps, feeding the tokens ``fed`` or, when None,
    what ``decide`` chooses from the model's own logits at the step before (default: the
    greedy choice). Before a step with parents (those of ``fed``, or those ``decide`` gives)
    the state is ``reorder``-ed to them.

    Every step's return is checked (:func:`next_token_logits`); the logits are kept detached
    on the CPU; a problem names the step by its ``label`` attribute, else "the step".
    Guarantees: the model sees exactly the tokens returned in ``tokens``.

    Args:
        step: ``step(model, tokens, state) -> (logits, state)``.
        model: the model decoded.
        inputs: the prompt, as the step's first call takes it.
        steps: the steps after the prompt.
        fed: the tokens ``(batch, steps)``, or a :class:`Fed` of them and, in a beam search,
            the rows they continue (``parents[:, s - 1]`` before step ``s``); None: the
            model's own choices.
        reorder: ``reorder(state, index) -> state``, keeping row ``index[r]`` as row ``r``.
        decide: chooses a step's tokens (and parents) from the logits of the step before,
            where ``fed`` is None.
        during: ``during(s)`` gives a context the call of step ``s`` runs in (a capture of
            that step).

    Returns:
        The :class:`Decoding`: every step's logits, the tokens fed and their parents.
    """
    tokens, parents = (fed.tokens, fed.parents) if isinstance(fed, Fed) else (fed, None)
    label = getattr(step, "label", "the step")
    if steps < 0:
        raise UsageError(f"steps={steps}: decode zero or more steps after the prompt")
    if tokens is not None and (tokens.dim() != 2 or tokens.shape[1] < steps):
        raise UsageError(f"tokens must be (batch, steps) = (batch, {steps}) token ids; got shape "
                         f"{tuple(tokens.shape)}")
    if parents is not None and (tokens is None or parents.shape != tokens.shape):
        raise UsageError("parents must come with tokens of the same shape (batch, steps)")
    during = during or (lambda s: contextlib.nullcontext())
    logits: list[torch.Tensor] = []
    fed: list[torch.Tensor] = []
    moved: list[torch.Tensor] = []
    state, device = None, None
    for s in range(steps + 1):
        if s == 0:
            given = inputs
        else:
            if tokens is not None:
                token = tokens[:, s - 1]
                parent = None if parents is None else parents[:, s - 1]
            elif decide is not None:
                token, parent = decide(s, logits[-1])
            else:
                token, parent = logits[-1].argmax(-1), None
            if parent is not None:
                if reorder is None:
                    raise UsageError(f"{label} has no reorder for a beam search; return a "
                                     "'reorder' key from the factory: reorder(state, index) -> "
                                     "state, keeping row index[r] of the state as row r")
                state = reorder(state, parent.to(device))
                moved.append(parent)
            fed.append(token)
            given = token[:, None].to(device)  # beside the logits the model returned
        with during(s):
            returned = step(model, given, state)
        if not (isinstance(returned, tuple) and len(returned) == 2):
            raise UsageError(f"{label} returned {_describe(returned)} at step {s}; it must "
                             "return a pair (logits, state)")
        out, state = returned
        batch = logits[0].shape[0] if logits else None
        if tokens is not None and batch is None and tokens.shape[0] != _batch(out):
            raise UsageError(f"the tokens hold {tokens.shape[0]} sequence(s), the prompt "
                             f"{_batch(out)}; give one line of token ids per sequence")
        logits.append(next_token_logits(out, batch, s, label).detach())
        device = logits[-1].device
        logits[-1] = logits[-1].cpu()
    chosen = torch.stack(fed, 1) if fed else torch.empty(logits[0].shape[0], 0, dtype=torch.long)
    rows = torch.stack(moved, 1).cpu() if moved and len(moved) == len(fed) else None
    return Decoding(logits, chosen.cpu(), rows)


def _batch(out: Any) -> int | None:
    return out.shape[0] if isinstance(out, torch.Tensor) and out.dim() else None


def next_token_logits(out: Any, batch: int | None, step: int, label: str) -> torch.Tensor:
    """The ``(batch, vocab)`` next-token logits of what a step returned as logits; a one-line
    :class:`UsageError` naming what it returned and what it should be otherwise (``batch``:
    the prompt's, None at the prompt)."""
    want = "(batch, vocab) or (batch, positions, vocab) floating logits"
    if not isinstance(out, torch.Tensor):
        hint = "; return its .logits" if hasattr(out, "logits") else ""
        raise UsageError(f"{label} returned {_describe(out)} as logits at step {step}; it must "
                         f"return {want}{hint}")
    if not out.is_floating_point() or out.dim() not in (2, 3) or 0 in out.shape:
        raise UsageError(f"{label} returned logits of shape {tuple(out.shape)} "
                         f"{str(out.dtype).removeprefix('torch.')} at step {step}; it must return "
                         f"{want}")
    if batch is not None and out.shape[0] != batch:
        raise UsageError(f"{label} returned logits for {out.shape[0]} sequence(s) at step {step}, "
                         f"for {batch} at the prompt; keep the batch of the prompt")
    return out if out.dim() == 2 else out[:, -1]


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a Tensor{tuple(value.shape)}"
    if isinstance(value, tuple):
        return f"a tuple of {len(value)}"
    return "None" if value is None else f"a {type(value).__name__}"


# --------------------------------------------------------------------------------------------
# Tokens from a file


def read_tokens(path: str | Path, steps: int | None = None) -> torch.Tensor:
    """The token ids of ``path``: one sequence per line, ids separated by spaces or commas
    (what a beam search or a seeded sampler produced), as a ``(batch, steps)`` LongTensor.

    ``steps`` (default: the shortest line's length) cuts every line to that many tokens; a line
    shorter than ``steps``, a word that is no token id or an empty file is a one-line
    :class:`UsageError`."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise UsageError(f"cannot read the tokens file {path}: {exc.strerror or exc}") from None
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.replace(",", " ").split()
        if not words:
            continue
        bad = next((w for w in words if not w.isdigit()), None)
        if bad is not None:
            raise UsageError(f"tokens file {path} line {number}: {bad!r} is not a token id; "
                             "write one sequence of non-negative integer ids per line")
        rows.append([int(w) for w in words])
    if not rows:
        raise UsageError(f"tokens file {path} holds no token ids; write one sequence per line")
    length = min(len(r) for r in rows) if steps is None else steps
    short = next((i for i, r in enumerate(rows) if len(r) < length), None)
    if short is not None:
        raise UsageError(f"tokens file {path}: sequence {short} has {len(rows[short])} token(s), "
                         f"fewer than the {length} steps asked for (--steps)")
    return torch.tensor([r[:length] for r in rows], dtype=torch.long)


# --------------------------------------------------------------------------------------------
# Built-in steps


def builtin_step(model: nn.Module) -> StepFn | None:
    """The step of a model torchparity decodes by itself, or None: reference models (which
    make a ``new_cache``), ``transformers`` encoder-decoders and causal LMs."""
    if callable(getattr(model, "new_cache", None)) and hasattr(model, "config"):
        return reference_step
    if hf.generates(model):
        return seq2seq_step if model.config.is_encoder_decoder else causal_lm_step
    return None


def recompute_step(model: nn.Module) -> StepFn | None:
    """A step that runs the whole sequence so far without a cache, for the models whose cached
    step :func:`builtin_step` gives (encoder-decoders of ``transformers`` excepted); None for
    others. Compared with the cached step it checks the cache."""
    if callable(getattr(model, "new_cache", None)) and hasattr(model, "config"):
        return reference_recompute_step
    if hf.generates(model) and not model.config.is_encoder_decoder:
        return causal_lm_recompute_step
    return None


def _keywords(inputs: Any, what: str) -> dict[str, Any]:
    if not isinstance(inputs, Mapping):
        raise UsageError(f"the built-in step of {what} takes the prompt as a dict of keyword "
                         f"arguments; got {_describe(inputs)}; or {STEP_HINT}")
    return dict(inputs)


def _with_input_ids(inputs: Any, what: str) -> dict[str, Any]:
    """A transformers prompt's keyword arguments, which must hold its ``input_ids``."""
    keywords = _keywords(inputs, what)
    if "input_ids" not in keywords:
        raise UsageError(f"the prompt has no 'input_ids' (it has {', '.join(keywords)}); "
                         f"or {STEP_HINT}")
    return keywords


def _grown(mask: torch.Tensor | None) -> torch.Tensor | None:
    """The 1/0 mask with one more real position per sequence (None stays None)."""
    if mask is None:
        return None
    return torch.cat((mask, torch.ones_like(mask[:, :1])), dim=1)


def _reference_keys(model: nn.Module) -> tuple[str, str]:
    return ("tgt_ids", "tgt_mask") if model.config.is_encoder_decoder else ("input_ids",
                                                                            "attention_mask")


def reference_step(model: nn.Module, tokens: Any, state: Any) -> tuple[torch.Tensor, Any]:
    """A reference ``DecoderLM`` / ``EncoderDecoder`` step with its ``KVCache``: the prompt is
    the model's keyword arguments (``input_ids``, or ``src_ids`` and ``tgt_ids``, with their
    masks), later steps feed the new token and the mask of every token so far."""
    ids_key, mask_key = _reference_keys(model)
    if state is None:
        inputs = _keywords(tokens, "a reference model")
        cache = model.new_cache()
        return model(**inputs, cache=cache), {"cache": cache, "inputs": inputs}
    inputs = dict(state["inputs"])
    inputs[ids_key] = tokens
    inputs[mask_key] = _grown(inputs.get(mask_key))
    return model(**inputs, cache=state["cache"]), {"cache": state["cache"], "inputs": inputs}


def reference_recompute_step(model: nn.Module, tokens: Any, state: Any
                             ) -> tuple[torch.Tensor, Any]:
    """A reference model's step by full recompute: every step runs the whole sequence."""
    ids_key, mask_key = _reference_keys(model)
    if state is None:
        inputs = _keywords(tokens, "a reference model")
    else:
        inputs = dict(state)
        inputs[ids_key] = torch.cat((inputs[ids_key], tokens), dim=1)
        inputs[mask_key] = _grown(inputs.get(mask_key))
    return model(**inputs), inputs


def _cache_keyword(model: nn.Module) -> str:
    """``cache`` (transformers 5) or ``past_key_values`` (earlier versions), as the model's
    forward, or the first one up its classes that names either, takes it."""
    for cls in type(model).__mro__:
        forward = cls.__dict__.get("forward")
        names = inspect.signature(forward).parameters if forward is not None else {}
        for name in ("cache", "past_key_values"):
            if name in names:
                return name
    return "past_key_values"


def _prompt_positions(model: nn.Module, mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Position ids as ``generate`` makes them: each token's index among the real tokens of
    its row (left padding does not shift a prompt), 0 on padding."""
    if mask is None or "position_ids" not in inspect.signature(model.forward).parameters:
        return {}
    positions = mask.long().cumsum(-1) - 1
    return {"position_ids": positions.masked_fill(mask == 0, 0)}


def causal_lm_step(model: nn.Module, tokens: Any, state: Any) -> tuple[torch.Tensor, Any]:
    """A ``transformers`` causal LM step as ``generate`` takes it: the cache ``generate`` starts
    with (or none, for a model that makes its own), the model's own
    ``prepare_inputs_for_generation`` choosing what each call is fed, and
    ``_update_model_kwargs_for_generation`` growing the mask and positions. Of the prompt,
    ``input_ids`` and ``attention_mask`` are used (other inputs are for the forward pass, not
    for decoding); positions of left-padded prompts are those ``generate`` computes.

    A state without a cache (the model returned none, or a beam search could not reorder it)
    runs the whole sequence again, as a prompt: decoding by full recomputation. A model that
    returns no cache may still fill the one it is given (a BERT-style model built without
    ``is_decoder``), attending from the prompt to tokens after it: that is not decoding."""
    if not _generates_by_next_sequence_length():
        return _explicit_causal_lm_step(model, tokens, state)
    if state is None:
        inputs = _with_input_ids(tokens, "a transformers model")
        ids, mask = inputs["input_ids"], inputs.get("attention_mask")
        kwargs = {"use_cache": True, **_prompt_positions(model, mask)}
        if mask is not None:
            kwargs["attention_mask"] = mask
        key, cache = "cache", _generation_cache(model)
    else:
        ids = torch.cat((state["input_ids"], tokens), 1)
        kwargs, key, cache = state["kwargs"], state["cache_key"], state["cache"]
    if cache is not None:
        kwargs = {**kwargs, key: cache}
    whole = state is None or cache is None
    fed = ({"next_sequence_length": ids.shape[1], "is_first_iteration": True} if whole
           else {"next_sequence_length": 1})
    out = model(**model.prepare_inputs_for_generation(ids, **fed, **kwargs), return_dict=True)
    kwargs = model._update_model_kwargs_for_generation(out, dict(kwargs))
    for name in _CACHE_NAMES:  # the cache goes on only as the model returned it
        kwargs.pop(name, None)
    key = next((name for name in _CACHE_NAMES if out.get(name) is not None), "cache")
    cache = out.get(key)
    if cache is None:  # a BERT-style model that is no decoder, or one without a cache
        recomputing(model, "it returns no cache")
    return out.logits, {"input_ids": ids, "cache": cache, "cache_key": key, "kwargs": kwargs}


#: The names ``transformers`` models keep a cache under (``state``: RWKV, ``mems``: XLNet).
_CACHE_NAMES = ("cache", "past_key_values", "cache_params", "state", "mems",
                "past_buckets_states")
_said: set[str] = set()


def recomputing(model: nn.Module, why: str) -> None:
    """Say once, on stderr, that ``model`` is decoded by full recomputation, and ``why``."""
    line = f"torchparity: {type(model).__name__}: decoding by full recomputation: {why}"
    if line not in _said:
        _said.add(line)
        print(wrapped(line), file=sys.stderr, flush=True)


@functools.cache
def _generates_by_next_sequence_length() -> bool:
    """Whether the installed ``transformers`` feeds ``prepare_inputs_for_generation`` the
    length of the tokens not yet cached (releases before it slice by ``cache_position``)."""
    from transformers import GenerationMixin

    return "next_sequence_length" in inspect.signature(
        GenerationMixin.prepare_inputs_for_generation).parameters


def _generation_cache(model: nn.Module) -> Any:
    """The cache ``generate`` gives a model before its first call: a ``DynamicCache`` of its
    text config, or None for the models that make a cache of their own."""
    from transformers import DynamicCache

    if not model._supports_default_dynamic_cache():
        return None
    return DynamicCache(config=model.config.get_text_config(decoder=True))


def _explicit_causal_lm_step(model: nn.Module, tokens: Any, state: Any
                             ) -> tuple[torch.Tensor, Any]:
    """The step of :func:`causal_lm_step` on releases that slice by ``cache_position``: the
    model's cache object, the mask growing by one per step, positions one past the last. A
    model that returns no cache under the name its forward takes is decoded by
    :func:`causal_lm_recompute_step`."""
    if state is not None and "recomputed" in state:
        logits, recomputed = causal_lm_recompute_step(model, tokens, state["recomputed"])
        return logits, {"recomputed": recomputed}
    cache_key = _cache_keyword(model)
    if state is None:
        inputs = _with_input_ids(tokens, "a transformers model")
        mask = inputs.get("attention_mask")
        kwargs = {"input_ids": inputs["input_ids"], **_prompt_positions(model, mask)}
    else:
        mask = _grown(state["attention_mask"])
        kwargs = {"input_ids": tokens, cache_key: state["cache"]}
        if "position_ids" in state:
            kwargs["position_ids"] = state["position_ids"][:, -1:] + 1
    if mask is not None:
        kwargs["attention_mask"] = mask
    out = model(**kwargs, use_cache=True)
    following = {"cache": out.get(cache_key), "attention_mask": mask}
    if "position_ids" in kwargs:
        following["position_ids"] = kwargs["position_ids"]
    # A cache of fixed size that its forward made to the prompt's length (4.x's HybridCache
    # of Gemma 2) has no room for the next token.
    capacity = getattr(following["cache"], "max_cache_len", None)
    full = capacity is not None and capacity <= kwargs["input_ids"].shape[1]
    if state is None and (following["cache"] is None or full):  # the state of a recompute
        recomputing(model, f"its {type(following['cache']).__name__} holds the prompt only"
                    if full else "it returns no cache")
        del following["cache"]
        return out.logits, {"recomputed": {**following, "input_ids": kwargs["input_ids"]}}
    return out.logits, following


def causal_lm_recompute_step(model: nn.Module, tokens: Any, state: Any
                             ) -> tuple[torch.Tensor, Any]:
    """A ``transformers`` causal LM step by full recompute (``use_cache=False``), with the
    positions of :func:`causal_lm_step` (each new token one past the last)."""
    if state is None:
        inputs = _keywords(tokens, "a transformers model")
        ids, mask = inputs["input_ids"], inputs.get("attention_mask")
        kwargs = _prompt_positions(model, mask)
    else:
        ids, mask = torch.cat((state["input_ids"], tokens), 1), _grown(state["attention_mask"])
        kwargs = {}
        if "position_ids" in state:
            last = state["position_ids"]
            kwargs["position_ids"] = torch.cat((last, last[:, -1:] + 1), 1)
    kwargs["input_ids"] = ids
    if mask is not None:
        kwargs["attention_mask"] = mask
    following = {"input_ids": ids, "attention_mask": mask}
    if "position_ids" in kwargs:
        following["position_ids"] = kwargs["position_ids"]
    return model(**kwargs, use_cache=False).logits, following


def seq2seq_step(model: nn.Module, tokens: Any, state: Any) -> tuple[torch.Tensor, Any]:
    """A ``transformers`` encoder-decoder step: the encoder runs once on the prompt's
    ``input_ids`` and ``attention_mask``; the decoder starts from the prompt's
    ``decoder_input_ids`` (else the config's ``decoder_start_token_id``) and keeps its cache."""
    cache_key = _cache_keyword(model)
    if state is None:
        inputs = _with_input_ids(tokens, "a transformers encoder-decoder")
        ids, mask = inputs["input_ids"], inputs.get("attention_mask")
        encoded = model.get_encoder()(input_ids=ids, attention_mask=mask, return_dict=True)
        decoder_ids = inputs.get("decoder_input_ids")
        if decoder_ids is None:
            start = model.config.decoder_start_token_id
            if start is None:
                raise UsageError("the prompt has no 'decoder_input_ids' and the config no "
                                 "decoder_start_token_id; give decoder_input_ids")
            decoder_ids = torch.full((ids.shape[0], 1), start, dtype=torch.long,
                                     device=ids.device)
        state = {"encoder_outputs": encoded, "attention_mask": mask, "cache": None,
                 "decoder_attention_mask": inputs.get("decoder_attention_mask")}
        tokens = decoder_ids
    else:
        state = {**state, "decoder_attention_mask": _grown(state["decoder_attention_mask"])}
    kwargs = {"encoder_outputs": state["encoder_outputs"], "decoder_input_ids": tokens}
    for key in ("attention_mask", "decoder_attention_mask"):
        if state[key] is not None:
            kwargs[key] = state[key]
    if state["cache"] is not None:
        kwargs[cache_key] = state["cache"]
    out = model(**kwargs, use_cache=True)
    return out.logits, {**state, "cache": out[cache_key]}
