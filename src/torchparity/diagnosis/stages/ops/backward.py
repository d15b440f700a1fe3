"""The backward ops of one module call: what its gradient computes, op by op.

The call runs forward under anomaly detection, so that each autograd node keeps the stack of
the forward op that made it, then backward from the recorded output gradient with the ops
captured: a backward op carries the lines of the forward op it differentiates.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from torchparity.comparison.selection import PaddingSpec
from torchparity.diagnosis.stages.ops.capture import OpRecorder, Step, detached_copy
from torchparity.subject.trees import flatten_tensors

__all__ = ["capture_backward"]


def capture_backward(module: nn.Module, args: tuple, kwargs: dict,
                     grad_out: dict[str, torch.Tensor], padding: PaddingSpec = None
                     ) -> list[Step]:
    """The ops of ``module``'s backward from ``grad_out`` (gradients by output path), its
    floating inputs made leaves that require grad; [] when no output takes a gradient."""
    args, kwargs = detached_copy((args, kwargs))  # the recorded inputs stay as they were
    leaves = [t.requires_grad_() for t in _floating(args, kwargs)]
    with torch.enable_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # anomaly detection's own warning: wanted here
        with torch.autograd.detect_anomaly(check_nan=False):
            outputs = flatten_tensors(module(*args, **kwargs))
    seeds = [(outputs[p], g.to(outputs[p])) for p, g in grad_out.items()
             if p in outputs and outputs[p].requires_grad]
    if not seeds:
        return []
    targets = leaves + [p for p in module.parameters() if p.requires_grad]
    if not targets:
        return []
    recorder = OpRecorder(nn.Module(), None, backward=True, padding=padding)
    with recorder:  # autograd.grad: the module's own .grad stays as it was
        torch.autograd.grad([o for o, _ in seeds], targets, [g for _, g in seeds],
                            allow_unused=True)
    return recorder.steps


def _floating(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    flat = {**flatten_tensors(args, "args"), **flatten_tensors(kwargs, "kwargs")}
    return [t for t in flat.values() if t.is_floating_point()]
