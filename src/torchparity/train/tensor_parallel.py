"""The tensor-parallel plan of the reference models (Megatron-style, with DTensor).

Attention: q/k/v column-wise (each rank computes its own heads), the output projection
row-wise (partial sums all-reduced). MLP: gate/up column-wise, down row-wise. Token and
position embeddings and norms are replicated; the LM head is column-wise with its logits
gathered, or replicated when it is tied to the token embeddings.

Each attention module is told its local head counts, so its reshapes split the projections
into the right heads; with ALiBi it also learns which global heads it holds (the slopes depend
on the head's index). Key/value projections are sharded by heads when ``n_kv_heads`` is a
multiple of the degree, so a rank keeps whole GQA groups; a single KV head (MQA) is replicated
(:class:`ReplicatedParallel`). :func:`torchparity.train.parallel.tensor_parallel_problem`
refuses every other layout before anything is built.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from torchparity.reference.attention import Attention
from torchparity.reference.mlp import MLP
from torchparity.reference.positions import alibi_bias


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Apply the plan of the module docstring to ``model`` in place over the 1-D ``mesh``.

    ``model``'s config must pass :func:`torchparity.train.parallel.tensor_parallel_problem`.
    """
    degree, rank = mesh.size(), mesh.get_local_rank()
    for module in model.modules():
        if isinstance(module, Attention):
            plan = attention_plan(module, degree)
            parallelize_module(module, mesh, plan)
            shard_heads(module, degree, rank, kv_sharded=isinstance(plan["k_proj"],
                                                                    ColwiseParallel))
        elif isinstance(module, MLP):
            parallelize_module(module, mesh, mlp_plan(module))
    if not model.config.tie_embeddings:
        parallelize_module(model, mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})


def attention_plan(attention: Attention, degree: int) -> dict[str, ParallelStyle]:
    """Heads split column-wise, the output projection row-wise; MQA's KV replicated."""
    kv = ColwiseParallel() if attention.n_kv_heads % degree == 0 else ReplicatedParallel()
    return {"q_proj": ColwiseParallel(), "k_proj": kv, "v_proj": kv,
            "o_proj": RowwiseParallel()}


def mlp_plan(mlp: MLP) -> dict[str, ParallelStyle]:
    """The hidden width split: gate/up column-wise, down row-wise."""
    plan = {"up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
    if mlp.gate_proj is not None:
        plan["gate_proj"] = ColwiseParallel()
    return plan


def shard_heads(attention: Attention, degree: int, rank: int, *, kv_sharded: bool) -> None:
    """Make ``attention`` reshape into its local heads: rank ``rank`` of ``degree`` holds query
    heads ``[rank * n, (rank + 1) * n)`` and, when ``kv_sharded``, their KV groups."""
    global_heads = attention.n_heads
    attention.n_heads = global_heads // degree
    if kv_sharded:
        attention.n_kv_heads //= degree
    if attention.positions == "alibi":
        attention.__class__ = _alibi_sharded(type(attention))
        attention.global_heads, attention.head_offset = global_heads, rank * attention.n_heads


def _alibi_sharded(cls: type[Attention]) -> type[Attention]:
    """``cls`` computing the ALiBi bias of its own heads only (FSDP2 swaps classes alike)."""

    class HeadShardedAttention(cls):
        def position_bias(self, q: torch.Tensor, ctx) -> torch.Tensor | None:
            bias = alibi_bias(ctx.q_positions, ctx.k_positions, self.global_heads, q.dtype)
            return bias[:, self.head_offset:self.head_offset + self.n_heads]

    HeadShardedAttention.__name__ = HeadShardedAttention.__qualname__ = f"HeadSharded{cls.__name__}"
    return HeadShardedAttention


class ReplicatedParallel(ParallelStyle):
    """A linear layer replicated on every rank, inside a head-sharded region.

    Its input is the replicated activation, but its output feeds only this rank's heads, so the
    gradient arriving at its output is partial on each rank. The output is marked so: the
    backward sums that gradient over the ranks first, and the weights' and the input's
    gradients come out whole and replicated. The forward is the plain replicated layer.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=_replicated_input,
                                 output_fn=_partial_gradient_output)


def _replicated_input(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)


def _partial_gradient_output(module: nn.Module, output: DTensor,
                             mesh: DeviceMesh) -> torch.Tensor:
    # The redistribution is the identity forward; backward, it all-reduces the Partial gradient.
    return output.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
