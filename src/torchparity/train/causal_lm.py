"""The training recipe of a ``transformers`` causal LM that brings none: an ``hf:FAMILY``
entry, or a factory that returns such a model without ``batches`` or ``optimizer`` (what it
leaves out is taken from here).

It is the recipe of a fine-tuning run with ``transformers``' Trainer, made small and
deterministic: seeded random token batches (:data:`BATCH` rows of :data:`SEQUENCE` tokens,
the same on every machine), the model's own loss on its labels (the inputs; the model shifts
them), AdamW whose no-decay group holds what the Trainer's ``get_decay_parameter_names``
leaves out (biases, and the weights of every norm), a linear warm-up of :data:`WARMUP` steps
to a constant learning rate, gradients clipped to norm :data:`CLIP`. The model stays in the
mode it was built in (an ``hf:`` model in eval mode: no dropout, so every run of the recipe
is the same mathematics).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from torchparity.subject.model import Subject

BATCH, SEQUENCE = 4, 16
PEAK_LR, WARMUP, DECAY, BETAS, CLIP = 1e-3, 5, 0.1, (0.9, 0.95), 1.0
#: The names the Trainer keeps out of weight decay (``Trainer.get_decay_parameter_names``).
NO_DECAY_NAMES = (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")
#: Token ids below this are left out of the batches: pad, bos and eos in the tiny models.
FIRST_TOKEN = 3


def is_causal_lm(model: nn.Module) -> bool:
    """Whether ``model`` is one of ``transformers``' causal LMs (``AutoModelForCausalLM``'s
    classes: ``LlamaForCausalLM``, ``GPT2LMHeadModel``, ...), which compute their own loss
    from ``labels``."""
    try:
        from transformers import PreTrainedModel
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return False
    return (isinstance(model, PreTrainedModel)
            and type(model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def with_recipe(subject: Subject) -> Subject:
    """``subject`` with what its factory left out of its training recipe taken from this one,
    where its model is a causal LM: the batches, the optimizer (and with it the schedule),
    and the step unless the factory gives a ``loss_fn``. Any other model: unchanged."""
    if not is_causal_lm(subject.model):
        return subject
    config = subject.model.config
    # a multimodal family keeps its vocabulary in its language model's config
    vocab = int(getattr(config, "vocab_size", None) or config.get_text_config().vocab_size)
    defaults: dict[str, object] = {}
    if subject.batches is None:
        defaults["batches"] = lambda step: token_batches(step, vocab)
    if subject.optimizer is None:
        defaults["optimizer"] = optimizer
        if subject.scheduler is None:
            defaults["scheduler"] = scheduler
    if subject.train_step is None and subject.loss_fn is None:
        defaults["train_step"] = train_step
    return dataclasses.replace(subject, **defaults)


def token_batches(step: int, vocab: int) -> dict[str, torch.Tensor]:
    """Step ``step``'s batch: random tokens of ids ``FIRST_TOKEN``..``vocab - 1``, drawn from
    a generator seeded by the step; the labels are the tokens."""
    generator = torch.Generator().manual_seed(10_000 + step)
    tokens = torch.randint(FIRST_TOKEN, vocab, (BATCH, SEQUENCE), generator=generator)
    return {"input_ids": tokens, "attention_mask": torch.ones_like(tokens),
            "labels": tokens.clone()}


def decay_parameter_names(model: nn.Module) -> set[str]:
    """The parameters that decay, as the Trainer picks them: none inside a LayerNorm, none
    whose name says bias or norm."""
    from transformers.trainer_pt_utils import get_parameter_names

    try:
        return set(get_parameter_names(model, [nn.LayerNorm], list(NO_DECAY_NAMES)))
    except TypeError:  # 4.x, whose Trainer leaves out the biases only
        return {n for n in get_parameter_names(model, [nn.LayerNorm]) if "bias" not in n}


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW in two named groups, ``decay`` and ``no_decay``."""
    decaying = decay_parameter_names(model)
    # as the Trainer: frozen parameters (a router's running bias) are not optimised
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return torch.optim.AdamW([
        {"params": [p for n, p in named if n in decaying], "weight_decay": DECAY,
         "name": "decay"},
        {"params": [p for n, p in named if n not in decaying], "weight_decay": 0.0,
         "name": "no_decay"},
    ], lr=PEAK_LR, betas=BETAS)


def scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """A linear warm-up of ``WARMUP`` steps to the peak, then constant."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / WARMUP))


def train_step(model: nn.Module, batch: dict[str, torch.Tensor],
               opt: torch.optim.Optimizer) -> torch.Tensor:
    """The model's own loss on the batch's labels, backward, clipping, the update."""
    loss = model(**batch).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss
