""":class:`Float64Run` over a model sharded by a plan (what ``golden update --nproc N`` runs on
every rank): the outputs, loss and gradients of the unsharded model in float64, bit for bit,
with the parameters as a tensor-parallel plan leaves them (DTensors) and as FSDP2 swaps them
while a unit runs (unsharded tensors of their own); and no float64 weight outlives its module's
call, DTensor or not: autograd keeps the parameter, and the backward casts it again.

One rank in this process (a mesh of one over gloo) has the same parameters' types as N ranks;
that N ranks make the goldens of one process is tests/golden/test_sharded.py's."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.distributed as dist

import sharded_models
from torchparity.subject.blockwise import Float64Run
from torchparity.subject.running import projection_loss


@pytest.fixture
def mesh(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                            world_size=1)
    try:
        yield init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    finally:
        dist.destroy_process_group()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return sharded_models.TinyLM().eval()


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def _float64_copy(model: torch.nn.Module, ids: torch.Tensor):
    double = copy.deepcopy(model).double()
    loss = projection_loss({"logits": double(ids)})
    params = dict(double.named_parameters())
    return loss, dict(zip(params, torch.autograd.grad(loss, list(params.values())),
                          strict=True))


class _Watched(Float64Run):
    """A float64 run that keeps a weak reference to every float64 weight it casts."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.casts: list[weakref.ref] = []

    def value(self, name: str, parameter: torch.Tensor) -> torch.Tensor:
        value = super().value(name, parameter)
        self.casts.append(weakref.ref(value))
        return value


@pytest.mark.parametrize("plan", ["tensor parallel", "fsdp2"])
def test_a_float64_run_over_shards_is_the_float64_model_and_keeps_no_float64_weight(
        mesh, plan):
    model = _model()
    ids = sharded_models.tokens()
    loss, grads = _float64_copy(model, ids)
    (sharded_models.MINE_TP if plan == "tensor parallel" else sharded_models.MINE_FSDP)(
        model, mesh)
    if plan == "tensor parallel":
        assert type(model.layers[0].attn.q.weight).__name__ == "DTensor"
    found = {}
    with _Watched(model, on_grad=lambda name, grad: found.__setitem__(name, _whole(grad))
                  ) as run:
        found_loss = projection_loss({"logits": model(ids)})
        gc.collect()
        alive = [ref for ref in run.casts if ref() is not None]
        run.backward(found_loss)
    assert not alive  # every cast of the forward died with its module's call
    assert torch.equal(found_loss, loss)
    assert found.keys() == grads.keys()
    assert all(torch.equal(found[name], grad) for name, grad in grads.items())
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_a_tied_weight_is_one_gradient_named_as_the_model_names_it_under_fsdp2(mesh):
    # While a unit runs, FSDP2 gives both modules that hold a tied weight one unsharded
    # tensor of its own: the float64 run hands over one gradient, the sum of both uses, under
    # the name one process gives it (named_parameters' first), not one per module.
    model = _model()
    model.head.weight = model.embed.weight
    ids = sharded_models.tokens()
    loss, grads = _float64_copy(model, ids)
    sharded_models.MINE_FSDP(model, mesh)
    found = {}
    with Float64Run(model, on_grad=lambda name, grad: found.__setitem__(name, _whole(grad))
                    ) as run:
        run.backward(projection_loss({"logits": model(ids)}))
    assert "embed.weight" in grads and "head.weight" not in grads
    assert found.keys() == grads.keys()
    assert all(torch.equal(found[name], grad) for name, grad in grads.items())
