"""A user-style decoder trained sharded: the small Megatron-style decoder of
tests/self_sharded_models.py (whole in one process) trained by user_lm.py's data, AdamW with
a no-decay group, warm-up and cosine decay, and its own clipped step, sharded under torchrun
as ``SHARDED_LM`` says:

- ``fsdp``: the factory's FSDP2 plan over ``{"dp": -1}``, and a data-parallel ``train_step``:
  each rank takes its rows of the batch, FSDP2 averages the ranks' gradients, the step's loss
  is the ranks' losses all-reduced;
- ``tp``: the factory's DTensor tensor-parallel plan over ``{"tp": -1}``, every rank on the
  whole batch;
- ``manual_tp``: the factory shards the model itself, by hand (plain slices, reduced by hand);
- ``unreduced_input_grads`` (a bug): as ``manual_tp``, but the column-parallel linears never
  all-reduce their input's gradient (Megatron's ``f`` missing): the forward is one process's,
  the norms' and the embedding's gradients are each rank's share only;
- ``local_clip`` (a bug): as ``manual_tp``, but clipped by torch's ``clip_grad_norm_``,
  which clips each rank by the norm of its own slices, not the whole model's;
- ``rank_one_dies``, ``rank_one_stops``, ``rank_one_raises``: as ``manual_tp``, but rank 1 is
  killed (SIGKILL), stopped (SIGSTOP) or raises as its third step starts.

In one process every variant is the same model and recipe, so one golden judges them all
(``lm`` is the factory). The ranks import this file by its path."""

from __future__ import annotations

import functools
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]

import user_lm  # noqa: E402

import self_sharded_models as ssm  # noqa: E402
import sharded_models  # noqa: E402
import torchparity as tp  # noqa: E402

#: This recipe's gradient clipping norm.
CLIP = 1.0
VARIANTS = ("fsdp", "tp", "manual_tp", "unreduced_input_grads", "local_clip",
            "rank_one_dies", "rank_one_stops", "rank_one_raises")


def variant() -> str:
    name = os.environ.get("SHARDED_LM", "manual_tp")
    if name not in VARIANTS:
        raise ValueError(f"unknown SHARDED_LM {name!r}")
    return name


def _ranks() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def clip_whole(model, max_norm: float) -> None:
    """``clip_grad_norm_`` of the whole model, for a model whose parameters are DTensors and
    plain tensors (torch's own refuses the mix): a DTensor's squared norm gathered, a hand-made
    slice's summed over the ranks, a parameter every rank holds whole counted once."""
    from torch.distributed.tensor import DTensor

    sliced = ssm.split_dims(model) if variant() != "tp" else {}
    whole, parts = torch.zeros(()), torch.zeros(())
    grads = [(name, p.grad) for name, p in model.named_parameters() if p.grad is not None]
    for name, grad in grads:
        if isinstance(grad, DTensor):
            whole += grad.pow(2).sum().full_tensor()
        elif name in sliced:
            parts += grad.pow(2).sum()
        else:
            whole += grad.pow(2).sum()
    dist.all_reduce(parts)
    coefficient = torch.clamp(max_norm / ((whole + parts).sqrt() + 1e-6), max=1.0).item()
    for _, grad in grads:
        grad.mul_(coefficient)


def train_step(model, batch, opt) -> torch.Tensor:
    """One optimizer step: the summed token loss over the batch's target tokens, clipped.
    Under FSDP2 each rank takes its rows (data parallel): its loss times the ranks, since
    FSDP2 averages the ranks' gradients, and the step's loss is the ranks' sum."""
    rank, ranks = _ranks() if variant() == "fsdp" else (0, 1)
    n_tokens = (batch["labels"] >= 0).sum()
    tokens, labels = (batch[key].chunk(ranks)[rank] for key in ("tokens", "labels"))
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                           reduction="sum") / n_tokens
    (loss * ranks).backward()
    if _ranks()[1] > 1 and variant() not in ("fsdp", "local_clip"):  # FSDP2: all DTensors
        clip_whole(model, CLIP)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    opt.step()
    opt.zero_grad(set_to_none=True)
    total = loss.detach()
    if ranks > 1:
        dist.all_reduce(total)
    return total


class _LocalColumns(ssm.ColumnLinear):
    """A column-parallel linear without Megatron's ``f``: its input's gradient stays this
    rank's share (the columns it holds), never summed over the ranks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not getattr(self, "parallel", False):
            return super().forward(x)
        return F.linear(x, self.weight, self.bias)


def _unreduced_input_grads(model: ssm.ManualLM) -> None:
    for module in model.modules():
        if type(module) is ssm.ColumnLinear:
            module.__class__ = _LocalColumns
    ssm._correct(model)


def _fails_in_step_three(model: ssm.ManualLM, sent: signal.Signals | None) -> None:
    """Correct, but rank 1 is sent ``sent`` (None: raises) as its third step starts."""
    ssm._correct(model)
    calls = []

    def count(module, args) -> None:
        calls.append(1)
        if len(calls) == 3 and ssm.this_rank() == 1:
            if sent is not None:
                os.kill(os.getpid(), sent)
            raise FloatingPointError("planted failure in step 3 of rank 1")

    model.register_forward_pre_hook(count)


def lm() -> dict:
    """The factory: the decoder sharded as ``SHARDED_LM`` says, trained by user_lm's recipe."""
    name = variant()
    recipe = {"batches": user_lm.batches, "optimizer": user_lm.optimizer,
              "scheduler": user_lm.scheduler, "train_step": train_step}
    if name in ("fsdp", "tp"):
        model = tp.init_weights(ssm.ManualLM(), seed=0)  # whole: the plan shards it
        plan = {"fsdp": sharded_models.MINE_FSDP, "tp": sharded_models.MINE_TP}[name]
        return {**recipe, "model": model, "inputs": (sharded_models.tokens(),),
                "parallelize": plan, "mesh": {"dp": -1} if name == "fsdp" else {"tp": -1}}
    shard = {"manual_tp": None, "local_clip": None,
             "unreduced_input_grads": _unreduced_input_grads,
             "rank_one_dies": functools.partial(_fails_in_step_three, sent=signal.SIGKILL),
             "rank_one_stops": functools.partial(_fails_in_step_three, sent=signal.SIGSTOP),
             "rank_one_raises": functools.partial(_fails_in_step_three, sent=None)}[name]
    return {**recipe, **ssm._manual(shard)}
