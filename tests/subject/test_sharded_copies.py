"""A run's copy of a sharded model is planned on the meta device and then given storage
(distributed/sharding.py): the gradient hooks the plan put on its parameters must survive that, or
the copy computes other gradients than the model (a plan that reduces a gradient in a hook)."""

from __future__ import annotations

import torch
from torch import nn

from torchparity.distributed import sharding


def test_a_gradient_hook_the_plan_put_on_a_meta_parameter_runs_on_the_copy():
    with torch.device("meta"):
        model = nn.Linear(3, 2)
    model.weight.register_hook(lambda grad: 2 * grad)  # what a plan may do
    sharding._materialised(model, "cpu")
    with torch.no_grad():
        model.weight.copy_(torch.arange(6.0).reshape(2, 3))
        model.bias.zero_()
    inputs = torch.tensor([[1.0, 2.0, 3.0]])
    model(inputs).sum().backward()
    # d(sum(W x))/dW is x in every row; the hook doubles it, and leaves the bias alone
    assert torch.equal(model.weight.grad, 2 * inputs.expand(2, 3))
    assert torch.equal(model.bias.grad, torch.ones(2))
