"""The optimizer's groups compared by meaning (:mod:`torchparity.train.optimizer_groups`): a
value computed another way by the recipe is the same value; a parameter that changed group
and a hyper-parameter that changed are named, with both values, at the first step they differ.
"""

from __future__ import annotations

import torch
from torch import nn

from torchparity.train.optimizer_groups import OptimizerGroups, compare_groups


def groups(norm_decays: bool, lrs: list[float]) -> OptimizerGroups:
    """AdamW over a linear layer and a norm, the norm's weight in ``decay`` or not, run with
    the learning rates ``lrs``."""
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    decay = [model[0].weight, *([model[1].weight] if norm_decays else [])]
    rest = [model[0].bias, model[1].bias, *([] if norm_decays else [model[1].weight])]
    optimizer = torch.optim.AdamW([{"params": decay, "name": "decay"},
                                   {"params": rest, "weight_decay": 0.0, "name": "no_decay"}])
    described = OptimizerGroups.of(optimizer, model, ["decay", "no_decay"])
    for lr in lrs:
        for group in optimizer.param_groups:
            group["lr"] = lr
        described.record(optimizer)
    return OptimizerGroups.from_dict(described.to_dict())


def test_a_learning_rate_computed_another_way_is_the_same_value():
    # 0.1 * 3 is 0.30000000000000004: one rounding of float64 from 0.3
    assert compare_groups(groups(False, [0.3, 0.2]), groups(False, [0.1 * 3, 0.2]), 2) == []


def test_a_moved_parameter_and_a_changed_lr_are_named_with_the_step_and_both_values():
    changes = compare_groups(groups(False, [1e-3, 2e-3, 3e-3]),
                             groups(True, [1e-3, 2.2e-3, 3e-3]), 3)
    assert [(c.sentence, c.step, c.members) for c in changes] == [
        ("1 parameter moved from group no_decay to decay: 1.weight", 1, True),
        ("lr at step 2 in groups decay, no_decay: 0.002 (A) vs 0.0022 (B)", 2, False)]
    # up to step 1 only the membership differs
    assert [c.members for c in compare_groups(groups(False, [1e-3, 2e-3]),
                                              groups(True, [1e-3, 2.2e-3]), 1)] == [True]
