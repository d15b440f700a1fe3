"""Cached decoding step by step: the prompt, then one token per step through the model's own
KV cache, each step's next-token logits kept.

One step is ``step(model, tokens, state) -> (logits, state)``: ``tokens`` (batch, new) are the
prompt on the first step (``state`` None) and one token id per sequence afterwards; ``logits``
(batch, vocab) predict the next token. :func:`hf_step` is that step for ``transformers``
decoder-only language models (their ``DynamicCache``, positions counted over real tokens);
:func:`decode_steps` drives any step, either greedily (each step fed the argmax of the last)
or teacher-forced (fed given tokens, so two runs of different precision see the same
sequence however a near tie falls).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchparity.errors import UsageError
from torchparity.subject import hf

#: ``step(model, tokens, state) -> (logits, state)``; ``state`` is None before the prompt.
Step = Callable[[nn.Module, torch.Tensor, Any], tuple[torch.Tensor, Any]]


@dataclass
class HFState:
    """What a ``transformers`` causal LM carries between steps: its cache and the attention
    mask of every token so far (1 real, 0 padding)."""

    cache: Any
    mask: torch.Tensor


def steppable(model: nn.Module) -> bool:
    """Whether :func:`hf_step` can decode ``model``: a generating ``transformers`` model that
    is decoder-only."""
    return hf.generates(model) and not getattr(model.config, "is_encoder_decoder", False)


def hf_step(prompt_mask: torch.Tensor | None) -> Step:
    """The step of a ``transformers`` causal LM whose prompt has attention mask
    ``prompt_mask`` (None: no padding). Positions count real tokens only, as the reference
    models' do: with a left-padded prompt they are ``generate``'s; after a right-padded one the
    new tokens continue from the last real token (``generate`` counts from the padding)."""
    def step(model: nn.Module, tokens: torch.Tensor, state: HFState | None
             ) -> tuple[torch.Tensor, HFState]:
        from transformers import DynamicCache

        if state is None:
            mask = torch.ones_like(tokens) if prompt_mask is None else prompt_mask
            state = HFState(DynamicCache(config=model.config), mask.to(tokens.device))
        else:
            state.mask = torch.cat((state.mask, torch.ones_like(tokens)), dim=1)
        positions = (state.mask.long().cumsum(-1) - 1).clamp(min=0)[:, -tokens.shape[1]:]
        output = model(input_ids=tokens, attention_mask=state.mask, position_ids=positions,
                       use_cache=True, **{_cache_argument(model): state.cache})
        return output.logits[:, -1], state

    return step


def _cache_argument(model: nn.Module) -> str:
    """``cache`` in recent ``transformers``, ``past_key_values`` before."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


@torch.no_grad()
def decode_steps(model: nn.Module, step: Step, prompt: torch.Tensor, steps: int,
                 tokens: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """``steps`` steps from ``prompt`` (batch, length): ``{"logits": (batch, steps, vocab),
    "tokens": (batch, steps)}``. Each step after the first is fed ``tokens[:, s - 1]`` when
    ``tokens`` are given (teacher forcing), else the argmax of the previous step's logits."""
    logits, chosen, state, fed = [], [], None, prompt
    for index in range(steps):
        step_logits, state = step(model, fed, state)
        logits.append(step_logits)
        token = step_logits.argmax(-1) if tokens is None else tokens[:, index].to(
            step_logits.device)
        chosen.append(token)
        fed = token[:, None]
    return {"logits": torch.stack(logits, 1), "tokens": torch.stack(chosen, 1)}


def prompt_of(inputs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The prompt ``input_ids`` and ``attention_mask`` of keyword inputs."""
    if not isinstance(inputs, Mapping) or "input_ids" not in inputs:
        raise UsageError("decoding step by step needs keyword inputs with input_ids (a dict)")
    return inputs["input_ids"], inputs.get("attention_mask")
