"""Decoding one step at a time: the protocol torchparity's decoding loop drives.

A *step* is ``step(model, tokens, state) -> (logits, state)``: first called with the factory's
``inputs`` and ``state=None``, then with the next token ids ``(batch, 1)`` and the state it
returned; ``logits`` is ``(batch, vocab)`` or ``(batch, positions, vocab)``, the last position
the next token's. torchparity owns the loop (:func:`teacher_forced`), so two revisions are fed
the same tokens: a difference at one step cannot change what the next sees. A beam search also
calls ``reorder(state, index) -> state`` (row ``index[r]`` becomes row ``r``) before every step
with parents, so two revisions reorder exactly where the search did.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from torchparity.errors import UsageError
from torchparity.subject import hf
from torchparity.subject.trees import PyTree
from torchparity.text import with_article, wrapped

#: ``step(model, tokens, state) -> (logits, state)``: one decoding step of a model.
StepFn = Callable[[nn.Module, PyTree, PyTree], tuple[torch.Tensor, PyTree]]
#: ``reorder(state, index) -> state``: the state with row ``index[r]`` as its row ``r``.
ReorderFn = Callable[[PyTree, torch.Tensor], PyTree]
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
    """What a teacher-forced decoding saw; step 0 is the prompt."""

    logits: list[torch.Tensor]  # logits[s]: step s's next-token logits (batch, vocab)
    tokens: torch.Tensor  # tokens[:, s - 1]: fed at step s
    parents: torch.Tensor | None = None  # the rows they continue; None: greedy or given tokens

    @property
    def steps(self) -> int:
        """Decoding steps after the prompt."""
        return len(self.logits) - 1


@dataclass(frozen=True)
class Fed:
    """What a decoding is fed: ``tokens`` and, in a beam search, the rows they continue."""

    tokens: torch.Tensor  # (batch, steps)
    parents: torch.Tensor | None = None  # (batch, steps)


def teacher_forced(step: StepFn, model: nn.Module, inputs: PyTree, steps: int,
                   fed: torch.Tensor | Fed | None = None, *, reorder: ReorderFn | None = None,
                   decide: DecideFn | None = None,
                   during: Callable[[int], contextlib.AbstractContextManager] | None = None,
                   ) -> Decoding:
    """Run the prompt and ``steps`` further steps, the model seeing exactly the ``tokens`` returned.

    Args:
        step: ``step(model, tokens, state) -> (logits, state)``; messages name its ``label``.
        model: the model decoded.
        inputs: the prompt, as the step's first call takes it.
        steps: the steps after the prompt.
        fed: the tokens ``(batch, steps)``, or a :class:`Fed` with the rows they continue
            (``parents[:, s - 1]`` before step ``s``); None: what ``decide`` chooses from the
            logits of the step before (default: greedy).
        reorder: ``reorder(state, index) -> state``, called before a step with parents.
        decide: chooses a step's tokens (and parents) from the logits of the step before.
        during: ``during(s)`` gives a context step ``s`` runs in (a capture of that step).

    Returns:
        Every step's logits (detached, on the CPU), the tokens fed and their parents.
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


def _batch(out: object) -> int | None:
    return out.shape[0] if isinstance(out, torch.Tensor) and out.dim() else None


def next_token_logits(out: object, batch: int | None, step: int, label: str) -> torch.Tensor:
    """The ``(batch, vocab)`` next-token logits a step returned, else a one-line UsageError."""
    # batch: the prompt's, None at the prompt
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


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a Tensor{tuple(value.shape)}"
    if isinstance(value, tuple):
        return f"a tuple of {len(value)}"
    return "None" if value is None else with_article(type(value).__name__)


# --------------------------------------------------------------------------------------------
# Tokens from a file


def read_tokens(path: str | Path, steps: int | None = None) -> torch.Tensor:
    """The ``(batch, steps)`` token ids of ``path``: one sequence a line, spaces or commas."""
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
    # steps (default: the shortest line's length) cuts every line
    length = min(len(r) for r in rows) if steps is None else steps
    short = next((i for i, r in enumerate(rows) if len(r) < length), None)
    if short is not None:
        raise UsageError(f"tokens file {path}: sequence {short} has {len(rows[short])} token(s), "
                         f"fewer than the {length} steps asked for (--steps)")
    return torch.tensor([r[:length] for r in rows], dtype=torch.long)


# --------------------------------------------------------------------------------------------
# Built-in steps


def builtin_step(model: nn.Module) -> StepFn | None:
    """The step of a reference or ``transformers`` model (causal LM, encoder-decoder), or None."""
    if callable(getattr(model, "new_cache", None)) and hasattr(model, "config"):
        return reference_step
    if hf.generates(model):
        return seq2seq_step if model.config.is_encoder_decoder else causal_lm_step
    return None


def recompute_step(model: nn.Module) -> StepFn | None:
    """A step without a cache for the models :func:`builtin_step` serves (bar encoder-decoders)."""
    if callable(getattr(model, "new_cache", None)) and hasattr(model, "config"):
        return reference_recompute_step  # compared with the cached step it checks the cache
    if hf.generates(model) and not model.config.is_encoder_decoder:
        return causal_lm_recompute_step
    return None


def _keywords(inputs: PyTree, what: str) -> dict[str, PyTree]:
    if not isinstance(inputs, Mapping):
        raise UsageError(f"the built-in step of {what} takes the prompt as a dict of keyword "
                         f"arguments; got {_describe(inputs)}; or {STEP_HINT}")
    return dict(inputs)


def _with_input_ids(inputs: PyTree, what: str) -> dict[str, PyTree]:
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


def reference_step(model: nn.Module, tokens: PyTree, state: PyTree) -> tuple[torch.Tensor, PyTree]:
    """A reference ``DecoderLM`` / ``EncoderDecoder`` step with its ``KVCache``."""
    ids_key, mask_key = _reference_keys(model)
    if state is None:
        inputs = _keywords(tokens, "a reference model")
        cache = model.new_cache()
        return model(**inputs, cache=cache), {"cache": cache, "inputs": inputs}
    # later steps feed the new token and the mask of every token so far
    inputs = dict(state["inputs"])
    inputs[ids_key] = tokens
    inputs[mask_key] = _grown(inputs.get(mask_key))
    return model(**inputs, cache=state["cache"]), {"cache": state["cache"], "inputs": inputs}


def reference_recompute_step(model: nn.Module, tokens: PyTree, state: PyTree
                             ) -> tuple[torch.Tensor, PyTree]:
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
    """``cache`` (transformers 5) or ``past_key_values`` (earlier), as the forward takes it."""
    for cls in type(model).__mro__:
        forward = cls.__dict__.get("forward")
        names = inspect.signature(forward).parameters if forward is not None else {}
        for name in ("cache", "past_key_values"):
            if name in names:
                return name
    return "past_key_values"


def _prompt_positions(model: nn.Module, mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Position ids as ``generate`` makes them: left padding shifts no prompt, padding is 0."""
    if mask is None or "position_ids" not in inspect.signature(model.forward).parameters:
        return {}
    positions = mask.long().cumsum(-1) - 1
    return {"position_ids": positions.masked_fill(mask == 0, 0)}


def causal_lm_step(model: nn.Module, tokens: PyTree, state: PyTree) -> tuple[torch.Tensor, PyTree]:
    """A ``transformers`` causal LM step as ``generate`` takes it."""
    if not _generates_by_next_sequence_length():
        return _explicit_causal_lm_step(model, tokens, state)
    # of the prompt, input_ids and attention_mask only (other inputs are for the forward, not
    # decoding)
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
    # the model's own prepare_inputs_for_generation chooses what each call is fed
    out = model(**model.prepare_inputs_for_generation(ids, **fed, **kwargs), return_dict=True)
    # grows the mask and positions
    kwargs = model._update_model_kwargs_for_generation(out, dict(kwargs))
    for name in _CACHE_NAMES:  # the cache goes on only as the model returned it
        kwargs.pop(name, None)
    key = next((name for name in _CACHE_NAMES if out.get(name) is not None), "cache")
    cache = out.get(key)
    # a state without a cache runs the whole sequence again, as a prompt; a model returning no cache
    # may still fill the one given, attending past the prompt: not decoding
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
    """Whether ``transformers`` feeds the uncached length, not ``cache_position``, to generation."""
    from transformers import GenerationMixin

    return "next_sequence_length" in inspect.signature(
        GenerationMixin.prepare_inputs_for_generation).parameters


def _generation_cache(model: nn.Module) -> object:
    """The ``DynamicCache`` ``generate`` starts a model with, or None for one making its own."""
    from transformers import DynamicCache

    if not model._supports_default_dynamic_cache():
        return None
    return DynamicCache(config=model.config.get_text_config(decoder=True))


def _explicit_causal_lm_step(model: nn.Module, tokens: PyTree, state: PyTree
                             ) -> tuple[torch.Tensor, PyTree]:
    """:func:`causal_lm_step` where releases slice by ``cache_position``."""
    # a model returning no cache under the name its forward takes is recomputed
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


def causal_lm_recompute_step(model: nn.Module, tokens: PyTree, state: PyTree
                             ) -> tuple[torch.Tensor, PyTree]:
    """A ``transformers`` causal LM step by full recompute, each new position one past the last."""
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


def seq2seq_step(model: nn.Module, tokens: PyTree, state: PyTree) -> tuple[torch.Tensor, PyTree]:
    """A ``transformers`` encoder-decoder step: the encoder runs once, the decoder has a cache."""
    cache_key = _cache_keyword(model)
    if state is None:
        inputs = _with_input_ids(tokens, "a transformers encoder-decoder")
        ids, mask = inputs["input_ids"], inputs.get("attention_mask")
        encoded = model.get_encoder()(input_ids=ids, attention_mask=mask, return_dict=True)
        # else the config's decoder_start_token_id
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
