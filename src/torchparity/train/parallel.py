"""How a reference model is spread over processes: DDP, FSDP2, tensor parallel, or FSDP2 x TP.

Every parallelism trains the same mathematics as one process; only the order of reductions
changes. The layouts:

- ``ddp``: every rank holds the whole model and a share of the batch rows; gradients are
  averaged by DDP.
- ``fsdp``: FSDP2 (``fully_shard``) on every transformer layer and on the root; parameters,
  gradients and optimizer state are sharded along their first dimension; a share of the rows.
- ``tp``: tensor parallel over all ranks, which all see the whole batch: attention heads and
  the MLP's hidden width are split (the plan is in :mod:`torchparity.train.tensor_parallel`).
- ``fsdp+tp``: a 2-D mesh ``(dp, tp)`` with ``tp = 2``: the TP plan inside each ``tp`` group,
  FSDP2 across the ``dp`` groups, which take shares of the rows.

A model that tensor parallelism cannot split correctly (heads, KV heads, widths that do not
divide) is refused with one line by :func:`tensor_parallel_problem`, never trained wrongly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from torchparity.errors import UsageError
from torchparity.reference.config import TransformerConfig
from torchparity.reference.layers import TransformerLayer

if TYPE_CHECKING:  # importing torch.distributed's mesh and tensor modules takes seconds
    from torch.distributed.device_mesh import DeviceMesh

PARALLELISMS = ("ddp", "fsdp", "tp", "fsdp+tp")
#: The tensor-parallel degree of the 2-D mesh; the rest of the ranks shard data (FSDP).
MESH_TP_DEGREE = 2


@dataclass(frozen=True)
class Layout:
    """How ``world_size`` ranks split into data-parallel and tensor-parallel dimensions."""

    parallelism: str
    world_size: int

    @property
    def tp(self) -> int:
        """Ranks that share one batch and split the layers (1 without tensor parallelism)."""
        return {"tp": self.world_size, "fsdp+tp": MESH_TP_DEGREE}.get(self.parallelism, 1)

    @property
    def dp(self) -> int:
        """Ranks that take different rows of the batch."""
        return self.world_size // self.tp

    def problem(self) -> str | None:
        """Why this layout cannot be built, or None."""
        if self.parallelism not in PARALLELISMS:
            return (f"unknown parallelism {self.parallelism!r}; choose one of "
                    f"{', '.join(PARALLELISMS)}")
        if self.world_size < 2:
            return f"--parallel {self.parallelism} needs at least 2 processes (--nproc 2)"
        if self.world_size % self.tp:
            return (f"--parallel fsdp+tp puts {MESH_TP_DEGREE} ranks in each tensor-parallel "
                    f"group; --nproc {self.world_size} is not a multiple of it")
        return None


def parallelize(model: nn.Module, layout: Layout, device_type: str) -> DeviceMesh:
    """Spread ``model`` (a reference model) over the ranks as ``layout`` says, in place; return
    the ``(dp, tp)`` device mesh. DDP is the trainer's own wrapper and has no mesh here."""
    from torch.distributed.device_mesh import init_device_mesh

    problem = layout.problem() or tensor_parallel_problem(model.config, layout.tp)
    if problem:
        raise UsageError(problem)
    mesh = init_device_mesh(device_type, (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))
    if layout.tp > 1:
        from torchparity.train.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, mesh["tp"])
    if layout.parallelism.startswith("fsdp"):
        apply_fsdp(model, mesh["dp"])
    return mesh


def apply_fsdp(model: nn.Module, mesh: DeviceMesh) -> None:
    """FSDP2 over the 1-D ``mesh``: one unit per transformer layer, the rest in the root's."""
    from torch.distributed.fsdp import fully_shard

    for module in model.modules():
        if isinstance(module, TransformerLayer):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)


def tensor_parallel_problem(config: TransformerConfig, degree: int) -> str | None:
    """Why ``config`` cannot be split over ``degree`` tensor-parallel ranks, or None.

    Heads, the MLP width and the vocabulary must divide evenly. A KV head count below the
    degree is replicated only when it is 1 (MQA: every query head uses that one head); for
    other GQA counts, replicated KV heads would pair a rank's query heads with the wrong groups.
    """
    if degree == 1:
        return None
    name = f"tensor parallel over {degree} ranks"
    if config.n_heads % degree:
        return f"{name} needs n_heads divisible by {degree}; the model has {config.n_heads}"
    kv = config.kv_heads
    if kv % degree and kv != 1:
        return (f"{name} needs n_kv_heads divisible by {degree} (or 1, replicated): with "
                f"{kv} KV heads a rank's query heads would not hold whole GQA groups")
    if config.d_ff % degree:
        return f"{name} needs d_ff divisible by {degree}; the model has {config.d_ff}"
    if config.vocab_size % degree:
        return f"{name} needs vocab_size divisible by {degree}; the model has {config.vocab_size}"
    if config.positions == "relative":
        return (f"{name} is not supported with Shaw relative positions: their key table is "
                "shared by all heads, so its gradient would be partial on every rank")
    return None
